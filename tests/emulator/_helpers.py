"""Helpers for the emulator tests: a tiny HTTP client and an SSE parser."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about determinism in batched inference."}]


@dataclass
class Reply:
    status: int
    headers: CIMultiDict[str]
    raw: bytes

    def json(self) -> Any:
        return orjson.loads(self.raw)

    def events(self) -> list[Any]:
        return parse_sse(self.raw)


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


def chat(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "emulator-model", "messages": MESSAGES, "temperature": 0}
    body.update(extra)
    return body


def completion(**extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "emulator-model",
        "prompt": "Once upon a time",
        "temperature": 0,
    }
    body.update(extra)
    return body


def chat_text(body: dict[str, Any], field: str = "content") -> str:
    return "".join(c["message"][field] or "" for c in body["choices"][:1])


def stream_text(events: list[Any], field: str = "content", index: int = 0) -> str:
    out = []
    for ch in chunks(events):
        for choice in ch["choices"]:
            if choice["index"] == index and choice.get("delta", {}).get(field):
                out.append(choice["delta"][field])
    return "".join(out)


class Client:
    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def post(self, path: str, body: Any, headers: dict[str, str] | None = None) -> Reply:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self.session.post(self.base + path, data=data, headers=hdrs) as resp:
            raw = await resp.read()
            return Reply(resp.status, resp.headers.copy(), raw)

    async def get(self, path: str) -> Reply:
        async with self.session.get(self.base + path) as resp:
            return Reply(resp.status, resp.headers.copy(), await resp.read())

    async def chat(self, body: dict[str, Any], headers: dict[str, str] | None = None) -> Reply:
        return await self.post(CHAT, body, headers)

    async def completion(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> Reply:
        return await self.post(COMPLETIONS, body, headers)
