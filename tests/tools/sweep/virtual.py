"""Virtual time for the sweep's tests: an event loop whose clock jumps to the next timer, and an
in-memory upstream (a ``proxy.testing.MockUpstream``) that streams on that clock. No socket, no
wall clock: every figure the sweep computes is exact and the same on a busy machine as on an
idle one."""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from proxy.testing import MockResponse, MockUpstream, Received, Reply
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

    def mock(self) -> MockUpstream:
        """The sweep's upstream client, served by this upstream in memory."""
        return MockUpstream(self._answer)

    def _answer(self, request: Received) -> Reply | MockResponse:
        if request.method == "POST":
            body = request.json()
            self.requests += 1
            self.bodies.append(body)
            return MockResponse(200, (), self.stream(int(body["max_tokens"])))
        if request.path == "/version":
            self.version_reads += 1
        return Reply(404, body=b"not found")
