"""One upstream HTTP/1.1 connection: an asyncio protocol fed to llhttp (httptools).

It carries one response at a time for ``proxy.http.h1``'s pool: the status and headers, the body
as parsed (reading pauses above ``HIGH_WATER`` bytes held until the consumer takes them), and
how the response ended (complete, delimited by the close, cut short, or never started).
"""

from __future__ import annotations

import asyncio
import collections
from typing import cast

import httptools

from proxy.http.errors import UpstreamBodyError, UpstreamTimeout
from proxy.http.headers import FRAMING_NAMES
from proxy.http.upstream import Sink

__all__ = ["HIGH_WATER", "Closed", "Conn", "UpstreamBodyError", "expire", "forget"]

HIGH_WATER = 256 * 1024


class Closed(Exception):
    """The connection closed before any byte of a response came back."""


class Conn(asyncio.Protocol):
    """One upstream connection; carries one response at a time."""

    __deletable__ = ["_parser", "_feed"]  # for mypyc: see connection_lost

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # Bound once: compiled, ``self._loop.time()`` looks the method up at every call (a
        # stream's token calls each of these once).
        self._time = loop.time
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._feed = self._parser.feed_data
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
        # One timer for the read timeout, re-armed when it fires early, instead of one
        # scheduled and cancelled per body chunk (a stream waits once per token).
        self._silence_timer: asyncio.TimerHandle | None = None
        self._silence_deadline = 0.0
        self._silence_s = 0.0
        # While a consumer waits in ``wait_pushed``: body pieces go to it from the parser's
        # callback, with no task woken per piece (a stream's token is one piece).
        self._sink: Sink | None = None
        self.sink_stopped = False
        self._drain: asyncio.Future[None] | None = None
        self.method = "GET"
        self.status = 0
        self.header_list: list[tuple[bytes, bytes]] = []
        self.chunks: collections.deque[bytes] = collections.deque()
        self.held = 0
        self.got_bytes = False
        self.complete = False
        self.until_close = False  # no length, not chunked: the body ends with the connection
        self.keep_alive = False
        self.error: BaseException | None = None
        self._paused = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    @property
    def reading_paused(self) -> bool:
        """Reading from the socket is paused: more than ``HIGH_WATER`` bytes are held."""
        return self._paused

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._feed(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBodyError(f"malformed response from the upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # The parser's callbacks are this protocol's methods: a reference cycle, left to the
        # cyclic collector unless cut. Nothing is parsed after the connection is lost.
        del self._parser
        del self._feed
        if self.complete:
            return
        if self.until_close and self._head is not None and self._head.done():
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        elif not self.got_bytes:
            self._fail(Closed())
        else:
            self._fail(UpstreamBodyError("upstream connection lost before the response ended"))
        self.resume_writing()  # a writer waiting to drain sees `closed` next

    def pause_writing(self) -> None:
        self._drain = self._loop.create_future()

    def resume_writing(self) -> None:
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_list.append((name, value))

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if 100 <= status < 200 and status != 101:
            self.header_list = []  # an interim response (100 Continue): wait for the real one
            return
        self.status = status
        # Asked here: llhttp forgets the message's flags once it is complete.
        self.keep_alive = self._parser.should_keep_alive()
        if self.method == "HEAD" or status in (204, 304):
            framing = False
        else:
            framing = any(FRAMING_NAMES.holds(n) for n, _ in self.header_list)
        self.until_close = not framing and self.method != "HEAD" and status not in (204, 304)
        if self.method == "HEAD":
            # llhttp would wait for the body the length announces; there is none.
            self.complete = True
            self.close()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        sink = self._sink
        if sink is not None and not self.chunks:
            self._silence_deadline = self._time() + self._silence_s
            try:
                more = sink(body)
            except Exception as exc:  # the consumer's own fault: raised where it waits
                self._sink = None
                waiter = self._waiter
                if waiter is not None and not waiter.done():
                    waiter.set_exception(exc)
                return
            if not more:
                self._sink = None
                self.sink_stopped = True
                self._wake()
            return
        self.chunks.append(body)
        self.held += len(body)
        if self.held > HIGH_WATER and not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self.status == 0:
            return  # the end of an interim response
        self.complete = True
        self._wake()

    # -- used by the pool and the response -----------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        head = self._head
        if head is not None and not head.done():
            head.set_exception(exc)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)

    def start(self, method: str) -> asyncio.Future[None]:
        self.method = method
        self.status = 0
        self.header_list = []
        self.chunks.clear()
        self.held = 0
        self.got_bytes = False
        self.complete = False
        self.until_close = False
        self.keep_alive = False
        self.error = None
        self._head = self._loop.create_future()
        return self._head

    async def drain(self) -> None:
        if self._drain is not None:
            await self._drain

    async def wait_head(self, silence_s: float) -> None:
        """Until the response's head (``start``'s future) or an error; UpstreamTimeout after
        ``silence_s`` seconds, timed by the connection's one timer: no timer is scheduled and
        cancelled per request."""
        head = self._head
        assert head is not None
        if not head.done():
            await self._wait(head, silence_s)
        head.result()

    async def wait_data(self, silence_s: float) -> None:
        """Until a body chunk, the end of the body or an error (UpstreamTimeout after
        ``silence_s`` seconds of silence)."""
        await self._wait(self._loop.create_future(), silence_s)

    async def _wait(self, waiter: asyncio.Future[None], silence_s: float) -> None:
        loop = self._loop
        self._waiter = waiter
        deadline = self._silence_deadline = loop.time() + silence_s
        timer = self._silence_timer
        if timer is not None and timer.when() > deadline:  # a shorter timeout than the last
            timer.cancel()
            timer = None
        if timer is None:
            self._silence_timer = loop.call_at(deadline, self._silence_check)
        try:
            await waiter
        finally:
            self._waiter = None

    async def wait_pushed(self, sink: Sink, silence_s: float) -> bool:
        """Like ``wait_data``, but the body pieces that come meanwhile go to ``sink`` as they
        are parsed (the silence is timed from the last one). True when the sink stopped."""
        self._sink = sink
        self._silence_s = silence_s
        self.sink_stopped = False
        try:
            await self.wait_data(silence_s)
        finally:
            self._sink = None
        return self.sink_stopped

    def _silence_check(self) -> None:
        """The timer fired: a wait that began since has a later deadline (re-arm for it);
        no wait now, nothing to time (the next one arms it again)."""
        self._silence_timer = None
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        if self._loop.time() >= self._silence_deadline:
            expire(waiter)
        else:
            self._silence_timer = self._loop.call_at(self._silence_deadline, self._silence_check)

    def take(self) -> bytes:
        chunks = self.chunks
        data = chunks.popleft() if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        self.held = 0
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return (
            self.complete
            and not self.closed
            and self.error is None
            and not self.until_close
            and self.method != "HEAD"
            and self.keep_alive
        )

    def close(self) -> None:
        self.closed = True
        if self._silence_timer is not None:
            self._silence_timer.cancel()
            self._silence_timer = None
        if self.transport is not None:
            self.transport.close()


def forget(future: asyncio.Future[None]) -> None:
    """Mark a future's exception as seen: nobody will await it any more."""
    if future.done() and not future.cancelled():
        future.exception()


def expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(UpstreamTimeout("upstream sent nothing within the read timeout"))
