"""proxy.testing's FakeUpstream (proxy/testing/server.py): its default answers, scripts and
routes, the faults it plays, what it records, and forwarding to a real server."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.testing import (
    FakeUpstream,
    Received,
    Reply,
    answers,
    chat_answer,
    chat_stream,
    completion_stream,
)
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.sse import parse_sse

CHAT = "/v1/chat/completions"
ASK = {"model": "fake-model", "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(
    http: aiohttp.ClientSession, url: str, body: Any = ASK, **kw: Any
) -> tuple[int, bytes]:
    async with http.post(url, json=body, **kw) as resp:
        return resp.status, await resp.read()


def streamed(raw: bytes, field: str = "content") -> str:
    events = parse_sse(raw)
    assert events[-1] == "[DONE]", f"the stream did not end with [DONE]: {raw[-80:]!r}"
    return "".join(
        c["choices"][0]["delta"].get(field) or c["choices"][0].get("text") or ""
        for c in events[:-1]
        if c["choices"]
    )


async def test_by_default_it_answers_chat_whole_and_streamed_as_asked(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        status, raw = await post(http, upstream.url + CHAT)
        assert status == 200, raw
        answer = orjson.loads(raw)
        assert answer["choices"][0]["message"]["content"] == "Hello!"
        assert answer["choices"][0]["logprobs"] is None  # none asked for
        stream = ASK | {"stream": True, "stream_options": {"include_usage": True}}
        status, raw = await post(http, upstream.url + CHAT, stream | {"logprobs": True})
        assert status == 200 and streamed(raw) == "Hello!"
        chunks = parse_sse(raw)[:-1]
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 1
        tokens = [c["choices"][0]["logprobs"] for c in chunks if c["choices"]]
        assert [lp["content"][0]["token"] for lp in tokens if lp] == ["Hello!"]


async def test_by_default_it_answers_completions_the_model_list_and_404(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream(answers("Once upon a time", model="m")) as upstream:
        body = {"prompt": "x", "logprobs": 1}
        status, raw = await post(http, upstream.url + "/v1/completions", body)
        (choice,) = orjson.loads(raw)["choices"]
        assert status == 200 and choice["text"] == "Once upon a time"
        assert choice["logprobs"]["tokens"] == ["Once ", "upon ", "a ", "time"]
        assert choice["logprobs"]["text_offset"] == [0, 5, 10, 12]
        body = {"prompt": "x", "stream": True}
        status, raw = await post(http, upstream.url + "/v1/completions", body)
        chunks = parse_sse(raw)[:-1]
        assert [c["choices"][0]["text"] for c in chunks] == ["Once ", "upon ", "a ", "time", ""]
        async with http.get(upstream.url + "/v1/models") as resp:
            assert (await resp.json())["data"][0]["id"] == "m"
        async with http.get(upstream.url + "/metrics") as resp:
            assert resp.status == 404


async def test_scripted_replies_answer_the_next_requests_to_their_path_in_order(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.error(503, "overloaded"), Reply.json(chat_answer(["Two"])))
        first = await post(http, upstream.url + CHAT)
        assert first[0] == 503
        assert orjson.loads(first[1])["error"] == {
            "message": "overloaded",
            "type": "BadRequestError",
            "param": None,
            "code": 503,
        }
        second = await post(http, upstream.url + CHAT)
        assert orjson.loads(second[1])["choices"][0]["message"]["content"] == "Two"
        third = await post(http, upstream.url + CHAT)  # the script used up: the handler
        assert orjson.loads(third[1])["choices"][0]["message"]["content"] == "Hello!"


async def test_a_route_answers_every_request_to_its_path_until_removed(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.on(CHAT, Reply.error(400, "refused"))
        upstream.script(CHAT, Reply.json({"scripted": True}))
        assert orjson.loads((await post(http, upstream.url + CHAT))[1]) == {"scripted": True}
        assert [(await post(http, upstream.url + CHAT))[0] for _ in range(2)] == [400, 400]
        upstream.on(CHAT, None)
        assert (await post(http, upstream.url + CHAT))[0] == 200


async def test_routes_alone_answer_their_paths_and_404_elsewhere(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream(routes={CHAT: Reply.json({"routed": True})}) as upstream:
        assert orjson.loads((await post(http, upstream.url + CHAT))[1]) == {"routed": True}
        status, raw = await post(http, upstream.url + "/v1/completions", {"prompt": "x"})
        assert (status, orjson.loads(raw)) == (404, {"detail": "Not Found"})
        async with http.get(upstream.url + "/v1/models") as resp:
            assert resp.status == 404, "a path no route names was answered"


async def test_a_text_reply_has_its_content_type(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream(routes={"/metrics": Reply.text("up 1\n")}) as upstream:
        resp = await http.get(upstream.url + "/metrics")
        assert resp.headers["Content-Type"] == "text/plain; charset=utf-8"
        assert (resp.status, await resp.text()) == (200, "up 1\n")


async def test_it_records_each_request_as_it_came(http: aiohttp.ClientSession) -> None:
    async with FakeUpstream() as upstream:
        await post(http, upstream.url + CHAT + "?a=1", headers={"X-Test": "yes"})
        async with http.get(upstream.url + "/v1/models"):
            pass
        first, second = upstream.requests
        assert (first.method, first.path, first.query) == ("POST", CHAT, "a=1")
        assert first.headers["x-test"] == "yes" and first.json() == ASK
        assert (second.method, second.path, second.body, second.json()) == (
            "GET",
            "/v1/models",
            b"",
            None,
        )
        assert upstream.received(CHAT) == [first] and upstream.bodies(CHAT) == [ASK]


async def test_handlers_may_be_plain_or_async_and_see_the_request(
    http: aiohttp.ClientSession,
) -> None:
    def echo(request: Received) -> Reply:
        return Reply.json({"echo": request.json()["messages"][0]["content"]})

    async def slow(request: Received) -> Reply:
        await asyncio.sleep(0)
        return Reply.sse(chat_stream(["a", "b"]))

    async with FakeUpstream(echo) as upstream:
        assert orjson.loads((await post(http, upstream.url + CHAT))[1]) == {"echo": "Hi"}
        upstream.script(CHAT, slow)
        assert streamed((await post(http, upstream.url + CHAT))[1]) == "ab"


async def test_a_handler_that_raises_answers_500_and_fails_the_block(
    http: aiohttp.ClientSession,
) -> None:
    def broken(request: Received) -> Reply:
        raise KeyError("no such field")

    with pytest.raises(KeyError, match="no such field"):
        async with FakeUpstream(broken) as upstream:
            status, raw = await post(http, upstream.url + CHAT)
            assert status == 500 and b"KeyError" in raw
            assert len(upstream.errors) == 1


async def test_a_stream_cut_after_n_events_ends_without_its_end(
    http: aiohttp.ClientSession,
) -> None:
    events = chat_stream(["a", "b", "c"])  # role, a, b, c, finish
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.sse(events, cut_after=2), Reply.sse(events))
        got = b""
        with pytest.raises(aiohttp.ClientPayloadError):
            async with http.post(upstream.url + CHAT, json=ASK) as resp:
                async for data in resp.content.iter_any():
                    got += data
        assert parse_sse(got) == events[:2], "not the events before the cut"
        status, raw = await post(http, upstream.url + CHAT)  # the server goes on
        assert status == 200 and streamed(raw) == "abc"


async def test_a_cut_reply_closes_the_connection_with_no_answer(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.cut())
        with pytest.raises(aiohttp.ServerDisconnectedError):
            await post(http, upstream.url + CHAT)
        assert len(upstream.received(CHAT)) == 1  # read, then cut
        assert (await post(http, upstream.url + CHAT))[0] == 200


async def test_a_delay_holds_the_answer_and_an_interval_paces_the_events(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.json({}, delay_s=0.2))
        started = time.monotonic()
        await post(http, upstream.url + CHAT)
        assert time.monotonic() - started >= 0.2
        upstream.script(CHAT, Reply.sse(completion_stream(["a", "b", "c"]), interval_s=0.1))
        started = time.monotonic()
        await post(http, upstream.url + CHAT)
        assert time.monotonic() - started >= 0.3  # 5 events: 4 intervals, 0.1 s each


async def test_an_end_delay_holds_the_streams_end_after_its_last_event(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.sse(completion_stream(["a"]), end_delay_s=0.2))
        async with http.post(upstream.url + CHAT, json=ASK) as resp:
            await resp.content.readuntil(b"data: [DONE]\n\n")
            started = time.monotonic()
            assert await resp.read() == b""
            assert time.monotonic() - started >= 0.2, "the stream ended before its end delay"


async def test_a_client_that_leaves_mid_stream_leaves_the_server_answering(
    http: aiohttp.ClientSession,
) -> None:
    async with FakeUpstream() as upstream:
        upstream.script(CHAT, Reply.sse(chat_stream(["x"] * 50), interval_s=0.01))
        async with http.post(upstream.url + CHAT, json=ASK) as resp:
            await resp.content.readuntil(b"\n\n")  # the first event, then away
        assert (await post(http, upstream.url + CHAT))[0] == 200


async def test_forwarded_requests_are_recorded_and_the_answer_passed_on_as_it_came(
    http: aiohttp.ClientSession,
) -> None:
    async with (
        FakeUpstream(answers("From the engine.")) as engine,
        FakeUpstream(forward=engine.url + "/") as upstream,
    ):
        upstream.script("/v1/completions", Reply.error(400, "refused"))
        status, raw = await post(http, upstream.url + CHAT, ASK | {"stream": True})
        assert status == 200 and streamed(raw) == "From the engine."
        status, _ = await post(http, upstream.url + "/v1/completions", {"prompt": "x"})
        assert status == 400  # scripted: the engine never saw it
        async with http.get(upstream.url + "/nothing?q=1") as resp:
            assert resp.status == 404
        assert [r.path for r in upstream.requests] == [CHAT, "/v1/completions", "/nothing"]
        assert [(r.path, r.query) for r in engine.requests] == [(CHAT, ""), ("/nothing", "q=1")]
        assert engine.bodies(CHAT) == upstream.bodies(CHAT) == [ASK | {"stream": True}]


async def test_url_is_known_only_inside_the_block_and_the_port_is_closed_after() -> None:
    upstream = FakeUpstream()
    with pytest.raises(RuntimeError, match="inside its `async with` block"):
        _ = upstream.url
    async with upstream:
        url = upstream.url
    with pytest.raises(RuntimeError):
        _ = upstream.url
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.ClientConnectionError):
            await post(http, url + CHAT)


def test_a_handler_and_forward_together_are_refused() -> None:
    with pytest.raises(ValueError, match="not both"):
        FakeUpstream(answers(), forward="http://127.0.0.1:1")


async def test_detproxy_in_front_of_it_relays_its_answers_and_it_sees_what_detproxy_sent(
    make_proxy: Any,
) -> None:
    async with FakeUpstream() as upstream:
        client = await make_proxy(upstream.url, env=NO_SHADOWS)
        resp = await client.post(CHAT, json=ASK)
        assert resp.status == 200, await resp.text()
        assert (await resp.json())["choices"][0]["message"]["content"] == "Hello!"
        resp = await client.post(CHAT, json=ASK | {"stream": True})
        assert resp.status == 200 and streamed(await resp.read()) == "Hello!"
        sent = upstream.bodies(CHAT)
        assert [b["messages"] for b in sent] == [ASK["messages"]] * 2, sent
        assert [b.get("stream", False) for b in sent] == [False, True]
