"""Every other path and method is reverse-proxied untouched; /detproxy/ is detproxy's own."""

from __future__ import annotations

import gzip
from typing import Any

from proxy.testing import MockUpstream, Received, Reply
from tests.helpers.metrics import metric
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import eventually


def echo(request: Received) -> Reply:
    """What the upstream received, as JSON, with a header of its own and hop-by-hop ones."""
    path = request.path + ("?" + request.query if request.query else "")
    seen = {
        "method": request.method,
        "path": path,
        "body": request.body.decode(),
        "headers": {k.lower(): v for k, v in request.headers.items()},
    }
    hop = {"X-Upstream-Header": "kept", "Keep-Alive": "timeout=5", "Connection": "keep-alive"}
    return Reply.json(seen, headers=hop)


def metrics(request: Received) -> Reply:
    body = gzip.compress(b"vllm:num_requests_running 3\n")
    return Reply(200, (("Content-Encoding", "gzip"), ("Content-Type", "text/plain")), body)


async def test_other_paths_and_methods(make_proxy: Any) -> None:
    client = await make_proxy(MOCK_URL, upstream=MockUpstream(echo))
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


async def test_hop_by_hop_headers_are_not_forwarded(make_proxy: Any) -> None:
    client = await make_proxy(MOCK_URL, upstream=MockUpstream(echo))
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


async def test_encoded_bodies_pass_untouched(make_proxy: Any, mock_upstream: MockUpstream) -> None:
    mock_upstream.on("/metrics", metrics)
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.get("/metrics", auto_decompress=False)
    assert resp.headers["Content-Encoding"] == "gzip"
    assert gzip.decompress(await resp.read()) == b"vllm:num_requests_running 3\n"


async def test_upstream_statuses_pass_through(make_proxy: Any, mock_upstream: MockUpstream) -> None:
    mock_upstream.on("/health", Reply.text("engine dead", 503))
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.get("/health")
    assert (resp.status, await resp.text()) == (503, "engine dead")


async def test_detproxy_endpoints_are_never_forwarded(make_proxy: Any, registry: Any) -> None:
    client = await make_proxy(MOCK_URL, upstream=MockUpstream(echo))
    assert (await (await client.get("/detproxy/health")).json()) == {"status": "ok"}
    resp = await client.get("/detproxy/nope")
    assert resp.status == 404 and "detproxy" in (await resp.json())["error"]["message"]
    await client.get("/v1/models")
    text = await (await client.get("/detproxy/metrics")).text()
    assert 'detproxy_requests_total{deterministic="false",endpoint="other"' in text
    status = await (await client.get("/detproxy/status")).json()
    assert status["upstream"] == MOCK_URL and status["inflight"] == 0
    assert (
        metric(
            registry, "detproxy_request_duration_seconds_count", endpoint="other", stream="false"
        )
        >= 1
    )


async def test_a_stream_the_client_leaves_on_done_is_whole_not_a_disconnect(
    make_proxy: Any, mock_upstream: MockUpstream, registry: Any
) -> None:
    """A route passed through that streams SSE (vLLM's streamed transcriptions, say): the
    openai SDK closes the connection once it reads ``data: [DONE]``, here a second before the
    upstream ends its framing. The client had the whole stream: a 200, not a disconnect."""

    transcribe = Reply.sse([b'data: {"delta": "hello"}\n\n'], end_delay_s=1.0)
    mock_upstream.on("/v1/audio/transcriptions", transcribe)
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
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
    make_proxy: Any, mock_upstream: MockUpstream, registry: Any
) -> None:
    mock_upstream.on("/v1/embeddings", Reply.error(400, "not an embedding model"))
    mock_upstream.on("/health", Reply(503))
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
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
