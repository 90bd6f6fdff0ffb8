"""Live speed as detproxy sees it: TTFT, inter-token latency and decode rate per stream,
bucketed by how many requests were in flight."""

from __future__ import annotations

import asyncio
from typing import Any

from prometheus_client import CollectorRegistry

from proxy.emulator import EmulatorConfig, EmulatorServer
from proxy.metrics import inflight_bucket
from tests.conftest import metric


def test_inflight_buckets() -> None:
    assert [inflight_bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 64, 65, 1000)] == [
        "1",
        "2",
        "3-4",
        "3-4",
        "5-8",
        "9-16",
        "17-32",
        "33-64",
        "65+",
        "65+",
    ]


async def test_speed_by_concurrency(make_proxy: Any, registry: CollectorRegistry) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.01)) as emu:
        client = await make_proxy(emu.url)
        body = {
            "model": "emulator-model",
            "temperature": 0.5,
            "max_tokens": 20,
            "stream": True,
            "messages": [{"role": "user", "content": "speed"}],
        }
        resp = await client.post("/v1/chat/completions", json=body)
        await resp.read()

        async def one() -> None:
            r = await client.post("/v1/chat/completions", json=body)
            await r.read()

        await asyncio.gather(*(one() for _ in range(4)))

    def count(name: str, bucket: str) -> float:
        return metric(registry, f"detproxy_{name}_count", model="emulator-model", inflight=bucket)

    buckets = ("1", "2", "3-4", "5-8")
    assert sum(count("time_to_first_token_seconds", b) for b in buckets) == 5
    assert sum(count("time_to_first_token_seconds", b) for b in buckets[1:]) >= 2  # under load
    alone = {"model": "emulator-model", "inflight": "1"}
    n = count("inter_token_latency_seconds", "1")
    itl = metric(registry, "detproxy_inter_token_latency_seconds_sum", **alone) / n
    assert 0.008 < itl < 0.1  # the emulator's 10 ms per token, as seen through detproxy
    rate = metric(registry, "detproxy_output_tokens_per_second_sum", **alone) / n
    assert 10 < rate < 120
