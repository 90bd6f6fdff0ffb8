"""Metrics fed by events: the per-request figures, through the cached label children."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.audit.verdict import VERDICTS, Verdict
from proxy.config import STATE_DIR_ENV
from proxy.events import (
    AuditCompleted,
    EventBus,
    RequestClassified,
    RequestFinished,
    RequestStarted,
    StreamTimed,
)
from proxy.observe.metrics import Metrics
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric, metric_samples
from tests.helpers.processes import bare_env, free_port, wait_healthy
from tests.helpers.waiting import Unmet, eventually

ROOT = str(Path(__file__).resolve().parents[2])


def finished(status: int = 200, model: str = "m", stream: bool = False) -> RequestFinished:
    return RequestFinished("chat", model, stream, True, status, "ok", 0.002, 0.001)


def test_requests_responses_and_durations_by_label() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    requests = "detproxy_requests_total"
    labels = {"endpoint": "chat", "deterministic": "true"}
    for ev in (finished(), finished(), finished(502), finished(model="n", stream=True)):
        bus.publish(RequestClassified(ev.endpoint, ev.model, ev.stream, ev.deterministic))
    # Counted as they start: before any of them has finished.
    assert metric(registry, requests, model="m", stream="false", **labels) == 3
    assert metric(registry, requests, model="n", stream="true", **labels) == 1
    for ev in (finished(), finished(), finished(502), finished(model="n", stream=True)):
        bus.publish(ev)
    assert metric(registry, requests, model="m", stream="false", **labels) == 3  # not again
    assert metric(registry, requests, model="n", stream="true", **labels) == 1
    responses = "detproxy_responses_total"
    assert metric(registry, responses, endpoint="chat", code="200", outcome="ok") == 3
    assert metric(registry, responses, endpoint="chat", code="502", outcome="ok") == 1
    duration = "detproxy_request_duration_seconds_count"
    assert metric(registry, duration, endpoint="chat", stream="false") == 3
    assert (
        metric(registry, "detproxy_time_to_first_byte_seconds_sum", endpoint="chat", stream="true")
        == 0.001
    )


def test_inflight_follows_starts_and_finishes() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    for _ in range(3):
        bus.publish(RequestStarted("chat"))
    bus.publish(finished())
    assert metric(registry, "detproxy_inflight_requests") == 2
    assert b"\ndetproxy_inflight_requests 2.0\n" in generate_latest(registry)


def test_stream_speed_by_model_and_concurrency() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    for inflight in (1, 1, 3):
        bus.publish(StreamTimed("chat", "m", inflight, 0.1, 0.01, 10, 100.0))
    bus.publish(StreamTimed("chat", "m", 1, 0.1, None, 1, None))
    ttft = "detproxy_time_to_first_token_seconds_count"
    assert metric(registry, ttft, model="m", inflight="1") == 3
    assert metric(registry, ttft, model="m", inflight="3-4") == 1
    itl = "detproxy_inter_token_latency_seconds_count"
    assert metric(registry, itl, model="m", inflight="1") == 2


def test_every_verdict_series_of_a_model_and_mode_starts_together_at_zero() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    verdict = Verdict("identical", None, None, None, "h", "h", 3, 3)
    bus.publish(
        AuditCompleted("r1", "m", "chat", "full", 0, verdict, "k", 1, 0, 0.1, 0.1, "same", 0.0)
    )
    text = generate_latest(registry).decode()
    for name in VERDICTS:
        line = f'detproxy_audits_total{{mode="full",model="m",verdict="{name}"}}'
        assert f"{line} {'1.0' if name == 'identical' else '0.0'}" in text, name
    assert 'mode="prefill"' not in text  # only the mode that was seen


# One worker of ``serve --workers N`` (its metrics in PROMETHEUS_MULTIPROC_DIR's files): its
# recovery budget for model m, as the budget publishes it, with ``spent`` tokens of 1000.
BUDGET_WORKER = """
import sys
from prometheus_client import CollectorRegistry
from proxy.events import EventBus, RecoveryBudgetUsed
from proxy.observe.metrics import Metrics
bus = EventBus()
Metrics(CollectorRegistry(), budget_shared=sys.argv[1] == "shared").subscribe(bus)
bus.publish(RecoveryBudgetUsed("m", int(sys.argv[2]), 1000))
"""


async def test_a_shared_recovery_budget_is_the_max_across_workers_not_the_sum(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every worker reports the fleet's account when Redis shares it (a scrape aggregates the
    # workers' gauges); its own part of the budget otherwise. Two workers, one scrape.
    async def worker(folder: Path, budget: str, spent: int) -> None:
        env = bare_env(PYTHONPATH=ROOT, PROMETHEUS_MULTIPROC_DIR=str(folder))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", BUDGET_WORKER, budget, str(spent), env=env
        )
        assert await proc.wait() == 0, f"the {budget} budget's worker failed"

    scraped = {}
    for budget in ("own", "shared"):
        folder = tmp_path / budget
        folder.mkdir()
        await asyncio.gather(worker(folder, budget, 100), worker(folder, budget, 300))
        monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(folder))
        text = Metrics(CollectorRegistry()).exposition().decode()
        scraped[budget] = metric_samples(text, "detproxy_recovery_budget_tokens")
    name = "detproxy_recovery_budget_tokens"
    assert scraped == {
        "own": {
            f'{name}{{kind="allowed",model="m"}}': 2000,
            f'{name}{{kind="spent",model="m"}}': 400,
        },
        "shared": {
            f'{name}{{kind="allowed",model="m"}}': 1000,
            f'{name}{{kind="spent",model="m"}}': 300,
        },
    }


async def test_two_workers_count_an_upstream_restart_once(tmp_path: Path) -> None:
    """Under --workers every worker reads the upstream: one restart is 1, not one per worker."""
    upstream, port = free_port(), free_port()
    base = f"http://127.0.0.1:{port}"
    env = {
        **bare_env(),
        "PYTHONPATH": ROOT,
        "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.1",
        STATE_DIR_ENV: os.environ.get(STATE_DIR_ENV, str(tmp_path)),
    }
    argv = ["-m", "proxy", "serve", "--upstream", f"http://127.0.0.1:{upstream}"]
    argv += ["--port", str(port), "--workers", "2"]

    async def scrape(http: aiohttp.ClientSession) -> dict[str, float]:
        async with http.get(base + "/detproxy/metrics") as resp:
            return metric_samples(await resp.text(), "detproxy_upstream_")

    def fresh() -> aiohttp.ClientSession:  # a connection per request: any worker answers
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))

    async def both(what: str, check: Callable[[dict[str, Any]], bool]) -> None:
        """Until each of the two workers says so in its ``upstream_state``."""
        seen = dict[int, Any]()
        async with fresh() as http:

            async def said() -> bool | Unmet:
                async with http.get(base + "/detproxy/status") as resp:
                    status = await resp.json()
                if check(status["upstream_state"]):
                    seen[status["worker"]["index"]] = status["upstream_state"]
                return len(seen) == 2 or Unmet(seen)

            await eventually(said, timeout_s=30, what=f"both workers {what}")

    proc = await asyncio.create_subprocess_exec(
        sys.executable, *argv, env=env, stderr=asyncio.subprocess.DEVNULL
    )
    try:
        await wait_healthy(base + "/detproxy/health")
        config = EmulatorConfig(version="0.23.0")
        async with EmulatorServer(config, port=upstream):
            await both("read it up", lambda state: state["state"] == "up")
        await both("read it down", lambda state: state["state"] == "down")
        async with EmulatorServer(config, port=upstream):
            await both("saw the restart", lambda state: state["restarts"] == 1)
            for _ in range(6):  # whichever worker answers the scrape
                async with fresh() as http:
                    seen = await scrape(http)
                assert (seen["detproxy_upstream_restarts_total"], seen["detproxy_upstream_up"]) == (
                    1,
                    1,
                ), seen
                assert seen["detproxy_upstream_changes_total"] == 0, seen
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 30)
