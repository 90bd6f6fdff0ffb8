"""Recovering from a reasoning loop by closing the reasoning: the reasoning before the loop is
kept, the end-of-reasoning marker appended, and the engine answers."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from policies.base import Trigger
from proxy.loops.continuation import (
    Continued,
    can_close_reasoning,
    closed_reasoning,
    content_of,
    merge_closed,
    reasoning_keys,
)
from proxy.loops.detector import LoopDetector
from proxy.openai import move_reasoning_to_content
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import chat, knobs
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks, sse_comments

MODEL = "emulator-model"
RETRY = {"DETPROXY_LOOPS__POLICY": "retry", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"}
ASK, STREAMED = chat(max_tokens=200), chat(max_tokens=200, stream=True)
TRIGGER = Trigger("proxy", "reasoning", 0, 40, 8, 100, "unit")
CLOSE = {
    "DETPROXY_LOOPS__LADDERS": orjson.dumps(
        [{"models": "*", "attempts": [{"strategy": "close_reasoning"}]}]
    ).decode()
}
# A reasoning loop no sampling change ends (loop_escape_probability 0): a restart loops again.
STUCK = {
    "loop_channel": "reasoning",
    "loop_after_tokens": 3,
    "reasoning_tokens": 6,
    "loop_escape_probability": 0.0,
}


def test_what_can_close_its_reasoning() -> None:
    body = {"messages": [{"role": "user", "content": "x"}]}
    assert can_close_reasoning("chat", body, TRIGGER)
    assert not can_close_reasoning("completions", {"prompt": "x"}, TRIGGER)
    assert not can_close_reasoning("chat", body, Trigger("proxy", "content", 0, 40, 8, 100))
    assert not can_close_reasoning("chat", body, Trigger("engine", "reasoning", 0))
    assert not can_close_reasoning("chat", body, Trigger("runaway", "reasoning", 0))
    assert not can_close_reasoning("chat", body | {"n": 2}, TRIGGER)
    assert not can_close_reasoning("chat", body | {"logprobs": True}, TRIGGER)


def test_the_closing_message_wraps_the_kept_reasoning_in_the_markers() -> None:
    assert closed_reasoning("\nLet me think.\n", "<think>", "</think>") == (
        "<think>\nLet me think.\n</think>\n\n"
    )
    assert closed_reasoning("Hm", "[R]", "[/R]") == "[R]\nHm\n[/R]\n\n"


@pytest.mark.parametrize("keys", [("reasoning",), ("reasoning", "reasoning_content"), ()])
def test_the_answer_after_a_closed_reasoning_is_the_content(keys: tuple[str, ...]) -> None:
    # vLLM's deepseek_r1 parser reads an answer with no end marker as reasoning.
    answer: dict[str, Any] = {
        "choices": [
            {"index": 0, "message": {"role": "assistant", "reasoning": "The answer is 4."}}
        ],
        "usage": {"prompt_tokens": 50, "completion_tokens": 5, "total_tokens": 55},
    }
    closed = closed_reasoning("Two and two.", "<think>", "</think>")
    merge_closed(answer, Continued("Two and two.", True, closed), keys, prompt_tokens=20)
    message = answer["choices"][0]["message"]
    assert message["content"] == "The answer is 4."
    for key in keys or ("reasoning",):
        assert message[key] == "Two and two."
    assert "reasoning_content" not in message or "reasoning_content" in keys
    assert answer["usage"] == {"prompt_tokens": 20, "completion_tokens": 35, "total_tokens": 55}
    assert content_of("chat", answer, "reasoning") == "Two and two."
    assert reasoning_keys("chat", answer) == (keys or ("reasoning",))


@pytest.mark.parametrize("echo", ["message", "parsed"])
def test_an_engine_that_answers_with_the_closed_reasoning_in_front_gets_it_taken_off(
    echo: str,
) -> None:
    # llama.cpp's server answers a non-streamed continuation with the final assistant message
    # in front (measured: the markers in the content); a parser might read it as reasoning.
    closed = closed_reasoning("Two and two.", "<think>", "</think>")
    message: dict[str, Any] = {"role": "assistant"}
    if echo == "message":
        message["content"] = closed + "The answer is 4."
    else:
        message |= {"reasoning_content": "Two and two.", "content": "The answer is 4."}
    answer: dict[str, Any] = {"choices": [{"index": 0, "message": message}]}
    merge_closed(answer, Continued("Two and two.", True, closed), ("reasoning_content",), 20)
    assert answer["choices"][0]["message"] == {
        "role": "assistant",
        "reasoning_content": "Two and two.",
        "content": "The answer is 4.",
    }


def test_a_streamed_reasoning_delta_becomes_content() -> None:
    chunk: dict[str, Any] = {
        "choices": [{"index": 0, "delta": {"reasoning": "4.", "reasoning_content": "4."}}]
    }
    move_reasoning_to_content(chunk)
    assert chunk["choices"][0]["delta"] == {"content": "4."}


def recoveries(registry: CollectorRegistry, strategy: str, outcome: str) -> float:
    return metric(
        registry, "detproxy_recoveries_total", model=MODEL, strategy=strategy, outcome=outcome
    )


def no_loop_in(text: str) -> bool:
    detector = LoopDetector()
    return detector.feed(text) is None and detector.report is None


@pytest.mark.parametrize("parser", ["reasoning", "content"])
async def test_a_reasoning_loop_is_closed_and_answered(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, parser: str
) -> None:
    client = await make_proxy(emulator.url, env=RETRY | CLOSE)
    headers = knobs(**STUCK, closed_reasoning_answer=parser)
    resp = await client.post("/v1/chat/completions", json=ASK, headers=headers)
    assert resp.status == 200
    assert resp.headers["X-Detproxy-Strategy"] == "close_reasoning"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    answer = await resp.json()
    message = answer["choices"][0]["message"]
    assert message["reasoning"] and no_loop_in(message["reasoning"])  # cut before the loop
    assert message["content"] and no_loop_in(message["content"])  # the answer, as content
    assert answer["choices"][0]["finish_reason"] in ("stop", "length")
    assert recoveries(registry, "close_reasoning", "recovered") == 1
    kept = metric(
        registry, "detproxy_recovery_tokens_total", model=MODEL, strategy="close_reasoning",
        kind="kept",
    )  # fmt: skip
    assert kept > 0


async def test_a_restart_does_not_end_the_same_loop(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # The control: the same loop, recovered by restarting, loops again.
    restart = orjson.dumps([{"models": "*", "attempts": [{"presence_penalty": 1.5}]}]).decode()
    # stream_mode "restart": the ladder's own strategy (under "continue" every retry goes on
    # from the loop's onset, streamed or not).
    env = RETRY | {"DETPROXY_LOOPS__LADDERS": restart, "DETPROXY_LOOPS__STREAM_MODE": "restart"}
    client = await make_proxy(emulator.url, env=env)
    resp = await client.post("/v1/chat/completions", json=ASK, headers=knobs(**STUCK))
    assert resp.status == 200
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert recoveries(registry, "restart", "looped_again") == 1


@pytest.mark.parametrize("parser", ["reasoning", "content"])
async def test_a_streamed_reasoning_loop_is_closed_and_the_answer_follows(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, parser: str
) -> None:
    client = await make_proxy(emulator.url, env=RETRY | CLOSE)
    headers = knobs(**STUCK, closed_reasoning_answer=parser)
    resp = await client.post("/v1/chat/completions", json=STREAMED, headers=headers)
    assert resp.status == 200
    raw = await resp.read()
    assert not sse_comments(raw)  # not a restart: nothing to mark
    events = sse_chunks(raw)
    assert len({e["id"] for e in events}) == 1  # the first attempt's id throughout
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    kinds = ["r" if d.get("reasoning") else "c" if d.get("content") else "" for d in deltas]
    shown = "".join(k for k in kinds if k)
    # The reasoning the client had (up to where the loop was seen), then only the answer.
    assert shown.startswith("r") and "c" in shown and "r" not in shown[shown.index("c") :]
    answer = "".join(d.get("content") or "" for d in deltas)
    assert answer and no_loop_in(answer)
    finished = [e for e in events if e.get("choices")]
    assert finished[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    # The last chunk before [DONE] says what the recovery came to (SPEC 5).
    info = {"recovered": True, "attempts": 2, "strategy": "close_reasoning"}
    assert events[-1].get("detproxy") == info, f"last chunk {events[-1]}"
    assert recoveries(registry, "close_reasoning", "recovered") == 1


async def test_with_hold_reasoning_the_client_gets_the_kept_reasoning_once_then_the_answer(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # The looping attempt's reasoning was held, never shown: the kept part of it is sent as
    # one reasoning chunk, in the field the upstream uses, before the answer.
    env = RETRY | CLOSE | {"DETPROXY_LOOPS__STREAM_MODE": "hold_reasoning"}
    client = await make_proxy(emulator.url, env=env)
    headers = knobs(**STUCK, reasoning_style="reasoning_content")
    resp = await client.post("/v1/chat/completions", json=STREAMED, headers=headers)
    raw = await resp.read()
    assert not sse_comments(raw)
    events = sse_chunks(raw)
    assert len({e["id"] for e in events}) == 1
    deltas = [e["choices"][0]["delta"] for e in events if e.get("choices")]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert len(reasoning) == 1 and no_loop_in(reasoning[0])  # the kept reasoning, whole
    assert not any(d.get("reasoning") for d in deltas)  # the upstream's field only
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert deltas.index(next(d for d in deltas if d.get("reasoning_content"))) < first_content
    answer = "".join(d.get("content") or "" for d in deltas)
    assert answer and no_loop_in(answer)
    assert recoveries(registry, "close_reasoning", "recovered") == 1
