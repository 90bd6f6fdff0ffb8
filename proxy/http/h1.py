"""A lean HTTP/1.1 client for the upstream: asyncio protocols, llhttp (httptools) parsing.

Why not aiohttp's client here: on a request the proxy relays, aiohttp's ``ClientSession``
cost more than the rest of detproxy did (URL objects, header defaults, tracing, timers:
measured with ``tests/bench/bench_proxy.py`` while both were kept). This client does
only what a reverse proxy needs: a keep-alive pool per upstream, one request at a time per
connection, the body relayed as it is parsed. Its contract is ``proxy.http.upstream.Upstream``:

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
  above ``HIGH_WATER`` bytes held and resumes when the consumer has taken them;
- ``pump`` hands the body to a consumer's sink from the read's own callback, piece by piece
  as it is parsed (a stream's token is one piece): no task is woken per piece; the sink says
  when to stop (a decision, a client to drain), and the rest waits in the connection.
"""

from __future__ import annotations

import asyncio
import collections
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from urllib.parse import urlsplit

from multidict import CIMultiDict

from proxy.http.errors import UpstreamFailure
from proxy.http.h1conn import HIGH_WATER, Closed, Conn, UpstreamBodyError, forget
from proxy.http.headers import EncodedFields, HeaderFields, decode_field, encode_head, via_field
from proxy.http.upstream import Body, Sink

__all__ = ["HIGH_WATER", "H1Response", "H1Upstream", "UpstreamBodyError"]

_BODYLESS_REQUEST = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "CONNECT"})


def _encoded(headers: Mapping[str, str]) -> bytes:
    # One list of pieces, joined and encoded once: a formatted string per line cost more.
    parts: list[str] = []
    for name, value in headers.items():
        parts.append(name)
        parts.append(": ")
        parts.append(value)
        parts.append("\r\n")
    return encode_head("".join(parts))


def _reset() -> UpstreamFailure:
    return UpstreamFailure(502, "upstream closed the connection before responding", "reset")


class H1Response:
    """One upstream response; see the module docstring for what closing it means."""

    __slots__ = ("_conn", "_done", "_headers", "_pool", "_timeout", "raw_fields", "status")

    def __init__(self, conn: Conn, pool: H1Upstream, timeout: float) -> None:
        self._conn = conn
        self._pool = pool
        self._timeout = timeout
        self._done = False
        self.status = conn.status
        self.raw_fields: list[tuple[bytes, bytes]] | None = conn.header_list
        self._headers: Mapping[str, str] | None = None

    @property
    def headers(self) -> Mapping[str, str]:
        # Decoded when asked: a proxied answer's head is passed on from ``raw_fields``.
        headers = self._headers
        if headers is None:
            raw = self.raw_fields or []
            headers = CIMultiDict([(n.decode("latin-1"), decode_field(v)) for n, v in raw])
            self._headers = headers
        return headers

    @property
    def held(self) -> int:
        """Body bytes read from the upstream that its reader has not taken yet."""
        return self._conn.held

    @property
    def reading_paused(self) -> bool:
        """Reading from the upstream is paused until the reader takes what is held."""
        return self._conn.reading_paused

    def chunks(self) -> AsyncIterator[bytes]:
        """The body, piece by piece as it is parsed (an async iterator, not a generator:
        mypyc compiles no async generators)."""
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._done:  # released at its end, or closed: nothing more is this response's
            raise StopAsyncIteration
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    return conn.take()
                if conn.complete:
                    break
                if conn.error is not None:
                    raise UpstreamBodyError(str(conn.error)) from conn.error
                await conn.wait_data(self._timeout)
        except BaseException:
            self.close()
            raise
        self._release()
        raise StopAsyncIteration

    async def pump(self, sink: Sink) -> bool:
        """The body to ``sink``, each piece as it is parsed (no task woken per piece); True at
        its end, False when the sink stopped (the rest is read by the next call)."""
        conn = self._conn
        try:
            while True:
                if conn.chunks:
                    if not sink(conn.take()):
                        return False
                    continue
                if conn.complete:
                    break
                if conn.error is not None:
                    raise UpstreamBodyError(str(conn.error)) from conn.error
                if await conn.wait_pushed(sink, self._timeout):
                    return False
        except BaseException:
            self.close()
            raise
        self._release()
        return True

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
        connect_timeout_s: float = 10.0,
        read_timeout_s: float = 3600.0,
        keepalive_timeout_s: float = 4.0,
        max_connections: int = 1024,
        connector: Callable[[], Awaitable[Conn]] | None = None,
        server_id: str | None = None,
    ) -> None:
        """The timeouts and limit default to ``[upstream]``'s (proxy/config.py).
        ``connector``: how a new connection is made (a benchmark makes them in memory);
        by default, TCP (TLS for https) to the base URL's host and port. ``server_id``: the
        ``X-Detproxy-Via`` every request carries, after the fields it is given."""
        parts = urlsplit(base_url)
        self._tls = parts.scheme == "https"
        self._host = parts.hostname or "127.0.0.1"
        self._port = parts.port or (443 if self._tls else 80)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        host = netloc.encode("idna") if not netloc.isascii() else netloc.encode()
        # Written after Host on every request: the client's own X-Detproxy-Via fields (a
        # detproxy in front of this one) pass on beside it.
        self._host_line = b"Host: " + host + b"\r\n" + via_field(server_id)
        self._prefix = parts.path.rstrip("/")
        self._connect_timeout = connect_timeout_s
        self._read_timeout = read_timeout_s
        self._keepalive = keepalive_timeout_s
        self._max = max_connections
        self._ssl: ssl.SSLContext | None = ssl.create_default_context() if self._tls else None
        self._idle: collections.deque[Conn] = collections.deque()
        self._connector = connector or self._connect
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    # -- the pool ------------------------------------------------------------------------

    async def _acquire(self, fresh: bool) -> tuple[Conn, bool]:
        """A connection and whether it came from the pool."""
        while self._busy >= self._max:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
                elif waiter.done() and not waiter.cancelled():
                    self._wake_one()  # woken, then cancelled: the freed slot goes to the next
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
            return await self._connector(), False
        except BaseException:
            self._busy -= 1
            self._wake_one()
            raise

    async def _connect(self) -> Conn:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout):
                _, conn = await loop.create_connection(
                    lambda: Conn(loop),
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

    def release(self, conn: Conn) -> None:
        """Called once per acquired connection, by its response."""
        self._busy -= 1
        now = time.monotonic()
        idle = self._idle
        # The oldest idle connections are the ones the upstream closes first: let them go.
        while idle and (idle[0].closed or now - idle[0].idle_since > self._keepalive):
            idle.popleft().close()
        if conn.reusable():
            conn.idle_since = now
            idle.append(conn)
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

    @property
    def waiting(self) -> int:
        """Requests waiting for a connection (``max_connections`` are in use)."""
        return sum(1 for w in self._waiters if not w.done())

    # -- a request -----------------------------------------------------------------------

    def _head(self, method: str, raw_path: str, headers: HeaderFields, body: Body) -> bytes:
        if isinstance(body, bytes):
            framing = b"Content-Length: %d\r\n\r\n" % len(body)
        elif body is not None:
            framing = b"Transfer-Encoding: chunked\r\n\r\n"
        elif method not in _BODYLESS_REQUEST:
            framing = b"Content-Length: 0\r\n\r\n"
        else:
            framing = b"\r\n"
        # A proxied request's fields are the client's own bytes, written as they came.
        fields = headers.lines if isinstance(headers, EncodedFields) else _encoded(headers)
        line = encode_head(f"{method} {self._prefix}{raw_path} HTTP/1.1\r\n")
        return line + self._host_line + fields + framing  # Host second, idna-encoded; Via

    async def send(
        self, method: str, raw_path: str, headers: HeaderFields, body: Body
    ) -> H1Response:
        head = self._head(method, raw_path, headers, body)
        conn, pooled = await self._acquire(fresh=False)
        try:
            await self._attempt(conn, method, head, body)
        except Closed as exc:
            # A pooled keep-alive connection the upstream had closed: nothing was answered,
            # so try once more on a fresh connection (a streamed body cannot be sent twice).
            if not pooled or not isinstance(body, bytes | None):
                raise _reset() from exc
            conn, _ = await self._acquire(fresh=True)
            try:
                await self._attempt(conn, method, head, body)
            except Closed as again:
                raise _reset() from again
        return H1Response(conn, self, self._read_timeout)

    async def _attempt(self, conn: Conn, method: str, head: bytes, body: Body) -> None:
        """Send the request, wait for the response head; on any failure the connection is
        closed and given back (cancelled included: closing it aborts the generation)."""
        try:
            await self._exchange(conn, method, head, body)
        except BaseException as exc:
            conn.close()
            self.release(conn)
            if isinstance(exc, Closed | UpstreamFailure) or not isinstance(exc, Exception):
                raise
            if isinstance(exc, TimeoutError):
                raise UpstreamFailure(
                    504, "upstream timed out before sending response headers", "timeout"
                ) from exc
            if isinstance(exc, UpstreamBodyError | OSError):
                raise UpstreamFailure(502, f"upstream error: {exc}", "reset") from exc
            raise UpstreamFailure(502, f"upstream error: {type(exc).__name__}", "error") from exc

    async def _exchange(self, conn: Conn, method: str, head: bytes, body: Body) -> None:
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
                            forget(headers_ready)
                            raise Closed()
                        transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                        await conn.drain()
                transport.write(b"0\r\n\r\n")
        await conn.drain()
        if conn.closed and not headers_ready.done():
            raise Closed()
        await conn.wait_head(self._read_timeout)
