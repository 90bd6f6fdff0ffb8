"""Recovering from a loop by continuing: the prefix before the loop is kept, the engine goes on."""

from __future__ import annotations

import itertools
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from policies.base import Trigger
from proxy.loops.continuation import (
    SNAP_CHARS,
    can_continue,
    content_of,
    continuation_body,
    estimate_tokens,
    merge_answer,
    prefix_of,
    word_end,
)
from proxy.testing import Handler, MockUpstream, Received, Reply
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks
from tests.helpers.upstreams import MOCK_URL

CHAT = "/v1/chat/completions"
UNIT = " The waves roll in and the waves roll out again."
LOOPING = "The sea is calm tonight." + UNIT * 30
ONSET = len("The sea is calm tonight.")
TRIGGER = Trigger("proxy", "content", 0, len(UNIT), 8, ONSET, UNIT)
CONTINUE_LADDER = orjson.dumps(
    [{"models": "*", "attempts": [{"strategy": "continue", "presence_penalty": 1.5}]}]
).decode()


def test_the_prefix_is_the_text_before_the_loop_and_one_unit() -> None:
    assert prefix_of(LOOPING, TRIGGER) == "The sea is calm tonight." + UNIT
    assert prefix_of(LOOPING, Trigger("engine", "content", 0)) is None  # no onset known
    assert prefix_of("short", TRIGGER) is None  # the offsets are past the text


def test_the_prefix_is_cut_at_a_word_end() -> None:
    # A unit that does not end on a word: the cut moves back to the end of one.
    text = "Once upon a time there was a cat" * 10
    trigger = Trigger("proxy", "content", 0, 32, 8, 0, "")
    assert text[:32].endswith("a cat") and text[32] == "O"  # the raw cut is inside "catOnce"
    assert prefix_of(text, trigger) == "Once upon a time there was a"
    assert word_end("word one\ntwo", 9) == 8  # before the newline
    assert word_end("word one\ntwo", 8) == 8  # already there
    assert word_end("word  two", 6) == 4  # a space run: before its first space
    assert word_end("x" * 100, 90) == 90  # no word end near: the cut stays
    assert word_end("a " + "x" * 100, 90) == 90
    assert word_end("abc", 3) == 3  # the text's end


def test_what_can_be_continued() -> None:
    chat = {"messages": [{"role": "user", "content": "x"}]}
    assert can_continue("chat", chat, TRIGGER)
    assert can_continue("completions", {"prompt": "x"}, TRIGGER)
    assert not can_continue("completions", {"prompt": ["x", "y"]}, TRIGGER)
    assert not can_continue("chat", chat | {"n": 2}, TRIGGER)
    assert not can_continue("chat", chat | {"logprobs": True}, TRIGGER)
    assert not can_continue("chat", chat, Trigger("proxy", "reasoning", 0, 4, 8, 10))
    assert not can_continue("chat", chat, Trigger("engine", "content", 0))


def test_the_continuation_request() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 100}
    body = continuation_body("chat", base, {"presence_penalty": 1.5}, "Hello", 30)
    assert body == {
        "model": "m",
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
        ],
        "max_tokens": 70,
        "presence_penalty": 1.5,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    assert base["messages"] == [{"role": "user", "content": "Hi"}]  # not changed in place
    completion = continuation_body(
        "completions", {"prompt": "Once", "max_tokens": 9}, {}, " upon", 2
    )
    assert completion == {"prompt": "Once upon", "max_tokens": 7}
    assert continuation_body("chat", base, {}, "Hello", 100) is None  # nothing left to generate
    # The kept text's tokens, from that text alone: 4 UTF-8 bytes a token, at least one.
    assert estimate_tokens("abcdefgh") == 2
    assert estimate_tokens("ab") == 1
    assert estimate_tokens("一二三四") == 3  # 12 bytes: CJK is not 4 chars a token


def test_the_client_gets_prefix_and_continuation_as_one_answer() -> None:
    answer = {
        "choices": [{"index": 0, "message": {"role": "assistant", "content": " Done."}}],
        "usage": {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43},
    }
    merge_answer("chat", answer, "Kept text.", prompt_tokens=12)
    assert content_of("chat", answer) == "Kept text. Done."
    # The continuation's prompt held the client's 12 tokens and the 28 kept ones.
    assert answer["usage"] == {"prompt_tokens": 12, "completion_tokens": 31, "total_tokens": 43}


def scripted() -> Handler:
    """Loops under greedy decoding; a continuation (a final assistant message to go on from)
    answers only its continuation, as vLLM and llama-server do. Streamed, the n-th answer's
    id is chatcmpl-n."""
    answered = itertools.count(1)

    def answer(request: Received) -> Reply:
        body = request.json()
        n = next(answered)
        if body.get("continue_final_message"):
            texts, finish = [" Then the storm came", " and the night ended."], "stop"
        else:
            texts, finish = ["The sea is calm tonight."] + [UNIT] * 30, "length"
        if not body.get("stream"):
            content = "".join(texts)
            return Reply.json(
                {
                    "id": "chatcmpl-x",
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": content},
                            "finish_reason": finish,
                        }
                    ],
                    "usage": {
                        "prompt_tokens": 10 + len(body["messages"][-1]["content"]) // 4,
                        "completion_tokens": len(content) // 4,
                        "total_tokens": 0,
                    },
                }
            )
        role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        chunks = [role] + [
            {
                "index": 0,
                "delta": {"content": t},
                "finish_reason": finish if i == len(texts) - 1 else None,
            }
            for i, t in enumerate(texts)
        ]
        return Reply.sse({"id": f"chatcmpl-{n}", "choices": [c]} for c in chunks)

    return answer


def ask(stream: bool) -> dict[str, Any]:
    return {
        "model": "m",
        "temperature": 0,
        "max_tokens": 1000,
        "stream": stream,
        "messages": [{"role": "user", "content": "Write about the sea."}],
    }


ENV = {
    "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
    "DETPROXY_LOOPS__LADDERS": CONTINUE_LADDER,
}


def continued_prefix(upstream: MockUpstream, onset: bool = True) -> str:
    """The prefix the second attempt continued from (``onset``: cut at the loop's onset and
    one unit, as a non-streamed continuation is)."""
    (second,) = upstream.bodies(CHAT)[1:]
    assert second["continue_final_message"] is True and second["add_generation_prompt"] is False
    assert second["presence_penalty"] == 1.5
    assert second["messages"][:-1] == ask(False)["messages"]
    assert second["messages"][-1]["role"] == "assistant"
    assert second["max_tokens"] < 1000  # the kept tokens are not asked again
    prefix = str(second["messages"][-1]["content"])
    # Up to the loop's onset, and one unit: the detector's onset is where the text starts to
    # repeat, which can be a character or so before the first whole unit.
    assert LOOPING.startswith(prefix)
    if not onset:
        return prefix
    assert prefix.count("The waves roll in") == 1
    # Up to the unit's end, or a word end just before it (the detector's onset can be a few
    # characters early, and the cut then moves back to the end of a word).
    assert ONSET + len(UNIT) - 3 - SNAP_CHARS <= len(prefix) <= ONSET + len(UNIT)
    assert len(prefix) > ONSET and LOOPING[len(prefix)] == " " and prefix[-1] != " "
    return prefix


async def test_a_non_streamed_loop_is_continued(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    upstream = mock_upstream
    upstream.on(CHAT, scripted())
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=ENV)
    resp = await proxy.post(CHAT, json=ask(False))
    answer = await resp.json()
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    assert resp.headers["X-Detproxy-Strategy"] == "continue"
    prefix = continued_prefix(upstream)
    content = answer["choices"][0]["message"]["content"]
    assert content == prefix + " Then the storm came and the night ended."
    assert answer["choices"][0]["finish_reason"] == "stop"
    labels = {"model": "m", "strategy": "continue"}
    assert metric(registry, "detproxy_recoveries_total", outcome="recovered", **labels) == 1
    kept = metric(registry, "detproxy_recovery_tokens_total", kind="kept", **labels)
    generated = metric(registry, "detproxy_recovery_tokens_total", kind="generated", **labels)
    assert kept > 0 and generated == len(" Then the storm came and the night ended.") // 4


async def test_a_streamed_loop_is_continued_after_what_the_client_has(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    upstream = mock_upstream
    upstream.on(CHAT, scripted())
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=ENV)
    resp = await proxy.post(CHAT, json=ask(True))
    raw = await resp.read()
    assert b": detproxy retry" not in raw  # no restart: nothing to mark
    events = sse_chunks(raw)
    assert {e["id"] for e in events} == {"chatcmpl-1"}  # the first attempt's id throughout
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    prefix = continued_prefix(upstream)
    # What the client had (the start, the loop until it was seen), then the continuation:
    # nothing shown twice.
    shown, _, rest = text.partition(" Then the storm came")
    assert rest == " and the night ended."
    assert shown.count("The sea is calm tonight.") == 1
    assert LOOPING.startswith(shown)  # the first attempt's text, cut where the loop was seen
    # The engine went on from the loop's onset and one unit, as a non-streamed recovery does
    # (one path); the client keeps the repeats it was shown before the loop was caught.
    assert shown.startswith(prefix) and len(shown) > len(prefix), (prefix, shown)
    assert [e for e in events if e.get("choices")][-1]["choices"][0]["finish_reason"] == "stop"
    assert events[-1]["detproxy"] == {"recovered": True, "attempts": 2, "strategy": "continue"}
    assert (
        metric(
            registry,
            "detproxy_recoveries_total",
            model="m",
            strategy="continue",
            outcome="recovered",
        )
        == 1
    )


@pytest.mark.parametrize("stream", [False, True])
async def test_what_cannot_be_continued_restarts(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry, stream: bool
) -> None:
    upstream = mock_upstream
    upstream.on(CHAT, scripted())
    # Streamed, the default goes on from what the client was shown, logprobs or not (the shown
    # tokens had theirs): the ladder's own continue strategy is what restart mode keeps.
    env = ENV | ({"DETPROXY_LOOPS__STREAM_MODE": "restart"} if stream else {})
    proxy = await make_proxy(MOCK_URL, upstream=upstream, env=env)
    resp = await proxy.post(CHAT, json=ask(stream) | {"logprobs": True})
    await resp.read()
    assert "continue_final_message" not in upstream.bodies(CHAT)[1]
    assert upstream.bodies(CHAT)[1]["presence_penalty"] == 1.5
    assert (
        metric(
            registry,
            "detproxy_recoveries_total",
            model="m",
            strategy="restart",
            outcome="looped_again",
        )
        == 1
    )


def test_a_continuation_that_already_carries_the_prefix_is_not_doubled() -> None:
    # llama.cpp's server answers a non-streamed continuation with the prefix in front.
    answer = {"choices": [{"index": 0, "message": {"content": "Kept text. Done."}}]}
    merge_answer("chat", answer, "Kept text.", prompt_tokens=None)
    assert content_of("chat", answer) == "Kept text. Done."
    completion = {"choices": [{"index": 0, "text": " Done."}]}
    merge_answer("completions", completion, "Kept", prompt_tokens=None)
    assert content_of("completions", completion) == "Kept Done."
