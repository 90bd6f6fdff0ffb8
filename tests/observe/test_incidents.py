from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import BUS
from proxy.audit.compare import Divergence, Verdict
from proxy.config import ConfigError, IncidentConfig, load_settings
from proxy.events import AuditCompleted, EventBus
from proxy.observe.incidents import IncidentLog, QueryError, parse_query
from proxy.tools.emulator import EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.waiting import Unmet, eventually


def sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


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


async def test_only_non_identical_audits_are_incidents_newest_first(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig(path=str(tmp_path / "inc.jsonl"), ring_size=3))
    bus = EventBus()
    log.subscribe(bus)
    log.start()  # the file's writer
    for i in range(5):
        bus.publish(event(i))
    bus.publish(event(99, verdict="identical"))
    assert [r["request_id"] for r in log.recent(10)] == ["r4", "r3", "r2"]  # ring bounded
    await log.close()
    lines = (tmp_path / "inc.jsonl").read_bytes().splitlines()
    assert [orjson.loads(x)["request_id"] for x in lines] == ["r0", "r1", "r2", "r3", "r4"]
    first = orjson.loads(lines[0])
    assert first["divergence"]["index"] == 3 and first["verdict"] == "text_divergence"
    assert "prompt" not in first and first["primary_hash"] == "p"


def test_text_is_kept_only_when_the_event_carries_it(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig(path=""))
    bus = EventBus()
    log.subscribe(bus)
    bus.publish(event(1, prompt="secret prompt", primary_text="x", shadow_text="y"))
    (record,) = log.recent(1)
    assert (record["prompt"], record["primary_text"], record["shadow_text"]) == (
        "secret prompt",
        "x",
        "y",
    )


async def test_rotation_keeps_backups(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path), max_bytes=1500, backups=2))
    bus = EventBus()
    log.subscribe(bus)
    log.start()  # the file's writer
    for i in range(20):
        bus.publish(event(i))
    await log.close()
    files = sorted(sizes(tmp_path))
    assert files == ["inc.jsonl", "inc.jsonl.1", "inc.jsonl.2"]
    ids = [
        orjson.loads(x)["request_id"]
        for name in ("inc.jsonl.2", "inc.jsonl.1", "inc.jsonl")
        for x in (tmp_path / name).read_bytes().splitlines()
    ]
    assert ids == [f"r{i}" for i in range(20 - len(ids), 20)]  # oldest fell off, order kept
    assert max(sizes(tmp_path).values()) <= 1500, sizes(tmp_path)


async def test_incidents_endpoint_and_store_text(make_proxy: Any, tmp_path: Path) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env=NO_SHADOWS  # the incident below is the passive duplicate check's
            | {
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

        async def file_status() -> dict[str, int] | Unmet:
            status = (await (await client.get("/detproxy/status")).json())["incidents"]
            return status if status["written"] >= 1 else Unmet(status)

        status = await eventually(file_status, what="the app's writer task wrote the incident")
        assert (status["queued"], status["dropped"]) == (0, 0), status
        await client.close()  # shutdown flushes the file
        line = (tmp_path / "i.jsonl").read_bytes().splitlines()[0]
        assert orjson.loads(line)["request_id"] == incident["request_id"]


async def test_tally_lines_carry_the_denominators(make_proxy: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env=NO_SHADOWS
            | {
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

        def tallied() -> bool:
            return path.exists() and b'"kind":"tally"' in path.read_bytes()

        await eventually(tallied, what="a periodic tally line")
        await client.close()
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    tallies = [x for x in lines if x["kind"] == "tally"]
    assert len(tallies) >= 2  # periodic, and a last one at shutdown
    last = tallies[-1]
    assert last["audits"] == {"emulator-model": {"duplicate": {"identical": 2}}}
    assert last["process"] == tallies[0]["process"] and last["ts"] >= tallies[0]["ts"]


async def test_the_default_log_is_on_disk_in_the_state_dir_its_folder_created(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    state = tmp_path / "not" / "there" / "yet"
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(state))
    log = IncidentLog(load_settings().incidents)
    bus = EventBus()
    log.subscribe(bus)
    bus.publish(event(1))
    await log.close()
    assert log.on_disk and log.written == 1
    (line,) = (state / "incidents.jsonl").read_bytes().splitlines()
    assert orjson.loads(line)["request_id"] == "r1"


async def test_the_default_log_rotates(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(tmp_path))
    config = IncidentConfig(max_bytes=1500, backups=2)  # the default path, small files
    assert config.path == str(tmp_path / "incidents.jsonl")
    log = IncidentLog(config)
    bus = EventBus()
    log.subscribe(bus)
    for i in range(20):
        bus.publish(event(i))
    await log.close()
    names = sorted(sizes(tmp_path))
    assert names == ["incidents.jsonl", "incidents.jsonl.1", "incidents.jsonl.2"]
    assert max(sizes(tmp_path).values()) <= 1500, sizes(tmp_path)


async def test_a_default_log_that_cannot_be_written_keeps_incidents_in_memory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")  # a folder cannot be made under a file (as root too)
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(blocker / "state"))
    with caplog.at_level(logging.WARNING, logger="proxy.observe.incidents"):
        log = IncidentLog(IncidentConfig())
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "in memory only" in warning.getMessage() and "DETPROXY_STATE_DIR" in warning.getMessage()
    bus = EventBus()
    log.subscribe(bus)
    bus.publish(event(1))
    assert not log.on_disk and [r["request_id"] for r in log.recent(5)] == ["r1"]
    await log.close()


@pytest.mark.parametrize("where", ["under-a-file", "a-folder"])
def test_a_configured_log_that_cannot_be_written_stops_the_start(
    tmp_path: Path, where: str
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    path = blocker / "incidents.jsonl" if where == "under-a-file" else tmp_path
    with pytest.raises(ConfigError) as exc:
        IncidentLog(IncidentConfig(path=str(path)))
    message = str(exc.value)
    assert message.startswith(f"incidents.path: cannot write {path}") and "\n" not in message
    assert 'incidents.path = ""' in message


async def test_a_configured_log_gets_its_folders(tmp_path: Path) -> None:
    path = tmp_path / "var" / "log" / "detproxy" / "incidents.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path)))
    await log.close()
    assert path.is_file() and log.on_disk


async def test_an_empty_path_keeps_incidents_in_memory_only(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig(path=""))
    assert not log.on_disk
    await log.close()


@pytest.mark.parametrize(
    ("query", "param", "says"),
    [
        ("verdict=loops", "verdict", "identical, logprob_drift, text_divergence"),
        ("verdict=diverged", "verdict", "loop, upstream_change"),
        ("kind=audits", "kind", "audit, loop, upstream_change"),
        ("mode=shadow", "mode", "full, prefill, n_choices, duplicate"),
        ("limit=-1", "limit", "non-negative integer"),
        ("limit=1.5", "limit", "non-negative integer"),
        ("limit=%D9%A5", "limit", "non-negative integer"),  # a non-ASCII digit
        ("verdcit=loop", "verdcit", "known: limit, kind, verdict, mode, model"),
        ("verdict=loop&verdict=identical", "verdict", "more than once"),
    ],
)
async def test_a_filter_the_endpoint_does_not_know_is_a_400_listing_the_known_values(
    make_proxy: Any, query: str, param: str, says: str
) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_INCIDENTS__PATH": ""})
        resp = await client.get(f"/detproxy/incidents?{query}")
        error = (await resp.json())["error"]
        assert (resp.status, error["param"], error["type"]) == (400, param, "BadRequestError"), (
            f"{query}: {resp.status} {error}"
        )
        assert says in error["message"], error["message"]
        await client.close()


def test_filters_select_by_kind_verdict_mode_and_model() -> None:
    log = IncidentLog(IncidentConfig(path=""))
    log.record({"kind": "audit", "verdict": "text_divergence", "mode": "full", "model": "a"})
    log.record({"kind": "audit", "verdict": "logprob_drift", "mode": "prefill", "model": "b"})
    log.record({"kind": "loop", "model": "a", "channel": "content"})
    log.record({"kind": "upstream_change"})

    def select(query: str) -> list[tuple[str | None, ...]]:
        pairs = [tuple(kv.split("=")) for kv in query.split("&") if kv]
        found = log.select(parse_query(pairs))  # type: ignore[arg-type]
        return [(r["kind"], r.get("verdict"), r.get("model")) for r in found]

    assert select("verdict=loop") == [("loop", None, "a")]
    assert select("kind=audit&model=a") == [("audit", "text_divergence", "a")]
    assert select("verdict=logprob_drift&mode=prefill") == [("audit", "logprob_drift", "b")]
    assert select("verdict=upstream_change") == [("upstream_change", None, None)]
    assert select("model=a&limit=1") == [("loop", None, "a")]  # newest first
    assert select("limit=0") == [] and len(select("")) == 4
    assert select("verdict=&model=") == select("")  # an empty value means unset
    with pytest.raises(QueryError):
        parse_query([("limit", "1" * 10)])


async def test_lines_a_full_queue_dropped_show_in_the_status_and_the_metrics(
    make_proxy: Any, registry: CollectorRegistry, tmp_path: Path
) -> None:
    async with EmulatorServer() as emu:
        env = {
            "DETPROXY_INCIDENTS__PATH": str(tmp_path / "i.jsonl"),
            "DETPROXY_INCIDENTS__QUEUE_LINES": "2",
        }
        client = await make_proxy(emu.url, env=env)
        bus = client.server.app[BUS]
        for i in range(5):  # no await between them: the writer cannot take any meanwhile
            bus.publish(event(i))
        status = (await (await client.get("/detproxy/status")).json())["incidents"]
        assert (status["recorded"], status["dropped"]) == (5, 3), status
        labels = {"component": "incident_log", "name": "queue_full"}
        assert metric(registry, "detproxy_isolated_failures_total", **labels) == 3
        await client.close()
    lines = [orjson.loads(x) for x in (tmp_path / "i.jsonl").read_bytes().splitlines()]
    assert [x["request_id"] for x in lines if x["kind"] == "audit"] == ["r0", "r1"]
