"""The recovery budget shared by every replica, through Redis.

Each replica keeps deciding on its own ``RecoveryBudget`` (no Redis on the request path) and,
once per ``interval_s``, publishes its own window totals and reads the others': one hash per
model (``detproxy:budget:<model>``), one field per replica holding ``"<generated> <spent>
<unix ms>"``, and a set of the models (``detproxy:budget:models``). A replica's totals older
than ``stale_s`` are dropped (a replica that stopped); every key expires unless refreshed. A
slow or absent Redis costs only the sharing: each replica goes on with its own totals (the
others' are forgotten once stale), and the failure is published (``SharedStoreFailed``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable

import redis.asyncio as redis
from redis.exceptions import RedisError

from policies.budget import MAX_MODELS, RecoveryBudget
from proxy.events import EventBus, SharedStoreFailed

log = logging.getLogger(__name__)

PREFIX = "detproxy:budget:"
MODELS = PREFIX + "models"
MAX_MODEL_KEY = 256  # model names are client-controlled: longer ones are not shared


def replica_name() -> str:
    """Unique per process: host, pid and a random part (a restarted pid is another replica)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class RedisBudgetSync:
    def __init__(
        self,
        url: str,
        budget: RecoveryBudget,
        bus: EventBus,
        interval_s: float = 1.0,
        *,
        replica: str | None = None,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        self._budget = budget
        self._bus = bus
        self._interval = interval_s
        self._timeout = timeout_s
        self._clock = clock
        self.replica = replica or replica_name()
        self.stale_s = max(5 * interval_s, 10.0)
        self.replicas = 1  # replicas seen at the last sync, this one included
        self.errors = 0
        self.last_sync: float | None = None  # unix time of the last good sync

    async def sync_once(self) -> None:
        """Publish this replica's totals and take the others'; raises what Redis raises."""
        now = self._clock()
        now_ms = int(now * 1000)
        ttl_ms = int(self.stale_s * 2000)
        local = {m: t for m, t in self._budget.local_totals().items() if len(m) <= MAX_MODEL_KEY}
        async with asyncio.timeout(self._timeout):
            pipe = self._client.pipeline(transaction=False)
            for model, (generated, spent) in local.items():
                pipe.hset(PREFIX + model, self.replica, f"{generated} {spent} {now_ms}")
                pipe.pexpire(PREFIX + model, ttl_ms)
            if local:
                pipe.sadd(MODELS, *local)
                pipe.pexpire(MODELS, ttl_ms)
            pipe.srandmember(MODELS, MAX_MODELS)
            listed = (await pipe.execute())[-1] or []
            models = sorted({m.decode() for m in listed} | local.keys())[:MAX_MODELS]
            pipe = self._client.pipeline(transaction=False)
            for model in models:
                pipe.hgetall(PREFIX + model)
            hashes = await pipe.execute()
            others, stale, seen = self._others(models, hashes, now_ms)
            if stale:
                pipe = self._client.pipeline(transaction=False)
                for model, replica in stale:
                    pipe.hdel(PREFIX + model, replica)
                await pipe.execute()
        self._budget.set_others(others)
        self.replicas = len(seen | {self.replica})
        self.last_sync = now

    def _others(
        self, models: list[str], hashes: list[dict[bytes, bytes]], now_ms: int
    ) -> tuple[dict[str, tuple[int, int]], list[tuple[str, str]], set[str]]:
        others: dict[str, tuple[int, int]] = {}
        stale: list[tuple[str, str]] = []
        seen: set[str] = set()
        for model, fields in zip(models, hashes, strict=True):
            generated = spent = 0
            for raw_replica, raw in fields.items():
                replica = raw_replica.decode()
                if replica == self.replica:
                    continue
                try:
                    g, s, at = (int(x) for x in raw.split())
                except ValueError:
                    stale.append((model, replica))  # not ours to read: drop it
                    continue
                if now_ms - at > self.stale_s * 1000:
                    stale.append((model, replica))
                    continue
                seen.add(replica)
                generated += max(0, g)
                spent += max(0, s)
            if generated or spent:
                others[model] = (generated, spent)
        return others, stale, seen

    async def run(self) -> None:
        """Sync every interval until cancelled."""
        while True:
            try:
                await self.sync_once()
            except (RedisError, OSError, TimeoutError) as exc:
                self.errors += 1
                self._bus.publish(SharedStoreFailed("recovery_budget", type(exc).__name__))
                log.warning("recovery budget store unavailable: %r", exc)
                if self.last_sync is None or self._clock() - self.last_sync > self.stale_s:
                    self._budget.set_others({})  # the others' totals are too old to hold
                    self.replicas = 1
            await asyncio.sleep(self._interval)

    def status(self) -> dict[str, object]:
        age = None if self.last_sync is None else round(self._clock() - self.last_sync, 3)
        return {
            "store": "redis",
            "replica": self.replica,
            "replicas": self.replicas,
            "errors": self.errors,
            "last_sync_age_s": age,
        }

    async def close(self) -> None:
        await self._client.aclose()
