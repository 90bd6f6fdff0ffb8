"""Load: hundreds of concurrent streams, every greedy request audited, a loop storm being
recovered. Bounded in count and time. No client-visible error from detproxy, the shadow queue
stays within its bound, the retry budget holds, and nothing leaks."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
from prometheus_client import CollectorRegistry

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.served import own_tasks
from tests.helpers.waiting import Unmet, eventually, settle

STREAMS = 300


LOOP_SHARE = 3  # every third request makes the model loop
MAX_TOKENS = 120


async def test_hundreds_of_streams_audited_with_a_loop_storm(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.001)) as emu:
        client = await make_proxy(
            emu.url,
            env={
                "DETPROXY_AUDIT__SAMPLE_RATE": "1",
                "DETPROXY_AUDIT__QUEUE_SIZE": "64",
                "DETPROXY_AUDIT__MAX_CONCURRENT_SHADOWS": "4",
                "DETPROXY_LOOPS__POLICY": "retry",
                # A budget that binds: no share, a floor of ten retries' reservations.
                "DETPROXY_LOOPS__RECOVERY_TOKEN_SHARE": "0",
                "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": str(10 * MAX_TOKENS),
                "DETPROXY_UPSTREAM__MAX_CONNECTIONS": "512",
            },
        )
        await client.get("/detproxy/health")
        tasks_before = own_tasks()
        peak_queue = 0
        done = asyncio.Event()

        async def watch_queue() -> None:
            nonlocal peak_queue
            while not done.is_set():
                status = await (await client.get("/detproxy/status")).json()
                peak_queue = max(peak_queue, status["shadow"]["queued"])
                await asyncio.sleep(0.05)

        async def one(i: int) -> tuple[int, bytes]:
            headers = {}
            if i % LOOP_SHARE == 0:
                headers["X-Emulator-Knobs"] = orjson.dumps(
                    {"loop_channel": "content", "loop_after_tokens": 4}
                ).decode()
            body = {
                "model": "emulator-model",
                "temperature": 0,
                "max_tokens": MAX_TOKENS,
                "stream": True,
                "messages": [{"role": "user", "content": f"load {i % 17}"}],
            }
            resp = await client.post(
                "/v1/chat/completions",
                json=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=60),
            )
            return resp.status, await resp.read()

        watcher = asyncio.create_task(watch_queue())
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(STREAMS))), 90)
        done.set()
        await watcher
        await settle(client, timeout_s=30)  # let the shadows drain

        def left_behind() -> bool | Unmet:  # the handlers' last steps run after their answers
            now = own_tasks()
            return now <= tasks_before or Unmet(now)

        # No task left behind.
        await eventually(left_behind, what=f"no more tasks than {tasks_before}")
        stats = emu.stats()
        records = [r for r in emu.injections() if not r["request_id"].endswith("-shadow")]

    assert all(status == 200 for status, _ in results)
    assert all(raw.endswith(b"data: [DONE]\n\n") for _, raw in results)  # every stream ended
    assert not any(b'"error"' in raw for _, raw in results)
    assert peak_queue <= 64  # the bound held
    loops = STREAMS // LOOP_SHARE

    def acted(action: str, outcome: str) -> float:
        return metric(
            registry,
            "detproxy_policy_actions_total",
            model="emulator-model",
            action=action,
            outcome=outcome,
        )

    recovered = acted("retry", "recovered")
    retried = recovered + acted("retry", "looped_again")
    # The budget holds under the storm: the first ten reservations fit, and what the retries
    # generated (their reservations settled) never went past the floor.
    assert retried >= 10
    spent = metric(
        registry, "detproxy_recovery_budget_tokens", model="emulator-model", kind="spent"
    )
    assert 0 < spent <= 10 * MAX_TOKENS
    assert acted("abort", "budget_exhausted") > 0
    # Every looping client request ends one way: recovered, out of attempts, or out of budget.
    ended = acted("abort", "attempts_exhausted") + acted("abort", "budget_exhausted")
    assert recovered + ended == loops
    # And the counts are what the emulator did: each looping attempt was seen as a loop, each
    # retry whose penalty or temperature ended the loop (probability 0.7) as a recovery.
    looping = sum(1 for r in records if r["kind"] == "loop")
    assert looping == loops + retried - recovered
    assert (
        sum(
            metric(
                registry,
                "detproxy_loops_total",
                model="emulator-model",
                channel="content",
                source=s,
            )
            for s in ("proxy", "engine", "runaway")
        )
        == looping
    )
    assert sum(1 for r in records if r["kind"] == "loop_escape") == recovered > 0
    audited = sum(
        metric(registry, "detproxy_audits_total", model="emulator-model", mode="full", verdict=v)
        for v in ("identical", "logprob_drift", "text_divergence")
    )
    dropped = sum(
        metric(registry, "detproxy_shadow_dropped_total", reason=r)
        for r in ("queue_full", "rate_limit", "token_budget")
    )
    assert audited > 0 and audited + dropped >= STREAMS - loops - 1
    assert stats["running"] == 0  # no upstream request left open
