"""``detproxy serve --workers 2`` as real processes in front of the emulator: both workers
answer on one port, the metrics are their sum, a killed worker is restarted and counted, and
SIGTERM drains and stops them all."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from proxy.config import Settings, load_settings
from proxy.cores import usable_cores
from proxy.observe.ui.incident import incident_id
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from proxy.workers import resolve_workers, worker_budgets
from tests.helpers.emulator import knobs
from tests.helpers.metrics import metric_samples
from tests.helpers.processes import bare_env, free_port, wait_healthy
from tests.helpers.waiting import Unmet, eventually

ROOT = Path(__file__).resolve().parents[1]
CHAT = {
    "model": "emulator-model",
    "temperature": 0,
    "max_tokens": 4,
    "messages": [{"role": "user", "content": "hello"}],
}


@asynccontextmanager
async def supervised(
    upstream: str, log: Path, *flags: str, workers: str | None = "2"
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """``workers`` None: the default (no --workers, no DETPROXY_WORKERS)."""
    port = free_port()
    count = ["--workers", workers] if workers is not None else []
    with log.open("wb") as err:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            upstream,
            "--port",
            str(port),
            *count,
            "--log-level",
            "INFO",
            *flags,
            env={**bare_env(DETPROXY_WORKERS=""), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stderr=err,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base + "/detproxy/health")
        yield base, proc
    finally:
        if proc.returncode is None:
            proc.kill()  # the workers see their supervisor gone and stop (tested below)
            await proc.wait()


def fresh() -> aiohttp.ClientSession:
    # A connection per request: the kernel picks a worker per connection.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))


async def workers_seen(
    base: str, want: int = 2, timeout_s: float = 30.0, of: int = 2
) -> dict[int, int]:
    """index -> pid of the workers that answered /detproxy/status, until ``want`` did (a
    worker still starting is not listening yet)."""
    seen: dict[int, int] = {}
    async with fresh() as http:

        async def answered() -> dict[int, int] | Unmet:
            async with http.get(base + "/detproxy/status") as resp:
                worker = (await resp.json())["worker"]
            seen[worker["index"]] = worker["pid"]
            assert worker["of"] == of, f"worker {worker} is one of {worker['of']}, not {of}"
            return seen if len(seen) == want else Unmet(seen)

        return await eventually(answered, timeout_s=timeout_s, what=f"{want} workers answering")


async def metric(base: str, name: str) -> float:
    async with fresh() as http, http.get(base + "/detproxy/metrics") as resp:
        text = await resp.text()
    values = [float(m) for m in re.findall(rf"^{re.escape(name)} (\S+)$", text, re.M)]
    assert len(values) == 1, f"{name} in:\n{text}"
    return values[0]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


async def gone(pid: int, within_s: float, what: str) -> None:
    await eventually(lambda: not alive(pid), timeout_s=within_s, interval_s=0.05, what=what)


REQUESTS = 'detproxy_requests_total{deterministic="true",endpoint="chat",model="emulator-model",stream="false"}'  # noqa: E501


async def test_two_workers_answer_share_metrics_restart_and_stop(tmp_path: Path) -> None:
    log = tmp_path / "serve.log"
    async with EmulatorServer() as emu, supervised(emu.url, log) as (base, proc):
        pids = await workers_seen(base)
        assert len(set(pids.values())) == 2 and proc.pid not in pids.values()
        async with fresh() as http, http.get(base + "/detproxy/status") as resp:
            config = (await resp.json())["config"]
        # Each worker holds half of the server's shadow rate (default 100/s); concurrent
        # shadows and the recovery budget are the server's, shared in the workers' folder.
        assert config["audit"]["max_shadows_per_s"] == 50
        assert config["audit"]["max_concurrent_shadows"] == 4
        assert config["loops"]["recovery_token_floor"] == 32768

        async with fresh() as http:
            for _ in range(40):
                async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
                    assert resp.status == 200 and (await resp.json())["choices"]
        # Whichever worker answers the scrape, it reports both workers' requests.
        for _ in range(6):
            assert await metric(base, REQUESTS) == 40
        assert await metric(base, "detproxy_workers") == 2
        assert await metric(base, 'detproxy_worker_restarts_total{worker="0"}') == 0

        os.kill(pids[0], signal.SIGKILL)
        await gone(pids[0], 5, "the killed worker gone")

        async def worker_0_again() -> dict[int, int] | Unmet:  # the supervisor starts it again
            seen = await workers_seen(base)
            return seen if seen[0] != pids[0] else Unmet(seen)

        restarted = await eventually(worker_0_again, timeout_s=30, what="worker 0 restarted")
        assert restarted[0] != pids[0] and restarted[1] == pids[1]
        assert await metric(base, 'detproxy_worker_restarts_total{worker="0"}') == 1
        assert await metric(base, REQUESTS) == 40  # the dead worker's counts are kept
        async with fresh() as http, http.get(base + "/detproxy/status") as resp:
            lines = {w["pid"]: w for w in (await resp.json())["workers"]}
        assert not lines[pids[0]]["alive"] and lines[pids[0]]["inflight"] == 0, lines
        assert lines[restarted[0]]["alive"] and lines[pids[1]]["alive"], lines

        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
        assert not alive(restarted[0]) and not alive(restarted[1])
    text = log.read_text()
    assert f"worker 0 (pid {pids[0]}) exited with signal SIGKILL" in text
    assert "SIGTERM: stopping 2 worker(s)" in text


async def test_by_default_one_worker_per_core_it_may_use(tmp_path: Path) -> None:
    cores = usable_cores()  # this machine's: its CPUs, bounded by its cgroup's quota
    async with (
        EmulatorServer() as emu,
        supervised(emu.url, tmp_path / "log", workers=None) as (base, _),
    ):
        seen = await workers_seen(base, want=cores, of=cores)
        assert sorted(seen) == list(range(cores))


def test_auto_is_resolved_once_by_the_command() -> None:
    settings = load_settings(None, {}, {"workers": "auto"})
    assert settings.server.workers == "auto" and settings.server.one_process  # nothing resolved
    resolved = resolve_workers(settings, cores=lambda: 6)
    assert resolved.server.workers == 6 and resolved.server.processes == 6
    assert resolved.audit == settings.audit  # only the count changes
    given = load_settings(None, {"DETPROXY_WORKERS": "1"})
    assert resolve_workers(given, cores=lambda: 6).server.workers == 1  # as given


async def audits_in_metrics(http: aiohttp.ClientSession, base: str) -> tuple[int, int]:
    """``detproxy_audits_total`` summed over its labels, and its non-identical part (each an
    audit incident), as one scrape says (the workers' sum, whichever answered)."""
    async with http.get(base + "/detproxy/metrics") as resp:
        samples = metric_samples(await resp.text(), "detproxy_audits_total{")
    total = sum(samples.values())
    odd = sum(v for k, v in samples.items() if 'verdict="identical"' not in k)
    return int(total), int(odd)


async def test_status_incidents_and_explorer_answer_for_every_worker(tmp_path: Path) -> None:
    """Whichever worker a request lands on, /detproxy/status counts every worker's audits (as
    the merged metrics do), /detproxy/incidents lists every worker's incidents, and the
    explorer shows any of them."""
    flips = EmulatorConfig(flip_probability=0.3, flip_position=1)  # some audits diverge
    async with (
        EmulatorServer(flips) as emu,
        supervised(emu.url, tmp_path / "log", "--sample-rate", "1") as (base, _),
    ):
        await workers_seen(base)
        async with fresh() as http:
            for i in range(60):  # a connection each: the kernel spreads them over both workers
                body = {**CHAT, "messages": [{"role": "user", "content": f"question {i}"}]}
                async with http.post(base + "/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()

            agreed: dict[int, int] = {}  # worker index -> the total its status agreed with

            async def settled() -> dict[int, int] | Unmet:
                """Every audit done and published (a worker publishes soon after a count, not
                at once): each worker's status agrees with the metrics on the same total, and
                both workers audited some."""
                total, _ = await audits_in_metrics(http, base)
                async with http.get(base + "/detproxy/status") as resp:
                    status = await resp.json()
                per_worker = [w["audits"] for w in status["workers"]]
                if status["audit"]["audits"] == total >= 60 and 0 not in per_worker:
                    agreed[status["worker"]["index"]] = total
                if len(agreed) < 2 or len(set(agreed.values())) > 1:
                    return Unmet((total, status["audit"]["audits"], per_worker, agreed))
                return agreed

            await eventually(settled, timeout_s=60, what="60 audits, counted by both workers")
            total, odd = await audits_in_metrics(http, base)
            assert odd > 0, "no divergent audit: nothing to list"
            answered: set[int] = set()
            for _ in range(12):  # fresh connections: both workers answer some of these
                async with http.get(base + "/detproxy/status") as resp:
                    status = await resp.json()
                answered.add(status["worker"]["index"])
                assert status["audit"]["audits"] == total, (status["worker"], status["audit"])
                assert sum(w["audits"] for w in status["workers"]) == total, status["workers"]
                assert sorted(w["index"] for w in status["workers"]) == [0, 1]
                assert status["incidents"]["recorded"] >= odd
                async with http.get(base + "/detproxy/incidents?kind=audit&limit=1000") as resp:
                    listed = await resp.json()
                assert len(listed) == odd, f"{len(listed)} audit incidents listed, {odd} counted"
                assert len({r["process"] for r in listed}) == 2, "not both workers' incidents"
                stamps = [r["ts"] for r in listed]
                assert stamps == sorted(stamps, reverse=True), "not newest first"
            assert answered == {0, 1}, f"only worker(s) {answered} answered"
            for record in listed[:8]:  # any worker shows any worker's incident
                url = f"{base}/detproxy/ui/incident/{incident_id(record)}"
                async with http.get(url) as resp:
                    assert resp.status == 200, (record["process"], await resp.text())
            async with http.get(base + "/detproxy/ui") as resp:
                assert resp.status == 200


async def test_sigterm_lets_every_worker_finish_its_streams(tmp_path: Path) -> None:
    slow = EmulatorConfig(token_latency_s=0.05)
    body = {**CHAT, "max_tokens": 30, "stream": True}
    async with EmulatorServer(slow) as emu, supervised(emu.url, tmp_path / "log") as (base, proc):
        await workers_seen(base)

        under_way: list[bytes] = []

        async def stream() -> bytes:
            async with fresh() as http, http.post(base + "/v1/chat/completions", json=body) as r:
                first = await r.content.readuntil(b"\n\n")
                under_way.append(first)
                return first + await r.read()

        streams = [asyncio.create_task(stream()) for _ in range(8)]
        await eventually(lambda: len(under_way) == 8, what="every stream under way")
        assert not any(s.done() for s in streams), "30 tokens take 1.5 s"
        proc.send_signal(signal.SIGTERM)
        bodies = await asyncio.wait_for(asyncio.gather(*streams), 30)
        assert all(b.endswith(b"data: [DONE]\n\n") and b.count(b"\n\n") > 30 for b in bodies)
        assert await asyncio.wait_for(proc.wait(), 30) == 0


async def test_workers_stop_when_their_supervisor_is_killed(tmp_path: Path) -> None:
    async with EmulatorServer() as emu, supervised(emu.url, tmp_path / "log") as (base, proc):
        pids = await workers_seen(base)
        proc.kill()  # no SIGTERM to pass on
        await proc.wait()
        for pid in pids.values():
            await gone(pid, 15, f"worker {pid} gone without its supervisor")


async def test_a_port_in_use_stops_the_supervisor_at_start(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--port",
            str(port),
            "--workers",
            "2",
            env={**bare_env(), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in err.decode()


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_the_workers_share_the_recovery_floor_rather_than_split_it(store: str) -> None:
    """Split 16 ways, the default floor held less than one 4096-token retry per worker: the
    workers add each other's totals instead (proxy/loops/budget_folder.py), Redis across
    replicas."""
    settings = Settings.model_validate(
        {"loops": {"recovery_token_floor": 3000, "recovery_budget_store": store}}
    )
    split = worker_budgets(settings, 3)
    assert "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR" not in split, split
    assert split["DETPROXY_AUDIT__MAX_SHADOWS_PER_S"] == repr(settings.audit.max_shadows_per_s / 3)


def test_the_workers_split_the_audit_allowance_and_stretch_its_floor() -> None:
    settings = Settings.model_validate({"audit": {"token_allowance": 9000, "at_least_every_s": 60}})
    split = worker_budgets(settings, 3)
    assert split["DETPROXY_AUDIT__TOKEN_ALLOWANCE"] == "3000"
    # Each worker audits a model at least every 180 s: the three together, about every 60 s.
    assert float(split["DETPROXY_AUDIT__AT_LEAST_EVERY_S"]) == 180.0
    # And the overrides are values the workers' own configuration accepts.
    worker = load_settings(None, split)
    assert worker.audit.token_allowance == 3000 and worker.audit.at_least_every_s == 180.0


def test_the_workers_do_not_split_triage_they_share_one_ledger() -> None:
    settings = Settings.model_validate(
        {"attribution": {"max_per_minute": 6.0, "token_allowance": 9000}}
    )
    split = worker_budgets(settings, 3)
    # A third of the allowance would not fit one experiment: the workers keep the server's
    # and start and spend from one ledger (tests/attribution/test_account.py).
    assert not any(name.startswith("DETPROXY_ATTRIBUTION__") for name in split), split


async def test_every_worker_retries_a_loop_whose_retry_needs_more_than_its_share_of_the_floor(
    tmp_path: Path,
) -> None:
    """The default floor (32768 tokens) split two ways held 16384 a worker, so a retry that
    reserves its max_tokens of 20000 was refused and the loop cut without one (on an H100 with
    16 workers, 14 of 48 requests at 4096 tokens ended after one attempt). The workers share
    one floor instead."""
    loop = knobs(loop_channel="content", loop_after_tokens=5, loop_escape_probability=1.0)
    body = {**CHAT, "max_tokens": 20000}
    long_enough = EmulatorConfig(max_model_len=32768)
    async with (
        EmulatorServer(long_enough) as emu,
        supervised(emu.url, tmp_path / "serve.log", "--loop-policy", "retry") as (base, _),
    ):
        await workers_seen(base)
        async with fresh() as http:
            for _ in range(6):  # a connection each: whichever worker, 20000 > 16384
                async with http.post(
                    base + "/v1/chat/completions", json=body, headers=loop
                ) as resp:
                    assert resp.status == 200, await resp.text()
                    assert resp.headers.get("X-Detproxy-Attempts") == "2", (
                        f"the loop was not retried: {dict(resp.headers)}"
                    )
                    assert resp.headers.get("X-Detproxy-Recovered") == "true"
