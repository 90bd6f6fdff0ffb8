"""Every forwarding row of SPEC section 3, provoked against a scripted upstream on a socket:
each is a fault as detproxy's own client meets it on the wire (refused, reset, silent, cut)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from aiohttp import ClientTimeout, web
from prometheus_client import CollectorRegistry

from tests.helpers.metrics import metric
from tests.helpers.processes import free_port
from tests.helpers.sse import sse_blocks
from tests.helpers.waiting import eventually

CHAT = "/v1/chat/completions"
EV1 = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
EV2 = b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'


async def test_refused_connection_is_502(make_proxy: Any, registry: CollectorRegistry) -> None:
    client = await make_proxy(f"http://127.0.0.1:{free_port()}")
    resp = await client.post(CHAT, json={"model": "m"})
    assert resp.status == 502
    err = (await resp.json())["error"]
    assert err["code"] == 502 and "refused" in err["message"]
    assert (
        metric(
            registry,
            "detproxy_upstream_errors_total",
            endpoint="chat",
            kind="refused",
            stage="headers",
        )
        == 1
    )


async def test_reset_before_headers_is_502(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    async def reset(request: web.Request) -> web.Response:
        await request.read()
        assert request.transport is not None
        request.transport.close()
        await asyncio.sleep(1)
        return web.Response()

    upstream_app.router.add_post(CHAT, reset)
    client = await make_proxy(await upstream())
    resp = await client.post(CHAT, json={"model": "m"})
    assert resp.status == 502
    assert (await resp.json())["error"]["type"] == "BadGatewayError"


async def test_timeout_before_headers_is_504(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    async def slow(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.Response()

    upstream_app.router.add_post(CHAT, slow)
    client = await make_proxy(await upstream(), env={"DETPROXY_UPSTREAM__READ_TIMEOUT_S": "0.3"})
    resp = await client.post(CHAT, json={"model": "m"})
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == 504


async def test_break_mid_stream_ends_with_inband_error_and_done(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    async def breaks(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(EV1 + EV2 + b'data: {"id":"c","cho')  # cut inside an event
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp

    upstream_app.router.add_post(CHAT, breaks)
    client = await make_proxy(await upstream())
    resp = await client.post(CHAT, json={"model": "m", "stream": True})
    assert resp.status == 200
    events = [block[len(b"data: ") :] for block in sse_blocks(await resp.read())]
    assert events[:2] == [EV1[6:-2], EV2[6:-2]]
    error = orjson.loads(events[2])["error"]
    assert error["code"] == 502 and "mid-stream" in error["message"]
    assert events[3:] == [b"[DONE]"]
    assert (
        metric(
            registry, "detproxy_upstream_errors_total", endpoint="chat", kind="reset", stage="body"
        )
        == 1
    )


async def test_malformed_sse_and_json_are_relayed_and_counted(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    bodies = {
        "sse": EV1 + b"garbage without a field name\n\n" + EV2 + b"data: [DONE]\n\n",
        "json": EV1 + b"data: {not json\n\n" + EV2 + b"data: [DONE]\n\n",
    }

    async def malformed(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        body = bodies[request.query["kind"]]
        for i in range(0, len(body), 7):  # awkward splits on purpose
            await resp.write(body[i : i + 7])
        return resp

    upstream_app.router.add_post(CHAT, malformed)
    client = await make_proxy(await upstream())
    for kind, body in bodies.items():
        resp = await client.post(CHAT + f"?kind={kind}", json={"stream": True})
        assert await resp.read() == body
    for reason in ("malformed_sse", "malformed_json"):
        assert (
            metric(registry, "detproxy_inspection_stopped_total", endpoint="chat", reason=reason)
            == 1
        )


async def test_oversized_event_switches_to_raw_relay(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    big = b"data: " + b"x" * 5000 + b"\n\n"
    body = EV1 + big + EV2 + b"data: [DONE]\n\n"

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(0, len(body), 1000):
            await resp.write(body[i : i + 1000])
            await asyncio.sleep(0.01)  # separate reads: the event is seen growing
        return resp

    upstream_app.router.add_post(CHAT, stream)
    client = await make_proxy(
        await upstream(), env={"DETPROXY_SERVER__MAX_SSE_EVENT_BYTES": "2048"}
    )
    resp = await client.post(CHAT, json={"stream": True})
    assert await resp.read() == body
    assert (
        metric(
            registry, "detproxy_inspection_stopped_total", endpoint="chat", reason="event_too_large"
        )
        == 1
    )


class EndlessUpstream:
    """Streams (or withholds an answer) until the connection from detproxy is closed."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()
        self.started = asyncio.Event()

    async def stream(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        self.started.set()
        try:
            while True:
                await resp.write(EV1)
                await asyncio.sleep(0.05)
        except (asyncio.CancelledError, ConnectionResetError):
            self.cancelled.set()
            raise

    async def never_answers(self, request: web.Request) -> web.Response:
        self.started.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.Response()


async def test_client_disconnect_mid_stream_closes_upstream(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    endless = EndlessUpstream()
    upstream_app.router.add_post(CHAT, endless.stream)
    client = await make_proxy(await upstream())
    resp = await client.post(CHAT, json={"stream": True})
    assert await resp.content.readuntil(b"\n\n") == EV1
    resp.close()  # the client goes away
    await asyncio.wait_for(endless.cancelled.wait(), timeout=1.0)

    def left() -> float:
        name = "detproxy_client_disconnects_total"
        return metric(registry, name, endpoint="chat", stream="true")

    await eventually(
        lambda: left() and metric(registry, "detproxy_inflight_requests") == 0,
        what="the disconnect counted and nothing in flight",
    )
    assert left() == 1
    assert metric(registry, "detproxy_inflight_requests") == 0


async def test_client_disconnect_while_waiting_closes_upstream(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: CollectorRegistry
) -> None:
    endless = EndlessUpstream()
    upstream_app.router.add_post(CHAT, endless.never_answers)
    client = await make_proxy(await upstream())
    request = asyncio.create_task(
        client.post(CHAT, json={"model": "m"}, timeout=ClientTimeout(total=30))
    )
    await asyncio.wait_for(endless.started.wait(), timeout=5)
    request.cancel()  # the client closes its connection before any answer
    await asyncio.wait_for(endless.cancelled.wait(), timeout=1.0)

    def left() -> float:
        name = "detproxy_client_disconnects_total"
        return metric(registry, name, endpoint="chat", stream="false")

    await eventually(
        lambda: left() and metric(registry, "detproxy_inflight_requests") == 0,
        what="the disconnect counted and nothing in flight",
    )
    assert left() == 1
    assert metric(registry, "detproxy_inflight_requests") == 0


async def test_a_stale_keepalive_connection_is_retried_once(make_proxy: Any) -> None:
    """The upstream answers the first request, keeps the connection, then drops it when the
    next request arrives on it without answering (a keep-alive it had given up on)."""
    answer = b'{"choices":[{"index":0,"message":{"content":"ok"},"finish_reason":"stop"}]}'
    seen: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = len(seen)
        seen.append(0)
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                writer.close()  # detproxy closed its pooled connection
                return
            length = int(
                next(
                    line.split(b":")[1]
                    for line in head.split(b"\r\n")
                    if line.lower().startswith(b"content-length")
                )
            )
            await reader.readexactly(length)
            seen[conn] += 1
            if seen[conn] == 2:  # the second request on this connection: hang up, no answer
                writer.close()
                return
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
            )
            await writer.drain()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        client = await make_proxy(
            f"http://127.0.0.1:{port}", env={"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
        )
        for _ in range(2):
            resp = await client.post(CHAT, json={"model": "m"})
            assert resp.status == 200 and (await resp.json())["choices"][0]["message"]
        assert seen == [2, 1]  # the dropped request went again, on a new connection
        await client.close()  # before the server: its handlers end on detproxy's close
    finally:
        server.close()
        await server.wait_closed()
