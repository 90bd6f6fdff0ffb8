"""The lean front (proxy/http/front.py) as a client's HTTP/1.1 sees it, on raw sockets: framing,
keep-alive, pipelining, bodies (chunked, expected, refused), faults, and detproxy's own
endpoints going to their own handler."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import pytest

from proxy.http.body import BadRequest
from proxy.http.front import FrontRequest, FrontServer
from proxy.http.headers import decode_field
from tests.helpers.waiting import eventually

Handler = Callable[[FrontRequest], Awaitable[None]]


@dataclass
class Front:
    port: int
    server: FrontServer
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)
    fields: list[bytes | None] = field(default_factory=list)
    read: list[tuple[object, object, list[tuple[str, str]]]] = field(default_factory=list)


SIZES = (1, 9, 10, 15, 16, 255, 256, 1023, 1024, 4097)


async def handler(front: Front, request: FrontRequest) -> None:
    """What the tests ask of the front, by path."""
    path = request.path
    if path == "/echo":
        body = await request.read_body(64)
        front.seen.append((request.method, request.raw_path, body))
        await request.respond(200, {"Content-Type": "text/plain"}, b"echo:" + body)
    elif path == "/stream":
        await request.start(200, {"Content-Type": "text/event-stream"})
        for i in range(3):
            await request.write(b"data: %d\n\n" % i)
        await request.end()
    elif path == "/sizes":  # each size of chunk-size line: from the table and formatted
        await request.start(200, {"Content-Type": "text/event-stream"})
        for size in SIZES:
            assert request.write_nowait(b"x" * size)
        await request.write(b"")  # nothing: not the last chunk
        await request.end()
    elif path == "/hang":
        await request.start(200, {"Content-Type": "text/event-stream"})
        await request.write(b"data: first\n\n")
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            front.cancelled.append(path)
            raise
    elif path == "/header":
        await request.read_body(64)  # a chunked body's trailers, when it has them, are read
        before = (request.header(b"x-a"), request.header(b"content-type"), request.header(b"x-no"))
        mapping = list(request.headers.items())
        after = (request.header(b"x-a"), request.header(b"content-type"), request.header(b"x-no"))
        front.read.append((before, after, mapping))
        await request.respond(204, {}, b"")
    elif path == "/fields":
        front.fields.append(request.passed_fields)
        await request.respond(204, {}, b"")
    elif path == "/fail":
        raise RuntimeError("a fault of the handler's")
    elif path == "/limit":
        try:
            await request.read_body(16)
        except BadRequest as exc:
            await request.respond(exc.status, {}, exc.message.encode())
    else:
        await request.respond(204, {}, b"")


@pytest.fixture
async def front() -> AsyncIterator[Front]:
    async def admin(request: FrontRequest) -> None:
        text = f"admin {request.raw_path} {request.header(b'x-token')}"
        await request.respond(200, {"Content-Type": "text/plain"}, text.encode())

    holder: list[Front] = []
    server = FrontServer(lambda r: handler(holder[0], r), admin, keepalive_s=5)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    holder.append(Front(sock.getsockname()[1], server))
    await server.listen(sock, 16)
    try:
        yield holder[0]
    finally:
        await server.shutdown(1.0)


async def exchange(port: int, data: bytes, *, until: bytes = b"") -> bytes:
    """Send ``data``; read until ``until`` was seen or the server closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        got = b""
        while not (until and until in got):
            part = await asyncio.wait_for(reader.read(65536), 5)
            if not part:
                break
            got += part
        return got
    finally:
        writer.close()


def post(path: str, body: bytes, extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


async def test_keep_alive_and_pipelined_requests_are_answered_in_order(front: Front) -> None:
    got = await exchange(
        front.port, post("/echo", b"one") + post("/echo?q=2", b"two"), until=b"echo:two"
    )
    first = got.index(b"echo:one")
    assert got.count(b"HTTP/1.1 200 OK") == 2 and first < got.index(b"echo:two")
    assert b"Content-Length: 8\r\n" in got and b"Date: " in got
    assert [s[1:] for s in front.seen] == [("/echo", b"one"), ("/echo?q=2", b"two")]


async def test_a_stream_is_chunk_framed_and_ends_with_the_last_chunk(front: Front) -> None:
    got = await exchange(front.port, post("/stream", b""), until=b"0\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert b"Transfer-Encoding: chunked" in head
    assert body == b"".join(b"9\r\ndata: %d\n\n\r\n" % i for i in range(3)) + b"0\r\n\r\n"


async def test_every_chunk_size_is_framed_in_hex(front: Front) -> None:
    got = await exchange(front.port, post("/sizes", b""), until=b"0\r\n\r\n")
    body = got.partition(b"\r\n\r\n")[2]
    expected = b"".join(f"{n:x}".encode() + b"\r\n" + b"x" * n + b"\r\n" for n in SIZES)
    assert body == expected + b"0\r\n\r\n"


async def test_http_1_0_gets_the_stream_unframed_and_the_connection_closed(front: Front) -> None:
    got = await exchange(front.port, b"POST /stream HTTP/1.0\r\nContent-Length: 0\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")  # read to the close: the server ended it
    assert b"chunked" not in head and b"Connection: close" in head
    assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


async def test_a_chunked_body_with_expect_continue(front: Front) -> None:
    data = (
        b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
        b"Expect: 100-continue\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    )
    got = await exchange(front.port, data, until=b"echo:abcde")
    assert got.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n")


async def test_a_body_past_the_limit_is_refused_and_the_rest_read_before_closing(
    front: Front,
) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    big = b"x" * 8_000_000  # more than the sockets buffer: the client is still sending
    writer.write(post("/limit", big))
    await writer.drain()  # the whole body: it was read (and dropped), not reset
    got = await asyncio.wait_for(reader.read(), 5)  # to the close, once it all came
    assert got.startswith(b"HTTP/1.1 413 ") and b"Connection: close" in got
    assert got.endswith(b"request body of 8000000 bytes exceeds the limit of 16")
    writer.close()


async def test_a_chunked_body_past_the_limit_is_refused_before_its_end(front: Front) -> None:
    """No length declared: refused once more than the limit came, the end not waited for."""
    data = b"POST /limit HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
    data += b"a\r\n0123456789\r\na\r\n0123456789\r\n"  # 20 bytes, and no last chunk
    got = await exchange(front.port, data, until=b"limit of 16 bytes")
    assert got.startswith(b"HTTP/1.1 413 "), f"a body past the limit answered {got[:40]!r}"
    assert got.endswith(b"request body exceeds the limit of 16 bytes")


async def test_a_client_that_leaves_cancels_its_handler(front: Front) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", front.port)
    writer.write(post("/hang", b""))
    await asyncio.wait_for(reader.readuntil(b"data: first"), 5)
    writer.close()
    await eventually(lambda: front.cancelled, what="the handler cancelled")
    assert front.cancelled == ["/hang"]
    assert front.server.busy() == 0


async def test_a_handler_fault_is_a_500_and_the_server_goes_on(front: Front) -> None:
    got = await exchange(front.port, post("/fail", b""), until=b"}")
    assert got.startswith(b"HTTP/1.1 500 ") and b"InternalServerError" in got
    assert b"Connection: close" in got
    assert b"echo:ok" in await exchange(front.port, post("/echo", b"ok"), until=b"echo:ok")


async def test_a_malformed_request_is_a_400_and_the_connection_closed(front: Front) -> None:
    got = await exchange(front.port, b"NOT HTTP AT ALL\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 400 ") and b"malformed HTTP request" in got


async def test_detproxy_endpoints_go_to_the_admin_handler(front: Front) -> None:
    data = b"GET /detproxy/metrics?x=1 HTTP/1.1\r\nHost: x\r\nX-Token: t0\r\n\r\n"
    got = await exchange(front.port, data, until=b"t0")
    assert got.startswith(b"HTTP/1.1 200 OK"), f"the admin handler answered {got[:40]!r}"
    assert got.endswith(b"admin /detproxy/metrics?x=1 t0")
    assert front.seen == []  # not the front's handler


async def test_bodyless_statuses_and_head_carry_no_body(front: Front) -> None:
    got = await exchange(front.port, b"GET /none HTTP/1.1\r\nHost: x\r\n\r\n", until=b"\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 204 No Content") and b"Content-Length" not in got
    head = b"HEAD /stream HTTP/1.1\r\nHost: x\r\n\r\n" + post("/echo", b"after")
    got = await exchange(front.port, head, until=b"echo:after")
    assert b"data:" not in got  # the HEAD's answer has no body, and the next one follows


async def test_an_idle_keep_alive_connection_is_closed_after_the_keepalive_timeout() -> None:
    """Requests that keep coming within the timeout keep the connection open, however long it
    lives (the idle timer is re-armed, not restarted per request); silence closes it."""

    async def answer(request: FrontRequest) -> None:
        await request.read_body(64)
        await request.respond(200, {}, b"ok")

    server = FrontServer(answer, answer, keepalive_s=0.6)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    await server.listen(sock, 4)
    reader, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
    try:
        for _ in range(6):  # 6 x 0.2 s: twice the timeout, never idle that long
            writer.write(post("/x", b""))
            got = await asyncio.wait_for(reader.readuntil(b"ok"), 5)
            assert got.startswith(b"HTTP/1.1 200 OK")
            await asyncio.sleep(0.2)
        idle_from = asyncio.get_running_loop().time()
        assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the server
        assert asyncio.get_running_loop().time() - idle_from < 2.0
    finally:
        writer.close()
        await server.shutdown(1.0)


async def test_the_fields_passed_on_are_the_clients_bytes_less_those_held(front: Front) -> None:
    """Each request of a keep-alive connection, pipelined ones too, gets its own: held
    fields (hop-by-hop, framing, Accept-Encoding, X-Request-Id) left out, and a Connection
    header naming another field makes the handler filter the mapping instead (None)."""
    first = (
        b"GET /fields HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nACCEPT-ENCODING: gzip\r\n"
        b"x-obs: caf\xe9\r\nX-Request-Id: r\r\nTE: trailers\r\nx-a: 2\r\n\r\n"
    )
    named = b"GET /fields HTTP/1.1\r\nHost: x\r\nX-A: 1\r\nConnection: keep-alive, X-A\r\n\r\n"
    only_held = b"GET /fields HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n"
    last = b"GET /other HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    got = await exchange(front.port, first + named + only_held + first + last)
    assert got.count(b"HTTP/1.1 204") == 5
    passed = b"X-A: 1\r\nx-obs: caf\xe9\r\nx-a: 2\r\n"
    assert front.fields == [passed, None, b"", passed]


async def test_a_field_is_read_without_the_mapping_and_as_the_mapping_reads_it(
    front: Front,
) -> None:
    """``header`` decodes the first field of a name, in any case, as ``headers`` does; the
    trailers of a chunked body are not among the request's fields."""
    body = b"5\r\nhello\r\n0\r\nX-Trailer: t\r\n\r\n"
    request = (
        b"POST /header HTTP/1.1\r\nHost: x\r\nx-a: caf\xe9\r\nCONTENT-TYPE: text/plain\r\n"
        b"X-A: 2\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + body
    )
    got = await exchange(front.port, request)
    assert got.startswith(b"HTTP/1.1 204")
    ((before, after, mapping),) = front.read
    expected = (decode_field(b"caf\xe9"), "text/plain", None)
    assert before == after == expected
    assert mapping == [
        ("Host", "x"),
        ("x-a", decode_field(b"caf\xe9")),
        ("CONTENT-TYPE", "text/plain"),
        ("X-A", "2"),
        ("Transfer-Encoding", "chunked"),
        ("Connection", "close"),
    ]
