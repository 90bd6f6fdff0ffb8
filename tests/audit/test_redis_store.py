"""The passive duplicate store on a real redis-server, shared by two detproxy replicas."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as redis
from prometheus_client import CollectorRegistry

from proxy.audit.redis_store import PREFIX, RedisDuplicateStore
from proxy.audit.store import ChoiceDigest
from proxy.tools.emulator import EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.processes import NEEDS_REDIS, free_port
from tests.helpers.waiting import Unmet, eventually

pytestmark = NEEDS_REDIS


DIGEST = (ChoiceDigest("t" * 32, "k" * 32, "l" * 32, 12, "stop"),)


async def test_check_and_put_swaps_and_expires(redis_url: str) -> None:
    store = RedisDuplicateStore(redis_url, window_s=0.3)
    try:
        assert await store.check_and_put("key", DIGEST) is None
        assert await store.check_and_put("key", DIGEST) == DIGEST
        await asyncio.sleep(0.4)  # the window is the key's TTL
        assert await store.check_and_put("key", DIGEST) is None
    finally:
        await store.close()


async def test_a_missing_redis_costs_a_check_not_a_request() -> None:
    store = RedisDuplicateStore(f"redis://127.0.0.1:{free_port()}/0", window_s=60, timeout_s=0.2)
    assert await store.check_and_put("key", DIGEST) is None
    assert store.errors == 1
    await store.close()


async def test_two_replicas_share_duplicates_and_store_no_text(
    make_proxy: Any, emulator: EmulatorServer, redis_url: str
) -> None:
    env = {"DETPROXY_AUDIT__DUPLICATE_STORE": "redis", "DETPROXY_AUDIT__REDIS_URL": redis_url}
    first = await make_proxy(emulator.url, env=env)
    second_registry = CollectorRegistry()
    second = await make_proxy(emulator.url, env=env, registry=second_registry)
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "a secret prompt about invoices"}],
    }
    assert (await first.post("/v1/chat/completions", json=body)).status == 200
    store = redis.Redis.from_url(redis_url)
    try:  # the first replica's record in the shared store, before the second asks
        await eventually(lambda: store.keys(PREFIX + "*"), what="the first answer stored")
    finally:
        await store.aclose()
    resp = await second.post(
        "/v1/chat/completions",
        json=body,
        headers={"X-Emulator-Knobs": '{"flip_probability": 1, "flip_position": 2}'},
    )
    assert resp.status == 200

    async def checked() -> dict[str, Any] | Unmet:
        status: dict[str, Any] = await (await second.get("/detproxy/status")).json()
        done = status["passive_pending"] == 0 and status["audit"]["audits"]
        return status if done else Unmet(status)

    await eventually(checked, what="the second replica's passive check counted")
    assert (
        metric(
            second_registry,
            "detproxy_audits_total",
            model="emulator-model",
            mode="duplicate",
            verdict="text_divergence",
        )
        == 1
    )
    client = redis.Redis.from_url(redis_url)
    try:
        keys = await client.keys(PREFIX + "*")
        assert len(keys) == 1
        ttl = await client.pttl(keys[0])
        assert 0 < ttl <= 300_000  # bounded by the duplicate window
        stored = await client.get(keys[0])
        assert stored is not None and b"invoice" not in stored and b"secret" not in stored
    finally:
        await client.aclose()
