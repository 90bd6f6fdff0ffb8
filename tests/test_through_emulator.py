"""detproxy in front of the vLLM emulator: the openai SDK, vLLM's shapes, faults and aborts."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.emulator import knobs
from tests.helpers.metrics import metric, metric_total
from tests.helpers.served import own_tasks
from tests.helpers.sse import sse_blocks
from tests.helpers.waiting import eventually

MESSAGES = [{"role": "user", "content": "Explain determinism in one paragraph."}]
# A model that loops at temperature 0, and whose loop a retry always ends.
LOOPS_ONCE = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)


@pytest.fixture
async def emulator() -> AsyncIterator[EmulatorServer]:
    async with EmulatorServer(EmulatorConfig(reasoning_tokens=4, reasoning_style="both")) as srv:
        yield srv


@pytest.fixture
async def sdk_pair(make_proxy: Any, emulator: EmulatorServer) -> AsyncIterator[tuple[Any, Any]]:
    proxy = await make_proxy(emulator.url)
    base = str(proxy.make_url("/v1"))
    direct = openai.AsyncOpenAI(base_url=emulator.url + "/v1", api_key="x", max_retries=0)
    proxied = openai.AsyncOpenAI(base_url=base, api_key="x", max_retries=0)
    yield direct, proxied
    await direct.close()
    await proxied.close()


async def test_sdk_sees_the_same_answers(sdk_pair: tuple[Any, Any]) -> None:
    direct, proxied = sdk_pair
    kwargs: dict[str, Any] = dict(
        model="emulator-model",
        messages=MESSAGES,
        temperature=0,
        max_tokens=20,
        logprobs=True,
        top_logprobs=5,
    )
    a = await direct.chat.completions.create(**kwargs)
    b = await proxied.chat.completions.create(**kwargs)
    assert a.model_dump(exclude={"id", "created"}) == b.model_dump(exclude={"id", "created"})

    async def chunks(client: Any) -> list[Any]:
        stream = await client.chat.completions.create(
            stream=True, stream_options={"include_usage": True}, **kwargs
        )
        return [c.model_dump(exclude={"id", "created"}) async for c in stream]

    sa, sb = await chunks(direct), await chunks(proxied)
    assert sa == sb
    assert any(
        (c["choices"] or [{}])[0].get("delta", {}).get("reasoning_content") for c in sb
    )  # vLLM 0.11-0.15 style reasoning reached the client


async def test_request_id_reaches_the_engine(make_proxy: Any, emulator: EmulatorServer) -> None:
    proxy = await make_proxy(emulator.url)
    resp = await proxy.post(
        "/v1/chat/completions",
        headers={"X-Request-Id": "trace-42"},
        json={"model": "emulator-model", "messages": MESSAGES},
    )
    assert (await resp.json())["id"] == "chatcmpl-trace-42"


async def test_a_client_that_closes_on_done_had_the_whole_answer(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # The sync openai SDK closes the connection as soon as it reads [DONE]. The engine's last
    # chunk frame comes a second later, so detproxy is still waiting for it when the client
    # leaves: the stream is nonetheless answered, audited and timed, not a disconnect.
    proxy = await make_proxy(
        emulator.url,
        env={
            "DETPROXY_AUDIT__SAMPLE_RATE": "1",
            "DETPROXY_AUDIT__MAX_SHADOWS_PER_S": "1000",
            "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
        },
    )

    def stream() -> list[Any]:
        sdk = openai.OpenAI(base_url=str(proxy.make_url("/v1")), api_key="x", max_retries=0)
        with sdk:
            parts = sdk.chat.completions.create(
                model="emulator-model",
                messages=MESSAGES,
                temperature=0,
                max_tokens=12,
                stream=True,
                extra_headers=knobs(end_delay_s=1.0),
            )
            return list(parts)

    parts = await asyncio.to_thread(stream)
    assert parts[-1].choices[0].finish_reason == "length"
    await eventually(  # the shadow replays the stream (its own end delayed too)
        lambda: metric_total(registry, "detproxy_audits_total"), what="an audit counted"
    )
    assert (
        metric(
            registry,
            "detproxy_audits_total",
            model="emulator-model",
            mode="full",
            verdict="identical",
        )
        == 1
    )
    assert metric_total(registry, "detproxy_client_disconnects_total") == 0
    assert (
        metric(registry, "detproxy_responses_total", endpoint="chat", code="200", outcome="ok") == 1
    )
    assert metric_total(registry, "detproxy_time_to_first_token_seconds_count") == 1
    assert metric_total(registry, "detproxy_inflight_requests") == 0


async def test_stream_abort_reaches_the_engine(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    proxy = await make_proxy(emulator.url)
    resp = await proxy.post(
        "/v1/chat/completions",
        headers=knobs(token_latency_s=0.05),
        json={
            "model": "emulator-model",
            "messages": MESSAGES,
            "stream": True,
            "max_tokens": 500,
            "temperature": 0,
        },
    )
    await resp.content.readuntil(b"\n\n")
    assert emulator.stats()["running"] == 1
    resp.close()
    await eventually(lambda: emulator.stats()["aborted"], what="the engine request aborted")
    assert emulator.stats()["aborted"] == 1 and emulator.stats()["running"] == 0


async def test_engine_faults(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    proxy = await make_proxy(emulator.url)
    body = {"model": "emulator-model", "messages": MESSAGES, "stream": True, "max_tokens": 12}

    resp = await proxy.post(
        "/v1/chat/completions",
        json=body,
        headers=knobs(fault="reset_mid_stream", fault_after_tokens=3),
    )
    events = sse_blocks(await resp.read())
    assert orjson.loads(events[-2][6:])["error"]["code"] == 502
    assert events[-1] == b"data: [DONE]"

    resp = await proxy.post("/v1/chat/completions", json=body, headers=knobs(fault="http_503"))
    assert resp.status == 503 and (await resp.json())["error"]["code"] == 503

    resp = await proxy.post("/v1/chat/completions", json=body, headers=knobs(fault="inband_error"))
    events = sse_blocks(await resp.read())
    assert b'"error"' in events[-2] and events[-1] == b"data: [DONE]"

    for fault, reason in (("malformed_sse", "malformed_sse"), ("malformed_json", "malformed_json")):
        resp = await proxy.post("/v1/chat/completions", json=body, headers=knobs(fault=fault))
        assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        assert (
            metric(registry, "detproxy_inspection_stopped_total", endpoint="chat", reason=reason)
            == 1
        )
    assert emulator.stats()["running"] == 0


async def test_answered_requests_leave_no_reference_cycle_of_detproxy_objects(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    """Each exchange's objects are freed by reference counting when it ends: the cyclic
    collector has none of detproxy's to walk, so requests do not bring on its pauses (issue 16).
    Streamed and not, with loop inspection and passive checks on, and a retried loop."""
    proxy = await make_proxy(emulator.url, env={"DETPROXY_LOOPS__POLICY": "retry"})
    body = {"model": "emulator-model", "messages": MESSAGES, "temperature": 0, "max_tokens": 16}
    idle = own_tasks()  # the app's own, before any request
    for stream in (False, True):  # warm-up: what the first requests create and keep
        resp = await proxy.post("/v1/chat/completions", json={**body, "stream": stream})
        await resp.read()
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        for i in range(3):
            for stream in (False, True):
                prompt = [{"role": "user", "content": f"request {i}"}]
                resp = await proxy.post(
                    "/v1/chat/completions", json={**body, "messages": prompt, "stream": stream}
                )
                assert resp.status == 200 and await resp.read()
            # And a looping answer, retried: the recovery's objects too.
            resp = await proxy.post(
                "/v1/chat/completions",
                json={**body, "max_tokens": 400, "stream": i % 2 == 1},
                headers=LOOPS_ONCE,
            )
            assert resp.status == 200 and await resp.read()
        # The handlers' last steps run after their answers: until no task is left of them.
        await eventually(lambda: own_tasks() <= idle, what=f"no more tasks than {idle}")
        gc.collect()
        ours = sorted({type(o).__qualname__ for o in gc.garbage if _is_detproxy(o)})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
    assert ours == []
    recovered = [
        s.value
        for family in registry.collect()
        for s in family.samples
        if s.name == "detproxy_recoveries_total" and s.labels["outcome"] == "recovered"
    ]
    assert sum(recovered) == 3  # the three loops were retried, streamed and not


def _is_detproxy(obj: object) -> bool:
    return type(obj).__module__.split(".")[0] in ("proxy", "policies")
