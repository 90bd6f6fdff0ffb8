"""The audit end to end against the emulator: every injected divergence is found, exactly."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import knobs
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks
from tests.helpers.waiting import settle

MODEL = "emulator-model"
FAST = {"DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000"}


def audits(registry: CollectorRegistry, mode: str, verdict: str) -> float:
    return metric(registry, "detproxy_audits_total", model=MODEL, mode=mode, verdict=verdict)


def chat(prompt: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}],
        **extra,
    }


async def read_answer(resp: Any) -> Any:
    if resp.headers["Content-Type"].startswith("text/event-stream"):
        return sse_chunks(await resp.read())
    return await resp.json()


async def test_every_injected_divergence_is_found_with_its_position(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        emulator.url,
        env={"DETPROXY_AUDIT__SAMPLE_RATE": "1", **FAST, "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"},
    )
    cases = []  # (request id, expected verdict, expected position)
    for i in range(24):
        rid = f"req-{i}"
        kind = ("clean", "flip", "jitter")[i % 3]
        headers = {"X-Request-Id": rid}
        position = None
        if kind == "flip":
            position = i % 7
            headers |= knobs(flip_probability=1.0, flip_position=position)
        elif kind == "jitter":
            headers |= knobs(logprob_jitter_probability=1.0)
        stream = i % 2 == 0
        path, body = ("/v1/chat/completions", chat(f"prompt {i}", stream=stream))
        if i % 4 == 1:
            path = "/v1/completions"
            body = {
                "model": MODEL,
                "temperature": 0,
                "max_tokens": 16,
                "prompt": f"prompt {i}",
                "stream": stream,
            }
        resp = await client.post(path, json=body, headers=headers)
        assert resp.status == 200
        answer = await read_answer(resp)
        chunks = answer if stream else [answer]
        assert all(c["choices"][0].get("logprobs") is None for c in chunks if c["choices"])
        expected = {"clean": "identical", "flip": "text_divergence", "jitter": "logprob_drift"}
        cases.append((rid, expected[kind], position))
    await settle(client)

    injected = {r["request_id"]: r for r in emulator.injections()}
    incidents = {
        i["request_id"]: i
        for i in await (await client.get("/detproxy/incidents?limit=1000")).json()
    }
    for rid, verdict, position in cases:
        if verdict == "identical":
            assert rid not in incidents
            continue
        incident = incidents[rid]
        assert incident["verdict"] == verdict, (rid, incident)
        assert incident["mode"] == "full"
        assert incident["divergence"]["index"] == injected[rid]["position"]
        if position is not None:
            assert incident["divergence"]["index"] == position
            assert incident["divergence"]["primary_token"] != incident["divergence"]["shadow_token"]
        else:
            # Drift at GPU magnitudes (tenths of a nat up to a few), from the injected position on.
            assert 0.05 < incident["max_abs_logprob_delta"] < 3.5, incident
    counts = {
        v: audits(registry, "full", v)
        for v in ("identical", "text_divergence", "logprob_drift", "incomparable")
    }
    assert counts == {"identical": 8, "text_divergence": 8, "logprob_drift": 8, "incomparable": 0}
    assert len(incidents) == 16
    assert (
        metric(registry, "detproxy_divergence_position_tokens_count", model=MODEL, mode="full") == 8
    )


async def test_client_sees_the_same_answer_with_auditing_on_and_off(
    make_proxy: Any, emulator: EmulatorServer
) -> None:
    audited = await make_proxy(emulator.url, env={"DETPROXY_AUDIT__SAMPLE_RATE": "1"})
    plain = await make_proxy(
        emulator.url,
        env={"DETPROXY_AUDIT__SAMPLE_RATE": "0", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"},
    )
    bodies = [
        chat("same content", stream=False),
        chat("same content", stream=True, stream_options={"include_usage": True}),
        chat("client asked", logprobs=True, top_logprobs=2),
        {"model": MODEL, "prompt": "complete me", "temperature": 0, "max_tokens": 8},
        {
            "model": MODEL,
            "prompt": "complete me",
            "temperature": 0,
            "max_tokens": 8,
            "stream": True,
        },
    ]
    for body in bodies:
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        answers = []
        for client in (audited, plain):
            resp = await client.post(path, json=body, headers={"X-Request-Id": "fixed"})
            answer = await read_answer(resp)
            for item in answer if isinstance(answer, list) else [answer]:
                item.pop("created", None)
            answers.append(answer)
        assert answers[0] == answers[1], body
    await settle(audited)
    status = await (await audited.get("/detproxy/status")).json()
    # Five shadows, and two passive twins (the same request streamed and not).
    assert status["audit"]["modes"] == {"full": 5, "duplicate": 2}
    assert status["audit"]["verdicts"] == {"identical": 7}


async def test_with_loops_off_non_streamed_answers_are_still_audited(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    env = {"DETPROXY_AUDIT__SAMPLE_RATE": "1", "DETPROXY_LOOPS__ENABLED": "false"}
    client = await make_proxy(emulator.url, env=env)
    for _ in range(2):  # the second one is also a passive duplicate of the first
        resp = await client.post("/v1/chat/completions", json=chat("audit me", stream=False))
        assert resp.status == 200
        assert (await resp.json())["choices"][0]["logprobs"] is None  # injected, stripped
    await settle(client)
    assert audits(registry, "full", "identical") == 2
    assert audits(registry, "duplicate", "identical") == 1


async def test_prefill_mode_compares_the_first_token_only(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(
        emulator.url,
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "1",
            **FAST,
            "DETPROXY_AUDIT__SHADOW_MODE": "prefill",
            "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
        },
    )
    for position in (0, 0, 3, 5):
        await client.post(
            "/v1/chat/completions",
            json=chat(f"p{position}"),
            headers=knobs(flip_probability=1.0, flip_position=position),
        )
    await client.post("/v1/chat/completions", json=chat("clean"))
    await settle(client)
    assert audits(registry, "prefill", "text_divergence") == 2
    assert audits(registry, "prefill", "identical") == 3


async def test_passive_checks_n_choices_and_duplicates(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    client = await make_proxy(emulator.url)  # sample rate 0: passive checks only
    resp = await client.post(
        "/v1/chat/completions",
        json=chat("twins", n=3),
        headers={"X-Request-Id": "n3"} | knobs(flip_probability=0.5, flip_position=2),
    )
    assert resp.status == 200
    flips = {
        r["choice"]
        for r in emulator.injections()
        if r["request_id"] == "n3" and r["kind"] == "flip"
    }
    expected_diverging = sum(1 for c in (1, 2) if (c in flips) != (0 in flips))
    assert audits(registry, "n_choices", "text_divergence") == expected_diverging
    assert audits(registry, "n_choices", "identical") == 2 - expected_diverging

    body = chat("asked twice", logprobs=True, top_logprobs=3)
    await client.post("/v1/chat/completions", json=body)
    await client.post("/v1/chat/completions", json=body)  # identical twin
    await client.post(
        "/v1/chat/completions", json=body, headers=knobs(logprob_jitter_probability=1.0)
    )
    streamed = await client.post(
        "/v1/chat/completions",
        json=body | {"stream": True},
        headers=knobs(flip_probability=1.0, flip_position=1),
    )
    await streamed.read()  # compared when the stream ends, not when its headers come
    counts = [
        audits(registry, "duplicate", v) for v in ("identical", "logprob_drift", "text_divergence")
    ]
    assert counts == [1, 1, 1]
    # Non-deterministic requests are never compared.
    await client.post("/v1/chat/completions", json=body | {"temperature": 0.9})
    await client.post("/v1/chat/completions", json=body | {"temperature": 0.9})
    assert (
        sum(
            audits(registry, "duplicate", v)
            for v in ("identical", "logprob_drift", "text_divergence")
        )
        == 3
    )
