"""The explorer's front page as a view model: per model, verdicts over time, the batch-effects
curve, loops and recoveries; the upstream's fingerprints on the same time axis; the incident
list, filtered. One pure function over ``Inputs`` (live: the ring, the tally and the live
history; a report: the lines of log files)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.attribution.case import TRIAGED
from proxy.audit.verdict import VERDICTS
from proxy.observe.status import INFLIGHT_CAP
from proxy.observe.ui.fields import integer, mapping, number, text
from proxy.observe.ui.filters import MODES, VERDICT_CHOICES, IncidentFilter
from proxy.observe.ui.incident import IncidentRow, mismatches_of, row_of
from proxy.observe.ui.timeline import Column, Observation, Point, Span, columns, spans
from proxy.tools.report.causes import UNTRIAGED, cause_order

Key3 = tuple[str, str, str]  # (model, x, y): the keys of the tally's counters
MAX_MODELS = 12  # model sections drawn; the rest are named in a note
DIVERGED = ("text_divergence", "answer_divergence")


@dataclass(frozen=True, slots=True)
class Inputs:
    records: Sequence[dict[str, Any]]  # incidents, newest first
    audits: Mapping[Key3, int] | None  # (model, mode, verdict); None: no tally (no denominators)
    loops: Mapping[Key3, int] | None  # (model, channel, source)
    recoveries: Mapping[Key3, int] | None  # (model, strategy, outcome)
    by_inflight: Mapping[Key3, int] | None  # (model, in flight, verdict)
    points: Sequence[Point]  # audits over time, identical ones included; () where unknown
    readings: Sequence[Observation]  # the upstream's fingerprint readings
    now: float | None  # the live page's clock; None: the data's last time
    source: str  # "live", or the files read
    upstream: Sequence[str] = ()  # the live upstream's state in words (down, restarts)
    # What the engine loaded: /detproxy/status's ``engine`` object (live), or None
    engine: Mapping[str, Any] | None = None
    notes: Sequence[str] = ()  # what the counts cover, where the source says (a report's files)


@dataclass(frozen=True, slots=True)
class InflightPoint:
    inflight: int  # requests in flight when the primary arrived (INFLIGHT_CAP: that or more)
    comparable: int | None  # None: unknown (counted from incidents only)
    unstable: int  # non-identical comparable audits
    diverged: int  # text or answer divergences

    @property
    def label(self) -> str:
        return f"{self.inflight}+" if self.inflight >= INFLIGHT_CAP else str(self.inflight)

    @property
    def rate(self) -> float | None:
        return self.unstable / self.comparable if self.comparable else None


@dataclass(frozen=True, slots=True)
class StrategyRow:
    strategy: str
    retried: int
    recovered: int
    looped_again: int

    @property
    def rate(self) -> float | None:
        return self.recovered / self.retried if self.retried else None


@dataclass(frozen=True, slots=True)
class ModelView:
    model: str
    audited: int | None  # None: unknown without a tally
    verdicts: tuple[tuple[str, int], ...]  # from the tally, else incident counts
    rate: float | None  # non-identical share of comparable audits
    columns: tuple[Column, ...]
    with_denominators: bool  # the columns count identical audits too
    inflight: tuple[InflightPoint, ...]
    loops: tuple[tuple[str, str, int], ...]  # (channel, source, count)
    strategies: tuple[StrategyRow, ...] | None  # None: unknown without a tally
    incidents: int
    causes: tuple[tuple[str, int], ...] = ()  # triage's causes of its audit incidents


@dataclass(frozen=True, slots=True)
class EngineView:
    """What the engine loaded and what it does not meet of [upstream.expect]."""

    origin: str  # "live" (the engine as read now) or "the last engine_mismatch incident"
    recipe: str  # its digest ("" unknown)
    loaded: tuple[tuple[str, str], ...]  # (fact, value as text)
    mismatches: tuple[tuple[str, str, str], ...]  # (field, declared, loaded)
    unknown_env: tuple[str, ...]
    fallbacks: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Overview:
    source: str
    start: float | None  # the time axis; None when nothing has a time
    end: float | None
    models: tuple[ModelView, ...]
    spans: tuple[Span, ...]
    rows: tuple[IncidentRow, ...]  # matching the filter, newest first, up to its limit
    matching: int  # rows matching the filter
    recorded: int  # rows in all
    filter: IncidentFilter
    options: Mapping[str, tuple[str, ...]]  # the values each filter can take here
    notes: tuple[str, ...]
    # per upstream fingerprint (newest first): triage's causes of the audits measured on it
    causes_by_fingerprint: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()
    engine: EngineView | None = None


def _observations(records: Sequence[dict[str, Any]]) -> list[Observation]:
    out = []
    for r in records:
        ts = number(r, "ts")
        if ts is None:
            continue
        sides = (mapping(r, "before"), mapping(r, "after"))
        if r.get("kind") != "upstream_change":
            sides = (None, mapping(r, "upstream"))
        for i, side in enumerate(sides):
            fp = text(side, "fingerprint")
            if fp:
                # the "before" of a change was seen up to the change: just before it
                out.append(
                    Observation(ts - 1e-6 * (1 - i), fp, text(side, "kind"), text(side, "version"))
                )
    return out


def _cause(record: dict[str, Any]) -> str | None:
    """An audit incident's cause; ``untriaged`` for one triage could take and has not."""
    cause = text(record, "cause")
    if cause:
        return cause
    return UNTRIAGED if text(record, "verdict") in TRIAGED else None


def cause_counts(audits: Sequence[dict[str, Any]]) -> tuple[tuple[str, int], ...]:
    counts = Counter(c for r in audits if (c := _cause(r)) is not None)
    return tuple((c, counts[c]) for c in sorted(counts, key=cause_order))


def _by_fingerprint(
    records: Sequence[dict[str, Any]], rows: Sequence[IncidentRow]
) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """Causes per upstream fingerprint, the newest fingerprint first; only triaged audits."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for record, row in zip(records, rows, strict=True):
        if row.kind == "audit" and row.cause:
            groups.setdefault(row.fingerprint or "(unknown)", []).append(record)
    return tuple((fp, cause_counts(audits)) for fp, audits in groups.items())


def _text(value: Any) -> str:
    """A fact's value as text: strings as they are, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return repr(value)


def engine_view(inputs: Inputs) -> EngineView | None:
    """Live: the engine as read now; from files: the last engine_mismatch incident."""
    if inputs.engine is not None:
        origin, state = "live", inputs.engine
        mismatches = mismatches_of(dict(state))
        recipe = text(state, "recipe") or ""
    else:
        last = next((r for r in inputs.records if r.get("kind") == "engine_mismatch"), None)
        if last is None:
            return None
        origin, state = "the last engine_mismatch incident", last
        mismatches, recipe = mismatches_of(last), text(last, "recipe") or ""
    loaded = mapping(state, "loaded") or {}
    facts = mapping(loaded, "facts") or {}
    if not facts and not mismatches and not recipe:
        return None
    unknown, fallbacks = loaded.get("unknown_env"), loaded.get("fallbacks")
    return EngineView(
        origin=origin,
        recipe=recipe,
        loaded=tuple((str(k), _text(v)) for k, v in facts.items()),
        mismatches=mismatches,
        unknown_env=tuple(map(str, unknown)) if isinstance(unknown, list) else (),
        fallbacks=tuple(map(str, fallbacks)) if isinstance(fallbacks, list) else (),
    )


def _verdicts(counts: Counter[str]) -> tuple[tuple[str, int], ...]:
    named = [(v, counts[v]) for v in VERDICTS]
    return (*named, *sorted((v, n) for v, n in counts.items() if v not in VERDICTS))


def _inflight(
    model: str, inputs: Inputs, audits: list[dict[str, Any]]
) -> tuple[InflightPoint, ...]:
    by: dict[int, Counter[str]] = {}
    if inputs.by_inflight is not None:
        for (m, label, verdict), n in inputs.by_inflight.items():
            if m == model and label.isdigit():
                by.setdefault(int(label), Counter())[verdict] += n
        known = True
    else:
        for r in audits:
            count = integer(r, "inflight_primary")
            if count is not None:
                bucket = min(max(count, 0), INFLIGHT_CAP)
                by.setdefault(bucket, Counter())[text(r, "verdict") or "?"] += 1
        known = False
    out = []
    for inflight, c in sorted(by.items()):
        comparable = sum(c.values()) - c["incomparable"]
        out.append(
            InflightPoint(
                inflight,
                comparable if known else None,
                comparable - c["identical"],
                sum(c[v] for v in DIVERGED),
            )
        )
    return tuple(out)


def _model_view(
    model: str, inputs: Inputs, rows: list[IncidentRow], start: float, end: float
) -> ModelView:
    mine = [r for r in inputs.records if r.get("model") == model]
    audit_records = [r for r in mine if r.get("kind") == "audit"]
    counts: Counter[str] = Counter()
    if inputs.audits is not None:
        for (m, _, verdict), n in inputs.audits.items():
            if m == model:
                counts[verdict] += n
    else:
        counts.update(text(r, "verdict") or "?" for r in audit_records)
    comparable = sum(counts.values()) - counts["incomparable"]
    unstable = comparable - counts["identical"]
    points = [p for p in inputs.points if p.model == model]
    with_denominators = bool(inputs.points) or inputs.audits is not None
    if not inputs.points:  # no history: the incidents themselves (non-identical only)
        points = [
            Point(ts, model, text(r, "verdict") or "?", 1)
            for r in audit_records
            if (ts := number(r, "ts")) is not None
        ]
        with_denominators = False
    loops: Counter[tuple[str, str]] = Counter()
    if inputs.loops is not None:
        for (m, channel, source), n in inputs.loops.items():
            if m == model:
                loops[(channel, source)] += n
    else:
        loops.update(
            (text(r, "channel") or "?", text(r, "source") or "?")
            for r in mine
            if r.get("kind") == "loop"
        )
    strategies = None
    if inputs.recoveries is not None:
        by_strategy: dict[str, Counter[str]] = {}
        for (m, strategy, outcome), n in inputs.recoveries.items():
            if m == model:
                by_strategy.setdefault(strategy, Counter())[outcome] += n
        strategies = tuple(
            StrategyRow(s, sum(c.values()), c["recovered"], c["looped_again"])
            for s, c in sorted(by_strategy.items())
        )
    return ModelView(
        model=model,
        audited=sum(counts.values()) if inputs.audits is not None else None,
        verdicts=_verdicts(counts),
        rate=unstable / comparable if inputs.audits is not None and comparable else None,
        columns=columns(points, start, end),
        with_denominators=with_denominators,
        inflight=_inflight(model, inputs, audit_records),
        loops=tuple((ch, src, n) for (ch, src), n in sorted(loops.items())),
        strategies=strategies,
        incidents=sum(1 for r in rows if r.model == model),
        causes=cause_counts(audit_records),
    )


def build_overview(inputs: Inputs, wanted: IncidentFilter) -> Overview:
    known = [(r, row) for r in inputs.records if (row := row_of(r)) is not None]
    all_rows = [row for _, row in known]
    matching = [row for row in all_rows if wanted.matches(row)]
    observations = [*inputs.readings, *_observations(inputs.records)]
    stamps = [p.ts for p in inputs.points] + [o.ts for o in observations]
    stamps += [row.ts for row in all_rows if row.ts is not None]
    if inputs.now is not None:
        stamps.append(inputs.now)
    start, end = (min(stamps), max(stamps)) if stamps else (None, None)
    activity: Counter[str] = Counter(row.model for row in all_rows if row.model)
    for counter in (inputs.audits, inputs.loops):
        for key, n in (counter or {}).items():
            activity[key[0]] += n
    models = sorted(activity, key=lambda m: (-activity[m], m))
    notes = [*inputs.upstream, *inputs.notes]
    if wanted.model is not None:
        models = [wanted.model]
    elif len(models) > MAX_MODELS:
        rest = models[MAX_MODELS:]
        notes.append(f"{len(rest)} more model(s) not drawn: pick one in the filter")
        models = models[:MAX_MODELS]
    if inputs.audits is None:
        notes.append(
            "no tally: identical audits are not counted, so rates are unknown; the counts are"
            " of incidents"
        )
    views = tuple(_model_view(m, inputs, all_rows, start or 0.0, end or 0.0) for m in models)
    options = {
        "model": tuple(sorted(set(activity) | ({wanted.model} if wanted.model else set()))),
        "verdict": VERDICT_CHOICES,
        "mode": MODES,
        "fingerprint": tuple(sorted({row.fingerprint for row in all_rows if row.fingerprint})),
    }
    return Overview(
        source=inputs.source,
        start=start,
        end=end,
        models=views,
        spans=spans(observations),
        rows=tuple(matching[: wanted.limit]),
        matching=len(matching),
        recorded=len(all_rows),
        filter=wanted,
        options=options,
        notes=tuple(notes),
        causes_by_fingerprint=_by_fingerprint([r for r, _ in known], all_rows),
        engine=engine_view(inputs),
    )
