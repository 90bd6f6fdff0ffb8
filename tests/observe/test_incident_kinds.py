"""Every kind of incident detproxy writes is one that its readers accept: the
``/detproxy/incidents`` filter (``kind=`` and ``verdict=``), the explorer's list filter and
rows, and ``detproxy report`` (one list, ``proxy.observe.kinds``; ``kind=upstream_restart``
was once a 400)."""

from __future__ import annotations

import ast
import time
from pathlib import Path
from typing import Any

import pytest

import proxy.observe.incidents as writer
from policies.base import Trigger
from proxy.config import IncidentConfig
from proxy.engine.expect import Mismatch
from proxy.engine.facts import EngineFacts
from proxy.engine.identity import Fingerprint
from proxy.events import (
    EngineFactsRead,
    EventBus,
    LoopDetected,
    PolicyActed,
    UpstreamFingerprinted,
    UpstreamRestarted,
)
from proxy.observe import kinds
from proxy.observe.incidents import IncidentLog, parse_query
from proxy.observe.ui.filters import parse_filter
from proxy.observe.ui.incident import row_of
from proxy.tools.emulator import EmulatorServer
from proxy.tools.report.load import read_logs
from tests.observe.test_incidents import event

OLD = Fingerprint("vllm", "0.23.0", ("m",), {"version": "0.23.0"}, fingerprint="0" * 16)
NEW = Fingerprint("vllm", "0.24.0", ("m",), {"version": "0.24.0"}, fingerprint="f" * 16)
FACTS = EngineFacts(values={"attention_backend": "FLASH_ATTN"}, sources={})


def every_event() -> list[object]:
    """One event of each kind the incident log turns into an incident."""
    loop = Trigger("proxy", "content", 0, 4, 8, 10, "unit")
    return [
        event(1),  # a non-identical audit
        LoopDetected("r2", "m", "chat", True, 1, loop, time.time(), "observe"),
        PolicyActed("r2", "m", "observe", "observe", 1),
        UpstreamFingerprinted(OLD, None, False),  # the first reading: no incident
        UpstreamFingerprinted(NEW, OLD, True),
        UpstreamRestarted(NEW, 3.0, "outage"),
        EngineFactsRead(
            FACTS,
            (Mismatch("attention_backend", "FLASHINFER", "FLASH_ATTN"),),
            (),
            ("attention_backend",),
            time.time(),
        ),
    ]


@pytest.fixture
async def written(tmp_path: Path) -> tuple[list[dict[str, Any]], Path]:
    """The incidents (the ring's records) and the file, from one event of each kind."""
    path = tmp_path / "incidents.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path)), process="p1")
    bus = EventBus()
    log.subscribe(bus)
    for ev in every_event():
        bus.publish(ev)
    await log.close()
    return log.recent(100), path


def test_the_walk_writes_every_incident_kind(written: tuple[list[dict[str, Any]], Path]) -> None:
    records, _ = written
    assert sorted(r["kind"] for r in records) == sorted(kinds.INCIDENT_KINDS), (
        "a kind the writer writes is missing from proxy.observe.kinds (or this walk misses it)"
    )
    assert {r["process"] for r in records} == {"p1"}, "an incident without its process"


def test_every_kind_written_is_accepted_by_every_filter(
    written: tuple[list[dict[str, Any]], Path],
) -> None:
    records, path = written
    log = IncidentLog(IncidentConfig(path=""))
    for record in records:
        log.record(dict(record))
    for record in records:
        kind = record["kind"]
        by_kind = log.select(parse_query([("kind", kind)]))
        assert [r["kind"] for r in by_kind] == [kind], f"kind={kind}"
        row = row_of(record)
        assert row is not None, f"the explorer has no row for {kind}"
        wanted = parse_filter([("verdict", row.verdict)])
        assert wanted.matches(row), f"the explorer's verdict={row.verdict}"
        assert log.select(parse_query([("verdict", row.verdict)])), f"verdict={row.verdict}"
    data = read_logs([str(path)])
    assert (data.malformed, data.unknown_kind) == (0, 0), "the report skipped a written line"


def test_every_kind_the_writer_names_is_in_the_one_list() -> None:
    """Read from the writer's source: a ``"kind":`` it writes is one of proxy.observe.kinds'
    names (a string written in its place would not be checked by the walk above)."""
    tree = ast.parse(Path(writer.__file__).read_text())
    named = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=True):
                if isinstance(key, ast.Constant) and key.value == "kind":
                    assert isinstance(value, ast.Name), f"a kind written as {ast.dump(value)}"
                    named.append(getattr(kinds, value.id))
    assert set(named) == {*kinds.INCIDENT_KINDS, kinds.CAUSE}


async def test_the_endpoint_filters_by_every_kind(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_INCIDENTS__PATH": ""})
        for kind in kinds.INCIDENT_KINDS:
            resp = await client.get(f"/detproxy/incidents?kind={kind}")
            assert resp.status == 200, f"kind={kind}: {resp.status} {await resp.text()}"
        resp = await client.get("/detproxy/incidents?kind=nope")
        message = (await resp.json())["error"]["message"]
        assert resp.status == 400 and ", ".join(kinds.INCIDENT_KINDS) in message
        await client.close()
