"""The recovery budget shared by replicas through a real redis-server."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as redis
from prometheus_client import CollectorRegistry

from policies.budget import RecoveryBudget
from proxy.events import EventBus, SharedStoreFailed
from proxy.loops.budget_sync import MODELS, PREFIX, RedisBudgetSync
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import chat, knobs
from tests.helpers.metrics import metric
from tests.helpers.processes import NEEDS_REDIS, free_port
from tests.helpers.waiting import Unmet, eventually

pytestmark = NEEDS_REDIS

MODEL = "emulator-model"
RETRY = {"DETPROXY_LOOPS__POLICY": "retry", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"}
# A loop that a retry's presence penalty always ends; one retry reserves max_tokens (200).
CONTENT_LOOP = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)
ASK = chat(max_tokens=200)


def actions(registry: CollectorRegistry, action: str, outcome: str) -> float:
    return metric(
        registry, "detproxy_policy_actions_total", model=MODEL, action=action, outcome=outcome
    )


class Clock:
    def __init__(self, now: float = 1_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def replica(
    url: str, name: str, clock: Clock, bus: EventBus | None = None
) -> tuple[RedisBudgetSync, RecoveryBudget]:
    """A replica's sync and the budget it keeps in step (the one its recoveries draw on)."""
    budget = RecoveryBudget(share=0.0, floor_tokens=100, window_s=60)
    sync = RedisBudgetSync(url, budget, bus or EventBus(), 0.05, replica=name, clock=clock)
    return sync, budget


async def test_each_replica_decides_on_the_fleets_totals(redis_url: str) -> None:
    clock = Clock()
    (a, a_budget), (b, b_budget) = replica(redis_url, "a", clock), replica(redis_url, "b", clock)
    try:
        a_budget.record_generated(MODEL, 500)
        assert a_budget.try_reserve(MODEL, 60)
        # Alone, b would allow 100 (its floor); before any sync it does not know a's 60.
        assert b_budget.use(MODEL).spent == 0
        await a.sync_once()
        await b.sync_once()
        use = b_budget.use(MODEL)
        assert (use.generated, use.spent, use.allowed) == (500, 60, 100)
        assert not b_budget.try_reserve(MODEL, 60)  # 60 + 60 over the fleet's 100
        assert b_budget.try_reserve(MODEL, 40)
        await b.sync_once()
        await a.sync_once()
        assert a_budget.use(MODEL).spent == 100  # its 60 and b's 40
        assert a.replicas == b.replicas == 2
        client = redis.Redis.from_url(redis_url)
        try:
            fields = await client.hgetall(PREFIX + MODEL)
            assert set(fields) == {b"a", b"b"}
            assert 0 < await client.pttl(PREFIX + MODEL) <= 20_000  # gone unless refreshed
            assert await client.smembers(MODELS) == {MODEL.encode()}
        finally:
            await client.aclose()
    finally:
        await a.close()
        await b.close()


async def test_a_replica_that_stopped_syncing_is_dropped(redis_url: str) -> None:
    a_clock, b_clock = Clock(), Clock()
    (a, a_budget), (b, b_budget) = (
        replica(redis_url, "a", a_clock),
        replica(redis_url, "b", b_clock),
    )
    try:
        assert a_budget.try_reserve(MODEL, 80)
        await a.sync_once()
        await b.sync_once()
        assert b_budget.use(MODEL).spent == 80
        b_clock.now += b.stale_s + 1  # a has not written since
        await b.sync_once()
        assert b_budget.use(MODEL).spent == 0
        assert b.replicas == 1
        client = redis.Redis.from_url(redis_url)
        try:
            assert await client.hgetall(PREFIX + MODEL) == {}  # its entry deleted
        finally:
            await client.aclose()
    finally:
        await a.close()
        await b.close()


async def test_a_missing_redis_leaves_each_replica_its_own_budget() -> None:
    bus = EventBus()
    failed: list[SharedStoreFailed] = []
    bus.subscribe(SharedStoreFailed, failed.append)
    clock = Clock()
    sync, budget = replica(f"redis://127.0.0.1:{free_port()}/0", "a", clock, bus)
    budget.set_others({MODEL: (0, 90)})  # what the others had spent, long ago
    task = asyncio.get_running_loop().create_task(sync.run())
    try:
        await eventually(lambda: sync.errors >= 2 or Unmet(sync.errors), what="two failed syncs")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sync.close()
    assert sync.errors >= 2 and failed and failed[0].store == "recovery_budget"
    assert budget.use(MODEL).spent == 0  # never synced: the others' totals are not held
    assert budget.try_reserve(MODEL, 100)  # and the replica's own floor still serves
    assert sync.status()["last_sync_age_s"] is None


async def test_two_detproxies_hold_one_recovery_budget(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry, redis_url: str
) -> None:
    # A floor of one retry's reservation (max_tokens 200), no share: the fleet has room for one
    # recovery. Alone, each replica would retry once; together only the first one does.
    env = RETRY | {
        "DETPROXY_LOOPS__RECOVERY_TOKEN_SHARE": "0",
        "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": "200",
        "DETPROXY_LOOPS__RECOVERY_BUDGET_STORE": "redis",
        "DETPROXY_LOOPS__RECOVERY_BUDGET_REDIS_URL": redis_url,
        "DETPROXY_LOOPS__RECOVERY_BUDGET_SYNC_S": "0.05",
    }
    first = await make_proxy(emulator.url, env=env)
    second_registry = CollectorRegistry()
    second = await make_proxy(emulator.url, env=env, registry=second_registry)
    resp = await first.post("/v1/chat/completions", json=ASK, headers=CONTENT_LOOP)
    assert resp.headers["X-Detproxy-Recovered"] == "true"

    async def synced() -> dict[str, Any] | Unmet:
        status: dict[str, Any] = await (await second.get("/detproxy/status")).json()
        spent = status["recovery_budget"].get(MODEL, {}).get("spent")
        return status if spent else Unmet(status["recovery_budget"])

    status = await eventually(synced, what="the second replica sees the first one's spending")
    assert status["recovery_budget_store"]["store"] == "redis"
    assert status["recovery_budget_store"]["replicas"] == 2
    resp = await second.post("/v1/chat/completions", json=ASK, headers=CONTENT_LOOP)
    assert resp.status == 200
    assert resp.headers["X-Detproxy-Recovered"] == "false"
    assert actions(registry, "retry", "recovered") == 1
    assert (
        metric(
            second_registry,
            "detproxy_policy_actions_total",
            model=MODEL,
            action="abort",
            outcome="budget_exhausted",
        )
        == 1
    )
    assert emulator.stats()["requests"] == 3  # two requests, one retry for the whole fleet


async def test_without_redis_each_detproxy_has_its_own_budget(
    make_proxy: Any, emulator: EmulatorServer, registry: CollectorRegistry
) -> None:
    # The control for the test above: the same two replicas with the memory store retry twice.
    env = RETRY | {
        "DETPROXY_LOOPS__RECOVERY_TOKEN_SHARE": "0",
        "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": "200",
    }
    first = await make_proxy(emulator.url, env=env)
    second = await make_proxy(emulator.url, env=env, registry=CollectorRegistry())
    for client in (first, second):
        resp = await client.post("/v1/chat/completions", json=ASK, headers=CONTENT_LOOP)
        assert resp.headers["X-Detproxy-Recovered"] == "true"
    status = await (await second.get("/detproxy/status")).json()
    assert status["recovery_budget_store"] == {"store": "memory"}
    assert emulator.stats()["requests"] == 4
