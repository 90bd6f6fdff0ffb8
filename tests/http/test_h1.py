"""The native upstream client (proxy/http/h1.py) against scripted HTTP/1.1 servers: framing,
keep-alive reuse, retries, timeouts, aborts, flow control, the connection limit."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.http.errors import UpstreamFailure
from proxy.http.h1 import HIGH_WATER, H1Upstream, UpstreamBodyError
from proxy.http.h1conn import Conn
from proxy.http.headers import EncodedFields, decode_field, is_event_stream_response
from proxy.http.upstream import READ_ERRORS
from tests.helpers.upstreams import (
    JSON_REPLY,
    ScriptedReply,
    ScriptedRequest,
    ScriptedServer,
    replies_with,
)
from tests.helpers.waiting import eventually


@pytest.fixture
async def scripted() -> AsyncIterator[Callable[[ScriptedReply], Awaitable[ScriptedServer]]]:
    servers: list[asyncio.Server] = []

    async def start(reply: ScriptedReply) -> ScriptedServer:
        s = ScriptedServer(reply)
        s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        servers.append(s.server)
        return s

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


def client(url: str, **kw: Any) -> H1Upstream:
    opts: dict[str, Any] = {
        "connect_timeout_s": 2.0,
        "read_timeout_s": 5.0,
        "keepalive_timeout_s": 4.0,
        "max_connections": 16,
    }
    opts.update(kw)
    return H1Upstream(url, **opts)


async def test_content_length_answers_reuse_one_connection(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url)
    for _ in range(3):
        resp = await up.send("POST", "/v1/chat/completions?x=1", {"X-Request-Id": "r1"}, b"{}")
        assert resp.status == 200
        assert resp.headers["content-type"] == "application/json"
        assert await resp.read() == b'{"a":1}'
    assert srv.connections == 1 and len(srv.requests) == 3
    req = srv.requests[0]
    assert req.lines[0] == b"POST /v1/chat/completions?x=1 HTTP/1.1"
    assert req.header(b"host") == srv.url.removeprefix("http://").encode()
    assert req.header(b"x-request-id") == b"r1"
    assert req.header(b"content-length") == b"2" and req.body == b"{}"
    await up.close()
    await eventually(lambda: srv.eofs, what="the idle connection closed")
    assert srv.eofs == 1  # closing the client closes its idle connections


async def test_every_request_carries_the_servers_via_beside_the_clients_own(
    scripted: Any,
) -> None:
    """proxy/selfloop.py: the server's id on every request, after Host; a detproxy in front
    of this one marked the request too, and its field is passed on, not replaced."""
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url, server_id="0123abcd")
    theirs = b"X-Detproxy-Via: ffff0000\r\n"
    for headers in ({"X-Detproxy-Via": "ffff0000"}, EncodedFields(theirs)):
        assert await (await up.send("POST", "/v1/completions", headers, b"{}")).read()
        vias = [line for line in srv.requests[-1].lines if line.lower().startswith(b"x-detproxy")]
        assert vias == [b"X-Detproxy-Via: 0123abcd", b"X-Detproxy-Via: ffff0000"]
        assert srv.requests[-1].lines[1].lower().startswith(b"host:")
    plain = client(srv.url)  # no id (the tools' clients): no field
    assert await (await plain.send("GET", "/v1/models", {}, None)).read()
    assert srv.requests[-1].header(b"x-detproxy-via") is None
    await up.close()
    await plain.close()


async def test_chunked_body_is_decoded_and_streamed(scripted: Any) -> None:
    parts = [b"data: one\n\n", b"data: two\n\n", b"data: [DONE]\n\n"]
    srv = await scripted(paced_stream(parts))
    up = client(srv.url)
    resp = await up.send("POST", "/s", {}, b"{}")
    got = [chunk async for chunk in resp.chunks()]
    assert b"".join(got) == b"".join(parts) and len(got) >= 2  # relayed as it came
    assert await (await up.send("POST", "/s", {}, b"{}")).read() == b"".join(parts)
    assert srv.connections == 1


async def test_a_body_delimited_by_close_ends_with_the_connection(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nall of it")
        return False  # close: that is the end of the body

    srv = await scripted(reply)
    up = client(srv.url)
    for _ in range(2):
        assert await (await up.send("GET", "/", {}, None)).read() == b"all of it"
    assert srv.connections == 2  # never pooled


async def test_connection_close_and_http10_are_not_reused(scripted: Any) -> None:
    replies = [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
    ]

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(replies[req.conn % 2])
        return True

    srv = await scripted(reply)
    up = client(srv.url)
    for _ in range(3):
        assert await (await up.send("GET", "/", {}, None)).read() == b"ok"
    assert srv.connections == 3


async def test_head_and_204_have_no_body(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        if req.lines[0].startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 1234\r\n\r\n")
        else:
            writer.write(b"HTTP/1.1 204 No Content\r\n\r\n")
        return True

    srv = await scripted(reply)
    up = client(srv.url)
    head = await asyncio.wait_for(up.send("HEAD", "/", {}, None), 2)
    assert head.status == 200 and head.headers["content-length"] == "1234"
    assert await asyncio.wait_for(head.read(), 2) == b""
    for _ in range(2):
        resp = await up.send("DELETE", "/x", {}, None)
        assert resp.status == 204 and await resp.read() == b""
    assert srv.connections == 2  # HEAD's connection is not reused; the 204s share one


async def test_an_interim_100_continue_is_skipped(scripted: Any) -> None:
    srv = await scripted(replies_with(b"HTTP/1.1 100 Continue\r\n\r\n" + JSON_REPLY))
    up = client(srv.url)
    resp = await up.send("POST", "/", {"Expect": "100-continue"}, b"{}")
    assert resp.status == 200 and await resp.read() == b'{"a":1}'


async def test_request_framing(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url + "/prefix/")

    async def body() -> AsyncIterator[bytes]:
        yield b"hello "
        yield b""
        yield b"world"

    await (await up.send("POST", "/a", {}, body())).read()
    await (await up.send("POST", "/b", {}, None)).read()
    await (await up.send("GET", "/c", {}, None)).read()
    streamed, empty, get = srv.requests
    assert streamed.lines[0] == b"POST /prefix/a HTTP/1.1"
    assert streamed.header(b"transfer-encoding") == b"chunked" and streamed.body == b"hello world"
    assert empty.header(b"content-length") == b"0"
    assert get.header(b"content-length") is None and get.header(b"transfer-encoding") is None


async def test_encoded_fields_are_written_as_they_are(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url)
    fields = EncodedFields(b"X-Obs: caf\xe9\r\nx-many: 1\r\nX-Many: 2\r\n")
    await (await up.send("POST", "/a", fields, b"{}")).read()
    (req,) = srv.requests
    host = srv.url.removeprefix("http://").encode()
    assert req.head == (
        b"POST /a HTTP/1.1\r\nHost: %s\r\nX-Obs: caf\xe9\r\nx-many: 1\r\nX-Many: 2\r\n"
        b"Content-Length: 2\r\n\r\n" % host
    )
    await up.close()


async def test_the_response_fields_come_as_sent_and_decode_when_asked(scripted: Any) -> None:
    heads = [
        b"HTTP/1.1 200 OK\r\nCONTENT-TYPE: text/event-stream; charset=utf-8\r\n",
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nX-Obs: caf\xe9\r\n",
        b"HTTP/1.1 200 OK\r\nX-Content-Type: text/event-stream\r\n",
    ]
    for head, stream in zip(heads, (True, False, False), strict=True):
        srv = await scripted(replies_with(head + b"Content-Length: 0\r\n\r\n"))
        up = client(srv.url)
        resp = await up.send("GET", "/", {}, None)
        assert resp.raw_fields == [
            tuple(line.split(b": ", 1)) for line in head.split(b"\r\n")[1:-1]
        ] + [(b"Content-Length", b"0")]
        assert is_event_stream_response(resp) is stream
        assert list(resp.headers.items()) == [
            (n.decode("latin-1"), decode_field(v)) for n, v in resp.raw_fields
        ]
        await resp.read()
        await up.close()


async def test_a_stale_pooled_connection_is_retried_once(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        if sum(r.conn == req.conn for r in srv.requests) == 2:
            return False  # the second request on a connection: hang up without answering
        writer.write(JSON_REPLY)
        return True

    srv = await scripted(reply)
    up = client(srv.url)
    for _ in range(2):
        assert await (await up.send("POST", "/", {}, b"{}")).read() == b'{"a":1}'
    assert [r.conn for r in srv.requests] == [0, 0, 1]


async def test_a_streamed_body_is_not_sent_twice(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        if sum(r.conn == req.conn for r in srv.requests) == 2:
            return False
        writer.write(JSON_REPLY)
        return True

    async def body() -> AsyncIterator[bytes]:
        yield b"{}"

    srv = await scripted(reply)
    up = client(srv.url)
    await (await up.send("POST", "/", {}, b"{}")).read()
    with pytest.raises(UpstreamFailure) as err:
        await up.send("POST", "/", {}, body())
    assert (err.value.status, err.value.kind) == (502, "reset")
    assert len(srv.requests) == 2


async def test_refused_and_timeouts_map_to_gateway_errors(scripted: Any) -> None:
    up = client("http://127.0.0.1:9")  # discard port: nothing listens
    with pytest.raises(UpstreamFailure) as err:
        await up.send("GET", "/", {}, None)
    assert (err.value.status, err.value.kind) == (502, "refused")

    async def silent(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        if req.lines[0].startswith(b"GET /slow-body"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
        await asyncio.sleep(1)
        return False

    srv = await scripted(silent)
    up = client(srv.url, read_timeout_s=0.2)
    with pytest.raises(UpstreamFailure) as err:
        await up.send("GET", "/slow-head", {}, None)
    assert (err.value.status, err.value.kind) == (504, "timeout")
    resp = await up.send("GET", "/slow-body", {}, None)
    with pytest.raises(TimeoutError):
        await resp.read()


async def test_a_body_cut_short_raises_a_payload_error(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        return False

    srv = await scripted(reply)
    resp = await client(srv.url).send("GET", "/", {}, None)
    with pytest.raises(UpstreamBodyError) as err:
        await resp.read()
    assert isinstance(err.value, READ_ERRORS)  # what every reader handles


async def test_a_malformed_response_is_a_bad_gateway(scripted: Any) -> None:
    srv = await scripted(replies_with(b"NOT HTTP AT ALL\r\n\r\n"))
    with pytest.raises(UpstreamFailure) as err:
        await client(srv.url).send("GET", "/", {}, None)
    assert err.value.status == 502


async def test_closing_an_unfinished_response_closes_the_connection(scripted: Any) -> None:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        return True  # a generation that goes on; the server waits for what comes next

    srv = await scripted(reply)
    up = client(srv.url)
    resp = await up.send("POST", "/", {}, b"{}")
    async for chunk in resp.chunks():
        assert chunk == b"first"
        break
    resp.close()
    await eventually(lambda: srv.eofs, what="the upstream saw the client go")
    assert srv.eofs == 1  # the upstream saw the client go: it can abort the generation
    assert up.idle_connections == 0


async def test_cancelling_a_request_closes_its_connection(scripted: Any) -> None:
    async def never(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        return True  # no answer; the server waits for what comes next

    srv = await scripted(never)
    up = client(srv.url, max_connections=1)
    task = asyncio.create_task(up.send("POST", "/", {}, b"{}"))
    await eventually(lambda: srv.requests, what="the request at the upstream")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await eventually(lambda: srv.eofs, what="the cancelled request's connection closed")
    assert srv.eofs == 1
    # The one connection slot was given back: a new request is not stuck behind it.
    srv.reply = replies_with(JSON_REPLY)
    resp = await asyncio.wait_for(up.send("POST", "/", {}, b"{}"), 2)
    assert await resp.read() == b'{"a":1}'


async def test_the_connection_limit_queues_requests(scripted: Any) -> None:
    gate = asyncio.Event()

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        await gate.wait()
        writer.write(JSON_REPLY)
        return True

    srv = await scripted(reply)
    up = client(srv.url, max_connections=2)

    async def one() -> bytes:
        resp = await up.send("POST", "/", {}, b"{}")
        return await resp.read()

    tasks = [asyncio.create_task(one()) for _ in range(3)]
    await eventually(lambda: len(srv.requests) == 2, what="two requests at the upstream")
    await eventually(lambda: up.waiting == 1, what="the third waiting for a connection")
    assert srv.connections == 2 and not any(t.done() for t in tasks)
    gate.set()
    assert await asyncio.wait_for(asyncio.gather(*tasks), 5) == [b'{"a":1}'] * 3
    assert srv.connections == 2  # the third request waited for a pooled connection


async def test_idle_connections_expire(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url, keepalive_timeout_s=0.05)
    await (await up.send("GET", "/", {}, None)).read()
    await (await up.send("GET", "/", {}, None)).read()
    assert srv.connections == 1
    await asyncio.sleep(0.15)
    await (await up.send("GET", "/", {}, None)).read()
    assert srv.connections == 2


async def test_a_slow_reader_pauses_the_upstream(scripted: Any) -> None:
    size = 8 * 1024 * 1024

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
        for _ in range(size // 65536):
            writer.write(b"x" * 65536)
            await writer.drain()
        return True

    srv = await scripted(reply)
    resp = await client(srv.url).send("GET", "/big", {}, None)
    # Nobody reads: the client must stop reading the socket, with little past the mark held.
    await eventually(lambda: resp.reading_paused, what="reading paused above the high water")
    held = resp.held
    assert HIGH_WATER < held <= HIGH_WATER + 512 * 1024, held
    total = 0
    async for chunk in resp.chunks():
        total += len(chunk)
    assert total == size


async def test_an_upstream_gone_during_a_streamed_upload_is_a_bad_gateway(scripted: Any) -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.close()  # before the body

    server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def body() -> AsyncIterator[bytes]:
        for _ in range(20):
            yield b"x" * 1024
            await asyncio.sleep(0.02)

    try:
        up = client(f"http://127.0.0.1:{port}")
        with pytest.raises(UpstreamFailure) as err:
            await asyncio.wait_for(up.send("PUT", "/upload", {}, body()), 5)
        assert err.value.status == 502
    finally:
        server.close()
        await server.wait_closed()


def test_under_uvloop() -> None:
    """uvloop's transports are not asyncio.Transport subclasses: the client must not care."""
    uvloop = pytest.importorskip("uvloop")

    async def scenario() -> tuple[list[bytes], int]:
        s = ScriptedServer(replies_with(JSON_REPLY))
        s.server = await asyncio.start_server(s.handle, "127.0.0.1", 0)
        up = client(s.url)
        try:
            bodies = [await (await up.send("POST", "/", {}, b"{}")).read() for _ in range(3)]
            await up.close()
            return bodies, s.connections
        finally:
            s.server.close()
            await s.server.wait_closed()

    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        bodies, connections = runner.run(scenario())
    assert bodies == [b'{"a":1}'] * 3 and connections == 1


async def test_a_waiter_woken_then_cancelled_passes_the_slot_on(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url, max_connections=1)
    first = await up.send("GET", "/", {}, None)  # holds the one slot until read
    woken = asyncio.create_task(up.send("GET", "/", {}, None))
    next_in_line = asyncio.create_task(up.send("GET", "/", {}, None))
    await eventually(lambda: up.waiting == 2, what="both waiting for the slot")
    await first.read()  # frees it: `woken` gets it...
    woken.cancel()  # ...and is cancelled before it runs
    resp = await asyncio.wait_for(next_in_line, 2)
    assert await resp.read() == b'{"a":1}'


async def test_expired_idle_connections_are_closed_on_a_release(scripted: Any) -> None:
    srv = await scripted(replies_with(JSON_REPLY))
    up = client(srv.url, keepalive_timeout_s=0.5)
    a, b = await asyncio.gather(*(up.send("GET", "/", {}, None) for _ in range(2)))
    await a.read()
    await b.read()  # two idle connections
    await asyncio.sleep(0.3)
    await (await up.send("GET", "/", {}, None)).read()  # the newest is used again
    await asyncio.sleep(0.3)  # the other one is now past the keep-alive time
    await (await up.send("GET", "/", {}, None)).read()
    await eventually(lambda: srv.eofs, what="the expired connection closed")
    assert (srv.connections, srv.eofs, up.idle_connections) == (2, 1, 1)


def paced_stream(parts: list[bytes], pause_s: float = 0.01) -> ScriptedReply:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in parts:
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
            await asyncio.sleep(pause_s)
        writer.write(b"0\r\n\r\n")
        return True

    return reply


async def test_pump_hands_each_piece_over_from_the_read_and_keeps_the_connection(
    scripted: Any,
) -> None:
    parts = [b"data: %d\n\n" % i for i in range(5)]
    srv = await scripted(paced_stream(parts))
    up = client(srv.url)
    resp = await up.send("POST", "/s", {}, b"{}")
    got: list[bytes] = []
    tasks: list[asyncio.Task[Any] | None] = []

    def sink(data: bytes) -> bool:
        got.append(data)
        tasks.append(asyncio.current_task())
        return True

    assert await resp.pump(sink) is True
    assert b"".join(got) == b"".join(parts) and len(got) >= 3
    # The pieces that came while the pump waited were handed over in the read's callback.
    assert None in tasks
    assert await (await up.send("POST", "/s", {}, b"{}")).read() == b"".join(parts)
    assert srv.connections == 1  # a complete pumped response returns its connection


async def test_a_sink_that_stops_gets_the_rest_from_the_next_pump(scripted: Any) -> None:
    parts = [b"one", b"two", b"three", b"four"]
    srv = await scripted(paced_stream(parts))
    resp = await client(srv.url).send("POST", "/s", {}, b"{}")
    first: list[bytes] = []
    assert await resp.pump(lambda d: first.append(d) or False) is False
    assert first == [b"one"]
    # What comes meanwhile waits in the connection.
    await eventually(lambda: resp.held >= len(b"twothree"), what="more held in the connection")
    rest: list[bytes] = []
    assert await resp.pump(lambda d: rest.append(d) or True) is True
    assert b"".join(first + rest) == b"".join(parts)


async def test_a_sink_that_raises_raises_in_the_pump_and_closes_the_connection(
    scripted: Any,
) -> None:
    srv = await scripted(paced_stream([b"one", b"two", b"three"]))
    up = client(srv.url)
    resp = await up.send("POST", "/s", {}, b"{}")
    seen: list[bytes] = []

    def sink(data: bytes) -> bool:
        seen.append(data)
        if len(seen) == 2:
            raise ConnectionResetError("the client left")
        return True

    with pytest.raises(ConnectionResetError):
        await resp.pump(sink)
    assert seen[:2] == [b"one", b"two"]
    assert up.idle_connections == 0  # unfinished: closed, not pooled
    assert await (await up.send("POST", "/s", {}, b"{}")).read() == b"onetwothree"
    assert srv.connections == 2


async def test_the_pumped_read_timeout_is_the_silence_since_the_last_piece(
    scripted: Any,
) -> None:
    # Pieces 0.1 s apart for 0.5 s under a 0.25 s read timeout: never silent that long.
    srv = await scripted(paced_stream([b"x"] * 5, pause_s=0.1))
    resp = await client(srv.url, read_timeout_s=0.25).send("POST", "/s", {}, b"{}")
    got: list[bytes] = []
    assert await resp.pump(lambda d: got.append(d) or True) is True
    assert b"".join(got) == b"x" * 5

    async def stalls(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n")
        await asyncio.sleep(1)
        return False

    srv = await scripted(stalls)
    resp = await client(srv.url, read_timeout_s=0.2).send("POST", "/s", {}, b"{}")
    with pytest.raises(TimeoutError):
        await resp.pump(lambda d: True)


def test_a_lost_connection_is_freed_by_reference_counting() -> None:
    """The parser calls back into its connection (a reference cycle): the cycle is cut when
    the connection is lost, so that it goes at once, not at the cyclic collector's next pass,
    which pauses the loop (issue 16)."""

    def conns() -> int:
        return sum(1 for o in gc.get_objects() if type(o) is Conn)

    loop = asyncio.new_event_loop()
    gc.collect()
    gc.disable()
    try:
        before = conns()
        conn = Conn(loop)
        conn.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        assert conn.complete and conns() == before + 1
        conn.connection_lost(None)
        del conn
        assert conns() == before
    finally:
        gc.enable()
        loop.close()
