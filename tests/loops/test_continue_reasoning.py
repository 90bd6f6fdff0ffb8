"""A loop in the content of an answer that reasoned first, continued (strategy ``continue``)
with its reasoning: on a template that keeps assistant reasoning, as the final assistant
message's ``reasoning``; on one that drops it, through the rendered prompt on /v1/completions
(proxy/loops/rendered.py). On the emulator, whose records say what the continuation was
conditioned on; whole, and streamed as the official openai SDK reads it."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest

from proxy.loops.continuation import continuation_body, merge_answer
from proxy.testing import MockUpstream, Reply
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.answers import no_loop_in
from tests.helpers.emulator import knobs
from tests.helpers.settings import rendering
from tests.helpers.upstreams import MOCK_URL, probes, recording

MODEL = "emulator-model"
LADDER = orjson.dumps(
    [{"models": "*", "attempts": [{"strategy": "continue", "presence_penalty": 1.5}]}]
).decode()
ENV = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_LOOPS__LADDERS": LADDER,
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
}
ASK: dict[str, Any] = {
    "model": MODEL,
    "temperature": 0,
    "max_tokens": 200,
    "messages": [{"role": "user", "content": "What is two and two?"}],
}


def looping(reasoning_tokens: int = 6, answer_in: str = "content") -> dict[str, str]:
    """A greedy answer that reasons, then loops in its content; the continuation (penalised)
    escapes. ``answer_in``: where the parser puts what follows a closed reasoning (vLLM's
    deepseek_r1 reads output with no end marker as reasoning)."""
    return knobs(
        loop_channel="content",
        loop_after_tokens=3,
        reasoning_tokens=reasoning_tokens,
        loop_escape_probability=1.0,
        closed_reasoning_answer=answer_in,
    )


@pytest.fixture
async def seen(emulator: EmulatorServer) -> AsyncIterator[MockUpstream]:
    """detproxy's upstream: the emulator, what it was sent recorded, refused where a test says."""
    async with recording(emulator.url) as upstream:
        yield upstream


@pytest.fixture
def drops() -> bool:
    """Whether the emulator's chat template drops assistant reasoning."""
    return False


@pytest.fixture
async def emulator(drops: bool) -> AsyncIterator[EmulatorServer]:
    server = EmulatorServer(EmulatorConfig(template_drops_reasoning=drops))
    async with server:
        yield server


def conditioned(emulator: EmulatorServer) -> list[dict[str, Any]]:
    """What each continuation after a reasoning was conditioned on: endpoint, the reasoning
    its prompt holds ("": dropped) and the content after it."""
    return [r["detail"] for r in emulator.injections() if r["kind"] == "closed_reasoning"]


def continued(seen: MockUpstream) -> list[dict[str, Any]]:
    """The final assistant messages of the chat continuations sent."""
    bodies = seen.bodies("/v1/chat/completions")
    return [b["messages"][-1] for b in bodies if b.get("continue_final_message")]


async def post(client: Any, headers: dict[str, str]) -> tuple[Any, dict[str, Any]]:
    resp = await client.post("/v1/chat/completions", json=ASK, headers=headers)
    assert resp.status == 200, await resp.text()
    return resp, await resp.json()


# -- whole answers -----------------------------------------------------------------------------


@pytest.mark.parametrize("answer_in", ["content", "reasoning"])
async def test_on_a_keeping_template_the_continued_message_carries_the_reasoning(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream, answer_in: str
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client, looping(answer_in=answer_in))
    assert resp.headers["X-Detproxy-Strategy"] == "continue"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    message = answer["choices"][0]["message"]
    reasoning, content = message["reasoning"], message["content"]
    (sent,) = continued(seen)
    assert sent["reasoning"] == reasoning, "the continuation did not carry the reasoning"
    assert conditioned(emulator) == [
        {"endpoint": "chat", "reasoning": reasoning.strip("\n"), "content": sent["content"]}
    ], "the engine was not conditioned on the reasoning before the kept content"
    # One answer: the reasoning as it came, the kept content and what the engine wrote after
    # it as the content (also where its parser reported that as reasoning).
    assert content.startswith(sent["content"]) and len(content) > len(sent["content"])
    assert no_loop_in(content)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    # The template keeps the reasoning (asked once): no rendered path.
    assert probes(seen) == 1 and not seen.bodies("/v1/completions")
    # The reasoning's tokens were generated too: taken off the limit with the content's.
    (body,) = [b for b in seen.bodies("/v1/chat/completions") if b.get("continue_final_message")]
    usage = answer["usage"]
    assert body["max_tokens"] < ASK["max_tokens"] - len(sent["content"].split())
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]


@pytest.mark.parametrize("drops", [True])
async def test_on_a_dropping_template_the_rendered_prompt_holds_the_reasoning(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client, looping())
    assert resp.headers["X-Detproxy-Strategy"] == "continue"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    message = answer["choices"][0]["message"]
    reasoning, content = message["reasoning"], message["content"]
    assert not continued(seen), "the chat continuation was sent (the template drops it)"
    (completion,) = seen.bodies("/v1/completions")
    assert all(type(t) is int for t in completion["prompt"])
    prompt = emulator.state.decode(completion["prompt"])
    head, _, prefix = prompt.partition("assistant:<think>\n" + reasoning.strip("\n"))
    assert head and prefix.startswith("\n</think>\n\n"), prompt
    prefix = prefix[len("\n</think>\n\n") :]
    assert conditioned(emulator) == [
        {"endpoint": "completion", "reasoning": reasoning.strip("\n"), "content": prefix}
    ], "the engine was not conditioned on the reasoning before the kept content"
    assert content.startswith(prefix) and len(content) > len(prefix) and no_loop_in(content)
    assert answer["object"] == "chat.completion" and answer["id"].startswith("chatcmpl-")
    assert completion["max_tokens"] < ASK["max_tokens"]


@pytest.mark.parametrize("drops", [True])
async def test_on_the_chat_path_a_dropping_template_loses_the_reasoning(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    # The control: declared never, the chat continuation carries the reasoning, and the
    # template drops it; the engine goes on from the content alone.
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV | rendering("never"))
    resp, answer = await post(client, looping())
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    (sent,) = continued(seen)
    assert sent["reasoning"] == answer["choices"][0]["message"]["reasoning"]
    assert conditioned(emulator) == [{"endpoint": "chat", "reasoning": ""}]
    assert not seen.bodies("/v1/completions")


async def test_an_answer_without_reasoning_is_continued_as_before(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client, looping(reasoning_tokens=0))
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    assert not answer["choices"][0]["message"].get("reasoning")
    (sent,) = continued(seen)
    assert set(sent) == {"role", "content"}, f"sent {sorted(sent)}"
    assert not seen.bodies("/tokenize") and not seen.bodies("/v1/completions")
    assert not conditioned(emulator)


@pytest.mark.parametrize("drops", [True])
async def test_a_refused_rendered_continuation_gives_the_answer_the_client_had(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    seen.on("/v1/completions", Reply.error(400, "refused"))
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    resp, answer = await post(client, looping())
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    message = answer["choices"][0]["message"]
    assert answer["object"] == "chat.completion" and message["reasoning"] and message["content"]
    assert len(seen.bodies("/v1/completions")) == 1


# -- streamed, as the openai SDK reads it ------------------------------------------------------


async def sdk_stream(client: Any) -> list[Any]:
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await sdk.chat.completions.create(
            **ASK,
            stream=True,
            stream_options={"include_usage": True},
            extra_headers=looping(answer_in="reasoning"),
        )
        return [chunk async for chunk in stream]
    finally:
        await sdk.close()


def reasoning_of(chunk: Any) -> str:
    return (chunk.choices[0].delta.model_extra or {}).get("reasoning") or ""


@pytest.mark.parametrize("drops", [False, True])
async def test_a_streamed_content_loop_is_continued_after_its_reasoning(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream, drops: bool
) -> None:
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    chunks = await sdk_stream(client)  # the SDK raises on an error event
    assert len({c.id for c in chunks}) == 1, "the stream changed its id"
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    with_choices = [c for c in chunks if c.choices]
    reasoning = "".join(reasoning_of(c) for c in with_choices)
    content = "".join(c.choices[0].delta.content or "" for c in with_choices)
    # The reasoning, then the content: the continuation's text (reported as reasoning by the
    # parser on the chat path) is content.
    first = next(i for i, c in enumerate(with_choices) if c.choices[0].delta.content)
    assert reasoning and not any(reasoning_of(c) for c in with_choices[first:])
    assert with_choices[-1].choices[0].finish_reason in ("stop", "length")
    (detail,) = conditioned(emulator)
    endpoint = "completion" if drops else "chat"
    assert detail["endpoint"] == endpoint and detail["reasoning"] == reasoning.strip("\n"), (
        "the continuation was not conditioned on the reasoning the client was shown"
    )
    # It went on from the content the client holds.
    assert detail["content"] and content.startswith(detail["content"])
    assert len(content) > len(detail["content"])
    if drops:
        assert not continued(seen) and len(seen.bodies("/v1/completions")) == 1
    else:
        (sent,) = continued(seen)
        assert sent["reasoning"] == reasoning and not seen.bodies("/v1/completions")
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info == {"recovered": True, "attempts": 2, "strategy": "continue"}, chunks[-1]


@pytest.mark.parametrize("drops", [True])
async def test_a_refused_streamed_continuation_is_no_error(
    make_proxy: Any, emulator: EmulatorServer, seen: MockUpstream
) -> None:
    seen.on("/v1/completions", Reply.error(400, "refused"))
    client = await make_proxy(MOCK_URL, upstream=seen, env=ENV)
    chunks = await sdk_stream(client)  # the SDK raises on an error event
    assert len(seen.bodies("/v1/completions")) == 1
    assert len({c.id for c in chunks}) == 1
    # The client's own request goes on from what it was shown (the chat path).
    assert len(continued(seen)) == 1
    info = (chunks[-1].model_extra or {}).get("detproxy")
    assert info is not None and info["recovered"] is False, chunks[-1]


# -- the parts ---------------------------------------------------------------------------------


def test_the_continued_message_carries_the_reasoning_only_where_there_was_some() -> None:
    base = {"messages": [{"role": "user", "content": "q"}], "max_tokens": 50}
    carried = continuation_body("chat", base, {}, "Four", 10, "Sum.")
    assert carried is not None and carried["max_tokens"] == 40
    assert carried["messages"][-1] == {"role": "assistant", "content": "Four", "reasoning": "Sum."}
    plain = continuation_body("chat", base, {}, "Four", 10)
    assert plain is not None and plain["messages"][-1] == {"role": "assistant", "content": "Four"}


def test_a_merged_continuation_keeps_the_reasoning_in_its_fields() -> None:
    def answer(message: dict[str, Any]) -> dict[str, Any]:
        return {"choices": [{"index": 0, "message": {"role": "assistant", **message}}]}

    keys = ("reasoning", "reasoning_content")
    # vLLM's deepseek_r1 parser: what follows the prefix reported as reasoning.
    misread = answer({"content": None, "reasoning": " is the sum."})
    merge_answer("chat", misread, "Four", None, "Sum.", keys)
    assert misread["choices"][0]["message"] == {
        "role": "assistant",
        "content": "Four is the sum.",
        "reasoning": "Sum.",
        "reasoning_content": "Sum.",
    }
    # llama.cpp's server, non-streamed: the sent message in front, its reasoning given back.
    echoed = answer({"content": "Four is the sum.", "reasoning_content": "Sum."})
    merge_answer("chat", echoed, "Four", None, "Sum.", ("reasoning",))
    message = echoed["choices"][0]["message"]
    assert message == {"role": "assistant", "content": "Four is the sum.", "reasoning": "Sum."}
