"""Injected nondeterminism and loops: each record matches what changed in the output."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import orjson
import pytest

from tests.helpers.emulator import EmulatorClient, chat
from tests.helpers.sse import chunks, stream_text

from .conftest import MakeClient

UNIT = " and then the model repeats itself."


def tokens_of(body: dict[str, Any]) -> list[dict[str, Any]]:
    return list(body["choices"][0]["logprobs"]["content"])


async def test_flip_takes_rank_two(make_client: MakeClient) -> None:
    base_client, _ = await make_client()
    client, server = await make_client(flip_probability=1.0, flip_position=3)
    req = chat(logprobs=True, top_logprobs=2, max_tokens=30)
    base = tokens_of((await base_client.chat(req)).json())
    flipped_reply = await client.chat(req, headers={"X-Request-Id": "flip-1"})
    flipped = tokens_of(flipped_reply.json())
    assert [t["token"] for t in flipped[:3]] == [t["token"] for t in base[:3]]
    assert flipped[:3] == base[:3]
    assert flipped[3]["token"] != base[3]["token"]
    assert flipped[3]["token"] == base[3]["top_logprobs"][1]["token"]
    # The distribution at the flip position is unchanged: the sampled token is listed first.
    assert flipped[3]["logprob"] == base[3]["top_logprobs"][1]["logprob"]
    (rec,) = server.injections()
    assert rec["kind"] == "flip" and rec["request_id"] == "flip-1"
    assert rec["choice"] == 0 and rec["position"] == 3 and rec["inflight"] == 1
    assert rec["detail"]["from_token"] == base[3]["token"]
    assert rec["detail"]["to_token"] == flipped[3]["token"]
    # Non-greedy requests are never flipped.
    await client.chat(chat(temperature=0.7, max_tokens=10))
    assert len(server.injections()) == 1


async def test_flip_probability_uses_seeded_rng(make_client: MakeClient) -> None:
    async def pattern() -> list[int]:
        client, server = await make_client(flip_probability=0.5, seed=7)
        for _ in range(16):
            await client.chat(chat(max_tokens=5))
        fired = {r["request_id"] for r in server.injections()}
        return [len(fired)]

    first, second = await pattern(), await pattern()
    assert first == second
    assert 0 < first[0] < 16


async def test_logprob_drift_over_many_positions(make_client: MakeClient) -> None:
    base_client, _ = await make_client()
    client, server = await make_client(logprob_jitter_probability=1.0)
    req = chat(logprobs=True, top_logprobs=5)
    base = tokens_of((await base_client.chat(req)).json())
    jit = tokens_of((await client.chat(req)).json())
    assert [t["token"] for t in jit] == [t["token"] for t in base]  # the text stays
    changed = [i for i, (a, b) in enumerate(zip(base, jit, strict=True)) if a != b]
    (rec,) = server.injections()
    assert rec["kind"] == "logprob_jitter"
    start = rec["position"]
    assert 0 <= start < 10 and rec["detail"]["from_position"] == start
    # Every position from the start on drifts; none before it.
    assert changed == list(range(start, len(base)))
    chosen = [abs(base[i]["logprob"] - jit[i]["logprob"]) for i in changed]
    tops = [
        abs(a["logprob"] - b["logprob"])
        for i in changed
        for a, b in zip(base[i]["top_logprobs"], jit[i]["top_logprobs"], strict=True)
        if a["token"] == b["token"]
    ]
    # GPU magnitudes (gpu-llama-server.md): the chosen token by tenths of a nat, the top-k by
    # up to a few nats; far from a rounding nudge.
    assert 0.15 < max(chosen) < 1.5
    assert 1.0 < max(tops) < 3.5
    assert sum(1 for d in chosen if d > 1e-6) >= len(chosen) // 2
    for i in changed:
        entry = jit[i]
        lps = [t["logprob"] for t in entry["top_logprobs"]]
        assert lps == sorted(lps, reverse=True)  # still a distribution, best first
        assert entry["top_logprobs"][0]["token"] == entry["token"]  # greedy: still the argmax
        assert sum(math.exp(lp) for lp in lps) <= 1.0 + 1e-9


async def _concurrent_divergence(
    make_client: MakeClient, slope: float, concurrency: int, rounds: int
) -> tuple[int, int, list[dict[str, Any]]]:
    """(diverged, total, records) for ``rounds`` bursts of ``concurrency`` identical requests."""
    client, server = await make_client(batch_divergence_slope=slope, token_latency_s=0.002, seed=3)
    req = chat(max_tokens=25)
    alone = (await client.chat(req)).json()["choices"][0]["message"]["content"]
    assert server.injections() == []  # one in flight: never
    diverged = 0
    for r in range(rounds):
        replies = await asyncio.gather(
            *(client.chat(req, headers={"X-Request-Id": f"b{r}-{i}"}) for i in range(concurrency))
        )
        recs = {x["request_id"] for x in server.injections() if x["kind"] == "batch_divergence"}
        for i, reply in enumerate(replies):
            text = reply.json()["choices"][0]["message"]["content"]
            assert (text != alone) == (f"b{r}-{i}" in recs)
        diverged += sum(1 for i in range(concurrency) if f"b{r}-{i}" in recs)
    return diverged, rounds * concurrency, server.injections()


async def test_batch_divergence_grows_with_concurrency(make_client: MakeClient) -> None:
    low, n_low, _ = await _concurrent_divergence(make_client, 0.05, 2, 20)
    high, n_high, recs = await _concurrent_divergence(make_client, 0.05, 12, 4)
    # p = min(1, 0.05 * (N - 1)): 5 % with 2 in flight, 55 % with 12.
    assert low / n_low < 0.25
    assert 0.25 < high / n_high < 0.85
    drifts = {r["request_id"]: r for r in recs if r["kind"] == "batch_drift"}
    flips = {r["request_id"]: r for r in recs if r["kind"] == "batch_divergence"}
    assert set(flips) <= set(drifts) and {r["kind"] for r in recs} == {
        "batch_drift",
        "batch_divergence",
    }
    for rid, rec in drifts.items():
        assert rec["inflight"] > 1
        assert rec["detail"]["probability"] == pytest.approx(0.05 * (rec["inflight"] - 1))
        if rid in flips:
            assert rec["position"] <= flips[rid]["position"] < max(10, rec["position"] + 1)


async def test_batch_effect_drifts_then_flips(make_client: MakeClient) -> None:
    client, server = await make_client(batch_divergence_slope=1.0, token_latency_s=0.002)
    base_client, _ = await make_client()
    req = chat(max_tokens=25, logprobs=True, top_logprobs=3)
    base = tokens_of((await base_client.chat(req)).json())
    ids = [f"c{i}" for i in range(3)]
    replies = await asyncio.gather(*(client.chat(req, headers={"X-Request-Id": i}) for i in ids))
    recs = server.injections()
    for rid, reply in zip(ids, replies, strict=True):
        got = tokens_of(reply.json())
        (drift,) = [r for r in recs if r["request_id"] == rid and r["kind"] == "batch_drift"]
        (flip,) = [r for r in recs if r["request_id"] == rid and r["kind"] == "batch_divergence"]
        start, at = drift["position"], flip["position"]
        assert start <= at < 10
        assert [t["token"] for t in got[:at]] == [t["token"] for t in base[:at]]
        assert got[:start] == base[:start]  # bit-identical before the batch hit
        assert all(got[i]["logprob"] != base[i]["logprob"] for i in range(start, at))
        # The divergent token was rank 2 and is the argmax of the drifted distribution.
        assert (
            got[at]["token"] == base[at]["top_logprobs"][1]["token"] == flip["detail"]["to_token"]
        )
        assert got[at]["top_logprobs"][0]["token"] == got[at]["token"]


async def test_loop_at_temperature_zero(make_client: MakeClient) -> None:
    client, server = await make_client(loop_channel="content", loop_after_tokens=5)
    body = (await client.chat(chat(max_tokens=60), headers={"X-Request-Id": "L"})).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"].count(UNIT) >= 5
    assert body["usage"]["completion_tokens"] == 60
    (rec,) = server.injections()
    assert rec["kind"] == "loop" and rec["position"] == 5 and rec["request_id"] == "L"
    assert rec["detail"] == {"channel": "content", "unit": UNIT, "after_tokens": 5}


def _looped(body: dict[str, Any]) -> bool:
    return UNIT in (body["choices"][0]["message"]["content"] or "")


async def test_loop_escape_is_a_chance_per_attempt(make_client: MakeClient) -> None:
    async def outcomes(seed: int, extra: dict[str, Any]) -> list[bool]:
        client, server = await make_client(loop_channel="content", seed=seed)
        looped = []
        for i in range(40):
            messages = [{"role": "user", "content": f"prompt number {i}"}]
            body = (await client.chat(chat(messages=messages, max_tokens=80, **extra))).json()
            looped.append(_looped(body))
        kinds = [r["kind"] for r in server.injections()]
        # The records say what happened: a loop record per looping answer, an escape otherwise.
        assert kinds.count("loop") == sum(looped)
        assert kinds.count("loop_escape") == 40 - sum(looped)
        return looped

    penalty = await outcomes(1, {"presence_penalty": 1.5})
    # Default escape probability 0.7: most attempts escape, some keep looping.
    assert 0.45 <= 1 - sum(penalty) / 40 <= 0.9
    assert await outcomes(1, {"presence_penalty": 1.5}) == penalty  # seeded: reproducible
    assert await outcomes(2, {"presence_penalty": 1.5}) != penalty  # the emulator seed counts
    sampled = await outcomes(1, {"temperature": 0.7, "seed": 11})
    assert 0.45 <= 1 - sum(sampled) / 40 <= 0.9
    # Greedy without a penalty always loops.
    assert all(await outcomes(1, {}))


async def test_loop_escape_probability_bounds(make_client: MakeClient) -> None:
    client, _ = await make_client(loop_channel="content", loop_escape_probability=1.0)
    for extra in ({"temperature": 0.7}, {"presence_penalty": 1.5}, {"repetition_penalty": 1.2}):
        body = (await client.chat(chat(max_tokens=200, **extra))).json()
        assert not _looped(body)
        assert body["choices"][0]["finish_reason"] == "stop"
    assert _looped((await client.chat(chat(max_tokens=80))).json())
    stuck, _ = await make_client(loop_channel="content", loop_escape_probability=0.0)
    for extra in ({"temperature": 0.7}, {"presence_penalty": 1.5}):
        body = (await stuck.chat(chat(max_tokens=80, **extra))).json()
        # A penalty that does not help: the loop holds however often the unit repeats.
        assert body["choices"][0]["message"]["content"].count(UNIT) >= 5
        assert body["choices"][0]["finish_reason"] == "length"


async def test_sampled_retries_draw_anew(make_client: MakeClient) -> None:
    """The same unseeded sampled request is a new draw each time (deterministic per emulator);
    a seeded or greedy-with-penalty one is the same every time, as on a real engine."""
    client, _ = await make_client(loop_channel="content", loop_escape_probability=0.5)

    async def tries(extra: dict[str, Any]) -> list[bool]:
        return [
            _looped((await client.chat(chat(max_tokens=60, **extra))).json()) for _ in range(16)
        ]

    unseeded = await tries({"temperature": 0.8})
    assert 0 < sum(unseeded) < 16
    assert len(set(await tries({"temperature": 0.8, "seed": 4}))) == 1
    assert len(set(await tries({"presence_penalty": 1.5}))) == 1
    again, _ = await make_client(loop_channel="content", loop_escape_probability=0.5)
    replay = [
        _looped((await again.chat(chat(max_tokens=60, temperature=0.8))).json()) for _ in range(16)
    ]
    assert replay == unseeded


async def test_reasoning_loop_is_a_runaway(make_client: MakeClient) -> None:
    client, server = await make_client(loop_channel="reasoning", loop_after_tokens=3)
    body = (await client.chat(chat(max_tokens=80))).json()
    msg = body["choices"][0]["message"]
    assert msg["content"] is None
    assert msg["reasoning"].count(UNIT) >= 8
    assert body["choices"][0]["finish_reason"] == "length"
    events = (await client.chat(chat(max_tokens=80, stream=True))).events()
    assert stream_text(events) == ""
    assert stream_text(events, "reasoning") == msg["reasoning"]
    assert [r["kind"] for r in server.injections()] == ["loop", "loop"]
    assert server.injections()[0]["detail"]["channel"] == "reasoning"
    escaped = (await client.chat(chat(chat_template_kwargs={"enable_thinking": False}))).json()
    assert escaped["choices"][0]["message"]["content"]


async def test_engine_repetition_detection(make_client: MakeClient) -> None:
    client, server = await make_client(
        loop_channel="content", loop_after_tokens=4, engine_repetition_detection=True
    )
    detect = {"min_pattern_size": 1, "max_pattern_size": 16, "min_count": 3}
    body = (await client.chat(chat(max_tokens=500, repetition_detection=detect))).json()
    choice = body["choices"][0]
    assert choice["finish_reason"] == "repetition"
    assert choice["stop_reason"] == "repetition_detected"
    assert choice["message"]["content"].endswith(UNIT * 3)
    assert [r["kind"] for r in server.injections()] == ["loop", "engine_repetition"]
    events = chunks(
        (await client.chat(chat(max_tokens=500, repetition_detection=detect, stream=True))).events()
    )
    assert events[-1]["choices"][0]["finish_reason"] == "repetition"
    assert events[-1]["choices"][0]["stop_reason"] == "repetition_detected"
    plain = (await client.chat(chat(max_tokens=100))).json()
    assert plain["choices"][0]["finish_reason"] == "length"


async def test_injection_endpoints_and_reset(make_client: MakeClient) -> None:
    client, server = await make_client(flip_probability=1.0)
    await client.chat(chat(max_tokens=5), headers={"X-Request-Id": "r1"})
    over_http = (await client.get("/emulator/injections")).json()
    assert over_http == server.injections()
    assert over_http[0]["request_id"] == "r1"
    assert set(over_http[0]) == {"request_id", "kind", "choice", "position", "detail", "inflight"}
    stats = (await client.get("/emulator/stats")).json()
    assert stats["requests"] == 1 and stats["completed"] == 1 and stats["running"] == 0
    assert (await client.post("/emulator/reset", {})).status == 200
    assert server.injections() == []
    assert server.stats()["requests"] == 0


async def test_knobs_header_per_request(client: EmulatorClient) -> None:
    knobs = {"flip_probability": 1.0, "flip_position": 0}
    hdr = {"X-Emulator-Knobs": orjson.dumps(knobs).decode()}
    base = (await client.chat(chat(max_tokens=5))).json()["choices"][0]["message"]["content"]
    flipped = (await client.chat(chat(max_tokens=5), headers=hdr)).json()
    assert flipped["choices"][0]["message"]["content"] != base
    again = (await client.chat(chat(max_tokens=5))).json()["choices"][0]["message"]["content"]
    assert again == base
    for bad in ("{not json", "[1]", '{"flip_probability": 2}', '{"no_such_knob": 1}'):
        reply = await client.chat(chat(), headers={"X-Emulator-Knobs": bad})
        assert reply.status == 400
        assert reply.json()["error"]["type"] == "BadRequestError"
