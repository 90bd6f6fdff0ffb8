"""The overview's data assembly: time series from history and from tallies, the batch-effects
curve, loops and recoveries, fingerprint spans, filtering."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import orjson

from policies.base import Trigger
from proxy.audit.verdict import Verdict
from proxy.engine.identity import Fingerprint
from proxy.events import (
    AuditCompleted,
    EventBus,
    LoopDetected,
    PolicyActed,
    UpstreamFingerprinted,
    UpstreamRestarted,
    UpstreamUnreachable,
)
from proxy.observe.status import INFLIGHT_CAP, AuditTally
from proxy.observe.ui.filters import IncidentFilter
from proxy.observe.ui.history import LiveHistory
from proxy.observe.ui.overview import Inputs, build_overview
from proxy.observe.ui.timeline import Observation, Point, columns, points_from_tallies, spans
from proxy.tools.report.load import Tally, parse_tally
from tests.observe.ui.records import audit, change, loop


def completed(verdict: str, ts: float, inflight: int, model: str = "m1") -> AuditCompleted:
    v = Verdict(verdict, None, None, None, "a", "b", 1, 1)
    return AuditCompleted("r", model, "chat", "full", 0, v, "k", inflight, 0, 0.1, 0.1, "same", ts)


def inputs(
    records: list[dict[str, Any]],
    tally: AuditTally | None,
    history: LiveHistory | None,
    now: float | None = None,
) -> Inputs:
    return Inputs(
        records=records,
        audits=tally.audits if tally else None,  # type: ignore[arg-type]
        loops=tally.loops if tally else None,  # type: ignore[arg-type]
        recoveries=tally.recoveries if tally else None,  # type: ignore[arg-type]
        by_inflight=tally.by_inflight if tally else None,  # type: ignore[arg-type]
        points=history.points() if history else (),
        readings=history.readings() if history else (),
        now=now,
        source="test",
    )


def test_columns_bucket_points_and_rates_count_identical_audits() -> None:
    pts = [
        Point(0.0, "m", "identical", 3),
        Point(1.0, "m", "text_divergence", 1),
        Point(9.9, "m", "logprob_drift", 2),
        Point(10.0, "m", "identical", 2),
        Point(11.0, "m", "identical", 5),
    ]
    cols = columns(pts, 0.0, 10.0, n=2)
    assert [c.total for c in cols] == [4, 4]  # the point past the end is left out
    assert cols[0].rate == 0.25 and cols[1].rate == 0.5
    assert cols[0].counts == (("identical", 3), ("text_divergence", 1))


def test_points_from_tallies_are_the_differences_of_one_process_lines() -> None:
    def tally(process: str, ts: float, identical: int, diverged: int) -> Tally:
        audits = {("m", "full", "identical"): identical, ("m", "full", "text_divergence"): diverged}
        return Tally(process, ts, 0.0, audits, {}, {}, {})

    pts = points_from_tallies(
        [tally("p", 20.0, 7, 1), tally("p", 10.0, 5, 0), tally("q", 15.0, 2, 2)]
    )
    got = sorted((p.ts, p.verdict, p.count) for p in pts)
    assert got == [
        (10.0, "identical", 5),
        (15.0, "identical", 2),
        (15.0, "text_divergence", 2),
        (20.0, "identical", 2),
        (20.0, "text_divergence", 1),
    ]


def test_spans_merge_runs_of_one_fingerprint() -> None:
    obs = [
        Observation(t, fp, "vllm", None)
        for t, fp in ((3, "a"), (1, "a"), (5, "b"), (7, "b"), (9, "a"))
    ]
    assert [(s.fingerprint, s.first, s.last) for s in spans(obs)] == [
        ("a", 1, 3),
        ("b", 5, 7),
        ("a", 9, 9),
    ]


def test_live_history_is_bounded_and_keeps_each_fingerprint_run_ends() -> None:
    history, bus = LiveHistory(bucket_s=10.0, max_buckets=3), EventBus()
    history.subscribe(bus)
    for ts in (0.0, 5.0, 15.0, 25.0, 35.0):
        bus.publish(completed("identical", ts, 1))
    assert sorted({p.ts for p in history.points()}) == [15.0, 25.0, 35.0]  # the oldest dropped

    def reading(fp: str, at: float) -> None:
        print_ = Fingerprint("vllm", "1", ("m",), {}, fingerprint=fp, read_at=at)
        bus.publish(UpstreamFingerprinted(print_, None, False))

    for fp, at in (("a", 1), ("a", 2), ("a", 3), ("a", 4), ("b", 5), ("b", 6)):
        reading(fp, at)
    assert [(o.fingerprint, o.ts) for o in history.readings()] == [
        ("a", 1),
        ("a", 4),
        ("b", 5),
        ("b", 6),
    ]


def test_the_overview_of_live_sources_per_model() -> None:
    bus, tally, history = EventBus(), AuditTally(), LiveHistory()
    tally.subscribe(bus)
    history.subscribe(bus)
    # batch effects: at 1 in flight all identical, at 8 half diverge
    for i in range(4):
        bus.publish(completed("identical", 100.0 + i, 1))
        bus.publish(completed("identical" if i % 2 else "text_divergence", 100.0 + i, 8))
    bus.publish(completed("identical", 100.0, 200))  # counted as INFLIGHT_CAP
    bus.publish(completed("incomparable", 100.0, 1, model="m2"))
    trigger = Trigger("proxy", "content", 0, 5, 9, 0, None)
    bus.publish(LoopDetected("l", "m1", "chat", True, 1, trigger, 101.0))
    bus.publish(PolicyActed("l", "m1", "retry", "recovered", 1, "restart"))
    bus.publish(PolicyActed("l2", "m1", "retry", "looped_again", 1, "restart"))
    records = [
        loop(ts=101.0),
        audit(ts=102.0),
        change(ts=50.0),
        audit("old", ts=40.0, model="m2", verdict="logprob_drift"),
    ]
    ov = build_overview(inputs(records, tally, history, now=110.0), IncidentFilter())
    assert [m.model for m in ov.models] == ["m1", "m2"]  # the busiest first
    m1 = ov.models[0]
    assert m1.audited == 9 and m1.rate == 2 / 9
    assert [(p.label, p.comparable, p.unstable, p.diverged) for p in m1.inflight] == [
        ("1", 4, 0, 0),
        ("8", 4, 2, 2),
        (f"{INFLIGHT_CAP}+", 1, 0, 0),
    ]
    assert m1.loops == (("content", "proxy", 1),)
    assert m1.strategies is not None
    assert [(s.strategy, s.retried, s.recovered, s.rate) for s in m1.strategies] == [
        ("restart", 2, 1, 0.5)
    ]
    assert m1.with_denominators and sum(c.total for c in m1.columns) == 9
    assert (ov.start, ov.end) == (40.0, 110.0)
    assert [s.fingerprint for s in ov.spans] == [
        "0123456789abcdef",
        "fedcba9876543210",
        "0123456789abcdef",
    ]
    assert [r.request_id for r in ov.rows] == [
        "loop-1",
        "req-1",
        "",
        "old",
    ]  # as given: newest first
    m2 = build_overview(inputs(records, tally, history), IncidentFilter(model="m2", limit=1))
    assert [m.model for m in m2.models] == ["m2"] and [r.request_id for r in m2.rows] == ["old"]
    assert m2.matching == 1 and m2.recorded == 4


def test_without_tallies_counts_are_of_incidents_and_rates_unknown() -> None:
    records = [
        audit(ts=1.0, inflight=3),
        audit("b", ts=2.0, inflight=3, verdict="answer_divergence"),
        loop(ts=3.0),
    ]
    ov = build_overview(inputs(records, None, None), IncidentFilter())
    (m1,) = ov.models
    assert m1.audited is None and m1.rate is None and m1.strategies is None
    assert not m1.with_denominators and sum(c.total for c in m1.columns) == 2
    assert [(p.label, p.comparable, p.unstable, p.diverged) for p in m1.inflight] == [
        ("3", None, 2, 2)
    ]
    assert m1.loops == (("content", "proxy", 1),)
    assert any("no tally" in n for n in ov.notes)
    assert dict(Counter(r.verdict for r in ov.rows)) == {
        "text_divergence": 1,
        "answer_divergence": 1,
        "loop": 1,
    }


def test_tally_lines_carry_audits_by_inflight_and_the_report_reads_them() -> None:
    bus, tally = EventBus(), AuditTally()
    tally.subscribe(bus)
    bus.publish(completed("identical", 1.0, 2))
    bus.publish(completed("text_divergence", 1.0, 2))
    bus.publish(completed("identical", 1.0, 500))
    line = orjson.loads(orjson.dumps(tally.summary()))
    assert line["audits_by_inflight"] == {
        "m1": {"2": {"identical": 1, "text_divergence": 1}, str(INFLIGHT_CAP): {"identical": 1}}
    }
    parsed = parse_tally(line)
    assert parsed is not None
    assert parsed.by_inflight == {
        ("m1", "2", "identical"): 1,
        ("m1", "2", "text_divergence"): 1,
        ("m1", str(INFLIGHT_CAP), "identical"): 1,
    }
    del line["audits_by_inflight"]  # a tally of an older detproxy
    older = parse_tally(line)
    assert older is not None and older.by_inflight == {}


def test_the_live_overview_says_when_the_upstream_is_down_and_how_often_it_restarted() -> None:
    history, bus, tally = LiveHistory(), EventBus(), AuditTally()
    history.subscribe(bus)
    print_ = Fingerprint("vllm", "0.23.0", ("m",), {}, fingerprint="a", read_at=120.0)

    def notes() -> tuple[str, ...]:
        live = replace(inputs([], tally, history, now=200.0), upstream=history.upstream_notes())
        return build_overview(live, IncidentFilter()).notes

    assert notes() == ()
    bus.publish(UpstreamUnreachable("connection refused", 60.0, was_up=False))
    assert notes() == (
        "The upstream is not up yet since 1970-01-01T00:01:00.000Z: connection refused",
    )
    bus.publish(UpstreamFingerprinted(print_, None, False))
    assert notes() == ()
    bus.publish(UpstreamUnreachable("HTTP 503 on /version, /v1/models, /props", 150.0, True))
    assert notes()[0].startswith("The upstream is down since 1970-01-01T00:02:30.000Z: HTTP 503")
    bus.publish(UpstreamFingerprinted(print_, print_, False))
    bus.publish(UpstreamRestarted(print_, 30.0, "outage"))
    assert notes() == (
        "The upstream restarted 1 time(s), the last at 1970-01-01T00:02:00.000Z: the same"
        " identity each time, not a change",
    )
