"""The OpenAI endpoints through detproxy against a scripted upstream: in process (a
``MockUpstream``) where a test is about what detproxy does, on real sockets where it is about
what crosses the wire (fields and their bytes)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest
from aiohttp import web
from multidict import CIMultiDict
from prometheus_client import CollectorRegistry

from policies.base import Continue, PolicyChain, PolicyContext, Retry
from proxy.testing import MockResponse, MockUpstream, Received, Reply
from tests.helpers.metrics import metric
from tests.helpers.relay_run import ExplodingInspector
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.upstreams import MOCK_URL, ScriptedRequest, ScriptedServer

CHAT = "/v1/chat/completions"
ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "finish_reason": "stop"}
    ],
}
EVENTS = [
    b'data: {"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"Hel"}}]}\n\n',
    b'data: {"id":"c","choices":[{"index":0,"delta":{"content":"lo"},"finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


class Recorder:
    """Answers chat whole and completions streamed (each event a piece); records each request
    (its path and query, fields, body) as the upstream got it."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, CIMultiDict[str], bytes]] = []

    def _record(self, request: Received) -> None:
        path_qs = request.path + (f"?{request.query}" if request.query else "")
        self.requests.append((path_qs, CIMultiDict(request.headers), request.body))

    def json_answer(self, request: Received) -> Reply:
        self._record(request)
        return Reply.json(ANSWER, headers={"X-Upstream": "yes"})

    def stream(self, request: Received) -> Reply:
        self._record(request)
        return Reply.sse(EVENTS, done=False)


@pytest.fixture
def recorder(mock_upstream: MockUpstream) -> Recorder:
    rec = Recorder()
    mock_upstream.on("/v1/chat/completions", rec.json_answer)
    mock_upstream.on("/v1/completions", rec.stream)
    return rec


async def test_non_streaming_is_byte_faithful(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, registry: CollectorRegistry
) -> None:
    # No audit: an audit adds logprobs.
    client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=NO_SHADOWS)
    body = b'{"model": "m", "temperature": 0,   "messages": [{"role":"user","content":"hi"}]}'
    resp = await client.post(CHAT, data=body, headers={"Content-Type": "application/json"})
    assert resp.status == 200
    assert await resp.read() == orjson.dumps(ANSWER)
    assert resp.headers["X-Upstream"] == "yes"
    ((_path, headers, sent),) = recorder.requests
    assert sent == body  # the original bytes, not a re-serialisation
    assert headers["X-Request-Id"] == resp.headers["X-Request-Id"]
    assert headers["Accept-Encoding"] == "identity"
    assert (
        metric(
            registry,
            "detproxy_requests_total",
            model="m",
            endpoint="chat",
            stream="false",
            deterministic="true",
        )
        == 1
    )


async def test_the_upstream_gets_the_clients_fields_as_they_came_less_hop_by_hop(
    make_proxy: Any, upstream: Any, upstream_app: web.Application
) -> None:
    # On a socket: about the head's bytes detproxy's client writes (raw fields, Host, length).
    received: list[list[tuple[bytes, bytes]]] = []

    async def answer(request: web.Request) -> web.Response:
        received.append(list(request.raw_headers))
        await request.read()
        return web.json_response(ANSWER)

    upstream_app.router.add_post(CHAT, answer)
    client = await make_proxy(await upstream())
    body = b'{"model": "m", "temperature": 0}'
    fields = (
        b"Host: proxy\r\nContent-Type: application/json\r\nX-Many: 1\r\n"
        b"Accept-Encoding: gzip\r\nx-request-id: mine\r\nTE: trailers\r\n"
        b"X-Obs-Text: caf\xe9 \xe2\x98\x83\r\nx-many: 2\r\nProxy-Authorization: Basic x\r\n"
    )
    for connection, dropped in ((b"keep-alive", set()), (b"keep-alive, X-Many", {b"x-many"})):
        request = b"POST %s HTTP/1.1\r\n%sConnection: %s\r\nContent-Length: %d\r\n\r\n%s" % (
            CHAT.encode(),
            fields,
            connection,
            len(body),
            body,
        )
        reader, writer = await asyncio.open_connection(client.host, client.port)
        writer.write(request)
        head = await reader.readuntil(b"\r\n\r\n")
        writer.close()
        assert head.startswith(b"HTTP/1.1 200")
        got = received.pop()
        names = [name.lower() for name, _ in got]
        # Hop-by-hop, framing and Accept-Encoding are the proxy's; the rest come as they
        # came: in order, repeated ones, and bytes that are not UTF-8 (obs-text) included.
        passed = [
            (n, v)
            for n, v in got
            if n.lower()
            not in {
                b"host",
                b"content-length",
                b"accept-encoding",
                b"x-request-id",
                b"connection",
                b"user-agent",
                b"x-detproxy-via",  # the proxy's own mark (proxy/selfloop.py)
            }
        ]
        expected = [
            (b"Content-Type", b"application/json"),
            (b"X-Many", b"1"),
            (b"X-Obs-Text", b"caf\xe9 \xe2\x98\x83"),
            (b"x-many", b"2"),
        ]
        assert passed == [f for f in expected if f[0].lower() not in dropped], got
        assert not {b"te", b"proxy-authorization"} & set(names)
        assert [v for n, v in got if n.lower() == b"accept-encoding"] == [b"identity"]
        assert [v for n, v in got if n.lower() == b"x-request-id"] == [b"mine"]
        assert names.count(b"host") == 1 and names.count(b"content-length") == 1


async def test_request_id_is_kept(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder
) -> None:
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, json={"model": "m"}, headers={"X-Request-Id": "abc-123"})
    assert resp.headers["X-Request-Id"] == "abc-123"
    assert recorder.requests[0][1]["X-Request-Id"] == "abc-123"


async def test_streaming_relays_every_event_unchanged(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder
) -> None:
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post("/v1/completions", json={"model": "m", "stream": True})
    assert resp.headers["Content-Type"] == "text/event-stream"
    assert await resp.read() == b"".join(EVENTS)


@pytest.mark.parametrize(
    ("body", "headers", "status", "message"),
    [
        (b"not json", {"Content-Type": "application/json"}, 400, "not valid JSON"),
        (b"[1, 2]", {"Content-Type": "application/json"}, 400, "must be a JSON object"),
        (b'{"a": "\xff\xfe"}', {"Content-Type": "application/json"}, 400, "not valid UTF-8"),
        (b'{"model": "m"}', {"Content-Type": "text/plain"}, 400, "Content-Type"),
        (b'{"model": "m"}', {"Content-Type": "application/json; charset=latin-1"}, 400, "charset"),
        (b"", {"Content-Type": "application/json"}, 400, "not valid JSON"),
    ],
)
async def test_bad_bodies_get_400_and_are_not_forwarded(
    make_proxy: Any,
    mock_upstream: MockUpstream,
    recorder: Recorder,
    body: bytes,
    headers: dict[str, str],
    status: int,
    message: str,
) -> None:
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, data=body, headers=headers)
    assert resp.status == status
    err = (await resp.json())["error"]
    assert message in err["message"] and err["code"] == status and err["type"]
    assert recorder.requests == []


async def test_oversized_body_gets_413_unread(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder
) -> None:
    client = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env={"DETPROXY_SERVER__MAX_BODY_BYTES": "1000"}
    )
    resp = await client.post(
        CHAT, data=b'{"x":"' + b"a" * 2000 + b'"}', headers={"Content-Type": "application/json"}
    )
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == 413

    async def chunked() -> Any:  # no Content-Length: the limit is enforced while reading
        yield b'{"x":"'
        for _ in range(20):
            yield b"a" * 100
        yield b'"}'

    resp = await client.post(CHAT, data=chunked(), headers={"Content-Type": "application/json"})
    assert resp.status == 413
    assert recorder.requests == []


async def test_wrong_field_types_are_forwarded_unaudited(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, registry: CollectorRegistry
) -> None:
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, json={"model": "m", "temperature": "0", "stream": "no"})
    assert resp.status == 200
    assert len(recorder.requests) == 1
    assert (
        metric(
            registry,
            "detproxy_requests_total",
            model="m",
            endpoint="chat",
            stream="false",
            deterministic="false",
        )
        == 1
    )


async def test_upstream_error_status_and_body_reach_the_client(
    make_proxy: Any, mock_upstream: MockUpstream
) -> None:
    body = (
        b'{"error":{"message":"The model `x` does not exist.","type":"NotFoundError","code":404}}'
    )
    mock_upstream.on(CHAT, Reply(404, (("Content-Type", "application/json"),), body))
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, json={"model": "x", "stream": True})
    assert resp.status == 404
    assert await resp.read() == body


class RetryOnce:
    name = "retry-once"

    def __init__(self) -> None:
        self.seen: list[PolicyContext] = []

    def decide(self, ctx: PolicyContext) -> Continue | Retry:
        self.seen.append(ctx)
        return Retry("test", {"temperature": 0.7}) if ctx.attempt == 1 else Continue()


class Broken:
    name = "broken"

    def decide(self, ctx: PolicyContext) -> Continue | Retry:
        raise RuntimeError("policy bug")


async def test_policy_seam_retry_and_isolation(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, registry: CollectorRegistry
) -> None:
    retry = RetryOnce()
    client = await make_proxy(
        MOCK_URL, upstream=mock_upstream, policies=PolicyChain([Broken(), retry])
    )
    resp = await client.post(CHAT, json={"model": "m", "temperature": 0})
    assert resp.status == 200
    assert resp.headers["X-Detproxy-Attempts"] == "2"
    assert [orjson.loads(r[2]).get("temperature") for r in recorder.requests] == [0, 0.7]
    assert retry.seen[0].body == ANSWER
    assert (
        metric(registry, "detproxy_isolated_failures_total", component="policy", name="broken") == 2
    )


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.chunks: list[dict[str, Any]] = []
        self.ended: list[bool] = []

    def on_delta(self, item: Any) -> None:
        self.chunks.append(item)

    def on_end(self, complete: bool) -> None:
        self.ended.append(complete)


async def test_inspector_seam_sees_every_chunk_and_failures_are_isolated(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, registry: CollectorRegistry
) -> None:
    collect = Collect()
    client = await make_proxy(
        MOCK_URL,
        upstream=mock_upstream,
        inspector_factories=[lambda view: ExplodingInspector(), lambda view: collect],
    )
    resp = await client.post("/v1/completions", json={"model": "m", "stream": True})
    assert await resp.read() == b"".join(EVENTS)
    assert [c["choices"][0]["delta"].get("content") for c in collect.chunks] == ["", "Hel", "lo"]
    assert collect.ended == [True]
    assert (
        metric(
            registry,
            "detproxy_inspection_stopped_total",
            endpoint="completions",
            reason="inspector_error",
        )
        == 1
    )


def held_back(release: asyncio.Event) -> MockResponse:
    """A stream whose first event comes at once, the rest once ``release`` is set."""

    async def events() -> AsyncIterator[bytes]:
        yield EVENTS[0]
        await release.wait()
        for event in EVENTS[1:]:
            yield event

    return MockResponse(200, {"Content-Type": "text/event-stream"}, events())


async def test_stream_is_relayed_as_it_arrives(
    make_proxy: Any, mock_upstream: MockUpstream
) -> None:
    release = asyncio.Event()  # the rest only once the client has seen the first event
    mock_upstream.on(CHAT, lambda request: held_back(release))
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, json={"stream": True})
    first = await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5)
    assert first == EVENTS[0]
    release.set()
    assert await resp.content.read() == b"".join(EVENTS[1:])


async def test_a_request_is_counted_when_it_starts_not_when_it_ends(
    make_proxy: Any, mock_upstream: MockUpstream, registry: CollectorRegistry
) -> None:
    """An hour-long stream shows in ``detproxy_requests_total`` from its start, once."""
    release = asyncio.Event()
    mock_upstream.on(CHAT, lambda request: held_back(release))
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    labels = {"model": "m", "endpoint": "chat", "stream": "true", "deterministic": "true"}
    resp = await client.post(CHAT, json={"model": "m", "temperature": 0, "stream": True})
    try:
        assert await asyncio.wait_for(resp.content.readuntil(b"\n\n"), timeout=5) == EVENTS[0]
        assert metric(registry, "detproxy_requests_total", **labels) == 1  # still streaming
    finally:
        release.set()
    await resp.read()
    assert metric(registry, "detproxy_requests_total", **labels) == 1
    assert metric(registry, "detproxy_responses_total", endpoint="chat", code="200", outcome="ok")


async def test_a_bad_request_is_counted_once_with_unknown_labels(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, registry: CollectorRegistry
) -> None:
    """Refused before its body was classified: model "", stream and deterministic false."""
    client = await make_proxy(MOCK_URL, upstream=mock_upstream)
    resp = await client.post(CHAT, data=b"not json", headers={"Content-Type": "application/json"})
    assert resp.status == 400
    labels = {"model": "", "endpoint": "chat", "stream": "false", "deterministic": "false"}
    assert metric(registry, "detproxy_requests_total", **labels) == 1
    code = {"endpoint": "chat", "code": "400", "outcome": "bad_request"}
    assert metric(registry, "detproxy_responses_total", **code) == 1


LOOPS_OFF = {
    "DETPROXY_LOOPS__ENABLED": "false",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    **NO_SHADOWS,  # nothing of detproxy's reads the answer
}


class OnlyTriggers(RetryOnce):
    name = "only-triggers"
    triggers_only = True  # says it never acts on an answer without a trigger


@pytest.mark.parametrize("env", [{}, LOOPS_OFF])
async def test_policies_see_clean_answers_unless_they_only_act_on_triggers(
    make_proxy: Any, mock_upstream: MockUpstream, recorder: Recorder, env: dict[str, str]
) -> None:
    reads, ignores = RetryOnce(), OnlyTriggers()
    client = await make_proxy(
        MOCK_URL, upstream=mock_upstream, env=env, policies=PolicyChain([ignores, reads])
    )
    resp = await client.post(CHAT, json={"model": "m", "temperature": 0})
    assert resp.status == 200 and resp.headers["X-Detproxy-Attempts"] == "2"
    assert [ctx.body for ctx in reads.seen] == [ANSWER, ANSWER]
    assert ignores.seen == []


async def test_with_loops_off_an_answer_nothing_reads_is_not_parsed(
    make_proxy: Any,
    mock_upstream: MockUpstream,
    recorder: Recorder,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The spy is on orjson's module, not on detproxy's: a compiled module (mypyc) calls its
    # neighbours directly, but looks orjson's functions up on each call.
    parsed: list[bytes] = []
    loads = orjson.loads
    answer = orjson.dumps(ANSWER)

    def spy(raw: Any) -> Any:
        if raw == answer:
            parsed.append(raw)
        return loads(raw)

    monkeypatch.setattr(orjson, "loads", spy)
    for env, times in ((LOOPS_OFF, 0), (NO_SHADOWS, 1)):
        client = await make_proxy(MOCK_URL, upstream=mock_upstream, env=env)
        resp = await client.post(CHAT, json={"model": "m", "temperature": 0})
        assert await resp.read() == orjson.dumps(ANSWER)
        assert len(parsed) == times


class RawUpstream:
    """Records each request's head as bytes; answers a JSON answer with ``field`` in its head
    (on a socket: these tests are about the bytes of the heads on the wire)."""

    def __init__(self, field: bytes) -> None:
        self.field = field
        self.server = ScriptedServer(self.reply)

    async def reply(self, req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        body = orjson.dumps(ANSWER)
        status = b"200 OK" if req.head.startswith(b"POST") else b"404 Not Found"
        writer.write(
            b"HTTP/1.1 %s\r\ncontent-type: application/json\r\n%s\r\ncontent-length: %d\r\n\r\n"
            b"%s" % (status, self.field, len(body), body)
        )
        return True


async def raw_exchange(make_proxy: Any, field: bytes) -> tuple[bytes, bytes]:
    """A chat request carrying ``field`` (bytes) through detproxy, on raw sockets both sides:
    (the head the upstream got, the head the client got)."""
    upstream = RawUpstream(b"X-Answer-" + field)
    upstream.server.server = await asyncio.start_server(upstream.server.handle, "127.0.0.1", 0)
    try:
        client = await make_proxy(upstream.server.url)
        body = b'{"model":"m","messages":[{"role":"user","content":"hi"}]}'
        reader, writer = await asyncio.open_connection("127.0.0.1", client.port)
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Client-%s\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (field, len(body), body)
        )
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
    finally:
        upstream.server.server.close()
    (sent,) = [r for r in upstream.server.requests if r.head.startswith(b"POST")]
    assert head.startswith(b"HTTP/1.1 200 ")
    return sent.head, head


async def test_utf_8_header_values_cross_unchanged(make_proxy: Any) -> None:
    sent, got = await raw_exchange(make_proxy, "Name: café ☃".encode())
    assert "\r\nX-Client-Name: café ☃\r\n".encode() in sent
    assert "\r\nX-Answer-Name: café ☃\r\n".encode() in got


async def test_obs_text_header_bytes_cross_unchanged(make_proxy: Any) -> None:
    """A byte that is not UTF-8 (obs-text, latin-1 ``é``): detproxy's client and server write
    it back as it came."""
    sent, got = await raw_exchange(make_proxy, b"Name: caf\xe9")
    assert b"\r\nX-Client-Name: caf\xe9\r\n" in sent
    assert b"\r\nX-Answer-Name: caf\xe9\r\n" in got


async def test_the_client_gets_the_upstreams_fields_as_they_came_less_hop_by_hop(
    make_proxy: Any,
) -> None:
    """The answer's head: the upstream's own fields in order (repeated ones, their case, its
    Date), hop-by-hop ones and those its Connection header names left out, the length
    written for the body the client gets, one request id."""
    date = b"Date: Wed, 02 Dec 2026 10:00:00 GMT"
    for connection, secret in ((b"keep-alive", True), (b"keep-alive, X-Secret", False)):
        field = b"A: 1\r\nKeep-Alive: timeout=5\r\nx-answer-a: 2\r\nServer: up\r\n%s\r\n" % date
        field += b"Connection: %s\r\nX-Secret: s" % connection
        _, got = await raw_exchange(make_proxy, field)
        lines = got.split(b"\r\n")[1:-2]
        names = [line.partition(b":")[0].lower() for line in lines]
        assert b"keep-alive" not in names and b"connection" not in names
        assert (b"x-secret" in names) is secret
        assert names.count(b"x-request-id") == 1 and names.count(b"content-length") == 1
        assert names.count(b"date") == 1
        assert b"Content-Length: %d" % len(orjson.dumps(ANSWER)) in lines
        at = lines.index(b"X-Answer-A: 1")
        assert lines[at : at + 4] == [b"X-Answer-A: 1", b"x-answer-a: 2", b"Server: up", date]
