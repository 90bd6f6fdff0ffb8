"""``detproxy report --html FILE``: the explorer's views over incident logs, in one
self-contained HTML file (inline CSS, script and SVG; it opens with no network)."""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

import orjson

from proxy.observe.kinds import AUDIT, CAUSE, INCIDENT_KINDS, LOOP, TALLY, UPSTREAM_KINDS
from proxy.observe.ui.filters import IncidentFilter
from proxy.observe.ui.incident import Detail, detail_of
from proxy.observe.ui.overview import Inputs, Key3, build_overview
from proxy.observe.ui.page import new_nonce
from proxy.observe.ui.render import report_page
from proxy.observe.ui.timeline import points_from_tallies
from proxy.tools.report.load import Tally, iter_lines, parse_tally
from proxy.tools.report.summary import Coverage, coverage_of, iso, latest_tallies

MAX_INCIDENTS = 1000  # pages in one file, the newest


@dataclass(slots=True)
class Records:
    incidents: list[dict[str, Any]] = field(default_factory=list)
    tallies: list[Tally] = field(default_factory=list)
    skipped: int = 0  # malformed lines and lines of no known kind


def read_records(paths: Sequence[str]) -> Records:
    """Incident dicts and tallies of the files; an incident line seen twice counts once.
    Raises LogReadError for a file that cannot be read."""
    out = Records()
    seen: set[bytes] = set()
    causes: list[dict[str, Any]] = []
    for path in paths:
        for raw in iter_lines(path):
            line = raw.strip()
            if not line:
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                out.skipped += 1
                continue
            kind = obj.get("kind") if isinstance(obj, dict) else None
            if kind == TALLY:
                tally = parse_tally(obj)
                if tally is None:
                    out.skipped += 1
                else:
                    out.tallies.append(tally)
            elif kind in INCIDENT_KINDS:
                digest = hashlib.blake2b(line, digest_size=16).digest()
                if digest not in seen:
                    seen.add(digest)
                    out.incidents.append(obj)
            elif kind == CAUSE:
                causes.append(obj)
            else:
                out.skipped += 1
    merge_causes(out.incidents, causes)
    return out


def merge_causes(incidents: list[dict[str, Any]], causes: list[dict[str, Any]]) -> None:
    """Each ``kind: cause`` line's verdict onto the audit incident it names (by ``audit_ts``,
    ``request_id``, ``mode`` and ``choice``; the latest line wins)."""
    if not causes:
        return
    by_key = {
        (c.get("audit_ts"), c.get("request_id"), c.get("mode"), c.get("choice")): c for c in causes
    }
    for record in incidents:
        if record.get("kind") != "audit":
            continue
        key = (record.get("ts"), record.get("request_id"), record.get("mode"), record.get("choice"))
        found = by_key.get(key)
        if found is not None:
            record["cause"] = found.get("cause")
            record["cause_evidence"] = found.get("cause_evidence")


def _summed(
    tallies: list[Tally], part: Callable[[Tally], dict[Key3, int]], keep: Callable[[str], bool]
) -> Counter[Key3]:
    out: Counter[Key3] = Counter()
    for t in tallies:
        out.update({k: n for k, n in part(t).items() if keep(k[0])})
    return out


def _ts(record: dict[str, Any]) -> float:
    ts = record.get("ts")
    return float(ts) if isinstance(ts, int | float) and not isinstance(ts, bool) else float("-inf")


def _after_note(incidents: Sequence[dict[str, Any]], coverage: Coverage) -> list[str]:
    """The incidents newer than the tallies: listed, but not yet in the counts and rates."""
    if coverage.newest is None:
        return []
    after = 0
    for r in incidents:
        process = r.get("process")
        if r.get("kind") in (AUDIT, LOOP) and not coverage.counts(
            _ts(r), process if isinstance(process, str) else ""
        ):
            after += 1
    if not after:
        return []
    return [
        f"{after} incident(s) came after the newest tally ({iso(coverage.newest)}): they are in"
        " the list, not yet in the counts and rates (the next tally counts them)"
    ]


def html_report(paths: Sequence[str], model_glob: str | None = None) -> str:
    records = read_records(paths)

    def keep(model: str) -> bool:
        return model_glob is None or fnmatchcase(model, model_glob)

    incidents = [
        r
        for r in records.incidents
        if r.get("kind") in UPSTREAM_KINDS or keep(str(r.get("model", "")))
    ]
    incidents.sort(key=_ts, reverse=True)
    latest = latest_tallies(records.tallies)
    tallied = bool(latest)
    kept_tallies = [
        Tally(
            t.process,
            t.ts,
            t.started,
            {k: n for k, n in t.audits.items() if keep(k[0])},
            t.loops,
            t.actions,
            t.dropped,
        )
        for t in records.tallies
    ]
    inputs = Inputs(
        records=incidents,
        audits=_summed(latest, lambda t: t.audits, keep) if tallied else None,
        loops=_summed(latest, lambda t: t.loops, keep) if tallied else None,
        recoveries=_summed(latest, lambda t: t.recoveries, keep) if tallied else None,
        by_inflight=_summed(latest, lambda t: t.by_inflight, keep)
        if tallied and any(t.by_inflight for t in latest)
        else None,
        points=points_from_tallies(kept_tallies),
        readings=(),
        now=None,
        source=", ".join(paths),
        notes=_after_note(incidents, coverage_of(latest)),
    )
    overview = build_overview(inputs, IncidentFilter(limit=MAX_INCIDENTS))
    details: list[Detail] = [
        d for r in incidents[:MAX_INCIDENTS] if (d := detail_of(r)) is not None
    ]
    return report_page(overview, details, new_nonce(), max(0, len(incidents) - MAX_INCIDENTS))
