"""A client for the emulator (proxy.tools.emulator): the requests it answers, the header that
sets its knobs for one request, and a tiny HTTP client that reads whole replies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from multidict import CIMultiDict

from tests.helpers.sse import parse_sse

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
MESSAGES = [{"role": "user", "content": "Tell me about determinism in batched inference."}]


def knobs(**fields: Any) -> dict[str, str]:
    """The header that sets emulator knobs for one request."""
    return {"X-Emulator-Knobs": orjson.dumps(fields).decode()}


def chat(**extra: Any) -> dict[str, Any]:
    """A greedy chat request to the emulator's model."""
    body: dict[str, Any] = {"model": "emulator-model", "messages": MESSAGES, "temperature": 0}
    body.update(extra)
    return body


def completion(**extra: Any) -> dict[str, Any]:
    """A greedy completions request to the emulator's model."""
    body: dict[str, Any] = {
        "model": "emulator-model",
        "prompt": "Once upon a time",
        "temperature": 0,
    }
    body.update(extra)
    return body


@dataclass
class EmulatorReply:
    status: int
    headers: CIMultiDict[str]
    raw: bytes

    def json(self) -> Any:
        return orjson.loads(self.raw)

    def events(self) -> list[Any]:
        return parse_sse(self.raw)


class EmulatorClient:
    """A tiny HTTP client that reads whole replies."""

    def __init__(self, session: aiohttp.ClientSession, base: str) -> None:
        self.session = session
        self.base = base

    async def post(
        self, path: str, body: Any, headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        data = body if isinstance(body, bytes) else orjson.dumps(body)
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        async with self.session.post(self.base + path, data=data, headers=hdrs) as resp:
            raw = await resp.read()
            return EmulatorReply(resp.status, resp.headers.copy(), raw)

    async def get(self, path: str) -> EmulatorReply:
        async with self.session.get(self.base + path) as resp:
            return EmulatorReply(resp.status, resp.headers.copy(), await resp.read())

    async def chat(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        return await self.post(CHAT, body, headers)

    async def completion(
        self, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> EmulatorReply:
        return await self.post(COMPLETIONS, body, headers)
