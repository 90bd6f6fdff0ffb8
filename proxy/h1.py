"""A lean HTTP/1.1 client for the upstream: asyncio protocols, llhttp (httptools) parsing.

Why not aiohttp's client here: on a request the proxy relays, aiohttp's ``ClientSession``
costs several times what the rest of detproxy does (URL objects, header defaults, tracing,
timers; see tests/bench/bench_proxy.py). This client does only what a reverse proxy needs:
a keep-alive pool per upstream, one request at a time per connection, the body relayed as
it is parsed. Its contract is ``proxy.upstream.Upstream``:

- closing a response before it is complete closes its TCP connection (how vLLM learns that a
  client left, and aborts the generation); a complete response returns its connection to
  the pool, unless either side asked to close;
- a pooled connection the upstream had already closed (no response byte came back) is
  retried once on a fresh connection when the body can be sent twice;
- the read timeout is the longest silence on the socket, headers included; the connect
  timeout bounds the TCP (and TLS) handshake; neither bounds a whole generation;
- an idle connection is dropped after ``keepalive_timeout_s``, below uvicorn's (vLLM's) 5 s,
  so the pool does not hand out one the upstream is closing;
- the body of a slow client is not buffered without bound: reading from the upstream pauses
  above ``_HIGH_WATER`` bytes held and resumes when the consumer has taken them.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import cast
from urllib.parse import urlsplit

import aiohttp
import httptools
from multidict import CIMultiDict

from proxy.errors import UpstreamFailure

Body = bytes | AsyncIterable[bytes] | None

_HIGH_WATER = 256 * 1024
_BODYLESS_REQUEST = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})


class UpstreamBodyError(aiohttp.ClientPayloadError):
    """The upstream's body ended before it was complete (a subclass of aiohttp's error so
    that every reader that handles a broken aiohttp body handles this one too)."""


class _Closed(Exception):
    """The connection closed before any byte of a response came back."""


def _reset() -> UpstreamFailure:
    return UpstreamFailure(502, "upstream closed the connection before responding", "reset")


class _Conn(asyncio.Protocol):
    """One upstream connection; carries one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._head: asyncio.Future[None] | None = None
        self._waiter: asyncio.Future[None] | None = None
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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamBodyError(f"malformed response from the upstream: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.complete:
            return
        if self.until_close and self._head is not None and self._head.done():
            self.complete = True  # a body delimited by the end of the connection
            self._wake()
        elif not self.got_bytes:
            self._fail(_Closed())
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
            framing = any(
                n.lower() in (b"content-length", b"transfer-encoding") for n, _ in self.header_list
            )
        self.until_close = not framing and self.method != "HEAD" and status not in (204, 304)
        if self.method == "HEAD":
            # llhttp would wait for the body the length announces; there is none.
            self.complete = True
            self.close()
        if self._head is not None and not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self.chunks.append(body)
        self.held += len(body)
        if self.held > _HIGH_WATER and not self._paused and self.transport is not None:
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

    async def wait_data(self, silence_s: float) -> None:
        """Until a body chunk, the end of the body or an error (TimeoutError after
        ``silence_s`` seconds of silence)."""
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(silence_s, _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

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
        if self.transport is not None:
            self.transport.close()


def _forget(future: asyncio.Future[None]) -> None:
    """Mark a future's exception as seen: nobody will await it any more."""
    if future.done() and not future.cancelled():
        future.exception()


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError("upstream sent nothing within the read timeout"))


class H1Response:
    """One upstream response; see the module docstring for what closing it means."""

    __slots__ = ("_conn", "_done", "_pool", "_timeout", "headers", "status")

    def __init__(self, conn: _Conn, pool: H1Upstream, timeout: float) -> None:
        self._conn = conn
        self._pool = pool
        self._timeout = timeout
        self._done = False
        self.status = conn.status
        self.headers: Mapping[str, str] = CIMultiDict(
            (n.decode("latin-1"), v.decode("latin-1")) for n, v in conn.header_list
        )

    async def chunks(self) -> AsyncIterator[bytes]:
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    yield conn.take()
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    raise UpstreamBodyError(str(conn.error)) from conn.error
                await conn.wait_data(self._timeout)
        except BaseException:
            self.close()
            raise
        self._release()

    async def read(self) -> bytes:
        conn = self._conn
        if conn.complete and not self._done:  # the usual small answer: all here already
            data = conn.take() if conn.chunks else b""
            self._release()
            return data
        parts = [data async for data in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _release(self) -> None:
        if not self._done:
            self._done = True
            self._pool.release(self._conn)

    def close(self) -> None:
        if not self._done:
            self._done = True
            if not self._conn.reusable() or self._conn.chunks:
                self._conn.close()  # unfinished: closing it is what aborts the generation
            self._pool.release(self._conn)


class H1Upstream:
    """``Upstream`` over a pool of keep-alive HTTP/1.1 connections to one base URL."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        keepalive_timeout_s: float,
        max_connections: int,
    ) -> None:
        parts = urlsplit(base_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        self._host_header = netloc.encode("idna")
        self._prefix = parts.path.rstrip("/")
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._keepalive = keepalive_timeout_s
        self._max = max_connections
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._idle: collections.deque[_Conn] = collections.deque()
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    # -- the pool ------------------------------------------------------------------------

    async def _acquire(self, fresh: bool) -> tuple[_Conn, bool]:
        """A connection and whether it came from the pool."""
        while self._busy >= self._max:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                raise
        self._busy += 1
        try:
            now = time.monotonic()
            idle = self._idle
            while idle and not fresh:
                conn = idle.pop()  # the most recently used: the least likely to be stale
                if conn.closed or now - conn.idle_since > self._keepalive:
                    conn.close()
                    continue
                return conn, True
            return await self._connect(), False
        except BaseException:
            self._busy -= 1
            self._wake_one()
            raise

    async def _connect(self) -> _Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: _Conn(loop),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._tls else None,
                )
        except TimeoutError as exc:
            raise UpstreamFailure(
                504, "upstream did not accept the connection in time", "timeout"
            ) from exc
        except OSError as exc:
            raise UpstreamFailure(
                502, f"upstream refused the connection: {exc}", "refused"
            ) from exc
        return conn

    def release(self, conn: _Conn) -> None:
        """Called once per acquired connection, by its response."""
        self._busy -= 1
        if conn.reusable():
            conn.idle_since = time.monotonic()
            self._idle.append(conn)
        else:
            conn.close()
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def close(self) -> None:
        while self._idle:
            self._idle.pop().close()

    @property
    def idle_connections(self) -> int:
        return sum(1 for c in self._idle if not c.closed)

    # -- a request -----------------------------------------------------------------------

    def _head(self, method: str, raw_path: str, headers: Mapping[str, str], body: Body) -> bytes:
        lines = [
            f"{method} {self._prefix}{raw_path} HTTP/1.1\r\n".encode(),
            b"Host: " + self._host_header + b"\r\n",
        ]
        for name, value in headers.items():
            lines.append(f"{name}: {value}\r\n".encode("utf-8", "surrogateescape"))
        if isinstance(body, bytes):
            lines.append(b"Content-Length: %d\r\n" % len(body))
        elif body is not None:
            lines.append(b"Transfer-Encoding: chunked\r\n")
        elif method not in _BODYLESS_REQUEST:
            lines.append(b"Content-Length: 0\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: Body
    ) -> H1Response:
        head = self._head(method, raw_path, headers, body)
        conn, pooled = await self._acquire(fresh=False)
        try:
            await self._attempt(conn, method, head, body)
        except _Closed as exc:
            # A pooled keep-alive connection the upstream had closed: nothing was answered,
            # so try once more on a fresh connection (a streamed body cannot be sent twice).
            if not pooled or not isinstance(body, bytes | None):
                raise _reset() from exc
            conn, _ = await self._acquire(fresh=True)
            try:
                await self._attempt(conn, method, head, body)
            except _Closed as again:
                raise _reset() from again
        return H1Response(conn, self, self._read_timeout)

    async def _attempt(self, conn: _Conn, method: str, head: bytes, body: Body) -> None:
        """Send the request, wait for the response head; on any failure the connection is
        closed and given back (cancelled included: closing it aborts the generation)."""
        try:
            await self._exchange(conn, method, head, body)
        except BaseException as exc:
            conn.close()
            self.release(conn)
            if isinstance(exc, _Closed | UpstreamFailure) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, TimeoutError):
                raise UpstreamFailure(
                    504, "upstream timed out before sending response headers", "timeout"
                ) from exc
            if isinstance(exc, UpstreamBodyError | OSError):
                raise UpstreamFailure(502, f"upstream error: {exc}", "reset") from exc
            raise UpstreamFailure(502, f"upstream error: {type(exc).__name__}", "error") from exc

    async def _exchange(self, conn: _Conn, method: str, head: bytes, body: Body) -> None:
        transport = conn.transport
        assert transport is not None
        headers_ready = conn.start(method)
        if isinstance(body, bytes):
            transport.write(head + body if len(body) < 64 * 1024 else head)
            if len(body) >= 64 * 1024:
                transport.write(body)
        else:
            transport.write(head)
            if body is not None:
                async for piece in body:
                    if piece:
                        if conn.closed:  # gone while the body was being sent
                            _forget(headers_ready)
                            raise _Closed()
                        transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await conn.drain()
                transport.write(b"0\r\n\r\n")
        await conn.drain()
        if conn.closed and not headers_ready.done():
            raise _Closed()
        timer = asyncio.get_running_loop().call_later(self._read_timeout, _expire, headers_ready)
        try:
            await headers_ready
        finally:
            timer.cancel()
