"""detproxy's lean HTTP/1.1 server: the client side of every proxied request.

Why not aiohttp's server here: a streamed answer is one write per token, and on aiohttp each
write goes through ``StreamResponse.write`` and its payload writer; with the request parsing
and dispatch around it, aiohttp's server cost about as much CPU per relayed event as all of
detproxy's own work (issue 16, measured with ``tests/bench/bench_paced.py`` while both were
kept). This server is an asyncio protocol on httptools' parser, as uvicorn's httptools
implementation is. A request's response is written straight to the transport, chunk-framed, a
loop iteration's writes to a connection in one (``proxy.http.coalesce``).

What it serves, each listener with its two handlers: ``/detproxy/...`` (detproxy's own
endpoints, ``proxy.http.admin``) to one, everything else (the OpenAI endpoints and what is
passed through to the upstream: the ``Forwarder``) to the other.

One ``FrontConnection`` per client connection: requests are answered in order (pipelined ones
wait, their bodies buffered and reading paused); a client that leaves cancels its request's
handler (which closes the upstream connection: the engine aborts the generation).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Final, cast
from urllib.parse import unquote

import httptools
import orjson
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.http.admin import ADMIN_PREFIX
from proxy.http.body import BadRequest
from proxy.http.coalesce import WriteCoalescer
from proxy.http.errors import error_payload
from proxy.http.headers import (
    HOP_BY_HOP,
    EncodedFields,
    HeaderFields,
    decode_field,
    encode_head,
    is_passed,
    names_other_fields,
)

log = logging.getLogger(__name__)

# Past this many bytes of a request body not yet read by its handler, reading pauses.
BODY_HIGH_WATER = 1 << 20
LINGER_S = 10.0  # how long a body answered before it came whole is still read (aiohttp's)
_NO_BODY_STATUS = frozenset({204, 304})
_FRAMED_HERE = HOP_BY_HOP | {"content-length"}  # a whole body's length is this server's
_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}
# The size line of a chunk of each size a token's event has, made once: formatting it costs
# more than the rest of the write (``FrontConnection.write_chunk``).
_SIZED_LINES: Final = 1024
_SIZE_LINES: Final = tuple(b"%x\r\n" % n for n in range(_SIZED_LINES))

Handler = Callable[["FrontRequest"], Awaitable[None]]


class _Date:
    """The ``Date`` header's value, formatted once a second."""

    __slots__ = ("_second", "_value")

    def __init__(self) -> None:
        self._second = -1
        self._value = b""

    def value(self) -> bytes:
        now = int(time.time())
        if now != self._second:
            self._second = now
            self._value = formatdate(now, usegmt=True).encode()
        return self._value


class FrontRequest:
    """One request on a front connection, and its response: a ``ClientSide``."""

    __slots__ = (
        "_body_waiter",
        "_chunked",
        "_conn",
        "_declared",
        "_discard",
        "_fields",
        "_headers",
        "_parts",
        "_path",
        "_size",
        "body_complete",
        "close_after",
        "method",
        "passed_fields",
        "raw_path",
        "started",
        "task",
        "version",
        "wrote_eof",
    )

    def __init__(
        self,
        conn: FrontConnection,
        method: str,
        raw_path: str,
        fields: list[tuple[bytes, bytes]],
        version: str,
        keep_alive: bool,
        passed_fields: bytes | None = None,
    ) -> None:
        self._conn = conn
        self.passed_fields = passed_fields
        self.method = method
        self.raw_path = raw_path
        self._path: str | None = None
        # The fields as parsed, (name, value) bytes; decoded into a mapping when asked: a
        # proxied request reads a few of them (``header``) and passes the rest on as bytes.
        self._fields = fields
        self._headers: CIMultiDictProxy[str] | None = None
        self.version = version
        self.close_after = not keep_alive
        length = self.header(b"content-length")
        self._declared = int(length) if length is not None and length.isdigit() else None
        self._parts: collections.deque[bytes] = collections.deque()
        self._size = 0  # bytes buffered, not yet taken
        self._discard = False  # the handler refused the body: what still comes is dropped
        self.body_complete = False
        self._body_waiter: asyncio.Future[None] | None = None
        self.started = False  # the response's head was written
        self.wrote_eof = False  # the response is complete
        self._chunked = False
        self.task: asyncio.Task[None] | None = None

    # -- the request ---------------------------------------------------------------------

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        headers = self._headers
        if headers is None:
            decoded = [(n.decode("latin-1"), decode_field(v)) for n, v in self._fields]
            headers = self._headers = CIMultiDictProxy(CIMultiDict(decoded))
        return headers

    def header(self, name: bytes) -> str | None:
        headers = self._headers
        if headers is not None:
            return headers.get(name.decode("latin-1"))
        size = len(name)
        for field, value in self._fields:
            if len(field) == size and (field == name or field.lower() == name):
                return decode_field(value)
        return None

    @property
    def path(self) -> str:
        path = self._path
        if path is None:
            path = self.raw_path.partition("?")[0]
            if "%" in path:  # most paths have nothing to unquote
                path = unquote(path)
            self._path = path
        return path

    @property
    def has_body(self) -> bool:
        if self._declared is not None:
            return self._declared > 0
        return "chunked" in (self.header(b"transfer-encoding") or "").lower()

    def feed(self, data: bytes) -> None:
        if self._discard:
            return
        self._parts.append(data)
        self._size += len(data)
        self._wake()
        if self._size > BODY_HIGH_WATER:
            self._conn.pause_reading_for_body()

    def feed_eof(self) -> None:
        self.body_complete = True
        self._wake()
        if self._discard and self.wrote_eof:
            self._conn.close()  # the lingering body has come: now the connection can end

    def linger(self) -> None:
        """Answered before its body came whole: the rest is read and dropped, then the
        connection closed (closing at once would reset it under a client still sending, which
        then never reads the answer), for ``LINGER_S`` at most."""
        self._refuse_body()
        self._conn.close_later(LINGER_S)

    def _wake(self) -> None:
        waiter = self._body_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _more(self) -> None:
        if self._conn.closed:
            raise ConnectionResetError("the client closed the connection")
        self._body_waiter = self._conn.loop.create_future()
        self._conn.resume_reading_for_body()
        try:
            await self._body_waiter
        finally:
            self._body_waiter = None

    def _take(self) -> bytes:
        parts = self._parts
        data = parts.popleft() if len(parts) == 1 else b"".join(parts)
        parts.clear()
        self._size = 0
        return data

    async def read_body(self, limit: int) -> bytes:
        declared = self._declared
        if declared is not None and declared > limit:
            self._refuse_body()
            raise BadRequest(413, f"request body of {declared} bytes exceeds the limit of {limit}")
        while self._size <= limit:
            if self.body_complete:
                return self._take() if self._parts else b""
            await self._more()
        self._refuse_body()
        raise BadRequest(413, f"request body exceeds the limit of {limit} bytes")

    def _refuse_body(self) -> None:
        """The rest of the body is not read: dropped as it comes, the connection closed after
        the response (as aiohttp does with a body past its limit)."""
        self._discard = True
        self._parts.clear()
        self._size = 0
        self.close_after = True
        self._conn.resume_reading_for_body()

    def body_chunks(self) -> AsyncIterator[bytes]:
        """The body as it comes (an async iterator, not a generator: mypyc compiles no
        async generators)."""
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        while True:
            if self._parts:
                return self._take()
            if self.body_complete:
                raise StopAsyncIteration
            await self._more()

    # -- the response --------------------------------------------------------------------

    def _head(
        self,
        status: int,
        headers: HeaderFields,
        framing: bytes,
        dropped: frozenset[str] = HOP_BY_HOP,
    ) -> bytes:
        """The response's head; ``dropped``: lowercased names this server writes itself
        (fields already encoded are the upstream's, ``client_response_headers`` left those
        out of them)."""
        head = b"HTTP/1.1 %d %s\r\n" % (status, _REASONS.get(status, b"Unknown"))
        if isinstance(headers, EncodedFields):
            head += headers.lines
            dated = headers.has_date
        else:
            parts: list[str] = []  # pieces joined once (as the upstream client's request head)
            for name, value in headers.items():
                if name.lower() not in dropped:  # framing and the connection are this server's
                    parts.append(name)
                    parts.append(": ")
                    parts.append(value)
                    parts.append("\r\n")
            head += encode_head("".join(parts))
            dated = "Date" in headers
        if not dated:
            head += b"Date: " + self._conn.date.value() + b"\r\n"
        return head + framing + (b"Connection: close\r\n\r\n" if self.close_after else b"\r\n")

    async def respond(self, status: int, headers: HeaderFields, body: bytes) -> None:
        self.started = True
        if self.method == "HEAD" or status in _NO_BODY_STATUS:
            self._conn.write(self._head(status, headers, b""))  # HEAD keeps a GET's length
        else:
            length = b"Content-Length: %d\r\n" % len(body)
            self._conn.write(self._head(status, headers, length, _FRAMED_HERE) + body)
        self._finish()

    async def start(self, status: int, headers: HeaderFields) -> None:
        self.started = True
        bodyless = self.method == "HEAD" or status in _NO_BODY_STATUS
        if isinstance(headers, EncodedFields):
            has_length = headers.has_length
        else:
            has_length = "Content-Length" in headers
        if has_length or bodyless:
            framing = b""  # a pass-through's length is kept as the upstream declared it
        elif self.version == "1.1":
            framing = b"Transfer-Encoding: chunked\r\n"
            self._chunked = True
        else:
            self.close_after = True  # HTTP/1.0: the body ends where the connection does
            framing = b""
        self._conn.write(self._head(status, headers, framing))

    async def write(self, data: bytes) -> None:
        if not self.write_nowait(data):
            await self._conn.drain()

    def write_nowait(self, data: bytes) -> bool:
        conn = self._conn
        if conn.closed:
            raise ConnectionResetError("the client closed the connection")
        if data:
            if self._chunked:  # never for HEAD: start() frames its answer with no body
                conn.write_chunk(data)
            elif self.method != "HEAD":
                conn.write(data)
        return not conn.write_paused

    async def drain(self) -> None:
        if self._conn.write_paused or self._conn.closed:
            await self._conn.drain()

    async def end(self) -> None:
        if self.wrote_eof:
            return
        if self._chunked and not self._conn.closed:
            self._conn.write(b"0\r\n\r\n")
        self._finish()

    def _finish(self) -> None:
        self.wrote_eof = True
        self._conn.response_done(self)


class FrontConnection(asyncio.Protocol):
    """One client connection of the front server."""

    __deletable__ = ["_parser"]  # for mypyc: see connection_lost

    def __init__(self, server: FrontServer) -> None:
        self.server = server
        self.loop = server.loop
        self.date = server.date
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.write_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._fields: list[tuple[bytes, bytes]] = []
        # The request's fields as they came, less those not passed on (``NOT_PASSED``): the
        # upstream is sent these bytes (``ClientSide.passed_fields``). Not whole: the
        # Connection header named another field to drop, which the mapping's filter does.
        self._passed: list[bytes] = []
        self._passed_whole = True
        self._parsing: FrontRequest | None = None  # the request whose bytes are arriving
        self._pipeline: collections.deque[FrontRequest] = collections.deque()  # head: active
        self._reading_paused = False
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since: float | None = None  # idle since (loop time); None: busy
        self._linger_timer: asyncio.TimerHandle | None = None
        self._out: list[bytes] = []

    # -- the connection ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's are not its subclasses
        self.server.connections.add(self)
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        # The parser's callbacks are this protocol's methods: a reference cycle, left to the
        # cyclic collector unless cut. Nothing is parsed after the connection is lost.
        del self._parser
        self.server.connections.discard(self)
        self._idle_since = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        for request in self._pipeline:
            request._wake()
            if request.task is not None and not request.task.done():
                request.task.cancel()  # the client left: its handler stops, upstream closes
        self._pipeline.clear()
        if self._drain is not None and not self._drain.done():
            self._drain.set_exception(ConnectionResetError("the client closed the connection"))
            self._drain.exception()  # retrieved: nobody may be waiting

    def data_received(self, data: bytes) -> None:
        self._cancel_idle()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._reject(400, "protocol upgrades are not supported")
        except httptools.HttpParserError as exc:
            self._reject(400, f"malformed HTTP request: {exc}")

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self._drain is not None and not self._drain.done():
            self._drain.set_result(None)
        self._drain = None

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client closed the connection")
        if self._drain is None:
            self._drain = self.loop.create_future()
        await self._drain

    def write(self, data: bytes) -> None:
        if self.closed:
            return
        out = self._out
        if not out:
            self.server.writes.queue(self)
        out.append(data)

    def write_chunk(self, data: bytes) -> None:
        """``data`` as one chunk of a chunked body (not empty: that one ends the body)."""
        if self.closed:
            return
        out = self._out
        if not out:
            self.server.writes.queue(self)
        size = len(data)
        out.append(_SIZE_LINES[size] if size < _SIZED_LINES else b"%x\r\n" % size)
        out.append(data)
        out.append(b"\r\n")

    def flush(self) -> None:
        out = self._out
        if not out:
            return
        data = out[0] if len(out) == 1 else b"".join(out)
        out.clear()
        transport = self.transport
        if transport is not None and not self.closed and not transport.is_closing():
            transport.write(data)

    def close(self) -> None:
        if self.transport is not None and not self.closed:
            self.flush()
            self.transport.close()

    def close_later(self, delay_s: float) -> None:
        if self._linger_timer is None:
            self._linger_timer = self.loop.call_later(delay_s, self.close)

    @property
    def idle(self) -> bool:
        return not self._pipeline and self._parsing is None

    def _reject(self, status: int, message: str) -> None:
        """A request that cannot be parsed: answered (if nothing else is) and the connection
        closed, as nothing after it can be framed."""
        if not self._pipeline:
            body = orjson.dumps(error_payload(status, message))
            self.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                b"Connection: close\r\n\r\n%b" % (status, _REASONS[status], len(body), body)
            )
        self.close()

    # -- flow control --------------------------------------------------------------------

    def _pause_reading(self) -> None:
        if not self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = True
            self.transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self.transport is not None and not self.closed:
            self._reading_paused = False
            self.transport.resume_reading()

    def pause_reading_for_body(self) -> None:
        self._pause_reading()

    def resume_reading_for_body(self) -> None:
        if len(self._pipeline) <= 1:
            self._resume_reading()

    # -- httptools' callbacks ------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._url = b""
        self._fields = []
        self._passed = []
        self._passed_whole = True

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Kept as bytes: the upstream gets them as they came (``passed_fields``), and the
        # request decodes a field only when it is read (``header``, ``headers``).
        if is_passed(name):
            self._passed.append(name + b": " + value)
        elif names_other_fields(name, value):
            self._passed_whole = False
        self._fields.append((name, value))

    def on_headers_complete(self) -> None:
        parser = self._parser
        request = FrontRequest(
            self,
            parser.get_method().decode("ascii"),
            decode_field(self._url),
            self._fields,
            parser.get_http_version(),
            parser.should_keep_alive(),
            self._passed_fields(),
        )
        self._fields = []  # the request's own now (a chunked body's trailers come next)
        self._parsing = request
        self._pipeline.append(request)
        if len(self._pipeline) == 1:
            self._begin(request)
        else:
            self._pause_reading()  # one pipelined request waits; the next ones stay unread

    def _passed_fields(self) -> bytes | None:
        if not self._passed_whole:
            return None
        passed = self._passed
        return b"\r\n".join(passed) + b"\r\n" if passed else b""

    def on_body(self, body: bytes) -> None:
        if self._parsing is not None:
            self._parsing.feed(body)

    def on_message_complete(self) -> None:
        if self._parsing is not None:
            self._parsing.feed_eof()
            self._parsing = None

    # -- requests ------------------------------------------------------------------------

    def _begin(self, request: FrontRequest) -> None:
        expect = request.header(b"expect")
        if expect is not None and expect.lower() == "100-continue" and request.has_body:
            self.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.task = self.loop.create_task(self._serve(request))

    async def _serve(self, request: FrontRequest) -> None:
        try:
            await self.server.dispatch(request)
            if not request.started:
                raise RuntimeError(f"no response to {request.method} {request.raw_path}")
        except asyncio.CancelledError:
            self.close()
            raise
        except (ConnectionResetError, BrokenPipeError):
            self.close()
        except Exception:
            log.exception("request %s %s failed", request.method, request.raw_path)
            if not request.started:
                request.close_after = True
                body = orjson.dumps(error_payload(500, "detproxy failed on this request"))
                await request.respond(500, {"Content-Type": "application/json"}, body)
            else:
                self.close()  # the response is cut short: the client sees it end early
        if not request.wrote_eof:
            self.close()

    def response_done(self, request: FrontRequest) -> None:
        pipeline = self._pipeline
        if pipeline and pipeline[0] is request:
            pipeline.popleft()
        if not request.body_complete:
            request.linger()
            return
        if request.close_after:
            self.close()
            return
        if pipeline:
            self._begin(pipeline[0])
        if len(pipeline) <= 1:
            self._resume_reading()
        if self.idle:
            self._arm_idle()

    # -- keep-alive ----------------------------------------------------------------------

    # One timer a connection, re-armed when it fires early, instead of one scheduled and
    # cancelled per request on a keep-alive connection.

    def _arm_idle(self) -> None:
        self._idle_since = now = self.loop.time()
        if self._idle_timer is None:
            self._idle_timer = self.loop.call_at(now + self.server.keepalive_s, self._idle_expired)

    def _cancel_idle(self) -> None:
        self._idle_since = None  # the timer, when it fires, finds the connection busy

    def _idle_expired(self) -> None:
        self._idle_timer = None
        since = self._idle_since
        if since is None or not self.idle:
            return
        deadline = since + self.server.keepalive_s
        if self.loop.time() >= deadline:
            self.close()
        else:
            self._idle_timer = self.loop.call_at(deadline, self._idle_expired)


class FrontServer:
    """The lean server's listeners and connections; ``dispatch`` answers one request:
    ``/detproxy/...`` with ``admin``, anything else with ``handle``."""

    def __init__(
        self,
        handle: Handler,
        admin: Handler,
        *,
        keepalive_s: float = 75.0,
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self._handle = handle  # the Forwarder's, on the main listener
        self._admin = admin
        self.keepalive_s = keepalive_s
        self.loop = loop or asyncio.get_running_loop()
        self.date = _Date()
        self.connections: set[FrontConnection] = set()
        self._servers: list[asyncio.Server] = []
        self.writes = WriteCoalescer(self.loop)

    async def dispatch(self, request: FrontRequest) -> None:
        if request.path.startswith(ADMIN_PREFIX):
            await self._admin(request)
        else:
            await self._handle(request)

    async def listen(self, sock: socket.socket, backlog: int) -> None:
        server = await self.loop.create_server(
            lambda: FrontConnection(self), sock=sock, backlog=backlog
        )
        self._servers.append(server)

    def stop_listening(self) -> None:
        for server in self._servers:
            server.close()

    def busy(self) -> int:
        """Connections with a request in progress."""
        return sum(1 for c in self.connections if not c.idle)

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting, let requests in progress finish for up to ``grace_s`` seconds, then
        cancel what is left and close every connection."""
        self.stop_listening()
        deadline = self.loop.time() + grace_s
        while True:
            for conn in list(self.connections):
                if conn.idle:
                    conn.close()
            if not self.connections or self.loop.time() >= deadline:
                break
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            conn.close()  # connection_lost cancels their handlers
        await asyncio.sleep(0)
        for server in self._servers:
            await server.wait_closed()
