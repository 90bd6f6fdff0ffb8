"""proxy.testing's MockUpstream (proxy/testing/mock.py): the fake upstream's answers in process,
as the upstream seam, streaming and faults included; the app given one sends it everything."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from proxy.http.errors import UpstreamBodyError, UpstreamFailure
from proxy.http.upstream import Upstream, UpstreamResponse, get
from proxy.testing import MockResponse, MockUpstream, Received, Reply, answers
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.waiting import eventually
from tests.testing.test_server import ASK, CHAT, streamed


async def test_the_mock_answers_as_the_server_does_in_process() -> None:
    mock = MockUpstream()
    seam: Upstream = mock
    resp: UpstreamResponse = await seam.send("POST", CHAT, {"X-A": "1"}, orjson.dumps(ASK))
    assert resp.status == 200 and resp.headers["content-type"] == "application/json"
    assert orjson.loads(await resp.read())["choices"][0]["message"]["content"] == "Hello!"
    resp = await seam.send("POST", CHAT + "?x=1", {}, orjson.dumps(ASK | {"stream": True}))
    assert resp.headers["Content-Type"] == "text/event-stream"
    pieces = [piece async for piece in resp.chunks()]
    assert len(pieces) > 2, "a stream comes in pieces, one event each"
    assert streamed(b"".join(pieces)) == "Hello!"
    first, second = mock.received(CHAT)
    assert (first.headers["x-a"], first.json(), second.query) == ("1", ASK, "x=1")
    assert (await get(seam, "/nowhere", 1.0)).status == 404


async def test_a_mock_response_streams_what_a_handler_gives_and_pump_resumes() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"
        yield b"c"

    mock = MockUpstream(lambda request: MockResponse(201, {"X-B": "2"}, body()))
    resp = await mock.send("GET", "/x", {}, None)
    assert (resp.status, resp.raw_fields) == (201, [(b"X-B", b"2")])
    got: list[bytes] = []

    def sink(piece: bytes) -> bool:
        got.append(piece)
        return len(got) != 2

    assert await resp.pump(sink) is False
    assert got == [b"a", b"b"], "the sink stopped after two"
    assert await resp.pump(sink) is True
    assert got == [b"a", b"b", b"c"] and not mock.responses[0].closed


async def test_the_mock_plays_faults_as_a_client_raises_them() -> None:
    """A cut before the head: ``send`` raises; a cut mid-stream: the body's read; a handler's
    own UpstreamError goes on as it is; a response closed early is known closed."""
    refused = UpstreamFailure(502, "refused", "refused")

    def refuse(request: Received) -> Reply:
        raise refused

    mock = MockUpstream(routes={"/cut": Reply.cut(), "/refused": refuse})
    mock.script(CHAT, Reply.sse([b"data: 1\n\n", b"data: 2\n\n"], cut_after=1))
    with pytest.raises(UpstreamFailure, match="before responding") as cut:
        await mock.send("GET", "/cut", {}, None)
    assert cut.value.kind == "reset"
    with pytest.raises(UpstreamFailure) as raised:
        await mock.send("GET", "/refused", {}, None)
    assert raised.value is refused
    resp = await mock.send("POST", CHAT, {}, b"{}")
    with pytest.raises(UpstreamBodyError):
        await resp.read()
    resp = await mock.send("POST", CHAT, {}, orjson.dumps(ASK | {"stream": True}))
    assert await resp.chunks().__anext__()
    resp.close()
    assert [r.closed for r in mock.responses] == [True, True]


async def test_a_mock_handler_that_raises_answers_500_and_fails_the_block() -> None:
    def broken(request: Received) -> Reply:
        raise KeyError("oops")

    with pytest.raises(KeyError, match="oops"):
        async with MockUpstream(broken) as mock:
            resp = await mock.send("GET", "/x", {}, None)
            assert resp.status == 500 and b"KeyError" in await resp.read()


async def test_a_mock_request_body_given_in_pieces_is_recorded_whole() -> None:
    async def body() -> AsyncIterator[bytes]:
        yield b'{"model":'
        yield b' "m"}'

    mock = MockUpstream()
    await mock.send("POST", "/v1/completions", {}, body())
    assert mock.bodies("/v1/completions") == [{"model": "m"}]


async def test_the_app_given_a_mock_sends_it_everything_engine_reads_included(
    make_proxy: Any,
) -> None:
    """``build_app(upstream=)`` swaps the whole upstream: proxied requests, and the engine's
    reads (the fingerprint's /version, /v1/models, /metrics) go to the mock, none elsewhere
    (the URL detproxy is given names the engine only: nothing listens there)."""
    mock = MockUpstream(routes={"/version": Reply.json({"version": "0.23.0"})}, model="m")
    mock.on("/v1/models", answers(model="m"))
    mock.on(CHAT, answers(model="m"))
    env = NO_SHADOWS | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05"}
    client = await make_proxy("http://127.0.0.1:9", env=env, upstream=mock)
    resp = await client.post(CHAT, json=ASK | {"stream": True})
    assert resp.status == 200 and streamed(await resp.read()) == "Hello!"

    async def identified() -> dict[str, Any] | None:
        status = await (await client.get("/detproxy/status")).json()
        fingerprint: dict[str, Any] | None = status["upstream_fingerprint"]
        return fingerprint

    fingerprint = await eventually(identified, what="the mock's fingerprint read")
    assert (fingerprint["version"], fingerprint["models"]) == ("0.23.0", ["m"]), fingerprint
    asked = {r.path for r in mock.requests}
    assert {CHAT, "/version", "/v1/models", "/metrics"} <= asked, asked


async def test_a_forwarding_mock_passes_on_what_it_does_not_answer_and_records_it() -> None:
    """``forward``: what no script or route answers goes to another upstream (the emulator,
    an engine), the request as detproxy sent it, its answer as it is read; closing the
    answer early closes the forwarded one (the engine's generation is aborted)."""
    engine = MockUpstream(routes={CHAT: Reply.sse([b"data: 1\n\n", b"data: 2\n\n"])})
    mock = MockUpstream(forward=engine, routes={"/refused": Reply.error(400, "refused")})
    resp = await mock.send("POST", CHAT + "?x=1", {"X-A": "1"}, b"{}")
    assert (resp.status, resp.headers["content-type"]) == (200, "text/event-stream")
    assert await resp.chunks().__anext__() == b"data: 1\n\n"
    resp.close()
    assert [r.closed for r in mock.responses] == [r.closed for r in engine.responses] == [True]
    assert (await (await mock.send("GET", "/refused", {}, None)).read()).startswith(b'{"error"')
    mock.script(CHAT, Reply.error(503, "busy"))
    assert (await mock.send("POST", CHAT, {}, b"{}")).status == 503  # scripted: not passed on
    assert (await mock.send("POST", CHAT, {}, b"{}")).status == 200
    (passed, again) = engine.received(CHAT)
    assert (passed.query, passed.headers["x-a"], passed.body) == ("x=1", "1", b"{}")
    assert [r.path for r in mock.requests] == [CHAT, "/refused", CHAT, CHAT]
    assert again.body == b"{}" and len(engine.requests) == 2
    with pytest.raises(ValueError, match="not both"):
        MockUpstream(answers(), forward=engine)


async def test_a_mock_stream_ends_its_end_delay_after_its_last_event() -> None:
    mock = MockUpstream(routes={CHAT: Reply.sse([b"data: 1\n\n"], end_delay_s=0.2)})
    resp = await mock.send("POST", CHAT, {}, b"{}")
    pieces = resp.chunks()
    assert [await anext(pieces), await anext(pieces)] == [b"data: 1\n\n", b"data: [DONE]\n\n"]
    started = time.monotonic()
    assert [piece async for piece in pieces] == []
    assert time.monotonic() - started >= 0.2, "the stream ended before its end delay"
    assert mock.responses[0].complete
