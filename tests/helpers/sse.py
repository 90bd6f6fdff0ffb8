"""SSE as vLLM frames it: building events and chunks, and reading a stream back (its events,
chunks, comments and text)."""

from __future__ import annotations

from typing import Any

import orjson

# SSE: building streams


def sse_event(obj: Any) -> bytes:
    """One vLLM-framed SSE event: ``data: <json>`` and a blank line."""
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chat_chunk(
    delta: dict[str, Any] | None = None,
    finish: str | None = None,
    *,
    chunk_id: str = "chatcmpl-1",
    **extra: Any,
) -> dict[str, Any]:
    """A vLLM ``chat.completion.chunk`` with one choice (no logprobs); ``extra`` adds top-level
    fields (``usage``, ...)."""
    choice = {"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish}
    return {"id": chunk_id, "object": "chat.completion.chunk", "choices": [choice], **extra}


def chat_event(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> bytes:
    """``chat_chunk`` as an SSE event."""
    return sse_event(chat_chunk(delta, finish, **extra))


# ---------------------------------------------------------------------------------------------
# SSE: reading streams


def sse_blocks(raw: bytes) -> list[bytes]:
    """A stream's events as framed, without the blank line that ends each: b'data: {...}',
    b': comment', b'data: [DONE]'."""
    return [block for block in raw.split(b"\n\n") if block]


def sse_chunks(raw: bytes) -> list[dict[str, Any]]:
    """The JSON of a stream's data events; [DONE] and comments left out."""
    return [
        orjson.loads(block[len(b"data: ") :])
        for block in sse_blocks(raw)
        if block.startswith(b"data: ") and block != b"data: [DONE]"
    ]


def sse_comments(raw: bytes) -> list[bytes]:
    """A stream's comment lines (``: ...``), as detproxy writes them between attempts."""
    return [block for block in sse_blocks(raw) if block.startswith(b":")]


def parse_sse(raw: bytes) -> list[Any]:
    """Strictly parse vLLM SSE framing: every event is ``data: <json>\\n\\n``, last is [DONE]."""
    assert raw.endswith(b"\n\n"), raw[-50:]
    out: list[Any] = []
    for block in raw[:-2].split(b"\n\n"):
        assert block.startswith(b"data: "), block
        payload = block[len(b"data: ") :]
        out.append("[DONE]" if payload == b"[DONE]" else orjson.loads(payload))
    return out


def chunks(events: list[Any]) -> list[dict[str, Any]]:
    """The chunks of ``parse_sse``'s events, which must end with [DONE]."""
    assert events[-1] == "[DONE]"
    assert all(isinstance(e, dict) for e in events[:-1])
    return list(events[:-1])


def without_ids(raw: bytes) -> bytes:
    """Remove id/created from a JSON body or every SSE chunk (for determinism comparisons)."""

    def scrub(obj: dict[str, Any]) -> bytes:
        return orjson.dumps({k: v for k, v in obj.items() if k not in {"id", "created"}})

    if raw.startswith(b"data: "):
        return b"|".join(b"[DONE]" if e == "[DONE]" else scrub(e) for e in parse_sse(raw))
    return scrub(orjson.loads(raw))


def chat_text(body: dict[str, Any], field: str = "content") -> str:
    return "".join(c["message"][field] or "" for c in body["choices"][:1])


def stream_text(events: list[Any], field: str = "content", index: int = 0) -> str:
    out = []
    for ch in chunks(events):
        for choice in ch["choices"]:
            if choice["index"] == index and choice.get("delta", {}).get(field):
                out.append(choice["delta"][field])
    return "".join(out)
