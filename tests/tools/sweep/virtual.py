"""Virtual time for the sweep's tests: an event loop whose clock jumps to the next timer, and an
in-memory upstream that streams on that clock. No socket, no wall clock: every figure the
sweep computes is exact and the same on a busy machine as on an idle one."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson

from tests.helpers.sse import chat_event, sse_event


class _JumpingSelector(selectors.DefaultSelector):
    """Never waits: where the loop would sleep until its next timer, time jumps there."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        events = super().select(0)
        if not events and timeout is not None and timeout > 0:
            self.now += timeout
        return events


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jumping = _JumpingSelector()
        super().__init__(self._jumping)

    def time(self) -> float:
        return self._jumping.now


def run_virtual(coro_fn: Callable[[], Any]) -> Any:
    """Run ``coro_fn()`` on a fresh virtual-time loop; the sweep's clock is ``loop.time``."""
    with asyncio.Runner(loop_factory=VirtualTimeLoop) as runner:
        return runner.run(coro_fn())


def clock() -> float:
    return asyncio.get_running_loop().time()


@dataclass
class Upstream:
    """Each request: the role chunk at once, the first token after ``ttft_s``, one more every
    ``gap_s``, ``max_tokens`` of them, then finish, usage and [DONE]. From the
    ``slow_from_version_read``-th /version read on (the sweep reads it after each run), every
    time is ``slow_factor`` times longer."""

    ttft_s: float = 1 / 64
    gap_s: float = 1 / 128
    slow_factor: float = 1.0
    slow_from_version_read: int = 0  # 0: never slow
    version_reads: int = 0
    requests: int = 0
    bodies: list[dict[str, Any]] = field(default_factory=list)

    def _factor(self) -> float:
        slow = self.slow_from_version_read and self.version_reads >= self.slow_from_version_read
        return self.slow_factor if slow else 1.0

    async def stream(self, tokens: int) -> AsyncIterator[bytes]:
        factor = self._factor()
        yield chat_event({"role": "assistant", "content": ""})
        for i in range(tokens):
            await asyncio.sleep((self.ttft_s if i == 0 else self.gap_s) * factor)
            yield chat_event({"content": "x"})
        yield chat_event({}, "length")
        yield sse_event({"choices": [], "usage": {"completion_tokens": tokens}})
        yield b"data: [DONE]\n\n"


class _Content:
    def __init__(self, chunks: AsyncIterator[bytes]) -> None:
        self._chunks = chunks

    def iter_any(self) -> AsyncIterator[bytes]:
        return self._chunks


class _Response:
    def __init__(self, status: int, content: _Content | None = None) -> None:
        self.status = status
        self.content = content

    async def read(self) -> bytes:
        return b"not found"

    async def __aenter__(self) -> _Response:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class Session:
    """What the sweep uses of an ``aiohttp.ClientSession``, served by an ``Upstream``."""

    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream

    def post(self, url: str, *, data: bytes, **_: Any) -> _Response:
        body = orjson.loads(data)
        self.upstream.requests += 1
        self.upstream.bodies.append(body)
        return _Response(200, _Content(self.upstream.stream(int(body["max_tokens"]))))

    def get(self, url: str, **_: Any) -> _Response:
        if url.endswith("/version"):
            self.upstream.version_reads += 1
        return _Response(404)
