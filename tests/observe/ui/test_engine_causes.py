"""The explorer and engine truth (SPEC 1.15) and causes (SPEC 1.14): the engine_mismatch and
upstream_restart incidents as detproxy records them, what loaded (live and from files), the
recipe an audit was measured on, triage's cause per model, per upstream and per incident."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import orjson

from proxy.config import IncidentConfig
from proxy.engine.expect import Mismatch
from proxy.engine.facts import EngineFacts
from proxy.events import EngineFactsRead, EventBus
from proxy.observe.incidents import IncidentLog
from proxy.observe.ui.filters import IncidentFilter, parse_filter
from proxy.observe.ui.history import LiveHistory
from proxy.observe.ui.incident import (
    AuditDetail,
    EngineMismatchDetail,
    RestartDetail,
    detail_of,
    row_of,
)
from proxy.observe.ui.overview import Inputs, build_overview
from proxy.observe.ui.page import Links
from proxy.observe.ui.render import incident_page, overview_page
from proxy.observe.ui.report import html_report
from tests.observe.ui.records import UPSTREAM, audit

FACTS = EngineFacts(
    values={"engine": "vllm", "version": "0.23.0", "attention_backend": "FLASH_ATTN"},
    sources={"attention_backend": "log"},
    unknown_env=("VLLM_ATTENTION_BACKEND",),
)
READ = EngineFactsRead(
    FACTS,
    (Mismatch("attention_backend", "FLASHINFER", "FLASH_ATTN"),),
    (),
    ("attention_backend",),
    1_700_000_200.0,
)
RESTART = {
    "kind": "upstream_restart",
    "ts": 1_700_000_300.0,
    "down_s": 4.5,
    "evidence": "process_start_time",
    "upstream": UPSTREAM,
}


def mismatch_record() -> dict[str, Any]:
    """The engine_mismatch incident exactly as the incident log records it."""
    bus = EventBus()
    log = IncidentLog(IncidentConfig(path=None))
    log.subscribe(bus)
    bus.publish(READ)
    (record,) = log.recent(10)
    assert record["kind"] == "engine_mismatch", f"the log recorded {record!r}"
    return record


def inputs(records: list[dict[str, Any]], engine: dict[str, Any] | None = None) -> Inputs:
    return Inputs(records, None, None, None, None, (), (), None, "test", engine=engine)


def triaged(rid: str, cause: str | None, ts: float, **kw: Any) -> dict[str, Any]:
    record = audit(rid, ts=ts, **kw)
    if cause is not None:
        record["cause"] = cause
        record["cause_evidence"] = {"missing": ["no quiet time within 60 s"]}
    return record


def test_an_engine_mismatch_is_a_row_and_a_page_with_declared_and_loaded() -> None:
    record = mismatch_record()
    row = row_of(record)
    assert row is not None, "engine_mismatch is not a known kind"
    assert row.verdict == "engine_mismatch" and row.recipe == FACTS.digest()
    assert "attention_backend: declared FLASHINFER, loaded FLASH_ATTN" in row.summary
    detail = detail_of(record)
    assert isinstance(detail, EngineMismatchDetail)
    assert detail.mismatches == (("attention_backend", "FLASHINFER", "FLASH_ATTN"),)
    assert ("attention_backend", "FLASH_ATTN") in detail.loaded
    page = incident_page(detail, Links(), "N", "live")
    assert "Declared in [upstream.expect], not met" in page
    assert re.search(
        r"attention_backend</td><td><code>FLASHINFER</code></td><td><code>FLASH_ATTN", page
    )
    assert "VLLM_ATTENTION_BACKEND" in page and FACTS.digest() in page


def test_an_upstream_restart_is_a_row_and_a_page() -> None:
    row = row_of(RESTART)
    assert row is not None and row.verdict == "upstream_restart", "restart not shown"
    assert "after 4.5 s down" in row.summary
    detail = detail_of(RESTART)
    assert isinstance(detail, RestartDetail) and detail.down_s == 4.5
    page = incident_page(detail, Links(), "N", "live")
    assert "process_start_time" in page and "same identity" in page
    assert parse_filter([("verdict", "upstream_restart")]).verdict == "upstream_restart"


def test_an_audit_shows_its_recipe_and_cause_with_or_without_one() -> None:
    with_recipe = audit(upstream={**UPSTREAM, "recipe": "feedfacefeedface"})
    detail = detail_of(with_recipe)
    assert isinstance(detail, AuditDetail)
    page = incident_page(detail, Links(), "N", "live")
    assert "feedfacefeedface" in page, "the recipe the audit was measured on is not shown"
    assert "untriaged" in page
    unknown = triaged("r2", "unknown", 1_700_000_001.0)
    page = incident_page(detail_of(unknown), Links(), "N", "live")  # type: ignore[arg-type]
    assert "c-unknown" in page and "Missing:</b> no quiet time within 60 s" in page
    assert 'id="cause-evidence"' in page


def test_causes_per_model_per_fingerprint_and_on_each_row() -> None:
    other = {**UPSTREAM, "fingerprint": "fedcba9876543210"}
    records = [
        triaged("r1", "intrinsic", 1_700_000_005.0),
        triaged("r2", "batch", 1_700_000_004.0),
        triaged("r3", "batch", 1_700_000_003.0, upstream=other),
        triaged("r4", None, 1_700_000_002.0),  # not triaged (yet)
        triaged("r5", "prefix_cache", 1_700_000_001.0, model="m2"),
        triaged("r6", None, 1_700_000_000.0, verdict="incomparable"),  # triage never takes it
    ]
    ov = build_overview(inputs(records), IncidentFilter())
    views = {v.model: v for v in ov.models}
    assert views["m1"].causes == (("intrinsic", 1), ("batch", 2), ("untriaged", 1))
    assert views["m2"].causes == (("prefix_cache", 1),)
    assert dict(ov.causes_by_fingerprint) == {
        "0123456789abcdef": (("intrinsic", 1), ("batch", 1), ("prefix_cache", 1)),
        "fedcba9876543210": (("batch", 1),),
    }
    page = overview_page(ov, Links(), "N")
    assert 'id="causes-by-upstream"' in page and "cache_salt per tenant" in page
    assert page.count('data-cause="batch"') == 2 and page.count('data-cause=""') == 2
    assert page.count("cause c-untriaged") == 2  # r4's badge and m1's table; r6 is incomparable


def test_no_causes_no_engine_no_sections() -> None:
    ov = build_overview(inputs([audit()]), IncidentFilter())
    page = overview_page(ov, Links(), "N")
    assert ov.engine is None and ov.causes_by_fingerprint == ()
    assert 'id="engine"' not in page and 'id="causes-by-upstream"' not in page


def test_live_the_engine_as_read_now() -> None:
    bus = EventBus()
    history = LiveHistory()
    history.subscribe(bus)
    assert history.engine() is None
    bus.publish(READ)
    engine = history.engine()
    assert engine is not None and engine["recipe"] == FACTS.digest()
    ov = build_overview(inputs([], engine), IncidentFilter())
    assert ov.engine is not None and ov.engine.origin == "live"
    assert ov.engine.mismatches == (("attention_backend", "FLASHINFER", "FLASH_ATTN"),)
    page = overview_page(ov, Links(), "N")
    assert 'id="engine-mismatch"' in page and "VLLM_ATTENTION_BACKEND" in page


def test_a_report_file_merges_cause_lines_and_shows_the_engine(tmp_path: Path) -> None:
    first = audit("r1", ts=1_700_000_010.0)
    cause = {
        "kind": "cause",
        "ts": 1_700_000_040.0,
        "audit_ts": first["ts"],
        "request_id": "r1",
        "model": "m1",
        "mode": first["mode"],
        "choice": first["choice"],
        "verdict": first["verdict"],
        "cause": "speculative",
        "cause_evidence": {},
    }
    lines = [first, audit("r2", ts=1_700_000_020.0), mismatch_record(), RESTART, cause]
    path = tmp_path / "incidents.jsonl"
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    page = html_report([str(path)])
    assert page.count('data-cause="speculative"') == 1, "the cause line was not merged"
    assert 'id="engine-mismatch"' in page and "the last engine_mismatch incident" in page
    assert 'data-verdict="upstream_restart"' in page
