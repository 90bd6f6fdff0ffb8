"""One incident record (an audit, a loop, an upstream change or restart, an engine that does
not run what was declared) as view models: a list row and
a detail page's figures. Pure functions over the dicts of the ring or of a log file."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from proxy.observe.kinds import INCIDENT_KINDS
from proxy.observe.ui.fields import flag, integer, mapping, number, text
from proxy.tools.report.stats import NEAR_TIE_NATS

KINDS = INCIDENT_KINDS
MINUS_INF = -9999.0  # vLLM's stand-in for minus infinity in logprobs
CONTEXT_CHARS = 400  # of the common prefix, shown before the sides part
TAIL_CHARS = 4000  # of each side after the divergence
_ID_FIELDS = ("kind", "ts", "request_id", "choice", "mode", "attempt", "channel", "source")


def incident_id(record: dict[str, Any]) -> str:
    """A short stable id from the fields that tell incidents apart (not the text: cheap)."""
    key = [record.get(k) for k in _ID_FIELDS]
    after = mapping(record, "after")
    key.append(text(after, "fingerprint"))
    try:
        raw = orjson.dumps(key)
    except TypeError:  # a value orjson cannot write (from an odd line): its repr will do
        raw = repr(key).encode()
    return xxhash.xxh3_64_hexdigest(raw)


def fingerprint_of(record: dict[str, Any]) -> str:
    """The upstream's fingerprint when the incident was recorded ("" where unknown)."""
    if record.get("kind") == "upstream_change":
        return text(mapping(record, "after"), "fingerprint") or ""
    return text(mapping(record, "upstream"), "fingerprint") or ""


@dataclass(frozen=True, slots=True)
class IncidentRow:
    id: str
    kind: str  # one of KINDS
    ts: float | None
    model: str
    verdict: str  # an audit's verdict, else the kind (loop, upstream_change, ...)
    mode: str  # an audit's mode; "" for the other kinds
    fingerprint: str
    request_id: str
    summary: str  # one line: where it diverged, what looped, what changed
    cause: str = ""  # an audit's cause as triage attributed it; "" not (yet) triaged
    recipe: str = ""  # the digest of what the engine loaded when it was recorded; "" unknown
    attempt: int | None = None  # a loop's attempt (1: the client's request, 2: its first retry)


def _token(value: str | None) -> str:
    return "(end)" if value is None else orjson.dumps(value).decode()


def _audit_summary(record: dict[str, Any]) -> str:
    div = mapping(record, "divergence")
    verdict = text(record, "verdict") or ""
    if verdict == "incomparable":
        return f"incomparable: {text(record, 'reason') or 'no reason recorded'}"
    if div is None:
        return "no divergence point recorded"
    index = integer(div, "index")
    if verdict == "logprob_drift":
        delta = number(record, "max_abs_logprob_delta")
        shown = "n/a" if delta is None else f"{delta:.4g}"
        return f"logprobs drift from token {index}; max |Δ| {shown} nats"
    where = f"token {index}: {_token(text(div, 'primary_token'))}"
    return f"{where} vs {_token(text(div, 'shadow_token'))}"


def loop_outcome(record: dict[str, Any]) -> str:
    """What was done about a loop and how it came out, in words ("" where the line does not
    say: an older detproxy's)."""
    action = text(record, "action")
    if action is None:
        return ""
    strategy, outcome = text(record, "strategy"), text(record, "outcome")
    done = f"{action} ({strategy})" if strategy else action
    if outcome is None:
        return f"{done}: outcome pending"
    return done if outcome == action else f"{done}: {outcome.replace('_', ' ')}"


def _loop_summary(record: dict[str, Any]) -> str:
    source, channel = text(record, "source") or "?", text(record, "channel") or "?"
    period, repeats = integer(record, "period"), integer(record, "repeats")
    what = f"{source} loop in {channel}"
    if period is not None and repeats is not None:
        what += f": {period} chars x {repeats}"
    done = loop_outcome(record)
    return f"{what}; {done}" if done else what


def _change_summary(record: dict[str, Any]) -> str:
    before, after = mapping(record, "before"), mapping(record, "after")
    old = text(before, "fingerprint") or "?"
    new = text(after, "fingerprint") or "?"
    versions = (text(before, "version"), text(after, "version"))
    moved = f" (version {versions[0]} → {versions[1]})" if versions[0] != versions[1] else ""
    return f"upstream {old} → {new}{moved}"


def _json(value: Any) -> str:
    if isinstance(value, str):
        return value
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return repr(value)


def mismatches_of(record: dict[str, Any]) -> tuple[tuple[str, str, str], ...]:
    """An engine_mismatch's (field, declared, loaded), values as JSON text but for strings."""
    raw = record.get("mismatches")
    if not isinstance(raw, list):
        return ()
    return tuple(
        (str(m.get("field")), _json(m.get("expected")), _json(m.get("loaded")))
        for m in raw
        if isinstance(m, dict)
    )


def _mismatch_summary(record: dict[str, Any]) -> str:
    found = mismatches_of(record)
    if not found:
        return "the engine does not run what [upstream.expect] declares"
    shown = "; ".join(f"{f}: declared {d}, loaded {ld}" for f, d, ld in found[:3])
    more = f" (+{len(found) - 3} more)" if len(found) > 3 else ""
    return f"engine runs another recipe: {shown}{more}"


def _restart_summary(record: dict[str, Any]) -> str:
    down = number(record, "down_s")
    after = "" if down is None else f" after {down:.3g} s down"
    return f"upstream restarted{after}: the same identity back, not a change"


def recipe_of(record: dict[str, Any]) -> str:
    """The digest of what the engine loaded when the incident was recorded ("" unknown)."""
    if record.get("kind") == "engine_mismatch":
        return text(record, "recipe") or ""
    if record.get("kind") == "upstream_change":
        return text(mapping(mapping(record, "after"), "identity"), "recipe") or ""
    return text(mapping(record, "upstream"), "recipe") or ""


def row_of(record: dict[str, Any]) -> IncidentRow | None:
    """None for a record of no known kind."""
    kind = text(record, "kind")
    if kind not in KINDS:
        return None
    if kind == "audit":
        verdict, mode = text(record, "verdict") or "?", text(record, "mode") or "?"
        summary = _audit_summary(record)
    elif kind == "loop":
        verdict, mode, summary = "loop", "", _loop_summary(record)
    elif kind == "engine_mismatch":
        verdict, mode, summary = kind, "", _mismatch_summary(record)
    elif kind == "upstream_restart":
        verdict, mode, summary = kind, "", _restart_summary(record)
    else:
        verdict, mode, summary = "upstream_change", "", _change_summary(record)
    return IncidentRow(
        id=incident_id(record),
        kind=kind,
        ts=number(record, "ts"),
        model=text(record, "model") or "",
        verdict=verdict,
        mode=mode,
        fingerprint=fingerprint_of(record),
        request_id=text(record, "request_id") or "",
        summary=summary,
        cause=(text(record, "cause") or "") if kind == "audit" else "",
        recipe=recipe_of(record),
        attempt=integer(record, "attempt") if kind == "loop" else None,
    )


@dataclass(frozen=True, slots=True)
class TopEntry:
    token: str
    logprob: float | None  # None: unknown (NaN, null); -inf for vLLM's -9999
    chosen: bool  # the token this side emitted

    @property
    def probability(self) -> float:
        return math.exp(self.logprob) if self.logprob is not None else 0.0


@dataclass(frozen=True, slots=True)
class DivergencePoint:
    index: int | None  # first divergent token (or character) index
    primary_token: str | None  # None past that side's end
    shadow_token: str | None
    primary_top: tuple[TopEntry, ...]
    shadow_top: tuple[TopEntry, ...]
    margin: float | None  # primary's top-1 minus top-2 logprob there (nats)
    near_tie: bool | None  # margin below NEAR_TIE_NATS
    # the primary's token: its logprob in the shadow minus in the primary, where both list it
    token_shift: float | None


@dataclass(frozen=True, slots=True)
class SideBySide:
    """The two outputs from where they part: the end of their common prefix, then each side
    with its divergent token marked."""

    offset: int  # character offset where the sides part
    common: str  # the last CONTEXT_CHARS of the common prefix
    common_hidden: int  # characters of the common prefix not shown
    primary_mark: str  # the divergent token (or the first differing character)
    primary_rest: str
    primary_cut: int  # characters of the primary not shown at the end
    shadow_mark: str
    shadow_rest: str
    shadow_cut: int


@dataclass(frozen=True, slots=True)
class AuditDetail:
    row: IncidentRow
    endpoint: str
    choice: int | None
    reason: str | None
    target: str | None
    request_key: str | None
    divergence: DivergencePoint | None
    max_delta: float | None  # max |delta logprob| over the common prefix (nats)
    primary_hash: str
    shadow_hash: str
    primary_tokens: int | None
    shadow_tokens: int | None
    primary_answer: str | None
    shadow_answer: str | None
    inflight_primary: int | None
    inflight_shadow: int | None
    primary_latency_s: float | None
    shadow_latency_s: float | None
    overlapped: bool | None  # a client request ran during the shadow
    upstream_kind: str | None
    upstream_version: str | None
    text_stored: bool
    prompt: str | None
    side_by_side: SideBySide | None
    cause_evidence: dict[str, Any] | None = None  # triage's evidence, with the row's cause


@dataclass(frozen=True, slots=True)
class LoopDetail:
    row: IncidentRow
    endpoint: str
    stream: bool | None
    attempt: int | None
    source: str
    channel: str
    choice: int | None
    period: int | None  # characters of the repeated unit
    repeats: int | None
    start_offset: int | None  # where the repeats start in the channel's text
    unit: str | None  # the first <= 120 chars of the unit, with store_text only
    # What was done about it (None: not said, an older detproxy's line; outcome None: pending)
    action: str | None = None  # retry | abort | observe
    strategy: str | None = None  # a retry's: restart | continue | close_reasoning
    outcome: str | None = None  # recovered | looped_again | empty | error | unfinished | ...
    attempts: int | None = None  # the request's attempts when the outcome was known
    retry_tokens: int | None = None  # what the retry made the engine generate
    kept_tokens: int | None = None  # what a continuation kept of the looping attempt


@dataclass(frozen=True, slots=True)
class ChangeDetail:
    row: IncidentRow
    before: dict[str, Any]
    after: dict[str, Any]
    changed_fields: tuple[tuple[str, str, str], ...]  # (identity field, before, after)


@dataclass(frozen=True, slots=True)
class EngineMismatchDetail:
    row: IncidentRow
    mismatches: tuple[tuple[str, str, str], ...]  # (field, declared, loaded)
    loaded: tuple[tuple[str, str], ...]  # the facts that loaded, in display order
    sources: dict[str, str]  # fact -> where it was read (log, server_info, ...)
    unknown_env: tuple[str, ...]
    deprecated: tuple[str, ...]
    fallbacks: tuple[str, ...]
    start_failed: bool


@dataclass(frozen=True, slots=True)
class RestartDetail:
    row: IncidentRow
    down_s: float | None
    evidence: str  # what showed the restart (a new process start time, an outage)


Detail = AuditDetail | LoopDetail | ChangeDetail | EngineMismatchDetail | RestartDetail


def _top(raw: Any, chosen: str | None) -> tuple[TopEntry, ...]:
    if not isinstance(raw, list | tuple):  # lists once read from JSON; tuples in the ring
        return ()
    out = []
    for item in raw:
        if not (isinstance(item, list | tuple) and len(item) == 2 and isinstance(item[0], str)):
            continue
        value = item[1]
        logprob: float | None = None
        if isinstance(value, int | float) and not isinstance(value, bool) and value == value:
            logprob = -math.inf if value <= MINUS_INF else float(value)
        out.append(TopEntry(item[0], logprob, item[0] == chosen))
    return tuple(out)


def _lookup(top: Sequence[TopEntry], token: str | None) -> float | None:
    for entry in top:
        if entry.token == token:
            return entry.logprob
    return None


def divergence_point(div: dict[str, Any]) -> DivergencePoint:
    ptok, stok = text(div, "primary_token"), text(div, "shadow_token")
    primary_top, shadow_top = _top(div.get("primary_top"), ptok), _top(div.get("shadow_top"), stok)
    margin = number(div, "margin")
    before, after = _lookup(primary_top, ptok), _lookup(shadow_top, ptok)
    shift = None
    if before is not None and after is not None and math.isfinite(before + after):
        shift = after - before
    return DivergencePoint(
        index=integer(div, "index"),
        primary_token=ptok,
        shadow_token=stok,
        primary_top=primary_top,
        shadow_top=shadow_top,
        margin=margin,
        near_tie=None if margin is None else margin < NEAR_TIE_NATS,
        token_shift=shift,
    )


def common_prefix(a: str, b: str, step: int = 1024) -> int:
    """The length of the common prefix: in chunks, then the differing chunk character-wise."""
    n, i = min(len(a), len(b)), 0
    while i < n and a[i : i + step] == b[i : i + step]:
        i += step
    i = min(i, n)
    while i < n and a[i] == b[i]:
        i += 1
    return i


def parting_offset(primary: str, shadow: str, ptok: str | None, stok: str | None) -> int:
    """Where the divergent tokens start: at or before the first differing character, at the
    last offset where each side's text goes on with its own token."""
    common = common_prefix(primary, shadow)
    reach = max(len(ptok or ""), len(stok or ""))
    for offset in range(common, max(common - reach, 0) - 1, -1):
        if (ptok is None or primary.startswith(ptok, offset)) and (
            stok is None or shadow.startswith(stok, offset)
        ):
            return offset
    return common


def side_by_side(primary: str, shadow: str, ptok: str | None, stok: str | None) -> SideBySide:
    offset = parting_offset(primary, shadow, ptok, stok)
    common_start = max(0, offset - CONTEXT_CHARS)
    pmark = (
        len(ptok) if ptok and primary.startswith(ptok, offset) else min(1, len(primary) - offset)
    )
    smark = len(stok) if stok and shadow.startswith(stok, offset) else min(1, len(shadow) - offset)
    if ptok is None and stok is None:  # character mode: mark the first differing character
        pmark, smark = min(1, len(primary) - offset), min(1, len(shadow) - offset)
    prest_end = min(len(primary), offset + pmark + TAIL_CHARS)
    srest_end = min(len(shadow), offset + smark + TAIL_CHARS)
    return SideBySide(
        offset=offset,
        common=primary[common_start:offset],
        common_hidden=common_start,
        primary_mark=primary[offset : offset + pmark],
        primary_rest=primary[offset + pmark : prest_end],
        primary_cut=len(primary) - prest_end,
        shadow_mark=shadow[offset : offset + smark],
        shadow_rest=shadow[offset + smark : srest_end],
        shadow_cut=len(shadow) - srest_end,
    )


def audit_detail(record: dict[str, Any], row: IncidentRow) -> AuditDetail:
    div = mapping(record, "divergence")
    point = divergence_point(div) if div is not None else None
    primary_text, shadow_text = text(record, "primary_text"), text(record, "shadow_text")
    pair = None
    if primary_text is not None and shadow_text is not None:
        ptok = point.primary_token if point is not None else None
        stok = point.shadow_token if point is not None else None
        pair = side_by_side(primary_text, shadow_text, ptok, stok)
    upstream = mapping(record, "upstream")
    return AuditDetail(
        row=row,
        endpoint=text(record, "endpoint") or "",
        choice=integer(record, "choice"),
        reason=text(record, "reason"),
        target=text(record, "target"),
        request_key=text(record, "request_key"),
        divergence=point,
        max_delta=number(record, "max_abs_logprob_delta"),
        primary_hash=text(record, "primary_hash") or "",
        shadow_hash=text(record, "shadow_hash") or "",
        primary_tokens=integer(record, "primary_tokens"),
        shadow_tokens=integer(record, "shadow_tokens"),
        primary_answer=text(record, "primary_answer"),
        shadow_answer=text(record, "shadow_answer"),
        inflight_primary=integer(record, "inflight_primary"),
        inflight_shadow=integer(record, "inflight_shadow"),
        primary_latency_s=number(record, "primary_latency_s"),
        shadow_latency_s=number(record, "shadow_latency_s"),
        overlapped=flag(record, "shadow_overlapped"),
        upstream_kind=text(upstream, "kind"),
        upstream_version=text(upstream, "version"),
        text_stored=primary_text is not None or text(record, "prompt") is not None,
        prompt=text(record, "prompt"),
        side_by_side=pair,
        cause_evidence=mapping(record, "cause_evidence"),
    )


def loop_detail(record: dict[str, Any], row: IncidentRow) -> LoopDetail:
    return LoopDetail(
        row=row,
        endpoint=text(record, "endpoint") or "",
        stream=flag(record, "stream"),
        attempt=integer(record, "attempt"),
        source=text(record, "source") or "",
        channel=text(record, "channel") or "",
        choice=integer(record, "choice"),
        period=integer(record, "period"),
        repeats=integer(record, "repeats"),
        start_offset=integer(record, "start_offset"),
        unit=text(record, "unit_preview"),
        action=text(record, "action"),
        strategy=text(record, "strategy"),
        outcome=text(record, "outcome"),
        attempts=integer(record, "attempts"),
        retry_tokens=integer(record, "retry_tokens"),
        kept_tokens=integer(record, "kept_tokens"),
    )


def _short(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def change_detail(record: dict[str, Any], row: IncidentRow) -> ChangeDetail:
    before, after = mapping(record, "before") or {}, mapping(record, "after") or {}
    old, new = mapping(before, "identity") or {}, mapping(after, "identity") or {}
    changed = tuple(
        (key, _short(old.get(key, "(absent)")), _short(new.get(key, "(absent)")))
        for key in sorted(set(old) | set(new))
        if old.get(key) != new.get(key)
    )
    return ChangeDetail(row, before, after, changed)


def _strings(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value) if isinstance(value, list | tuple) else ()


def engine_detail(record: dict[str, Any], row: IncidentRow) -> EngineMismatchDetail:
    loaded = mapping(record, "loaded") or {}
    facts = mapping(loaded, "facts") or {}
    sources = mapping(loaded, "sources") or {}
    return EngineMismatchDetail(
        row=row,
        mismatches=mismatches_of(record),
        loaded=tuple((str(k), _json(v)) for k, v in facts.items()),
        sources={str(k): _json(v) for k, v in sources.items()},
        unknown_env=_strings(loaded.get("unknown_env")),
        deprecated=_strings(loaded.get("deprecated")),
        fallbacks=_strings(loaded.get("fallbacks")),
        start_failed=flag(loaded, "start_failed") is True,
    )


def restart_detail(record: dict[str, Any], row: IncidentRow) -> RestartDetail:
    evidence = record.get("evidence")
    shown = "" if evidence is None else _json(evidence)
    return RestartDetail(row, number(record, "down_s"), shown)


def detail_of(record: dict[str, Any]) -> Detail | None:
    row = row_of(record)
    if row is None:
        return None
    if row.kind == "audit":
        return audit_detail(record, row)
    if row.kind == "loop":
        return loop_detail(record, row)
    if row.kind == "engine_mismatch":
        return engine_detail(record, row)
    if row.kind == "upstream_restart":
        return restart_detail(record, row)
    return change_detail(record, row)
