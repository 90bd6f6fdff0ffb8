"""Triage behind ``detproxy serve --workers 2`` (real processes, the emulator upstream): a
salted burst spread over both workers gets its causes, because the workers' shadows and
experiments take turns on the engine (one experiment at a time, no shadow of either worker
beside it) and spend from one ledger."""

from __future__ import annotations

import asyncio
import re
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.processes import bare_env, free_port, wait_healthy
from tests.helpers.triage import FAST, causes_of, idle
from tests.helpers.waiting import Unmet, eventually

ROOT = Path(__file__).resolve().parents[2]
LONG = " ".join(f"word{i}" for i in range(48))


def chat(prompt: str, salt: str) -> dict[str, object]:
    return {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": prompt}],
        "cache_salt": salt,
    }


def series(text: str, name: str) -> dict[str, float]:
    """``name``'s samples by their label text."""
    found = re.findall(rf"^{re.escape(name)}\{{(.*?)\}} (\S+)$", text, re.M)
    return {labels: float(value) for labels, value in found}


@asynccontextmanager
async def two_workers(upstream: str, env: dict[str, str], log: Path) -> AsyncIterator[str]:
    """``detproxy serve --workers 2`` in front of ``upstream``: its base URL."""
    port = free_port()
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            *("-m", "proxy", "serve", "--upstream", upstream, "--port", str(port)),
            env={**env, "DETPROXY_WORKERS": "2", "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stderr=err,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base + "/detproxy/health")
        yield base
    finally:
        proc.terminate()
        await proc.wait()


async def settled_causes(
    http: aiohttp.ClientSession, base: str, audits_at_least: int
) -> dict[str, dict[str, float]]:
    """The audit and cause counters once every divergence of ``audits_at_least`` audits has
    its cause (every worker's, merged)."""

    async def settled() -> dict[str, dict[str, float]] | Unmet:
        async with http.get(base + "/detproxy/metrics") as resp:
            text = await resp.text()
        audits = series(text, "detproxy_audits_total")
        causes = series(text, "detproxy_divergence_causes_total")
        divergent = sum(v for k, v in audits.items() if "identical" not in k)
        seen = {"audits": audits, "causes": causes}
        done = sum(audits.values()) >= audits_at_least and sum(causes.values()) >= divergent
        return seen if done else Unmet(seen)

    return await eventually(settled, timeout_s=180, what="every divergence caused")


async def merged_incidents(
    http: aiohttp.ClientSession, base: str, at_least: float
) -> list[dict[str, Any]]:
    """Every worker's audit incidents, whichever answers, each with its cause."""

    async def caused() -> list[dict[str, Any]] | Unmet:
        async with http.get(base + "/detproxy/incidents?kind=audit&limit=1000") as resp:
            incidents: list[dict[str, Any]] = await resp.json()
        done = len(incidents) >= at_least and all("cause" in i for i in incidents)
        return incidents if done else Unmet(len(incidents))

    return await eventually(caused, timeout_s=30, what="the merged incidents")


async def post_chat(http: aiohttp.ClientSession, base: str, body: dict[str, object]) -> None:
    async with http.post(base + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def test_a_burst_over_two_workers_gets_its_causes(tmp_path: Path) -> None:
    config = EmulatorConfig(batch_divergence_slope=0.3, token_latency_s=0.01, seed=5)
    env = bare_env(**FAST, DETPROXY_AUDIT__SCHEDULE="quiet")
    env["DETPROXY_AUDIT__MAX_CONCURRENT_SHADOWS"] = "1"  # the server's: one shadow at a time
    async with (
        EmulatorServer(config) as emu,
        two_workers(emu.url, env, tmp_path / "serve.log") as base,
    ):
        # A connection per request: the kernel spreads them over both workers.
        connector = aiohttp.TCPConnector(force_close=True)
        async with aiohttp.ClientSession(connector=connector) as http:
            for wave in range(2):
                bodies = [chat(f"{i % 4} {LONG}", f"s{wave}-{i}") for i in range(16)]
                await asyncio.gather(*(post_chat(http, base, b) for b in bodies))
            seen = await settled_causes(http, base, 32)
            async with http.get(base + "/detproxy/metrics") as resp:
                dropped = series(await resp.text(), "detproxy_triage_dropped_total")
            incidents = await merged_incidents(http, base, sum(seen["causes"].values()))
    causes = {re.sub(r".*cause=\"(\w+)\".*", r"\1", k): v for k, v in seen["causes"].items()}
    total = sum(causes.values())
    assert total >= 12, f"too few divergences to measure: {seen}"
    assert not any(dropped.values()), f"triage dropped some: {dropped}; causes {causes}"
    assert causes.get("batch", 0) / total >= 0.9, f"causes over two workers: {causes}"
    # The salts were new to the server: each primary ran cold, whichever worker sent it (the
    # other worker's table says so), and the cause rests on it.
    colds = [i["cause_evidence"]["runs"][0]["cache"] for i in incidents]
    assert colds == ["cold"] * len(incidents), colds


async def test_over_two_workers_a_shadow_with_no_request_beside_it_ran_alone(
    tmp_path: Path,
) -> None:
    """Serial requests to ``serve --workers 2``: every worker writes its requests in flight
    into the counts the workers share, so a shadow with no client request of either worker
    beside it is known to have run alone (the burst's company, likewise, is every worker's)."""
    config = EmulatorConfig(flip_probability=0.5, token_latency_s=0.002, seed=3)
    env = bare_env(**FAST, DETPROXY_AUDIT__SCHEDULE="quiet")
    async with (
        EmulatorServer(config) as emu,
        two_workers(emu.url, env, tmp_path / "serve.log") as base,
    ):
        connector = aiohttp.TCPConnector(force_close=True)  # both workers answer some
        async with aiohttp.ClientSession(connector=connector) as http:
            for i in range(8):
                await post_chat(http, base, chat(f"serial {i}", f"serial-{i}"))
                await settled_causes(http, base, i + 1)
            seen = await settled_causes(http, base, 8)
            incidents = await merged_incidents(http, base, sum(seen["causes"].values()))
    assert incidents, f"no divergence to read: {seen}"
    shadows = [i["cause_evidence"]["runs"][1] for i in incidents]
    assert {r["name"] for r in shadows} == {"shadow"}
    assert [r["alone"] for r in shadows] == [True] * len(shadows), shadows


@pytest.mark.parametrize("workers", [1, 2])
async def test_a_shadow_is_called_alone_only_where_its_worker_sees_every_request(
    make_proxy: Any, workers: int
) -> None:
    """Serial requests, each shadow with nothing of its own process beside it: with one
    process that is alone; with several and no counts they share (an app outside ``serve``),
    another worker's clients may have shared its batch unseen, so it is not known (a shadow
    "alone" that differs from cold replays alone would read as intrinsic)."""
    config = EmulatorConfig(flip_probability=0.5, token_latency_s=0.002, seed=3)
    async with EmulatorServer(config) as emu:
        env = FAST | {"DETPROXY_AUDIT__SCHEDULE": "quiet", "DETPROXY_WORKERS": str(workers)}
        client = await make_proxy(emu.url, env=env)
        for i in range(6):
            resp = await client.post("/v1/chat/completions", json=chat(f"serial {i}", f"s{i}"))
            assert resp.status == 200
            await resp.read()
            await idle(client)
        incidents = await causes_of(client)
    assert incidents, "no divergence to read"
    shadows = [i["cause_evidence"]["runs"][1] for i in incidents]
    assert {r["name"] for r in shadows} == {"shadow"}
    expected = True if workers == 1 else None
    assert [r["alone"] for r in shadows] == [expected] * len(shadows), shadows
