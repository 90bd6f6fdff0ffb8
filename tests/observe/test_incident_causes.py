"""Triage's cause on an audit incident: merged into the ring, appended to the file as its own
``kind: cause`` line (the first record is never rewritten), merged back by the report's reader."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import orjson
from prometheus_client import CollectorRegistry

from proxy.config import IncidentConfig
from proxy.events import CauseAttributed, EventBus
from proxy.observe.incidents import IncidentLog
from proxy.observe.metrics import Metrics
from proxy.observe.status import AuditTally
from proxy.tools.report.load import read_logs
from tests.helpers.metrics import metric
from tests.observe.test_incidents import event


def cause(audit_ts: float, request_id: str = "r1", cause: str = "batch") -> CauseAttributed:
    return CauseAttributed(
        request_id=request_id,
        model="m",
        mode="full",
        choice=0,
        verdict="text_divergence",
        cause=cause,
        evidence={"reason": "why", "missing": [], "runs": []},
        timestamp=audit_ts + 5,
        audit_ts=audit_ts,
        upstream="fp1",
    )


async def test_a_cause_is_merged_into_its_incident_and_appended_as_a_line(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path)))
    bus = EventBus()
    log.subscribe(bus)
    first, other = event(1), event(2)
    bus.publish(first)
    bus.publish(other)
    bus.publish(cause(first.timestamp))
    await log.close()

    ring = {r["request_id"]: r for r in log.recent(10)}
    assert ring["r1"]["cause"] == "batch"
    assert ring["r1"]["cause_evidence"]["reason"] == "why"
    assert "cause" not in ring["r2"]
    assert len(log.recent(10)) == 2  # the cause line is not an incident of its own

    lines = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [line["kind"] for line in lines] == ["audit", "audit", "cause"]
    assert "cause" not in lines[0]  # the first record as it was written
    assert lines[2] | {"cause_evidence": None} == {
        "kind": "cause",
        "ts": first.timestamp + 5,
        "audit_ts": first.timestamp,
        "request_id": "r1",
        "model": "m",
        "mode": "full",
        "choice": 0,
        "verdict": "text_divergence",
        "cause": "batch",
        "cause_evidence": None,
        "upstream_fingerprint": "fp1",
    }

    data = read_logs([str(path)])
    merged = {a.request_id: a for a in data.audits}
    assert merged["r1"].cause == "batch"
    assert merged["r2"].cause is None


async def test_a_cause_for_an_incident_no_longer_in_the_ring_is_still_written(
    tmp_path: Path,
) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path), ring_size=1))
    bus = EventBus()
    log.subscribe(bus)
    first = event(1)
    bus.publish(first)
    bus.publish(event(2))  # pushes r1 out of the ring
    bus.publish(cause(first.timestamp))
    await log.close()
    assert "cause" not in log.recent(10)[0]
    assert orjson.loads(path.read_bytes().splitlines()[-1])["cause"] == "batch"


async def test_a_cause_triaged_again_replaces_the_unknown_everywhere(tmp_path: Path) -> None:
    """An unknown for the budget, triaged again once it freed: the incident, the report's
    merge, the status's count and the metrics all say the new cause (the metrics also count
    the unknown it replaced)."""
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path)))
    bus = EventBus()
    log.subscribe(bus)
    tally = AuditTally()
    tally.subscribe(bus)
    registry = CollectorRegistry()
    Metrics(registry).subscribe(bus)
    first = event(1)
    bus.publish(first)
    bus.publish(cause(first.timestamp, cause="unknown"))
    assert tally.causes_by_model() == {"m": {"unknown": 1}}
    bus.publish(replace(cause(first.timestamp, cause="batch"), revises="unknown"))
    await log.close()

    assert log.recent(10)[0]["cause"] == "batch"
    assert tally.causes_by_model() == {"m": {"batch": 1}}, "one incident, counted once"
    assert metric(registry, "detproxy_divergence_causes_total", model="m", cause="batch") == 1
    assert metric(registry, "detproxy_divergence_causes_total", model="m", cause="unknown") == 1
    replaced = metric(
        registry, "detproxy_divergence_causes_revised_total", model="m", cause="unknown"
    )
    assert replaced == 1
    assert read_logs([str(path)]).audits[0].cause == "batch"
