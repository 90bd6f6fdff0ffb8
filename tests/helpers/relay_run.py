"""The stream relay driven without sockets: upstream reads in, client writes out, the events
it published recorded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from policies.base import Continue
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.fallback import Prefetched, first_event
from proxy.http.errors import UpstreamBodyError
from proxy.http.sse import Decoded
from proxy.loops.detector import DetectorConfig
from proxy.loops.rendered import RenderedResponse
from proxy.loops.watch import LoopWatch
from proxy.relay.inspectors import InspectorSet
from proxy.relay.result import StreamResult
from proxy.relay.stream import StreamPlan, StreamRelay
from proxy.testing import MockResponse


class ExplodingInspector:
    """An inspector with a bug: it raises on its first chunk (it must be dropped, in isolation)."""

    name = "explode"

    def on_delta(self, item: Any) -> None:
        raise ValueError("inspector bug")

    def on_end(self, complete: bool) -> None:
        raise AssertionError("a dropped inspector is not called again")


async def scripted_reads(reads: list[bytes], fail: bool) -> AsyncIterator[bytes]:
    """The upstream body: these reads, then the end or (``fail``) a lost connection."""
    for read in reads:
        yield read
    if fail:
        raise UpstreamBodyError("connection lost")


class RecordedWrites:
    """The client (a ``BodyWriter``, all the relay writes through): every write it was
    given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.writes.append(data)

    def write_nowait(self, data: bytes) -> bool:
        self.writes.append(data)
        return True

    async def drain(self) -> None:
        pass

    @property
    def body(self) -> bytes:
        return b"".join(self.writes)


class IterationWrites(RecordedWrites):
    """A client whose writes go out at the end of the event loop's iteration, each
    iteration's together, as the front's do (``proxy.http.coalesce``): ``flushes``, what went
    out at each."""

    def __init__(self) -> None:
        super().__init__()
        self.flushes: list[bytes] = []
        self._pending: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.write_nowait(data)

    def write_nowait(self, data: bytes) -> bool:
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)
        return super().write_nowait(data)

    def _flush(self) -> None:
        self.flushes.append(b"".join(self._pending))
        self._pending.clear()


class RelayRun:
    def __init__(self, relay: StreamRelay, client: RecordedWrites, result: StreamResult) -> None:
        self.relay, self.client, self.result = relay, client, result
        self.stopped: list[str] = []
        self.failed: list[str] = []
        self.decided: list[Any] = []
        self.decoded: Decoded | None = None  # the first events cut before the relay


def relay(
    reads: list[bytes],
    *,
    loops: bool = False,
    decision: Any = None,
    hold: bool = False,
    inspectors: list[Any] | None = None,
    watch: Any = None,
    fail: bool = False,
    general: bool = False,
    max_event_bytes: int = 1 << 20,
    endpoint: str = "chat",
    first: bool = False,
    rendered: str | None = None,
    iterations: bool = False,
    **plan: Any,
) -> RelayRun:
    """Relay these upstream reads through a ``StreamRelay`` (``general``: the reference, every
    event decoded and parsed: no templates, no raw path); ``decision`` answers every trigger of
    the loop watch (``loops``), or of ``watch``, a watcher in its place. ``first``: the stream
    read up to its first event before the relay (``proxy.fallback.first_event``, as an
    altered request's is), the events cut there handed to the relay with their decoder.
    ``rendered``: the reads are a completions stream, converted to chat events
    (``RenderedResponse``) and relayed as the events cut (``"events"``) or as the bytes they
    are written to (``"bytes"``). ``iterations``: the client writes at the end of each loop
    iteration (``IterationWrites``)."""
    bus = EventBus()
    decided: list[Any] = []

    def on_trigger(trigger: Any) -> Any:
        decided.append(trigger)
        return decision or Continue()

    stream_plan = StreamPlan(
        on_trigger=on_trigger if loops else None,
        hold_reasoning=hold,
        **plan,
    )
    dropped: list[str] = []
    if watch is None and loops:
        watch = LoopWatch(endpoint, DetectorConfig())
    r = StreamRelay(
        endpoint,
        InspectorSet(inspectors or [], dropped.append, [watch] if watch is not None else []),
        bus,
        max_event_bytes,
        0.0,
        stream_plan,
        fast_paths=not general,
    )
    stopped: list[str] = []
    failed: list[str] = []
    bus.subscribe(InspectionStopped, lambda ev: stopped.append(ev.reason))
    bus.subscribe(UpstreamFailed, lambda ev: failed.append(ev.kind))
    client = IterationWrites() if iterations else RecordedWrites()
    handed: list[Decoded | None] = [None]

    async def relayed() -> StreamResult:
        upstream = MockResponse(200, (), scripted_reads(reads, fail))
        if rendered is not None:
            converted = RenderedResponse(upstream, True, None)
            cut = converted if rendered == "events" else None
            return await r.run(converted, client, None, cut)
        if not first:
            return await r.run(upstream, client)
        response, _ = await first_event(upstream, max_event_bytes)
        assert isinstance(response, Prefetched)
        handed[0] = response.take_decoded()
        return await r.run(response, client, handed[0])

    result = asyncio.run(relayed())
    run = RelayRun(r, client, result)
    run.decoded = handed[0]
    run.stopped, run.failed, run.decided = stopped + dropped, failed, decided
    return run
