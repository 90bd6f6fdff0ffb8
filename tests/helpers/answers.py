"""Engine-shaped answers with logprobs: one non-streamed body and its equivalent stream (chat
and completions, one token or several a chunk), the tokens they are made of, and a check that a
text holds no loop."""

from __future__ import annotations

from typing import Any

from proxy.loops.detector import LoopDetector

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
    for field_name, tokens in ((reasoning_field, reasoning), ("content", content)):
        for tok in tokens:
            out.append(
                chunk(
                    {
                        "index": index,
                        "delta": {field_name: tok[0]},
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


def grouped_chat_chunks(
    content: list[Token],
    per_chunk: int,
    logprobs: bool = True,
    continuous_usage: bool = False,
    final_usage: bool = True,
) -> list[dict[str, Any]]:
    """A chat answer streamed ``per_chunk`` tokens a chunk, as vLLM's stream interval and
    speculative decoding send it: the role chunk, then the tokens (their logprobs entries in
    ``logprobs.content``, ``usage`` growing by the chunk's tokens with ``continuous_usage``),
    the last of them in the chunk that carries ``finish_reason``, then the usage chunk."""

    def chunk(choice: dict[str, Any], done: int) -> dict[str, Any]:
        out: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk"}
        out["choices"] = [choice]
        if continuous_usage:
            out["usage"] = {"prompt_tokens": 7, "completion_tokens": done}
        return out

    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None}
    out = [chunk({**role, "finish_reason": None}, 0)]
    for start in range(0, len(content), per_chunk):
        group = content[start : start + per_chunk]
        last = start + per_chunk >= len(content)
        choice: dict[str, Any] = {
            "index": 0,
            "delta": {"content": "".join(t for t, _, _ in group)},
            "logprobs": {"content": [chat_entry(*t) for t in group]} if logprobs else None,
            "finish_reason": "stop" if last else None,
        }
        out.append(chunk(choice, start + len(group)))
    if final_usage:
        usage = {"prompt_tokens": 7, "completion_tokens": len(content)}
        out.append({"id": "chatcmpl-1", "choices": [], "usage": usage})
    return out


def tokens(n: int) -> list[Token]:
    """``n`` distinct content tokens."""
    return [(f" t{i}", -0.5, [(f" t{i}", -0.5), (" x", -2.0)]) for i in range(n)]


def no_loop_in(text: str) -> bool:
    detector = LoopDetector()
    return detector.feed(text) is None and detector.report is None
