"""Every other path and method is reverse-proxied untouched; /detproxy/ is detproxy's own."""

from __future__ import annotations

import asyncio
import gzip
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from tests.helpers.metrics import metric
from tests.helpers.waiting import eventually

SEEN: list[tuple[str, str, CIMultiDict[str], bytes]] = []


async def echo(request: web.Request) -> web.Response:
    body = await request.read()
    return web.json_response(
        {
            "method": request.method,
            "path": request.path_qs,
            "body": body.decode(),
            "headers": {k.lower(): v for k, v in request.headers.items()},
        },
        headers={
            "X-Upstream-Header": "kept",
            "Keep-Alive": "timeout=5",
            "Connection": "keep-alive",
        },
    )


async def metrics(request: web.Request) -> web.Response:
    body = gzip.compress(b"vllm:num_requests_running 3\n")
    return web.Response(
        body=body, headers={"Content-Encoding": "gzip", "Content-Type": "text/plain"}
    )


async def test_other_paths_and_methods(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    upstream_app.router.add_route("*", "/{tail:.*}", echo)
    client = await make_proxy(await upstream())
    for method, path in [
        ("GET", "/v1/models"),
        ("GET", "/health"),
        ("POST", "/tokenize?x=1&y=%20"),
        ("PUT", "/anything/else"),
        ("DELETE", "/v1/responses/abc"),
        ("GET", "/v1/chat/completions"),
    ]:
        resp = await client.request(method, path, data=b"payload" if method != "GET" else None)
        assert resp.status == 200
        seen = await resp.json()
        assert (seen["method"], seen["path"]) == (method, path)
        assert seen["body"] == ("payload" if method != "GET" else "")
        assert resp.headers["X-Upstream-Header"] == "kept"
        assert "Keep-Alive" not in resp.headers


async def test_hop_by_hop_headers_are_not_forwarded(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    upstream_app.router.add_route("*", "/{tail:.*}", echo)
    client = await make_proxy(await upstream())
    resp = await client.get(
        "/v1/models",
        headers={
            "Connection": "keep-alive, X-Secret-Hop",
            "X-Secret-Hop": "1",
            "TE": "trailers",
            "Proxy-Authorization": "Basic x",
            "Authorization": "Bearer sk-1",
            "X-Custom": "y",
        },
    )
    seen = (await resp.json())["headers"]
    assert "x-secret-hop" not in seen and "te" not in seen and "proxy-authorization" not in seen
    assert seen["authorization"] == "Bearer sk-1" and seen["x-custom"] == "y"
    assert seen["x-request-id"] == resp.headers["X-Request-Id"]


async def test_encoded_bodies_pass_untouched(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    upstream_app.router.add_get("/metrics", metrics)
    client = await make_proxy(await upstream())
    resp = await client.get("/metrics", auto_decompress=False)
    assert resp.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(await resp.read()) == b"vllm:num_requests_running 3\n"


async def test_upstream_statuses_pass_through(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    async def dead(request: web.Request) -> web.Response:
        return web.Response(status=503, text="engine dead")

    upstream_app.router.add_get("/health", dead)
    client = await make_proxy(await upstream())
    resp = await client.get("/health")
    assert (resp.status, await resp.text()) == (503, "engine dead")


async def test_detproxy_endpoints_are_never_forwarded(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: Any
) -> None:
    upstream_app.router.add_route("*", "/{tail:.*}", echo)
    client = await make_proxy(await upstream())
    assert (await (await client.get("/detproxy/health")).json()) == {"status": "ok"}
    resp = await client.get("/detproxy/nope")
    assert resp.status == 404 and "detproxy" in (await resp.json())["error"]["message"]
    await client.get("/v1/models")
    text = await (await client.get("/detproxy/metrics")).text()
    assert 'detproxy_requests_total{deterministic="false",endpoint="other"' in text
    status = await (await client.get("/detproxy/status")).json()
    assert status["upstream"].startswith("http://127.0.0.1") and status["inflight"] == 0
    assert (
        metric(
            registry, "detproxy_request_duration_seconds_count", endpoint="other", stream="false"
        )
        >= 1
    )


async def test_a_stream_the_client_leaves_on_done_is_whole_not_a_disconnect(
    make_proxy: Any, upstream: Any, upstream_app: web.Application, registry: Any
) -> None:
    """A route passed through that streams SSE (vLLM's streamed transcriptions, say): the
    openai SDK closes the connection once it reads ``data: [DONE]``, here a second before the
    upstream ends its framing. The client had the whole stream: a 200, not a disconnect."""

    async def transcribe(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"delta": "hello"}\n\n')
        await resp.write(b"data: [DONE]\n\n")
        await asyncio.sleep(1.0)
        await resp.write_eof()
        return resp

    upstream_app.router.add_post("/v1/audio/transcriptions", transcribe)
    client = await make_proxy(await upstream())
    resp = await client.post("/v1/audio/transcriptions", data=b"audio")
    got = b""
    while not got.endswith(b"data: [DONE]\n\n"):
        got += await resp.content.readany()
    resp.close()  # as the SDK does on [DONE]

    def responses(outcome: str, code: str) -> float:
        return metric(
            registry, "detproxy_responses_total", endpoint="other", code=code, outcome=outcome
        )

    await eventually(  # the handler ends when the upstream does, or sees the client leave
        lambda: responses("ok", "200") or responses("client_disconnect", "499"),
        what="the response counted",
    )
    assert responses("ok", "200") == 1 and responses("client_disconnect", "499") == 0
    assert (
        metric(registry, "detproxy_client_disconnects_total", endpoint="other", stream="false") == 0
    )


async def test_upstream_errors_passed_through_are_counted_by_their_class(
    make_proxy: Any, fake_upstream: Any, registry: Any
) -> None:
    from proxy.testing import Reply

    upstream = await fake_upstream(
        routes={"/v1/embeddings": Reply.error(400, "not an embedding model"), "/health": Reply(503)}
    )
    client = await make_proxy(upstream.url)
    for method, path, status in [
        ("GET", "/v1/models", 404),  # nothing scripted: 404
        ("POST", "/v1/embeddings", 400),
        ("GET", "/health", 503),
    ]:
        assert (await client.request(method, path)).status == status

    def responses(code: str, outcome: str) -> float:
        return metric(
            registry, "detproxy_responses_total", endpoint="other", code=code, outcome=outcome
        )

    counted = [("404", "client_error"), ("400", "client_error"), ("503", "upstream_error")]
    await eventually(
        lambda: [responses(*labels) for labels in counted] == [1, 1, 1], what="each counted"
    )
    assert sum(responses(code, "ok") for code in ("400", "404", "503")) == 0
