"""Injected nondeterminism and loops: each record matches what changed in the output."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

from ._helpers import Client, chat, chunks, stream_text
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


async def test_logprob_jitter_only_last_bits(make_client: MakeClient) -> None:
    base_client, _ = await make_client()
    client, server = await make_client(logprob_jitter_probability=1.0)
    req = chat(logprobs=True, top_logprobs=5)
    base = tokens_of((await base_client.chat(req)).json())
    jit = tokens_of((await client.chat(req)).json())
    assert [t["token"] for t in jit] == [t["token"] for t in base]
    changed = [i for i, (a, b) in enumerate(zip(base, jit, strict=True)) if a != b]
    (rec,) = server.injections()
    assert rec["kind"] == "logprob_jitter"
    assert changed == [rec["position"]]
    a, b = base[rec["position"]], jit[rec["position"]]
    assert [t["token"] for t in a["top_logprobs"]] == [t["token"] for t in b["top_logprobs"]]
    assert a["logprob"] != b["logprob"]
    assert abs(a["logprob"] - b["logprob"]) < 1e-12


async def test_batch_divergence_under_concurrency(make_client: MakeClient) -> None:
    client, server = await make_client(batch_divergence_threshold=1, token_latency_s=0.005)
    req = chat(max_tokens=25)
    alone = (await client.chat(req)).json()["choices"][0]["message"]["content"]
    assert server.injections() == []
    replies = await asyncio.gather(
        *(client.chat(req, headers={"X-Request-Id": f"b{i}"}) for i in range(3))
    )
    texts = [r.json()["choices"][0]["message"]["content"] for r in replies]
    recs = [r for r in server.injections() if r["kind"] == "batch_divergence"]
    assert recs, "no divergence recorded"
    diverged = {r["request_id"] for r in recs}
    for i, text in enumerate(texts):
        assert (text != alone) == (f"b{i}" in diverged)
    for rec in recs:
        assert rec["inflight"] > 1
        assert rec["detail"]["threshold"] == 1


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


async def test_loop_escaped_by_sampling_or_presence_penalty(make_client: MakeClient) -> None:
    client, server = await make_client(loop_channel="content")
    for extra in ({"temperature": 0.7}, {"presence_penalty": 1.5}):
        body = (await client.chat(chat(max_tokens=200, **extra))).json()
        assert UNIT not in body["choices"][0]["message"]["content"]
        assert body["choices"][0]["finish_reason"] == "stop"
    assert server.injections() == []


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


async def test_knobs_header_per_request(client: Client) -> None:
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
