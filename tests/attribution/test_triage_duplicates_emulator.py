"""The passive duplicate check's divergences triaged end to end, in front of the emulator: the
same greedy request sent twice, once alone and once beside others, no shadow at all; the
duplicate incident carries the cause, read against the earlier answer's digest."""

from __future__ import annotations

import asyncio
from typing import Any

from aiohttp.test_utils import TestClient

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.triage import FAST, causes_of
from tests.helpers.waiting import Unmet, eventually

MODEL = "emulator-model"
# Passive checks only: no shadow is ever sent (no rate, no floor).
DUPLICATES = FAST | {
    "DETPROXY_AUDIT__SAMPLE_RATE": "0",
    "DETPROXY_AUDIT__AT_LEAST_EVERY_S": "0",
    "DETPROXY_AUDIT__PASSIVE_CHECKS": "true",
}


def chat(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}],
    }


async def send(client: TestClient[Any, Any], bodies: list[dict[str, Any]]) -> None:
    answers = await asyncio.gather(
        *(client.post("/v1/chat/completions", json=body) for body in bodies)
    )
    for resp in answers:
        assert resp.status == 200, await resp.text()
        await resp.read()


async def triaged(client: TestClient[Any, Any], n: int) -> list[dict[str, Any]]:
    """The divergent duplicate incidents once ``n`` of them carry a cause."""

    async def done() -> list[dict[str, Any]] | Unmet:
        incidents = [i for i in await causes_of(client) if i["mode"] == "duplicate"]
        divergent = [i for i in incidents if i["verdict"] != "identical"]
        caused = [i for i in divergent if "cause" in i]
        return caused if len(divergent) == len(caused) >= n else Unmet(len(caused))

    return await eventually(done, timeout_s=120, what=f"{n} duplicate incidents triaged")


async def test_a_duplicate_answered_beside_others_is_attributed_to_batch(make_proxy: Any) -> None:
    config = EmulatorConfig(batch_divergence_slope=0.3, token_latency_s=0.004, seed=5)
    async with EmulatorServer(config) as emu:
        client = await make_proxy(emu.url, env=DUPLICATES)
        # Alone first, then the same request again beside seven others; then the other way
        # round: crowded first (the in-memory store keeps its company), alone after.
        alone_first = [chat(f"alone first {i}") for i in range(8)]
        for body in alone_first:
            await send(client, [body])
        await send(client, alone_first)
        crowded_first = [chat(f"crowded first {i}") for i in range(8)]
        await send(client, crowded_first)
        for body in crowded_first:
            await send(client, [body])
        incidents = await triaged(client, 8)
    print("duplicates:", [(i["request_id"], i["cause"]) for i in incidents])
    assert all(i["cause"] == "batch" for i in incidents), [
        (i["cause"], i["cause_evidence"]) for i in incidents
    ]
    for i in incidents:
        evidence = i["cause_evidence"]
        names = [r["name"] for r in evidence["runs"]]
        assert names[:2] == ["primary", "earlier"], names
        assert evidence["compared_tokens"] is None  # replays whole against a digest
        runs = {r["name"]: r for r in evidence["runs"]}
        crowded = runs["primary"] if runs["primary"]["inflight"] > 1 else runs["earlier"]
        alone = runs["earlier"] if crowded is runs["primary"] else runs["primary"]
        assert crowded["alone"] is False and crowded["group"] != runs["cold-1"]["group"]
        assert alone["group"] == runs["cold-1"]["group"], evidence
    status = await (await client.get("/detproxy/status")).json()
    assert status["shadow"] is None  # no shadow ran: the duplicate checks alone were triaged
    assert status["triage"]["explained"] >= len(incidents)
