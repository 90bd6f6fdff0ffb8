"""A closed reasoning continued through the rendered prompt on /v1/completions, for templates
that drop the reasoning of assistant messages (proxy/loops/rendered.py): on the emulator with
such a template, the engine is conditioned on the kept reasoning, and the client gets the chat
answer it would have had, whole or streamed (read by the official openai SDK)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.http.sse import SSEEvent
from proxy.loops.continuation import Continued
from proxy.loops.rendered import (
    ChatEvents,
    RenderedContinuation,
    chat_answer,
    chat_chunk,
    opened,
    paths_of,
    supported,
)
from proxy.testing import MockUpstream, Reply, completion_stream
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.answers import no_loop_in
from tests.helpers.emulator import knobs
from tests.helpers.relay_run import relay
from tests.helpers.settings import rendering
from tests.helpers.sse import sse_event
from tests.helpers.upstreams import MOCK_URL, probes, recording

MODEL = "emulator-model"
LADDER = orjson.dumps([{"models": "*", "attempts": [{"strategy": "close_reasoning"}]}]).decode()
ENV = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_LOOPS__LADDERS": LADDER,
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
}
# A reasoning loop no sampling change ends: only closing the reasoning recovers it.
STUCK = knobs(
    loop_channel="reasoning",
    loop_after_tokens=3,
    reasoning_tokens=6,
    loop_escape_probability=0.0,
    closed_reasoning_answer="content",
)
ASK: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0,
    "max_tokens": 200,
    "messages": [{"role": "user", "content": "What is two and two?"}],
}


@pytest.fixture
async def seen(emulator: EmulatorServer) -> AsyncIterator[MockUpstream]:
    """detproxy's upstream: the emulator, what it was sent recorded, refused where a test says."""
    async with recording(emulator.url) as upstream:
        yield upstream


@pytest.fixture
def template_drops_reasoning() -> bool:
    return True


@pytest.fixture
async def emulator(template_drops_reasoning: bool) -> AsyncIterator[EmulatorServer]:
    server = EmulatorServer(EmulatorConfig(template_drops_reasoning=template_drops_reasoning))
    async with server:
        yield server


def conditioned(emulator: EmulatorServer) -> list[dict[str, Any]]:
    """What each continuation of a closed reasoning was conditioned on (endpoint, reasoning)."""
    return [r["detail"] for r in emulator.injections() if r["kind"] == "closed_reasoning"]


def shape(value: Any) -> Any:
    """The keys of a JSON value, all the way down (the values left out)."""
    if isinstance(value, dict):
        return {k: shape(v) for k, v in value.items() if k not in ("id", "created")}
    if isinstance(value, list):
        return [shape(v) for v in value[:1]]
    return type(value).__name__ if value is not None else None


async def post(client: Any, body: dict[str, Any] = ASK) -> tuple[Any, dict[str, Any]]:
    resp = await client.post("/v1/chat/completions", json=body, headers=STUCK)
    assert resp.status == 200, await resp.text()
    return resp, await resp.json()


# -- whole answers -----------------------------------------------------------------------------


async def test_a_closed_reasoning_is_continued_on_the_rendered_prompt(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client)
    assert resp.headers["X-Detproxy-Strategy"] == "close_reasoning"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    message = answer["choices"][0]["message"]
    kept = message["reasoning"]
    assert kept and no_loop_in(kept) and message["content"] and no_loop_in(message["content"])
    # The engine was conditioned on the kept reasoning: through /v1/completions, on token ids.
    assert conditioned(emulator) == [{"endpoint": "completion", "reasoning": kept.strip("\n")}], (
        "the continuation was not conditioned on the kept reasoning"
    )
    (completion,) = seen.bodies("/v1/completions")
    assert all(type(t) is int for t in completion["prompt"])
    # The template's generation prompt opens the reasoning: the closed one goes on from it.
    prompt = emulator.state.decode(completion["prompt"])
    assert prompt.endswith("assistant:<think>\n" + kept.strip("\n") + "\n</think>\n\n"), prompt
    assert "messages" not in completion and completion["temperature"] == 0
    assert completion["max_tokens"] < ASK["max_tokens"]  # the kept reasoning's share taken off
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    usage = answer["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("template_drops_reasoning", [False])
async def test_the_client_cannot_tell_the_rendered_answer_from_the_chat_one(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    # A template that keeps the reasoning, so that both paths answer.
    rendered, _ = await post(
        await make_proxy(MOCK_URL, upstream=seen, env=ENV | rendering("always"))
    )
    chat, _ = await post(await make_proxy(MOCK_URL, upstream=seen, env=ENV | rendering("never")))
    got = [c["endpoint"] for c in conditioned(emulator)]
    assert got == ["completion", "chat"], got
    assert shape(await rendered.json()) == shape(await chat.json())
    for name in ("X-Detproxy-Attempts", "X-Detproxy-Recovered", "X-Detproxy-Strategy"):
        assert rendered.headers[name] == chat.headers[name], name


async def test_on_the_chat_path_the_template_cannot_continue_the_reasoning(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    # The control: the same recovery as a final assistant message. The template cuts the
    # reasoning out of it, and continuing a message the template cut is refused (vLLM's 400,
    # transformers' error): the client keeps the answer it had.
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV | rendering("never"))
    resp, answer = await post(client)
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert answer["object"] == "chat.completion"
    continued = [b for b in seen.bodies("/v1/chat/completions") if b.get("continue_final_message")]
    assert len(continued) == 1 and not conditioned(emulator)
    assert not seen.bodies("/v1/completions") and not seen.bodies("/tokenize")


async def test_the_template_is_probed_once_per_model(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    for _ in range(3):
        await post(client)
    assert probes(seen) == 1, f"{probes(seen)} probes for one model"
    assert [c["endpoint"] for c in conditioned(emulator)] == ["completion"] * 3


@pytest.mark.parametrize("template_drops_reasoning", [False])
async def test_a_template_that_keeps_the_reasoning_keeps_the_chat_path(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    _, answer = await post(client)
    assert probes(seen) == 1 and not seen.bodies("/v1/completions")
    kept = answer["choices"][0]["message"]["reasoning"]
    assert conditioned(emulator) == [{"endpoint": "chat", "reasoning": kept.strip("\n")}]


# No /tokenize, and llama.cpp's server's (it reads "content": without, no tokens; measured
# with llama-server 0.3.36's, 2026-12-04).
@pytest.mark.parametrize("tokenize", [Reply.error(404, "refused"), Reply.json({"tokens": []})])
async def test_without_vllm_tokenize_the_chat_path_stays(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream, tokenize: Reply
) -> None:
    # The chat continuation is sent as before (here refused: the template cuts it), and the
    # client gets an answer, never an error.
    seen.on("/tokenize", tokenize)
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    for _ in range(2):
        resp, answer = await post(client)
        assert resp.headers["X-Detproxy-Recovered"] == "false"
        assert answer["object"] == "chat.completion"
    assert probes(seen) == 1, "a failed probe was not remembered"
    assert not seen.bodies("/v1/completions")
    continued = [b for b in seen.bodies("/v1/chat/completions") if b.get("continue_final_message")]
    assert len(continued) == 2


async def test_a_refused_rendered_continuation_gives_the_answer_the_client_had(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    seen.on("/v1/completions", Reply.error(400, "refused"))
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client)
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["reasoning"]
    assert len(seen.bodies("/v1/completions")) == 1


async def test_tools_keep_the_chat_path(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV | rendering("always"))
    await post(client, ASK | {"tools": [tool]})
    assert not seen.bodies("/tokenize") and not seen.bodies("/v1/completions")
    continued = [b for b in seen.bodies("/v1/chat/completions") if b.get("continue_final_message")]
    assert len(continued) == 1


# -- streamed, as the openai SDK reads it ------------------------------------------------------


async def sdk_stream(client: Any) -> list[Any]:
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await sdk.chat.completions.create(
            **ASK, stream=True, stream_options={"include_usage": True}, extra_headers=STUCK
        )
        return [chunk async for chunk in stream]
    finally:
        await sdk.close()


def reasoning_of(chunk: Any) -> str:
    return (chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""


async def test_a_streamed_closed_reasoning_reads_as_one_answer(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    chunks = await sdk_stream(client)
    (completion,) = seen.bodies("/v1/completions")
    assert completion["stream"] is True and completion["stream_options"] == {"include_usage": True}
    assert len({c.id for c in chunks}) == 1, "the stream changed its id"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    with_choices = [c for c in chunks if c.choices]
    reasoning = "".join(reasoning_of(c) for c in with_choices)
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    # The reasoning the client was shown, then the answer: nothing after the answer started.
    first = next(i for i, c in enumerate(with_choices) if c.choices[0].delta.content)
    assert not any(reasoning_of(c) for c in with_choices[first:])
    assert content and no_loop_in(content)
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    (detail,) = conditioned(emulator)
    assert detail["endpoint"] == "completion" and reasoning.startswith(detail["reasoning"]), (
        "the continuation was not conditioned on the reasoning the client was shown"
    )
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info == {"recovered": True, "attempts": 2, "strategy": "close_reasoning"}, chunks[-1]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert usage and usage[-1].completion_tokens > 0
    # The answer is the non-streamed recovery's.
    _, whole = await post(client)
    assert whole["choices"][0]["message"]["content"] == content


async def test_a_refused_streamed_rendered_continuation_is_no_error(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    seen.on("/v1/completions", Reply.error(400, "refused"))
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    chunks = await sdk_stream(client)  # the SDK raises on an error event
    assert len(seen.bodies("/v1/completions")) == 1
    assert len({c.id for c in chunks}) == 1
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info is not None and info["recovered"] is False, chunks[-1]


# -- the parts ---------------------------------------------------------------------------------


def test_where_the_generation_prompt_opens_the_reasoning() -> None:
    start = [7, 8]
    assert opened([1, 2, 7, 8], start) is False  # right at its end
    assert opened([1, 2, 7, 8, 9], start) is True  # its newline after it
    assert opened([1, 7, 8, 9, 9, 9], start) is None
    assert opened([1, 2, 3], start) is None and opened([1, 2], []) is None


def test_the_paths_beside_a_chat_request() -> None:
    paths = paths_of("/v1/chat/completions")
    assert paths is not None and (paths.tokenize, paths.completions) == (
        "/tokenize",
        "/v1/completions",
    )
    prefixed = paths_of("/engine/v1/chat/completions?x=1")
    assert prefixed is not None and (prefixed.tokenize, prefixed.completions) == (
        "/engine/tokenize",
        "/engine/v1/completions?x=1",
    )
    assert paths_of("/chat/completions") is None


def test_what_completions_cannot_answer() -> None:
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert supported({"messages": messages})
    assert not supported({"messages": messages, "tools": [{}]})
    assert not supported({"messages": messages, "response_format": {"type": "json_object"}})
    assert not supported({"messages": messages, "n": 2})
    image = {"type": "image_url", "image_url": {"url": "x"}}
    assert not supported({"messages": [{"role": "user", "content": [image]}, messages[1]]})


def test_a_completion_reads_as_the_looping_chat_answer() -> None:
    first = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": None, "reasoning": "loop loop"},
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
        ],
        "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14},
    }
    completion = {
        "id": "cmpl-2",
        "object": "text_completion",
        "model": MODEL,
        "choices": [{"index": 0, "text": "Four.", "finish_reason": "stop", "stop_reason": None}],
        "usage": {"prompt_tokens": 20, "completion_tokens": 2, "total_tokens": 22},
    }
    answer = chat_answer(completion, first)
    assert answer["id"] == "chatcmpl-1" and answer["object"] == "chat.completion"
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Four.",
        "reasoning": None,
    }
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["usage"] == completion["usage"]
    chunk = chat_chunk({**completion, "choices": [{"index": 0, "text": "Fo"}]})
    assert chunk["object"] == "chat.completion.chunk" and chunk["id"] == "chatcmpl-2"
    assert chunk["choices"] == [
        {"index": 0, "delta": {"content": "Fo"}, "logprobs": None, "finish_reason": None}
    ]


async def test_never_asks_nothing() -> None:
    rendered = RenderedContinuation([])
    body = {"model": MODEL, "messages": [{"role": "assistant", "content": "y"}]}

    class Refuses:
        async def send(self, *args: Any) -> Any:
            raise AssertionError("sent")

    closed = Continued("y", True, "<think>\ny\n</think>\n\n")
    assert await rendered.open(Refuses(), "/v1/chat/completions", {}, body, closed) is None  # type: ignore[arg-type]


# -- decoded once ------------------------------------------------------------------------------


RENDERED = b"".join(
    [
        b": ping\n\n",
        *[
            sse_event(chunk)
            for chunk in completion_stream([f" word{i % 7}" for i in range(40)], usage=True)
        ],
        b"data: [DONE]\n\n",
    ]
)


def unclocked(body: bytes) -> bytes:
    return re.sub(rb'"created":\s*\d+', b'"created":0', body)


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted(c for c in cuts if c <= len(stream))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


# A malformed event stops inspection: what follows is rewritten (or released) alone.
MALFORMED = RENDERED.replace(b"\n\ndata: {", b"\n\ndata: {not json\n\ndata: {", 20).replace(
    b"data: {not json\n\n", b"", 19
)


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from([RENDERED, MALFORMED]),
    st.lists(st.integers(0, len(RENDERED)), max_size=10),
    st.sampled_from(
        [
            {},
            {"loops": True},
            {"loops": True, "id_override": "chatcmpl-first"},
            {"loops": True, "hold_back_chars": 8},
        ]
    ),
    st.booleans(),
)
def test_the_relay_takes_the_converted_events_as_cut(
    stream: bytes, cuts: list[int], plan: dict[str, Any], fail: bool
) -> None:
    """A rendered continuation's stream is decoded once, as it is converted: the relay reads
    the chat events as cut, and relays what it relays of the bytes they are written to."""
    reads = split(stream, cuts)
    as_cut = relay(reads, rendered="events", fail=fail, **plan)
    as_bytes = relay(reads, rendered="bytes", fail=fail, **plan)
    # A chunk without its own "created" gets the second it was converted in: two runs may
    # straddle a second.
    assert unclocked(as_cut.client.body) == unclocked(as_bytes.client.body)
    assert as_cut.result.events == as_bytes.result.events > 0
    assert as_cut.result.token_events == as_bytes.result.token_events
    assert as_cut.result.complete == as_bytes.result.complete == (not fail)
    assert as_cut.stopped == as_bytes.stopped
    assert (b"{not json" in as_cut.client.body) == (stream is MALFORMED)


async def test_a_streamed_rendered_answer_is_decoded_once(
    make_proxy: Any, seen: MockUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through the app: the completions stream's events are converted as cut and handed to
    the relay; never written to bytes for the relay to decode again."""
    cut: list[int] = []
    written: list[bytes] = []
    events, feed = ChatEvents.events, ChatEvents.feed

    def counted(self: ChatEvents, data: bytes) -> list[SSEEvent]:
        out = events(self, data)
        cut.append(len(out))
        return out

    def encoded(self: ChatEvents, data: bytes) -> bytes:
        out = feed(self, data)
        written.append(out)
        return out

    monkeypatch.setattr(ChatEvents, "events", counted)  # loops.rendered: not compiled
    monkeypatch.setattr(ChatEvents, "feed", encoded)
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    chunks = await sdk_stream(client)
    assert seen.bodies("/v1/completions"), "no rendered continuation"
    assert sum(cut) > 2 and chunks
    assert not written, "the converted events were written to bytes the relay decoded again"
