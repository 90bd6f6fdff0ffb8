"""Builders for engine-shaped answers: one non-streamed body and its equivalent stream."""

from __future__ import annotations

from typing import Any

Token = tuple[str, float | None, list[tuple[str, float | None]]]  # (token, logprob, top-k)


def chat_entry(
    token: str, logprob: float | None, top: list[tuple[str, float | None]]
) -> dict[str, Any]:
    return {
        "token": token,
        "logprob": logprob,
        "bytes": list(token.encode()),
        "top_logprobs": [{"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top],
    }


def legacy_logprobs(tokens: list[Token]) -> dict[str, Any]:
    offsets, pos = [], 0
    for tok, _, _ in tokens:
        offsets.append(pos)
        pos += len(tok)
    return {
        "tokens": [t for t, _, _ in tokens],
        "token_logprobs": [v for _, v, _ in tokens],
        "top_logprobs": [dict(top) for _, _, top in tokens],
        "text_offset": offsets,
    }


def chat_body(
    reasoning: list[Token], content: list[Token], finish: str = "stop", index: int = 0
) -> dict[str, Any]:
    """A non-streamed chat answer whose texts are the concatenated tokens."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(t for t, _, _ in content)}
    if reasoning:
        message["reasoning"] = "".join(t for t, _, _ in reasoning)
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [
            {
                "index": index,
                "message": message,
                "logprobs": {"content": [chat_entry(*t) for t in reasoning + content]},
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 7, "completion_tokens": len(reasoning) + len(content)},
    }


def chat_chunks(
    reasoning: list[Token],
    content: list[Token],
    finish: str = "stop",
    index: int = 0,
    reasoning_field: str = "reasoning",
) -> list[dict[str, Any]]:
    """The same answer streamed one token per chunk, vLLM style, with a usage chunk."""

    def chunk(choice: dict[str, Any]) -> dict[str, Any]:
        return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "choices": [choice]}

    out = [
        chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )
    ]
    for field, tokens in ((reasoning_field, reasoning), ("content", content)):
        for tok in tokens:
            out.append(
                chunk(
                    {
                        "index": index,
                        "delta": {field: tok[0]},
                        "logprobs": {"content": [chat_entry(*tok)]},
                        "finish_reason": None,
                    }
                )
            )
    out.append(chunk({"index": index, "delta": {}, "finish_reason": finish, "stop_reason": None}))
    out.append(
        {
            "id": "chatcmpl-1",
            "choices": [],
            "usage": {"prompt_tokens": 7, "completion_tokens": len(reasoning) + len(content)},
        }
    )
    return out


def completion_body(tokens: list[Token], finish: str = "length") -> dict[str, Any]:
    return {
        "id": "cmpl-1",
        "object": "text_completion",
        "choices": [
            {
                "index": 0,
                "text": "".join(t for t, _, _ in tokens),
                "logprobs": legacy_logprobs(tokens),
                "finish_reason": finish,
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
    }


def completion_chunks(tokens: list[Token], finish: str = "length") -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [
                {
                    "index": 0,
                    "text": tok[0],
                    "logprobs": legacy_logprobs([tok]),
                    "finish_reason": None,
                }
            ],
        }
        for tok in tokens
    ]
    out.append(
        {
            "id": "cmpl-1",
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": finish, "stop_reason": None}],
        }
    )
    out.append(
        {
            "id": "cmpl-1",
            "choices": [],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(tokens)},
        }
    )
    return out


REASONING: list[Token] = [
    ("Let", -0.25, [("Let", -0.25), ("Okay", -1.5)]),
    (" me", -0.01, [(" me", -0.01), (" us", -4.75)]),
]
CONTENT: list[Token] = [
    ("Hi", -0.125, [("Hi", -0.125), ("Hello", -2.25)]),
    ("!", -0.5, [("!", -0.5), (".", -1.0)]),
    (" ok", -9999.0, [(" ok", -9999.0), (" no", -9999.0)]),
]
