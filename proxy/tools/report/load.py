"""Reading incident logs (JSON lines, plain or gzip) into typed records.

Unknown kinds and malformed lines are skipped and counted; an incident line seen twice (the
same file passed twice, or a copy next to its rotated original) is counted once.
"""

from __future__ import annotations

import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import orjson

from proxy.observe.kinds import LINE_KINDS, UPSTREAM_CHANGE

GZIP_MAGIC = b"\x1f\x8b"
KNOWN_KINDS = LINE_KINDS

Key3 = tuple[str, str, str]


class LogReadError(Exception):
    """A file could not be opened or read to the end."""


@dataclass(frozen=True, slots=True)
class AuditLine:
    ts: float
    request_id: str
    model: str
    mode: str
    choice: int
    verdict: str
    index: int | None  # first divergent token index, when the line has a divergence
    primary_token: str | None
    shadow_token: str | None
    margin: float | None
    delta: float | None  # max |delta logprob| in nats; None: unknown or +inf
    # An answer extractor ran and found an answer on either side (no extractor: never).
    answered: bool = False
    # Triage's verdict (SPEC 1.14): on the line itself, or from a later ``kind: cause`` line
    # that names it; None while triage has not decided (or never reached it).
    cause: str | None = None
    cause_evidence: dict[str, Any] | None = None
    fingerprint: str = ""  # the upstream's fingerprint when it was measured ("" unknown)
    recipe: str = ""  # the digest of what the engine loaded then ("" unknown)
    process: str = ""  # the detproxy process that wrote it (its tallies' id; "" not said)


@dataclass(frozen=True, slots=True)
class CauseLine:
    """A ``kind: cause`` line: triage's verdict on the audit incident it names."""

    audit_ts: float
    request_id: str
    mode: str
    choice: int
    cause: str
    evidence: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class EngineMismatchLine:
    """An ``engine_mismatch`` incident: declared fields ([upstream.expect]) not met."""

    ts: float
    recipe: str
    mismatches: tuple[tuple[str, str, str], ...]  # (field, declared, loaded), as JSON text
    loaded: dict[str, Any]  # the facts that loaded (``facts``), by name


@dataclass(frozen=True, slots=True)
class RestartLine:
    """An ``upstream_restart`` incident: the same identity back after an outage."""

    ts: float
    down_s: float | None
    fingerprint: str


@dataclass(frozen=True, slots=True)
class LoopLine:
    ts: float  # when it was detected
    request_id: str
    model: str
    channel: str
    source: str
    process: str = ""  # the detproxy process that wrote it ("" not said)


@dataclass(frozen=True, slots=True)
class Tally:
    process: str
    ts: float
    started: float
    audits: dict[Key3, int]  # (model, mode, verdict)
    loops: dict[Key3, int]  # (model, channel, source)
    actions: dict[Key3, int]  # (model, action, outcome)
    dropped: dict[str, int]  # reason
    recoveries: dict[Key3, int] = field(default_factory=dict)  # (model, strategy, outcome)
    recovery_tokens: dict[Key3, int] = field(default_factory=dict)  # (model, strategy, kind)
    by_inflight: dict[Key3, int] = field(default_factory=dict)  # (model, in flight, verdict)

    @property
    def weight(self) -> int:
        """Total of all counts: the later of two tallies with the same ts has more."""
        return sum(sum(d.values()) for d in (self.audits, self.loops, self.actions, self.dropped))


@dataclass(slots=True)
class LogData:
    audits: list[AuditLine] = field(default_factory=list)
    loops: list[LoopLine] = field(default_factory=list)
    tallies: list[Tally] = field(default_factory=list)
    lines: int = 0  # non-blank lines read
    malformed: int = 0
    unknown_kind: int = 0
    duplicates: int = 0
    upstream_changes: int = 0  # upstream_change lines: read, not summarised here
    engine_mismatches: list[EngineMismatchLine] = field(default_factory=list)
    restarts: list[RestartLine] = field(default_factory=list)
    causes: list[CauseLine] = field(default_factory=list)  # merged into audits by read_logs


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _int(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _counts(obj: Any) -> dict[str, int] | None:
    if not isinstance(obj, dict):
        return None
    out: dict[str, int] = {}
    for key, value in obj.items():
        n = _int(value)
        if n is None or n < 0:
            return None
        out[key] = n
    return out


def _nested3(obj: Any) -> dict[Key3, int] | None:
    """``{a: {b: {c: n}}}`` as ``{(a, b, c): n}``; None when the shape is wrong."""
    if obj is None:
        return {}
    if not isinstance(obj, dict):
        return None
    out: dict[Key3, int] = {}
    for a, level2 in obj.items():
        if not isinstance(level2, dict):
            return None
        for b, level3 in level2.items():
            counts = _counts(level3)
            if counts is None:
                return None
            for c, n in counts.items():
                out[(a, b, c)] = n
    return out


def parse_audit(obj: dict[str, Any]) -> AuditLine | None:
    ts, model = _num(obj.get("ts")), _str(obj.get("model"))
    mode, verdict = _str(obj.get("mode")), _str(obj.get("verdict"))
    if ts is None or model is None or mode is None or verdict is None:
        return None
    div = obj.get("divergence")
    if div is not None and not isinstance(div, dict):
        return None
    div = div or {}
    upstream = _dict(obj.get("upstream"))
    evidence = obj.get("cause_evidence")
    return AuditLine(
        ts=ts,
        request_id=_str(obj.get("request_id")) or "",
        model=model,
        mode=mode,
        choice=_int(obj.get("choice")) or 0,
        verdict=verdict,
        index=_int(div.get("index")),
        primary_token=_str(div.get("primary_token")),
        shadow_token=_str(div.get("shadow_token")),
        margin=_num(div.get("margin")),
        delta=_num(obj.get("max_abs_logprob_delta")),
        answered=obj.get("primary_answer") is not None or obj.get("shadow_answer") is not None,
        cause=_str(obj.get("cause")),
        cause_evidence=evidence if isinstance(evidence, dict) else None,
        fingerprint=_str(upstream.get("fingerprint")) or "",
        recipe=_str(upstream.get("recipe")) or "",
        process=_str(obj.get("process")) or "",
    )


def _json(value: Any) -> str:
    return value if isinstance(value, str) else orjson.dumps(value).decode()


def parse_cause(obj: dict[str, Any]) -> CauseLine | None:
    audit_ts, cause = _num(obj.get("audit_ts")), _str(obj.get("cause"))
    if audit_ts is None or cause is None:
        return None
    evidence = obj.get("cause_evidence")
    return CauseLine(
        audit_ts,
        _str(obj.get("request_id")) or "",
        _str(obj.get("mode")) or "",
        _int(obj.get("choice")) or 0,
        cause,
        evidence if isinstance(evidence, dict) else None,
    )


def parse_engine_mismatch(obj: dict[str, Any]) -> EngineMismatchLine | None:
    ts, raw = _num(obj.get("ts")), obj.get("mismatches")
    if ts is None or not isinstance(raw, list):
        return None
    rows = tuple(
        (str(m.get("field")), _json(m.get("expected")), _json(m.get("loaded")))
        for m in raw
        if isinstance(m, dict)
    )
    loaded = obj.get("loaded")
    facts = loaded.get("facts") if isinstance(loaded, dict) else None
    return EngineMismatchLine(
        ts, _str(obj.get("recipe")) or "", rows, facts if isinstance(facts, dict) else {}
    )


def parse_restart(obj: dict[str, Any]) -> RestartLine | None:
    ts = _num(obj.get("ts"))
    if ts is None:
        return None
    upstream = _dict(obj.get("upstream"))
    return RestartLine(ts, _num(obj.get("down_s")), _str(upstream.get("fingerprint")) or "")


def cause_key(ts: float, request_id: str, mode: str, choice: int) -> tuple[Any, ...]:
    return (ts, request_id, mode, choice)


def merge_causes(data: LogData) -> None:
    """Each ``kind: cause`` line's verdict onto the audit line it names (the latest wins); a
    cause whose incident is not among the lines read (rotated away) stays in ``causes`` only."""
    latest = {cause_key(c.audit_ts, c.request_id, c.mode, c.choice): c for c in data.causes}
    if not latest:
        return
    for i, a in enumerate(data.audits):
        found = latest.get(cause_key(a.ts, a.request_id, a.mode, a.choice))
        if found is not None:
            data.audits[i] = replace(a, cause=found.cause, cause_evidence=found.evidence)


def parse_loop(obj: dict[str, Any]) -> LoopLine | None:
    ts = _num(obj.get("ts"))
    model, channel = _str(obj.get("model")), _str(obj.get("channel"))
    source = _str(obj.get("source"))
    if ts is None or model is None or channel is None or source is None:
        return None
    request_id, process = _str(obj.get("request_id")) or "", _str(obj.get("process")) or ""
    return LoopLine(ts, request_id, model, channel, source, process)


def parse_tally(obj: dict[str, Any]) -> Tally | None:
    process, ts = _str(obj.get("process")), _num(obj.get("ts"))
    audits = _nested3(obj.get("audits"))
    loops = _nested3(obj.get("loops"))
    actions = _nested3(obj.get("policy_actions"))
    dropped = _counts(obj.get("shadows_dropped") or {})
    if process is None or ts is None or "audits" not in obj:
        return None
    if audits is None or loops is None or actions is None or dropped is None:
        return None
    started = _num(obj.get("started"))
    # Tallies of detproxy 0.1.0 have no recoveries: counted as none.
    recoveries = _nested3(obj.get("recoveries") or {}) or {}
    recovery_tokens = _nested3(obj.get("recovery_tokens") or {}) or {}
    by_inflight = _nested3(obj.get("audits_by_inflight") or {}) or {}  # older tallies: none
    return Tally(
        process,
        ts,
        ts if started is None else started,
        audits,
        loops,
        actions,
        dropped,
        recoveries,
        recovery_tokens,
        by_inflight,
    )


def iter_lines(path: str) -> Iterator[bytes]:
    """The lines of one incident log, plain or gzip; LogReadError when it cannot be read."""
    try:
        with open(path, "rb") as raw:
            compressed = raw.read(2) == GZIP_MAGIC
            raw.seek(0)
            if compressed:
                with gzip.GzipFile(fileobj=raw) as unzipped:
                    yield from unzipped
            else:
                yield from raw
    except (OSError, EOFError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise LogReadError(f"{path}: {reason}") from exc


def read_into(data: LogData, path: str, seen: set[bytes]) -> None:
    """Add the records of one file (plain or gzip) to ``data``; ``seen`` dedups incidents."""
    for raw in iter_lines(path):
        line = raw.strip()
        if not line:
            continue
        data.lines += 1
        try:
            obj = orjson.loads(line)
        except orjson.JSONDecodeError:
            data.malformed += 1
            continue
        if not isinstance(obj, dict):
            data.malformed += 1
            continue
        kind = obj.get("kind")
        if kind == UPSTREAM_CHANGE:  # counted, not summarised here
            data.upstream_changes += 1
            continue
        if kind not in KNOWN_KINDS:
            data.unknown_kind += 1
            continue
        if kind != "tally":
            digest = hashlib.blake2b(line, digest_size=16).digest()
            if digest in seen:
                data.duplicates += 1
                continue
            seen.add(digest)
        _add(data, kind, obj)


def _add(data: LogData, kind: str, obj: dict[str, Any]) -> None:
    if kind == "audit":
        audit = parse_audit(obj)
        if audit is not None:
            data.audits.append(audit)
            return
    elif kind == "loop":
        loop = parse_loop(obj)
        if loop is not None:
            data.loops.append(loop)
            return
    elif kind == "cause":
        cause = parse_cause(obj)
        if cause is not None:
            data.causes.append(cause)
            return
    elif kind == "engine_mismatch":
        mismatch = parse_engine_mismatch(obj)
        if mismatch is not None:
            data.engine_mismatches.append(mismatch)
            return
    elif kind == "upstream_restart":
        restart = parse_restart(obj)
        if restart is not None:
            data.restarts.append(restart)
            return
    else:
        tally = parse_tally(obj)
        if tally is not None:
            data.tallies.append(tally)
            return
    data.malformed += 1


def read_logs(paths: list[str]) -> LogData:
    data = LogData()
    seen: set[bytes] = set()
    for path in paths:
        read_into(data, path, seen)
    merge_causes(data)
    return data
