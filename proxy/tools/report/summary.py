"""From the records of incident logs to one report (a plain dict: what ``--json`` prints).

Denominators come from tallies: for each process its last tally line (highest ``ts``), summed
over processes. A tally counts what its process saw up to its ``ts``; on a live log the newest
incidents come after it. So that every figure covers the same period as the counts (and agrees
with ``/detproxy/status`` read then), the figures drawn from incident lines (positions, deltas,
causes, the note on lines against counts) use only the lines a tally has counted: a line of a
process up to that process's newest tally (a line that names no process, from an older detproxy:
up to the newest tally of any). The lines after are counted in ``coverage`` and each model's
``lines_after_tallies``, and stay in the worst items (``counted: false``). Without tallies,
every line is used.

The ``--json`` object (keys sorted; ``P`` = a proportion ``{count, denominator, of, rate,
ci_low, ci_high}`` with a 95% Wilson interval, rate and bounds null when the denominator is 0):
``schema``, ``files``, ``model_filter``, ``lines {read, audit, loop, tally, upstream_change,
malformed, unknown_kind, duplicate}`` (they add up to ``read``), ``time_range {first, last} |
null``, ``processes`` (ids whose last tally counted), ``denominators_known``, ``coverage
{counts_from (tally|incidents), until (the newest tally's time) | null, tallies [{process,
started, last}], newest_line | null, after_tallies {audit, loop}, tally_behind (bool: an
incident line is newer than its process's newest tally)}``, ``models {name: S}``,
``all_models S``,
``shadows_dropped {reason: n} | null``, ``worst [{request_id, model, mode, choice, verdict, index,
primary_token, shadow_token, margin, delta, ts, time}]``, ``notes [str]``. ``S``: ``counts_from``
(tally|incidents), ``audited``, ``audited_by_mode`` (null without tallies), ``verdicts``,
``verdicts_by_mode``, ``comparable``, ``rates {verdict: P}``, ``tar_r P``, ``tar_a P`` (null
without tallies, and null with ``tar_a_note`` when no audit line carries an extracted answer),
``answers_extracted`` (audit lines with an extracted answer, plus answer divergences),
``incident_lines {audit, loop}`` (the lines the figures use: those the tallies counted),
``lines_after_tallies {audit, loop}``, ``positions {count, divergent_lines, min, median, p90, max,
histogram [{bucket, count}], near_tie {threshold_nats, count, with_margin, share}}``,
``logprob_delta {count, null, p50, p90, p99, max}``, ``loops {counts_from, total,
by_channel_source}``, ``recovery_strategies {strategy: {retried, recovered, looped_again,
recovery P, generated_tokens, generated_per_retry, kept_tokens}}`` (null without tallies),
``policy_actions {by_action, retried, recovered, recovery P, aborts,
observed} | null``, ``causes {cause: {count, meaning, action}}`` (triage's verdicts on the audit
lines, SPEC 1.14; ``untriaged`` for those it has not decided) and ``unknown_missing {what: n}``.
Worst items carry ``cause`` (null: untriaged) and ``counted`` (false: after the tallies).
``causes_by_upstream [{fingerprint, recipe, causes {cause: n}}]``: the same per upstream the
audits were measured on.
``engine {recipes [digest], mismatches [{ts, time, recipe, fields [{field, declared,
loaded}]}], loaded {fact: value} | null, restarts {count, last, longest_down_s}}``: what the
engine loaded (SPEC 1.15), from the ``engine_mismatch`` and ``upstream_restart`` lines and the
recipe digests the audit lines were measured on.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from fnmatch import fnmatchcase
from typing import Any

from proxy.attribution.case import TRIAGED
from proxy.audit.verdict import VERDICTS
from proxy.tools.report.causes import (
    ACTION,
    MEANING,
    UNTRIAGED,
    cause_order,
    missing_evidence,
)
from proxy.tools.report.load import AuditLine, Key3, LogData, LoopLine, Tally
from proxy.tools.report.stats import delta_summary, position_summary, proportion

SCHEMA = "detproxy.report/1"
DIVERGED = ("text_divergence", "answer_divergence")
NO_ANSWERS = (
    "no answer was extracted: no answer extractor configured ([audit] answer_extractor),"
    " or it matched nothing"
)
WORST_RANK = {"answer_divergence": 0, "text_divergence": 1, "logprob_drift": 2}


def latest_tallies(tallies: Iterable[Tally]) -> list[Tally]:
    """Each process's last tally (highest ts; on a tie, the larger counts), sorted by process."""
    last: dict[str, Tally] = {}
    for t in tallies:
        prev = last.get(t.process)
        if prev is None or (t.ts, t.weight) > (prev.ts, prev.weight):
            last[t.process] = t
    return [last[p] for p in sorted(last)]


@dataclass(frozen=True, slots=True)
class Coverage:
    """Which incident lines the tallies have counted."""

    until: dict[str, float]  # process -> the ts of its newest tally
    newest: float | None  # the newest tally's ts; None: no tally (every line is used)

    def counts(self, ts: float, process: str) -> bool:
        """A line at ``ts`` of ``process`` ("" not named) is in the tallies' counts."""
        if self.newest is None:
            return True
        if not process:  # an older detproxy's line: the newest tally of any process
            return ts <= self.newest
        last = self.until.get(process)
        return last is not None and ts <= last


def coverage_of(tallies: list[Tally]) -> Coverage:
    """From each process's newest tally (``latest_tallies``)."""
    return Coverage({t.process: t.ts for t in tallies}, max((t.ts for t in tallies), default=None))


def _sum(tallies: list[Tally], part: Callable[[Tally], dict[Key3, int]]) -> Counter[Key3]:
    out: Counter[Key3] = Counter()
    for t in tallies:
        out.update(part(t))
    return out


def _nest(counts: Iterable[tuple[tuple[str, str], int]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for (a, b), n in sorted(counts):
        row = out.setdefault(a, {})
        row[b] = row.get(b, 0) + n
    return out


def iso(ts: float) -> str:
    """ISO 8601 UTC with milliseconds (``1970-01-01T00:00:00.000Z``)."""
    try:
        moment = datetime.fromtimestamp(ts, UTC)
    except (OverflowError, ValueError, OSError):
        return repr(ts)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _time_range(data: LogData) -> dict[str, str] | None:
    stamps = [a.ts for a in data.audits] + [lp.ts for lp in data.loops]
    stamps += [t.ts for t in data.tallies] + [t.started for t in data.tallies]
    return {"first": iso(min(stamps)), "last": iso(max(stamps))} if stamps else None


def _verdicts(by_mode: dict[str, dict[str, int]]) -> dict[str, int]:
    total: Counter[str] = Counter({v: 0 for v in VERDICTS})
    for counts in by_mode.values():
        total.update(counts)
    return {v: total[v] for v in (*VERDICTS, *sorted(set(total) - set(VERDICTS)))}


def _rates(verdicts: dict[str, int]) -> dict[str, Any]:
    audited = sum(verdicts.values())
    comparable = audited - verdicts["incomparable"]
    rates = {
        v: proportion(n, audited, "audited")
        if v == "incomparable"
        else proportion(n, comparable, "comparable")
        for v, n in verdicts.items()
    }
    return {
        "comparable": comparable,
        "rates": rates,
        "tar_r": proportion(
            verdicts["identical"] + verdicts["logprob_drift"], comparable, "comparable"
        ),
        "tar_a": proportion(comparable - verdicts["answer_divergence"], comparable, "comparable"),
    }


def _actions(by_action: dict[str, dict[str, int]]) -> dict[str, Any]:
    retry = by_action.get("retry", {})
    retried = sum(retry.values())
    return {
        "by_action": by_action,
        "retried": retried,
        "recovered": retry.get("recovered", 0),
        "recovery": proportion(retry.get("recovered", 0), retried, "retried"),
        "aborts": dict(sorted(by_action.get("abort", {}).items())),
        "observed": sum(by_action.get("observe", {}).values()),
    }


def _strategies(
    recoveries: dict[str, dict[str, int]], tokens: dict[str, dict[str, int]]
) -> dict[str, Any]:
    """Per recovery strategy: how often its retries recovered, and what they cost."""
    out = {}
    for strategy in sorted(set(recoveries) | set(tokens)):
        outcomes = recoveries.get(strategy, {})
        retried = sum(outcomes.values())
        recovered = outcomes.get("recovered", 0)
        generated = tokens.get(strategy, {}).get("generated", 0)
        out[strategy] = {
            "retried": retried,
            "recovered": recovered,
            "looped_again": outcomes.get("looped_again", 0),
            "recovery": proportion(recovered, retried, "retried"),
            "generated_tokens": generated,
            "generated_per_retry": generated / retried if retried else None,
            "kept_tokens": tokens.get(strategy, {}).get("kept", 0),
        }
    return out


def model_section(
    audits: list[AuditLine],
    loops: list[LoopLine],
    tally: tuple[Counter[Key3], ...] | None,
    after: tuple[int, int] = (0, 0),
) -> dict[str, Any]:
    """One model's (or all models') figures; ``audits`` and ``loops``: the lines the tallies
    counted (all of them without tallies); ``tally``: summed audits, loops, actions,
    recoveries and recovery tokens; ``after``: the audit and loop lines after the tallies."""
    strategies: dict[str, Any] | None = None
    if tally is not None:
        by_mode = _nest(((mode, v), n) for (_, mode, v), n in tally[0].items())
        loop_counts = _nest(((ch, src), n) for (_, ch, src), n in tally[1].items())
        actions: dict[str, Any] | None = _actions(
            _nest(((a, o), n) for (_, a, o), n in tally[2].items())
        )
        strategies = _strategies(
            _nest(((st, o), n) for (_, st, o), n in tally[3].items()),
            _nest(((st, k), n) for (_, st, k), n in tally[4].items()),
        )
    else:
        by_mode = _nest(((a.mode, a.verdict), 1) for a in audits)
        loop_counts = _nest(((lp.channel, lp.source), 1) for lp in loops)
        actions = None
    verdicts = _verdicts(by_mode)
    diverged = [a for a in audits if a.verdict in DIVERGED and a.index is not None]
    section: dict[str, Any] = {
        "counts_from": "tally" if tally is not None else "incidents",
        "audited": sum(verdicts.values()) if tally is not None else None,
        "audited_by_mode": (
            {m: sum(c.values()) for m, c in by_mode.items()} if tally is not None else None
        ),
        "verdicts": verdicts,
        "verdicts_by_mode": by_mode,
        "comparable": None,
        "rates": None,
        "tar_r": None,
        "tar_a": None,
        "incident_lines": {"audit": len(audits), "loop": len(loops)},
        "lines_after_tallies": {"audit": after[0], "loop": after[1]},
        "positions": position_summary(
            [a.index for a in diverged if a.index is not None], [a.margin for a in diverged]
        ),
        "logprob_delta": delta_summary([a.delta for a in audits if a.verdict != "incomparable"]),
        "loops": {
            "counts_from": "tally" if tally is not None else "incidents",
            "total": sum(sum(row.values()) for row in loop_counts.values()),
            "by_channel_source": loop_counts,
        },
        "policy_actions": actions,
        "recovery_strategies": strategies,
    }
    section.update(cause_section(audits))
    section["positions"]["divergent_lines"] = sum(1 for a in audits if a.verdict in DIVERGED)
    # An extractor that ran leaves answers on the audit lines (drifts and divergences alike) or
    # an answer_divergence; without one, every answer is null and TARa would read 100%.
    section["answers_extracted"] = sum(1 for a in audits if a.answered) + verdicts.get(
        "answer_divergence", 0
    )
    if tally is not None:
        section.update(_rates(verdicts))
        if not section["answers_extracted"]:
            section["tar_a"] = None
            section["tar_a_note"] = NO_ANSWERS
    return section


def cause_section(audits: list[AuditLine]) -> dict[str, Any]:
    """Triage's verdicts on these audit lines, each with what it means and what to do."""
    counts: Counter[str] = Counter()
    missing: Counter[str] = Counter()
    for a in audits:
        if a.cause is not None:
            counts[a.cause] += 1
            if a.cause == "unknown":
                missing[missing_evidence(a.cause_evidence) or "(not named)"] += 1
        elif a.verdict in TRIAGED:
            counts[UNTRIAGED] += 1
    return {
        "causes": {
            c: {"count": counts[c], "meaning": MEANING.get(c, ""), "action": ACTION.get(c, "")}
            for c in sorted(counts, key=cause_order)
        },
        "unknown_missing": dict(missing.most_common()),
    }


def causes_by_upstream(audits: list[AuditLine]) -> list[dict[str, Any]]:
    """Triage's causes per upstream the audits were measured on (fingerprint and recipe)."""
    groups: dict[tuple[str, str], Counter[str]] = {}
    for a in audits:
        if a.cause is not None:
            groups.setdefault((a.fingerprint, a.recipe), Counter())[a.cause] += 1
    return [
        {
            "fingerprint": fp or None,
            "recipe": recipe or None,
            "causes": {c: counts[c] for c in sorted(counts, key=cause_order)},
        }
        for (fp, recipe), counts in sorted(groups.items())
    ]


def engine_section(data: LogData) -> dict[str, Any]:
    """What the engine loaded: declared fields not met, restarts, the recipes measured on."""
    mismatches = sorted(data.engine_mismatches, key=lambda m: m.ts)
    restarts = data.restarts
    downs = [r.down_s for r in restarts if r.down_s is not None]
    return {
        "recipes": sorted({a.recipe for a in data.audits if a.recipe}),
        "mismatches": [
            {
                "ts": m.ts,
                "time": iso(m.ts),
                "recipe": m.recipe,
                "fields": [{"field": f, "declared": d, "loaded": ld} for f, d, ld in m.mismatches],
            }
            for m in mismatches
        ],
        "loaded": dict(mismatches[-1].loaded) if mismatches else None,
        "restarts": {
            "count": len(restarts),
            "last": iso(max(r.ts for r in restarts)) if restarts else None,
            "longest_down_s": max(downs) if downs else None,
        },
    }


def _worst_key(a: AuditLine) -> tuple[Any, ...]:
    delta = math.inf if a.delta is None else a.delta  # null stands for +inf in some lines
    index = a.index if a.index is not None and a.verdict != "logprob_drift" else math.inf
    return (WORST_RANK[a.verdict], index, -delta, a.ts, a.request_id, a.choice)


def worst(audits: list[AuditLine], top: int, coverage: Coverage) -> list[dict[str, Any]]:
    ranked = sorted((a for a in audits if a.verdict in WORST_RANK), key=_worst_key)
    return [
        {
            "request_id": a.request_id,
            "model": a.model,
            "mode": a.mode,
            "choice": a.choice,
            "verdict": a.verdict,
            "index": a.index,
            "primary_token": a.primary_token,
            "shadow_token": a.shadow_token,
            "margin": a.margin,
            "delta": a.delta,
            "cause": a.cause,
            "ts": a.ts,
            "time": iso(a.ts),
            "counted": coverage.counts(a.ts, a.process),
        }
        for a in ranked[:top]
    ]


def coverage_section(
    tallies: list[Tally], coverage: Coverage, audits: list[AuditLine], loops: list[LoopLine]
) -> dict[str, Any]:
    """What the counts cover: the tallies they come from, and the incident lines after them."""
    after_audits = sum(1 for a in audits if not coverage.counts(a.ts, a.process))
    after_loops = sum(1 for lp in loops if not coverage.counts(lp.ts, lp.process))
    stamps = [a.ts for a in audits] + [lp.ts for lp in loops]
    return {
        "counts_from": "tally" if tallies else "incidents",
        "until": iso(coverage.newest) if coverage.newest is not None else None,
        "tallies": [
            {"process": t.process, "started": iso(t.started), "last": iso(t.ts)} for t in tallies
        ],
        "newest_line": iso(max(stamps)) if stamps else None,
        "after_tallies": {"audit": after_audits, "loop": after_loops},
        "tally_behind": bool(after_audits or after_loops),
    }


def _notes(data: LogData, tallies: list[Tally], sections: dict[str, dict[str, Any]]) -> list[str]:
    notes = []
    if data.malformed or data.unknown_kind or data.duplicates:
        notes.append(
            f"ignored {data.malformed} malformed line(s), {data.unknown_kind} line(s) of an"
            f" unknown kind, {data.duplicates} duplicate incident line(s)"
        )
    if not tallies:
        notes.append(
            "no tally lines: denominators unknown (identical audits are only counted in"
            " tallies), so no rates; the counts are of incident lines"
        )
        return notes
    coverage = coverage_of(tallies)
    seen = Counter((a.model, a.verdict) for a in data.audits if coverage.counts(a.ts, a.process))
    for model, sec in sections.items():
        for verdict in sec["verdicts"]:
            lines, counted = seen[(model, verdict)], sec["verdicts"][verdict]
            if lines > counted:
                notes.append(
                    f"{model}: {lines} {verdict} incident line(s) up to the tallies' time but"
                    f" the tallies count {counted} (lines of another log, or of a process whose"
                    " tallies are not in these files)"
                )
    return notes


def _only(model: str) -> Callable[[str], bool]:
    return lambda m: m == model


def build_report(
    data: LogData, files: list[str], model_glob: str | None, top: int
) -> dict[str, Any]:
    """The whole report; ``model_glob`` keeps matching models, ``top`` the worst items."""

    def keep(model: str) -> bool:
        return model_glob is None or fnmatchcase(model, model_glob)

    every_audit = [a for a in data.audits if keep(a.model)]
    every_loop = [lp for lp in data.loops if keep(lp.model)]
    tallies = latest_tallies(data.tallies)
    coverage = coverage_of(tallies)
    audits = [a for a in every_audit if coverage.counts(a.ts, a.process)]
    loops = [lp for lp in every_loop if coverage.counts(lp.ts, lp.process)]
    summed = (
        _sum(tallies, lambda t: t.audits),
        _sum(tallies, lambda t: t.loops),
        _sum(tallies, lambda t: t.actions),
        _sum(tallies, lambda t: t.recoveries),
        _sum(tallies, lambda t: t.recovery_tokens),
    )
    models = sorted(
        {a.model for a in every_audit}
        | {lp.model for lp in every_loop}
        | {k[0] for c in summed for k in c}
    )
    models = [m for m in models if keep(m)]

    def section(model: str | None) -> dict[str, Any]:
        pick = _only(model) if model is not None else keep
        tally = None
        if tallies:
            tally = tuple(Counter({k: n for k, n in c.items() if pick(k[0])}) for c in summed)
        mine = [a for a in audits if pick(a.model)]
        my_loops = [lp for lp in loops if pick(lp.model)]
        after = (
            sum(1 for a in every_audit if pick(a.model)) - len(mine),
            sum(1 for lp in every_loop if pick(lp.model)) - len(my_loops),
        )
        return model_section(mine, my_loops, tally, after)

    sections = {m: section(m) for m in models}
    dropped: Counter[str] = Counter()
    for t in tallies:
        dropped.update(t.dropped)
    return {
        "schema": SCHEMA,
        "files": list(files),
        "model_filter": model_glob,
        "lines": {
            "read": data.lines,
            "audit": len(data.audits),
            "loop": len(data.loops),
            "tally": len(data.tallies),
            "malformed": data.malformed,
            "unknown_kind": data.unknown_kind,
            "duplicate": data.duplicates,
            "upstream_change": data.upstream_changes,
            "engine_mismatch": len(data.engine_mismatches),
            "upstream_restart": len(data.restarts),
            "cause": len(data.causes),
        },
        "time_range": _time_range(data),
        "processes": [t.process for t in tallies],
        "denominators_known": bool(tallies),
        "coverage": coverage_section(tallies, coverage, every_audit, every_loop),
        "models": sections,
        "all_models": section(None),
        "shadows_dropped": dict(sorted(dropped.items())) if tallies else None,
        "worst": worst(every_audit, top, coverage),
        "engine": engine_section(data),
        "causes_by_upstream": causes_by_upstream(audits),
        "notes": _notes(data, tallies, sections),
    }
