"""Scale-out on one machine: two detproxy replicas behind haproxy, a real Prometheus scraping
both with detproxy's recording rules, and the fleet nondeterminism rate read back over
Prometheus's HTTP API equals what the injected traffic implies."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from proxy.tools.emulator import EmulatorServer
from tests.helpers.processes import detproxy_serve, free_port, wait_healthy
from tests.helpers.waiting import Unmet, eventually

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("haproxy")),
        reason="needs Debian's prometheus and haproxy",
    ),
]
RULES = Path(__file__).resolve().parents[2] / "deploy/prometheus/detproxy-rules.yaml"
FLIPPED_EVERY = 4  # one request in four is made nondeterministic: the rate must read 0.25


async def start(args: list[str], log: Path) -> asyncio.subprocess.Process:
    with open(log, "wb") as out:  # noqa: ASYNC230 (a log file, before the loop gets busy)
        return await asyncio.create_subprocess_exec(*args, stdout=out, stderr=out)


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    env = {"DETPROXY_AUDIT__SAMPLE_RATE": "1", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"}
    async with (
        EmulatorServer() as emu,
        detproxy_serve(emu.url, env=env) as (one, _),
        detproxy_serve(emu.url, env=env) as (two, _),
    ):
        lb_port, prom_port = free_port(), free_port()
        (tmp_path / "haproxy.cfg").write_text(f"""
defaults
  mode http
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend detproxy
  bind 127.0.0.1:{lb_port}
  default_backend replicas
backend replicas
  balance roundrobin
  server one {one.removeprefix("http://")}
  server two {two.removeprefix("http://")}
""")
        (tmp_path / "prometheus.yml").write_text(f"""
global:
  scrape_interval: 1s
  evaluation_interval: 1s
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: detproxy
    metrics_path: /detproxy/metrics
    static_configs:
      - targets: ["{one.removeprefix("http://")}", "{two.removeprefix("http://")}"]
""")
        procs = [
            await start(
                ["haproxy", "-db", "-f", str(tmp_path / "haproxy.cfg")], tmp_path / "haproxy.log"
            ),
            await start(
                [
                    "prometheus",
                    f"--config.file={tmp_path / 'prometheus.yml'}",
                    f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                    f"--web.listen-address=127.0.0.1:{prom_port}",
                ],
                tmp_path / "prometheus.log",
            ),
        ]
        try:
            prom = f"http://127.0.0.1:{prom_port}"
            await wait_healthy(prom + "/-/ready", timeout_s=30)
            await wait_healthy(f"http://127.0.0.1:{lb_port}/detproxy/health")
            yield {"lb": f"http://127.0.0.1:{lb_port}", "prom": prom, "replicas": [one, two]}
        finally:
            for proc in procs:
                proc.terminate()
                await proc.wait()


async def query(http: aiohttp.ClientSession, prom: str, expr: str) -> list[dict[str, Any]]:
    async with http.get(prom + "/api/v1/query", params={"query": expr}) as resp:
        body = await resp.json()
    return body["data"]["result"]  # type: ignore[no-any-return]


async def test_fleet_rate_through_prometheus(fleet: dict[str, Any]) -> None:
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 8,
        "messages": [{"role": "user", "content": "fleet"}],
    }
    flip = {"X-Emulator-Knobs": orjson.dumps({"flip_probability": 1, "flip_position": 2}).decode()}
    async with aiohttp.ClientSession() as http:
        # Traffic starts once Prometheus scrapes both replicas: what a counter counted before
        # its first scrape is invisible to rate().
        async def both_up() -> list[dict[str, Any]] | Unmet:
            up = await query(http, fleet["prom"], 'up{job="detproxy"} == 1')
            return up if len(up) == 2 else Unmet(up)

        await eventually(both_up, timeout_s=20, interval_s=0.1, what="Prometheus scrapes both")
        for i in range(120):  # ~6 s of traffic, spread over both replicas by haproxy
            headers = flip if i % FLIPPED_EVERY == 0 else {}
            async with http.post(
                fleet["lb"] + "/v1/chat/completions", json=body, headers=headers
            ) as resp:
                assert resp.status == 200
            await asyncio.sleep(0.05)
        per_replica = []
        for replica in fleet["replicas"]:
            status = await (await http.get(replica + "/detproxy/status")).json()
            per_replica.append(status["audit"]["audits"])
        assert all(n > 20 for n in per_replica)  # both replicas took traffic

        async def fleet_rate() -> float | Unmet:
            result = await query(http, fleet["prom"], "detproxy:nondeterminism_rate:5m")
            rate = float(result[0]["value"][1]) if result else None
            return (
                rate if rate is not None and abs(rate - 1 / FLIPPED_EVERY) < 0.05 else Unmet(rate)
            )

        await eventually(
            fleet_rate, timeout_s=40, interval_s=0.5, what=f"a fleet rate of {1 / FLIPPED_EVERY}"
        )
        targets = await query(http, fleet["prom"], 'up{job="detproxy"}')
    assert len(targets) == 2 and all(t["value"][1] == "1" for t in targets)
