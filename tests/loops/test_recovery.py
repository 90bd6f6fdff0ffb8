"""Loops through detproxy against the emulator: detected, recovered, never multiplied."""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import pytest
from prometheus_client import CollectorRegistry

from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.emulator import CHAT, knobs
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks, sse_comments
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import eventually

MODEL = "emulator-model"
ENGINE_DETECTION = '{"min_pattern_size": 2, "max_pattern_size": 16, "min_count": 3}'
# These tests are about continuations (stream_mode continue, the default, set here too).
RETRY = {
    "DETPROXY_LOOPS__POLICY": "retry",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    "DETPROXY_LOOPS__STREAM_MODE": "continue",
}
RESTART = RETRY | {"DETPROXY_LOOPS__STREAM_MODE": "restart"}  # not the default


def chat(prompt: str = "tell me a story", **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


# A model that loops at temperature 0 and whose loop a presence penalty always ends
# (loop_escape_probability 1): these tests are about what detproxy does with one retry; how the
# counts follow a retry that may loop again is test_recovery_counts_follow_the_upstream.
ESCAPES = {"loop_escape_probability": 1.0}
CONTENT_LOOP = knobs(loop_channel="content", loop_after_tokens=5, **ESCAPES)
REASONING_LOOP = knobs(loop_channel="reasoning", loop_after_tokens=3, reasoning_tokens=6, **ESCAPES)


def last_choice(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The last choice of a stream's chunks (the recovery's own chunk has none)."""
    choice: dict[str, Any] = [c for c in chunks if c.get("choices")][-1]["choices"][0]
    return choice


def loops(registry: CollectorRegistry, channel: str, source: str) -> float:
    return metric(registry, "detproxy_loops_total", model=MODEL, channel=channel, source=source)


def actions(registry: CollectorRegistry, action: str, outcome: str) -> float:
    return metric(
        registry, "detproxy_policy_actions_total", model=MODEL, action=action, outcome=outcome
    )


async def test_non_streaming_content_loop_is_recovered(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(emulator.url, env=RETRY)
    resp = await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
    assert resp.status == 200
    assert resp.headers["X-Detproxy-Attempts"] == "2"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    # One path: the retry went on from the loop's onset and one unit (one repeat kept).
    assert resp.headers["X-Detproxy-Strategy"] == "continue"
    answer = await resp.json()
    assert answer["choices"][0]["message"]["content"].count("repeats itself") == 1
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert loops(registry, "content", "proxy") == 1
    assert actions(registry, "retry", "recovered") == 1
    assert emulator.stats()["requests"] == 2
    incidents = await (await client.get("/detproxy/incidents")).json()
    assert incidents[0]["kind"] == "loop" and incidents[0]["period"] == len(
        " and then the model repeats itself."
    )


async def test_streaming_restart_continues_under_the_original_id(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(emulator.url, env=RESTART)
    slow_loop = knobs(loop_channel="content", loop_after_tokens=5, token_latency_s=0.005, **ESCAPES)
    resp = await client.post("/v1/chat/completions", json=chat(stream=True), headers=slow_loop)
    raw = await resp.read()
    chunks, comments = sse_chunks(raw), sse_comments(raw)
    assert comments == [b": detproxy retry attempt=2 reason=loop (proxy, content)"]
    assert len({c["id"] for c in chunks}) == 1  # one id across both attempts
    assert last_choice(chunks)["finish_reason"] == "stop"
    info = {"recovered": True, "attempts": 2, "strategy": "restart"}
    assert chunks[-1]["detproxy"] == info, f"last chunk {chunks[-1]}"
    # The looping attempt's connection was closed: the engine aborted it.
    await eventually(lambda: emulator.stats()["aborted"], what="an aborted engine request")
    assert emulator.stats()["aborted"] == 1
    assert actions(registry, "retry", "recovered") == 1


async def test_the_sdk_reads_a_restarted_stream(make_proxy: Any, emulator: EmulatorServer) -> None:
    client = await make_proxy(emulator.url, env=RESTART)
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await sdk.chat.completions.create(**chat(stream=True), extra_headers=CONTENT_LOOP)
        parts = [c async for c in stream]
    finally:
        await sdk.close()
    text = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert "repeats itself" in text  # restart mode: what was shown stays shown
    assert [c for c in parts if c.choices][-1].choices[0].finish_reason == "stop"
    assert (parts[-1].model_extra or {}).get("detproxy") == {
        "recovered": True,
        "attempts": 2,
        "strategy": "restart",
    }


async def test_a_retry_is_recovered_when_the_client_closes_on_done(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # The sync openai SDK closes the connection on [DONE], before the engine's last chunk
    # frame (a second later here) reaches detproxy: the retry's clean end still counts.
    client = await make_proxy(emulator.url, env=RETRY)
    late_end = knobs(loop_channel="content", loop_after_tokens=5, end_delay_s=1.0, **ESCAPES)

    def stream() -> list[Any]:
        sdk = openai.OpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
        with sdk:
            return list(sdk.chat.completions.create(**chat(stream=True), extra_headers=late_end))

    parts = await asyncio.to_thread(stream)
    assert [c for c in parts if c.choices][-1].choices[0].finish_reason == "stop"
    assert (parts[-1].model_extra or {}).get("detproxy", {}).get("recovered") is True
    await eventually(  # detproxy sees the connection close after the SDK returned
        lambda: metric(registry, "detproxy_inflight_requests") == 0, what="no request in flight"
    )
    assert metric(registry, "detproxy_inflight_requests") == 0
    assert actions(registry, "retry", "recovered") == 1
    assert (
        metric(registry, "detproxy_client_disconnects_total", endpoint="chat", stream="true") == 0
    )
    assert (
        metric(registry, "detproxy_responses_total", endpoint="chat", code="200", outcome="ok") == 1
    )


async def test_hold_reasoning_never_shows_the_looping_attempt(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        emulator.url, env=RETRY | {"DETPROXY_LOOPS__STREAM_MODE": "hold_reasoning"}
    )
    sdk = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    try:
        stream = await sdk.chat.completions.create(
            **chat(stream=True), extra_headers=REASONING_LOOP
        )
        parts = [c async for c in stream]
    finally:
        await sdk.close()
    reasoning = "".join(
        getattr(c.choices[0].delta, "reasoning", None) or "" for c in parts if c.choices
    )
    content = "".join(c.choices[0].delta.content or "" for c in parts if c.choices)
    assert reasoning and "repeats itself" not in reasoning
    assert content
    assert loops(registry, "reasoning", "proxy") == 1
    assert actions(registry, "retry", "recovered") == 1


async def test_abort_ends_the_stream_cleanly(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(emulator.url, env={"DETPROXY_LOOPS__POLICY": "abort"})
    resp = await client.post("/v1/chat/completions", json=chat(stream=True), headers=CONTENT_LOOP)
    raw = await resp.read()
    chunks = sse_chunks(raw)
    assert raw.endswith(b"data: [DONE]\n\n")
    assert chunks[-1]["choices"][0]["finish_reason"] == "repetition"
    assert actions(registry, "abort", "loop") == 1
    resp = await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
    answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "repetition"
    assert answer["choices"][0]["message"]["content"].count("repeats itself") == 1
    assert resp.headers["X-Detproxy-Recovered"] == "false"


async def test_observe_only_records(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(emulator.url)  # the default policy is observe
    resp = await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
    answer = await resp.json()
    assert answer["choices"][0]["finish_reason"] == "length"
    assert "X-Detproxy-Attempts" in resp.headers and emulator.stats()["requests"] == 1
    assert loops(registry, "content", "proxy") == 1
    assert actions(registry, "observe", "observe") == 1


async def test_engine_repetition_and_runaway_are_triggers(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    async with EmulatorServer(EmulatorConfig(engine_repetition_detection=True)) as emu:
        client = await make_proxy(
            emu.url,
            env=RETRY | {"DETPROXY_LOOPS__ENGINE_DETECTION": ENGINE_DETECTION},
        )
        resp = await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
        assert resp.headers["X-Detproxy-Recovered"] == "true"
        assert loops(registry, "content", "engine") == 1
        # A runaway: reasoning to the token limit, no content, too short for the detector.
        resp = await client.post(
            "/v1/chat/completions", json=chat(max_tokens=12), headers=REASONING_LOOP
        )
        assert resp.headers["X-Detproxy-Attempts"] == "2"
        assert loops(registry, "reasoning", "runaway") == 1


async def test_the_recovery_budget_holds(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # No share of generated tokens, a floor of one retry's reservation (max_tokens 200): the
    # first loop's retry fits; once it has generated tokens, no second one does.
    env = {
        "DETPROXY_LOOPS__RECOVERY_TOKEN_SHARE": "0",
        "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": "200",
    }
    client = await make_proxy(emulator.url, env=RETRY | env)
    for _ in range(5):
        await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
    retried = actions(registry, "retry", "recovered") + actions(registry, "retry", "looped_again")
    assert retried == 1
    assert actions(registry, "abort", "budget_exhausted") == 4
    assert emulator.stats()["requests"] == 6  # 5 requests, 1 retry: load not multiplied
    spent = metric(registry, "detproxy_recovery_budget_tokens", model=MODEL, kind="spent")
    assert 0 < spent <= 200  # the retry's reservation was settled with what it generated
    assert metric(registry, "detproxy_recovery_budget_tokens", model=MODEL, kind="allowed") == 200
    status = await (await client.get("/detproxy/status")).json()
    assert status["recovery_budget"][MODEL]["spent"] == spent


async def test_a_loop_that_persists_exhausts_the_ladder(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # A loop at temperature 0 without a penalty holds whatever the seed (on the emulator as on
    # real models); a ladder that changes neither keeps looping even where a penalty would help.
    ladder = '[{"models": "*", "attempts": [{"seed": 1}, {"seed": 2}]}]'
    client = await make_proxy(emulator.url, env=RETRY | {"DETPROXY_LOOPS__LADDERS": ladder})
    resp = await client.post("/v1/chat/completions", json=chat(), headers=CONTENT_LOOP)
    assert resp.headers["X-Detproxy-Attempts"] == "3"
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert actions(registry, "retry", "looped_again") == 2
    assert actions(registry, "abort", "attempts_exhausted") == 1


@pytest.mark.parametrize("stream", [False, True])
async def test_each_retry_settles_its_own_reservation(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, stream: bool
) -> None:
    # Two retries that loop again: each reserved max_tokens when it was decided, and each is
    # settled with what it generated, so the budget spent is what the retries generated (a
    # second retry decided before the first had ended once left the first's estimate spent).
    ladder = '[{"models": "*", "attempts": [{"seed": 1}, {"seed": 2}]}]'
    client = await make_proxy(emulator.url, env=RETRY | {"DETPROXY_LOOPS__LADDERS": ladder})
    resp = await client.post("/v1/chat/completions", json=chat(stream=stream), headers=CONTENT_LOOP)
    await resp.read()
    assert actions(registry, "retry", "looped_again") == 2
    generated = metric(
        registry,
        "detproxy_recovery_tokens_total",
        model=MODEL,
        # Each retry goes on from the loop's onset, streamed or not (stream_mode continue).
        strategy="continue",
        kind="generated",
    )
    spent = metric(registry, "detproxy_recovery_budget_tokens", model=MODEL, kind="spent")
    # Each continuation asked max_tokens less the kept tokens (and, streamed, the loop stopped
    # it before those): less than reserved.
    assert 0 < generated < 2 * 200
    assert spent == generated


async def test_recovery_counts_follow_the_upstream(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    """With the default ladder (temperature 1.0 and both penalties, then 0.7) and a model
    whose loop each such retry ends only with probability 0.7 (seeded), every count detproxy
    reports matches what the emulator says each attempt did."""
    client = await make_proxy(
        emulator.url, env=RETRY | {"DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": "10000000"}
    )
    loop = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=0.7)
    seen: dict[str, tuple[int, bool]] = {}  # request id: (attempts, recovered) as the client saw
    for i in range(24):
        rid = f"loop-{i}"
        stream = i % 2 == 1
        resp = await client.post(
            "/v1/chat/completions",
            json=chat(f"story number {i}", stream=stream),
            headers=loop | {"X-Request-Id": rid},
        )
        assert resp.status == 200
        if stream:
            raw = await resp.read()
            chunks = sse_chunks(raw)
            assert not sse_comments(raw), "a streamed recovery continues: nothing to mark"
            info = chunks[-1]["detproxy"]  # a policy acted on every one of these streams
            finish = last_choice(chunks)["finish_reason"]
            assert info["recovered"] == (finish == "stop"), chunks[-1]
            seen[rid] = (info["attempts"], info["recovered"])
        else:
            await resp.read()
            seen[rid] = (
                int(resp.headers["X-Detproxy-Attempts"]),
                resp.headers["X-Detproxy-Recovered"] == "true",
            )
    looped = dict.fromkeys(seen, 0)
    escaped = dict.fromkeys(seen, 0)
    for rec in emulator.injections():
        assert rec["request_id"] in seen, rec
        if rec["kind"] == "loop":
            looped[rec["request_id"]] += 1
        elif rec["kind"] == "loop_escape":
            escaped[rec["request_id"]] += 1
    recovered = [rid for rid in seen if escaped[rid]]
    exhausted = [rid for rid in seen if not escaped[rid]]
    retries_looped = sum(looped.values()) - len(seen)
    # What the emulator did (seeded, the same every run): some first retries recovered, some
    # looped again, and some requests looped on every attempt.
    assert recovered and exhausted and retries_looped > len(exhausted)
    for rid, (attempts, was_recovered) in seen.items():
        assert escaped[rid] <= 1 and looped[rid] >= 1
        assert attempts == looped[rid] + escaped[rid], rid  # each attempt, as it went
        assert was_recovered == bool(escaped[rid]), rid
        if not escaped[rid]:
            assert attempts == 3  # the ladder ran out
    await eventually(  # outcomes are counted when the upstream response has ended
        lambda: actions(registry, "abort", "attempts_exhausted") == len(exhausted),
        what=f"{len(exhausted)} attempts_exhausted aborts counted",
    )
    assert actions(registry, "retry", "recovered") == len(recovered)
    assert actions(registry, "retry", "looped_again") == retries_looped
    assert actions(registry, "abort", "attempts_exhausted") == len(exhausted)
    assert loops(registry, "content", "proxy") == sum(looped.values())
    assert emulator.stats()["requests"] == sum(looped.values()) + len(recovered)


UNIT = " and then the model repeats itself."  # the scripted loops' unit


def stream_deltas(deltas: list[dict[str, Any]], finish: str) -> list[dict[str, Any]]:
    """``deltas`` as chat chunks, then one with ``finish`` (``Reply.sse`` adds ``[DONE]``)."""
    chunks = [
        {"id": "chatcmpl-s", "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
        for delta in deltas
    ]
    end = {"index": 0, "delta": {}, "finish_reason": finish}
    return [*chunks, {"id": "chatcmpl-s", "choices": [end]}]


def empty_first_retry(request: Received) -> Reply:
    """Loops at temperature 0; the default ladder's first retry (temperature 1.0) stops at once
    with no content; its second (temperature 0.7) answers. A ladder of its own whose only rung
    is a presence penalty at temperature 0 gets the empty answer too."""
    body = request.json()
    temperature = body.get("temperature") or 0
    if temperature == 0.7:
        pieces = ["A calm answer,", " at last."]
    elif temperature == 1.0 or body.get("presence_penalty"):
        pieces = []
    else:
        pieces = ["Once upon a time"] + [" and then the model repeats itself."] * 40
    finish = "stop" if len(pieces) < 10 else "length"
    if not body.get("stream"):
        message = {"role": "assistant", "content": "".join(pieces)}
        choice = {"index": 0, "message": message, "finish_reason": finish}
        return Reply.json({"id": "chatcmpl-e", "choices": [choice]})
    deltas = [{"role": "assistant", "content": ""}] + [{"content": p} for p in pieces]
    return Reply.sse(stream_deltas(deltas, finish))


async def test_a_retry_that_answers_nothing_is_empty_and_the_ladder_goes_on(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    engine = mock_upstream
    engine.on(CHAT, empty_first_retry)
    client = await make_proxy(
        MOCK_URL, upstream=engine, env=RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    )
    resp = await client.post("/v1/chat/completions", json=chat())
    answer = await resp.json()
    # Both retries went on from the loop's onset and one unit (the empty one added nothing).
    prefix = engine.bodies(CHAT)[1]["messages"][-1]["content"]
    assert prefix.startswith("Once upon a time") and prefix.count("repeats itself") == 1
    assert engine.bodies(CHAT)[2]["messages"][-1]["content"] == prefix
    content = answer["choices"][0]["message"]["content"]
    assert content == prefix + "A calm answer, at last.", answer
    assert resp.headers["X-Detproxy-Attempts"] == "3"
    assert resp.headers["X-Detproxy-Recovered"] == "true"
    assert actions(registry, "retry", "empty") == 1, "the empty retry was not counted as empty"
    assert actions(registry, "retry", "recovered") == 1
    assert loops(registry, "content", "proxy") == 1  # the empty answer is no loop
    assert [b.get("temperature") for b in engine.bodies(CHAT)] == [0, 1.0, 0.7]


async def test_an_empty_answer_at_the_end_of_the_ladder_is_not_recovered(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    engine = mock_upstream
    engine.on(CHAT, empty_first_retry)
    ladder = '[{"models": "*", "attempts": [{"presence_penalty": 1.5}]}]'
    env = RETRY | {
        "DETPROXY_LOOPS__LADDERS": ladder,
        "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
    }
    client = await make_proxy(MOCK_URL, upstream=engine, env=env)
    resp = await client.post("/v1/chat/completions", json=chat())
    answer = await resp.json()
    assert resp.headers["X-Detproxy-Recovered"] == "false", "an empty answer counted as recovered"
    # The continuation added nothing: the kept prefix (the loop's onset and one unit) alone.
    prefix = engine.bodies(CHAT)[1]["messages"][-1]["content"]
    assert answer["choices"][0]["message"]["content"] == prefix
    assert answer["choices"][0]["finish_reason"] == "stop"  # as it came: it is no loop
    assert actions(registry, "retry", "empty") == 1
    assert actions(registry, "retry", "recovered") == 0


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    """The content a delta-reading client (the openai SDK) assembles."""
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices")
    )


async def test_a_streamed_retry_that_answers_nothing_is_empty_and_the_ladder_goes_on(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    engine = mock_upstream
    engine.on(CHAT, empty_first_retry)
    client = await make_proxy(
        MOCK_URL, upstream=engine, env=RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    )
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    raw = await resp.read()
    chunks = sse_chunks(raw)
    assert chunks[-1]["detproxy"] == {"recovered": True, "attempts": 3, "strategy": "continue"}, (
        "the empty retry ended the stream"
    )
    text = streamed_text(chunks)
    prefix = engine.bodies(CHAT)[1]["messages"][-1]["content"]
    # One answer: what the looping attempt showed, then the third attempt's continuation (the
    # empty attempt added nothing), no restart; both went on from the loop's onset and one
    # unit, as a non-streamed recovery does.
    assert prefix.startswith("Once upon a time") and prefix.count("repeats itself") == 1
    shown = text.removesuffix("A calm answer, at last.")
    assert shown != text and shown.startswith(prefix), text
    assert shown.removeprefix("Once upon a time").replace(UNIT, "") == "", text
    assert not sse_comments(raw), "the stream restarted"
    assert engine.bodies(CHAT)[2]["messages"][-1]["content"] == prefix
    assert last_choice(chunks)["finish_reason"] == "stop"
    assert actions(registry, "retry", "empty") == 1, "the empty retry was not counted as empty"
    assert actions(registry, "retry", "recovered") == 1
    assert loops(registry, "content", "proxy") == 1  # the empty answer is no loop


async def test_a_streamed_empty_answer_at_the_end_of_the_ladder_goes_out_as_it_came(
    mock_upstream: MockUpstream, make_proxy: Any, registry: CollectorRegistry
) -> None:
    engine = mock_upstream
    engine.on(CHAT, empty_first_retry)
    ladder = '[{"models": "*", "attempts": [{"presence_penalty": 1.5}]}]'
    env = RETRY | {
        "DETPROXY_LOOPS__LADDERS": ladder,
        "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
    }
    client = await make_proxy(MOCK_URL, upstream=engine, env=env)
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    chunks = sse_chunks(await resp.read())
    assert chunks[-1]["detproxy"]["recovered"] is False, "an empty answer counted as recovered"
    assert last_choice(chunks)["finish_reason"] == "stop"  # as it came: it is no loop
    # What the looping attempt showed; the continuation (of its onset and one unit) added none.
    prefix = engine.bodies(CHAT)[1]["messages"][-1]["content"]
    text = streamed_text(chunks)
    assert text.startswith(prefix) and text.count("repeats itself") > 1, text
    assert actions(registry, "retry", "empty") == 1
    assert actions(registry, "retry", "recovered") == 0


def loops_twice(request: Received) -> Reply:
    """Loops at temperature 0 and on the default ladder's first retry (temperature 1.0) too,
    after text of its own; the second retry (temperature 0.7) answers."""
    temperature = request.json().get("temperature") or 0
    if temperature == 0.7:
        pieces, finish = [" The end."], "stop"
    elif temperature == 1.0:
        pieces = [" Then a new part."] + [" and again it says the same thing."] * 40
        finish = "length"
    else:
        pieces = ["Once upon a time"] + [" and then the model repeats itself."] * 40
        finish = "length"
    return Reply.sse(stream_deltas([{"content": p} for p in pieces], finish))


async def test_a_continuation_that_loops_again_is_continued_from_its_own_onset(
    mock_upstream: MockUpstream, make_proxy: Any
) -> None:
    engine = mock_upstream
    engine.on(CHAT, loops_twice)
    client = await make_proxy(
        MOCK_URL, upstream=engine, env=RETRY | {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0"}
    )
    resp = await client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=2000))
    chunks = sse_chunks(await resp.read())
    assert chunks[-1]["detproxy"]["attempts"] == 3, chunks[-1]
    text = streamed_text(chunks)
    second = engine.bodies(CHAT)[1]["messages"][-1]["content"]
    third = engine.bodies(CHAT)[2]["messages"][-1]["content"]
    # The third attempt goes on from the whole answer the model wrote, each loop cut at its
    # onset and one unit: the first attempt's prefix, then the second's own.
    assert second.startswith("Once upon a time") and second.count("repeats itself") == 1
    assert third.startswith(second + " Then a new part."), third
    assert third.count("again it says") == 1, third
    # The client holds the repeats each attempt showed, then the last continuation.
    first, _, rest = text.partition(" Then a new part.")
    assert first.startswith(second), text
    assert first.removeprefix("Once upon a time").replace(UNIT, "") == "", text
    assert rest.endswith(" The end."), text
    # the second loop's repeats, then the kept text's part of a unit, as the third attempt went
    # on from it (a unit caught mid-way is completed in that phase)
    kept = third.partition(" Then a new part.")[2]
    shown = rest.removesuffix(" The end.")
    again = " and again it says the same thing."
    assert shown.endswith(kept) and shown[: -len(kept)] == again * (len(shown) // len(again)), text
