from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import orjson

from proxy.audit.compare import Divergence, Verdict
from proxy.config import IncidentConfig
from proxy.events import AuditCompleted, EventBus
from proxy.observe.incidents import IncidentLog
from proxy.tools.emulator import EmulatorServer


def event(i: int, verdict: str = "text_divergence", **extra: Any) -> AuditCompleted:
    v = Verdict(
        verdict=verdict,
        reason=None,
        divergence=Divergence(3, "a", "b", (("a", -0.1),), (("b", -0.2),), 0.5),
        max_abs_logprob_delta=0.25,
        primary_hash="p",
        shadow_hash="s",
        primary_tokens=10,
        shadow_tokens=10,
    )
    return AuditCompleted(
        request_id=f"r{i}",
        model="m",
        endpoint="chat",
        mode="full",
        choice=0,
        verdict=v,
        request_key="k",
        inflight_primary=1,
        inflight_shadow=0,
        primary_latency_s=0.1,
        shadow_latency_s=0.2,
        target="same",
        timestamp=time.time(),
        **extra,
    )


def test_only_non_identical_audits_are_incidents_newest_first(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig(path=str(tmp_path / "inc.jsonl"), ring_size=3))
    bus = EventBus()
    log.subscribe(bus)
    for i in range(5):
        bus.publish(event(i))
    bus.publish(event(99, verdict="identical"))
    assert [r["request_id"] for r in log.recent(10)] == ["r4", "r3", "r2"]  # ring bounded
    log.close()
    lines = (tmp_path / "inc.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["request_id"] for x in lines] == ["r0", "r1", "r2", "r3", "r4"]
    first = orjson.loads(lines[0])
    assert first["divergence"]["index"] == 3 and first["verdict"] == "text_divergence"
    assert "prompt" not in first and first["primary_hash"] == "p"


def test_text_is_kept_only_when_the_event_carries_it(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig())
    bus = EventBus()
    log.subscribe(bus)
    bus.publish(event(1, prompt="secret prompt", primary_text="x", shadow_text="y"))
    (record,) = log.recent(1)
    assert (record["prompt"], record["primary_text"], record["shadow_text"]) == (
        "secret prompt",
        "x",
        "y",
    )


def test_rotation_keeps_backups(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path), max_bytes=1500, backups=2))
    bus = EventBus()
    log.subscribe(bus)
    for i in range(20):
        bus.publish(event(i))
    log.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["inc.jsonl", "inc.jsonl.1", "inc.jsonl.2"]
    ids = [
        orjson.loads(x)["request_id"]
        for name in ("inc.jsonl.2", "inc.jsonl.1", "inc.jsonl")
        for x in (tmp_path / name).read_bytes().splitlines()
    ]
    assert ids == [f"r{i}" for i in range(20 - len(ids), 20)]  # oldest fell off, order kept
    assert all(p.stat().st_size <= 1500 for p in tmp_path.iterdir())


async def test_incidents_endpoint_and_store_text(make_proxy: Any, tmp_path: Path) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env={
                "DETPROXY_INCIDENTS__STORE_TEXT": "true",
                "DETPROXY_INCIDENTS__PATH": str(tmp_path / "i.jsonl"),
            },
        )
        body = {
            "model": "emulator-model",
            "temperature": 0,
            "max_tokens": 6,
            "messages": [{"role": "user", "content": "the prompt"}],
        }
        await client.post("/v1/chat/completions", json=body)
        await client.post(
            "/v1/chat/completions",
            json=body,
            headers={"X-Emulator-Knobs": '{"flip_probability": 1, "flip_position": 2}'},
        )
        (incident,) = await (await client.get("/detproxy/incidents?limit=5")).json()
        assert incident["mode"] == "duplicate" and incident["verdict"] == "text_divergence"
        assert "the prompt" in incident["prompt"] and incident["primary_text"] is None
        resp = await client.get("/detproxy/incidents?limit=abc")
        assert resp.status == 400 and (await resp.json())["error"]["param"] == "limit"
        assert await (await client.get("/detproxy/incidents?limit=0")).json() == []
        await client.close()  # shutdown flushes the file
        line = (tmp_path / "i.jsonl").read_bytes().splitlines()[0]
        assert orjson.loads(line)["request_id"] == incident["request_id"]


async def test_tally_lines_carry_the_denominators(make_proxy: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env={
                "DETPROXY_INCIDENTS__PATH": str(path),
                "DETPROXY_INCIDENTS__TALLY_INTERVAL_S": "0.05",
            },
        )
        body = {
            "model": "emulator-model",
            "temperature": 0,
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "twice"}],
        }
        for _ in range(3):
            await client.post("/v1/chat/completions", json=body)
        await asyncio.sleep(0.2)
        await client.close()
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    tallies = [x for x in lines if x["kind"] == "tally"]
    assert len(tallies) >= 2  # periodic, and a last one at shutdown
    last = tallies[-1]
    assert last["audits"] == {"emulator-model": {"duplicate": {"identical": 2}}}
    assert last["process"] == tallies[0]["process"] and last["ts"] >= tallies[0]["ts"]
