"""The incident log: every non-identical audit and every loop as one JSON line, and a ring.

A subscriber of ``AuditCompleted``, ``LoopDetected`` and the upstream's events. Lines go to a
size-rotated file (``path``, ``path.1``, ... ``path.N``; written by its own task, never in the
publisher's call: ``proxy.observe.incident_file``) and to a bounded in-memory ring served
newest first at ``/detproxy/incidents`` (filtered by ``kind``, ``verdict``, ``mode`` and
``model``; a value the endpoint does not know is a 400 that lists the known ones: the kinds of
``proxy.observe.kinds``, which this module writes). Prompts and outputs are kept only when
``store_text`` is on; hashes always are. Each incident names the ``process`` that wrote it (its
tally lines' id), so ``detproxy report`` can tell which incidents a tally has counted.

A loop's line says what was done about it (``action``, ``strategy``, ``outcome``, ``attempts``,
the retry's tokens). A retry's outcome is known only when the attempt after the loop ends, so
the loop is in the ring at once and its line is written when its outcome is known, when its
request ends without one (``outcome: unfinished``), or when detproxy stops: one line per loop,
none left unwritten.

Several processes may write one file (``serve --workers N``): each batch and each rotation is
written under an exclusive ``flock`` of the file's folder, the size that decides a rotation is
the file's own (every process's lines), and a process whose file another one rotated reopens
the path before its next line. So lines are whole and never lost to a rotation, a rotation
happens once however many processes see the file full, and no backup is renamed over by two
processes at once.

The file's folder is created at start. A path the configuration names that cannot be written
stops the start (``ConfigError``); the default one (the state directory, e.g. a read-only home
in a container) only says so in the log once, and incidents stay in memory.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.config import STATE_DIR_ENV, ConfigError, IncidentConfig
from proxy.engine.expect import mismatch_record
from proxy.events import (
    AuditCompleted,
    CauseAttributed,
    EngineFactsRead,
    EventBus,
    LoopDetected,
    PolicyActed,
    RecoveryTokens,
    RequestFinished,
    UpstreamFingerprinted,
    UpstreamRestarted,
)
from proxy.observe.incident_file import IncidentFile
from proxy.observe.kinds import (
    AUDIT,
    CAUSE,
    ENGINE_MISMATCH,
    INCIDENT_KINDS,
    LOOP,
    UPSTREAM_CHANGE,
    UPSTREAM_RESTART,
)
from proxy.observe.ui.filters import MAX_MODEL_CHARS, MODES, VERDICT_CHOICES

log = logging.getLogger(__name__)

KINDS = INCIDENT_KINDS  # what ``kind=`` accepts: every kind this module writes
DEFAULT_LIMIT = 100
QUERY_PARAMS = ("limit", "kind", "verdict", "mode", "model")
# Requests whose loops wait for their outcome; past it, the oldest is written as it stands.
MAX_PENDING_REQUESTS = 1024
UNFINISHED = "unfinished"  # a loop's outcome when its request ended before one was known


def audit_incident(ev: AuditCompleted) -> dict[str, Any]:
    verdict = ev.verdict
    divergence = asdict(verdict.divergence) if verdict.divergence is not None else None
    record: dict[str, Any] = {
        "kind": AUDIT,
        "ts": ev.timestamp,
        "request_id": ev.request_id,
        "model": ev.model,
        "endpoint": ev.endpoint,
        "mode": ev.mode,
        "choice": ev.choice,
        "verdict": verdict.verdict,
        "reason": verdict.reason,
        "divergence": divergence,
        "max_abs_logprob_delta": verdict.max_abs_logprob_delta,
        "primary_hash": verdict.primary_hash,
        "shadow_hash": verdict.shadow_hash,
        "primary_tokens": verdict.primary_tokens,
        "shadow_tokens": verdict.shadow_tokens,
        "primary_answer": verdict.primary_answer,
        "shadow_answer": verdict.shadow_answer,
        "request_key": ev.request_key,
        "inflight_primary": ev.inflight_primary,
        "inflight_shadow": ev.inflight_shadow,
        "shadow_overlapped": ev.shadow_overlapped,
        "primary_latency_s": ev.primary_latency_s,
        "shadow_latency_s": ev.shadow_latency_s,
        "target": ev.target,
    }
    if ev.prompt is not None or ev.primary_text is not None:
        record["prompt"] = ev.prompt
        record["primary_text"] = ev.primary_text
        record["shadow_text"] = ev.shadow_text
    return record


def cause_record(ev: CauseAttributed) -> dict[str, Any]:
    """The file's follow-up line for an audit incident: ``audit_ts`` (the incident's ``ts``),
    ``request_id``, ``mode`` and ``choice`` name it (``detproxy report`` merges it in)."""
    return {
        "kind": CAUSE,
        "ts": ev.timestamp,
        "audit_ts": ev.audit_ts,
        "request_id": ev.request_id,
        "model": ev.model,
        "mode": ev.mode,
        "choice": ev.choice,
        "verdict": ev.verdict,
        "cause": ev.cause,
        "cause_evidence": ev.evidence,
        "upstream_fingerprint": ev.upstream,
    }


def loop_incident(ev: LoopDetected, store_text: bool) -> dict[str, Any]:
    """A loop as detected; ``outcome`` (and a retry's ``strategy``, ``attempts`` and tokens)
    are filled in as they become known (``PendingLoops``)."""
    trigger = ev.trigger
    record: dict[str, Any] = {
        "kind": LOOP,
        "ts": ev.timestamp,
        "request_id": ev.request_id,
        "model": ev.model,
        "endpoint": ev.endpoint,
        "stream": ev.stream,
        "attempt": ev.attempt,
        "source": trigger.source,
        "channel": trigger.channel,
        "choice": trigger.choice,
        "period": trigger.period,
        "repeats": trigger.repeats,
        "start_offset": trigger.start_offset,
        "action": ev.action or None,
        "strategy": None,  # a retry's: restart | continue | close_reasoning
        "outcome": None,
        "attempts": ev.attempt,  # the request's attempts when the outcome was known
        "retry_tokens": None,  # what the retry made the engine generate
        "kept_tokens": None,  # what a continuation kept of the looping attempt
    }
    if store_text:
        record["unit_preview"] = trigger.preview
    return record


def acted(record: dict[str, Any], ev: PolicyActed) -> None:
    """What the policy did about a loop, and how it came out."""
    record["action"] = ev.action
    record["outcome"] = ev.outcome
    record["attempts"] = ev.attempt
    if ev.strategy:
        record["strategy"] = ev.strategy


class PendingLoops:
    """Loop records whose outcome is not known yet, by request id and attempt (bounded).

    ``settled`` is called with each record once nothing more will be learnt of it."""

    def __init__(self, settled: Callable[[dict[str, Any]], None]) -> None:
        self._settled = settled
        self._requests: dict[str, dict[int, dict[str, Any]]] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, request_id: str, attempt: int, record: dict[str, Any]) -> None:
        loops = self._requests.get(request_id)
        if loops is None:
            if len(self._requests) >= MAX_PENDING_REQUESTS:
                self.finish(next(iter(self._requests)))  # the oldest: written as it stands
            loops = self._requests[request_id] = {}
        elif attempt in loops:  # two requests under one id (ids come from clients)
            self._settle(request_id, attempt)
            loops = self._requests.setdefault(request_id, {})
        loops[attempt] = record

    def on_acted(self, ev: PolicyActed) -> None:
        # A retry's outcome comes with the attempt after the loop; abort and observe at once.
        looped = ev.attempt - 1 if ev.action == "retry" else ev.attempt
        record = self._requests.get(ev.request_id, {}).get(looped)
        if record is None:
            return
        acted(record, ev)
        if ev.action != "retry" or ev.outcome == "error":  # no retry ran: no tokens to wait for
            self._settle(ev.request_id, looped)

    def on_tokens(self, ev: RecoveryTokens) -> None:
        """The retry after a loop ended: its tokens; the loop is settled once its outcome is
        known too (it usually is: the attempt's end decided it)."""
        looped = ev.attempt - 1
        record = self._requests.get(ev.request_id, {}).get(looped)
        if record is None:
            return
        record["retry_tokens"] = ev.generated
        record["kept_tokens"] = ev.kept
        record["strategy"] = ev.strategy
        if record["outcome"] is not None:
            self._settle(ev.request_id, looped)

    def finish(self, request_id: str) -> None:
        """The request ended: its loops are written with what is known."""
        for attempt in sorted(self._requests.get(request_id, {})):
            self._settle(request_id, attempt)

    def finish_all(self) -> None:
        for request_id in list(self._requests):
            self.finish(request_id)

    def _settle(self, request_id: str, attempt: int) -> None:
        loops = self._requests[request_id]
        record = loops.pop(attempt)
        if not loops:
            del self._requests[request_id]
        if record["outcome"] is None:
            record["outcome"] = UNFINISHED
        self._settled(record)


class IncidentLog:
    def __init__(self, config: IncidentConfig, process: str = "") -> None:
        self._config = config
        self._process = process  # the id of this process's tally lines ("" none)
        self._ring: deque[dict[str, Any]] = deque(maxlen=config.ring_size)
        self._loops = PendingLoops(self.write)
        self.changes = 0  # what the ring or the file took in: a publisher's cue (fleet.py)
        self._upstream: dict[str, Any] | None = None
        self._mismatched: frozenset[tuple[str, str, str]] = frozenset()  # recorded last
        self._on_disk = self._check(config.path) if config.path else False
        self._file = (
            IncidentFile(config.path, config.max_bytes, config.backups, config.queue_lines)
            if config.path and self._on_disk
            else None
        )

    @property
    def on_disk(self) -> bool:
        """Incidents go to a file (not only to the ring): it could be written at start."""
        return self._on_disk

    @property
    def written(self) -> int:
        """Lines the writer has written to the file."""
        return self._file.written if self._file is not None else 0

    def file_status(self) -> dict[str, int]:
        """The file's writer: lines written, queued, and dropped for a full queue."""
        f = self._file
        if f is None:
            return {"written": 0, "queued": 0, "dropped": 0}
        return {"written": f.written, "queued": f.queued, "dropped": f.dropped}

    def failures(self) -> dict[str, int]:
        """Lines dropped for a full queue, as the metrics count isolated failures."""
        dropped = self._file.dropped if self._file is not None else 0
        return {"queue_full": dropped} if dropped else {}

    def _check(self, path: str) -> bool:
        """Create the file's folder and the file (it is opened at the first line); what to do
        when that fails depends on whether the path was configured (stop the start) or is the
        default (log it, keep the ring)."""
        try:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab"):
                pass
            return True
        except OSError as exc:
            why = exc.strerror or type(exc).__name__
            if "path" in self._config.model_fields_set:
                raise ConfigError(
                    f"incidents.path: cannot write {path} ({why}); create its folder writable "
                    'by detproxy, choose another path, or set incidents.path = "" to keep '
                    "incidents in memory only"
                ) from None
            log.warning(
                "cannot write the default incident log %s (%s): incidents are kept in memory "
                "only; set %s or incidents.path to a writable place",
                path,
                why,
                STATE_DIR_ENV,
            )
            return False

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(AuditCompleted, self._on_audit)
        bus.subscribe(LoopDetected, self._on_loop)
        bus.subscribe(PolicyActed, self._loops.on_acted)
        bus.subscribe(RecoveryTokens, self._loops.on_tokens)
        bus.subscribe(RequestFinished, self._on_finished)
        bus.subscribe(UpstreamFingerprinted, self._on_fingerprint)
        bus.subscribe(UpstreamRestarted, self._on_restart)
        bus.subscribe(EngineFactsRead, self._on_engine_facts)
        bus.subscribe(CauseAttributed, self._on_cause)

    def _on_cause(self, ev: CauseAttributed) -> None:
        """Triage's verdict on an audit incident already recorded: merged into it in the ring,
        and appended to the file as its own line (``kind: cause``) that names the incident by
        ``request_id``, ``mode``, ``choice`` and ``audit_ts`` (the incident's ``ts``): the
        first record is never rewritten."""
        line = cause_record(ev)
        for record in reversed(self._ring):
            if (
                record.get("kind") == AUDIT
                and record.get("ts") == ev.audit_ts
                and record.get("request_id") == ev.request_id
                and record.get("mode") == ev.mode
                and record.get("choice") == ev.choice
            ):
                record["cause"] = ev.cause
                record["cause_evidence"] = ev.evidence
                break
        self.write(line)

    def _on_engine_facts(self, ev: EngineFactsRead) -> None:
        """One ``engine_mismatch`` per new set of unmet declarations, not one per reading."""
        now = frozenset((str(m.field), repr(m.expected), repr(m.loaded)) for m in ev.mismatches)
        if now == self._mismatched:
            return
        self._mismatched = now
        if not now:
            return
        self.record(
            {
                "kind": ENGINE_MISMATCH,
                "ts": ev.read_at,
                "mismatches": [mismatch_record(m) for m in ev.mismatches],
                "loaded": ev.facts.as_dict(),
                "recipe": ev.facts.digest(),
            }
        )

    def _on_fingerprint(self, ev: UpstreamFingerprinted) -> None:
        self._upstream = ev.fingerprint.summary()
        if ev.fingerprint.identity.get("recipe"):  # what loaded: audits carry it
            self._upstream["recipe"] = ev.fingerprint.identity["recipe"]
        if ev.changed and ev.previous is not None:
            self.record(
                {
                    "kind": UPSTREAM_CHANGE,
                    "ts": ev.fingerprint.read_at,
                    "before": ev.previous.summary() | {"identity": ev.previous.identity},
                    "after": self._upstream | {"identity": ev.fingerprint.identity},
                }
            )

    def _on_restart(self, ev: UpstreamRestarted) -> None:
        # The same identity back: not a change; kept so that audits after it can be read
        # against it. Only a change of identity is an "upstream_change".
        self.record(
            {
                "kind": UPSTREAM_RESTART,
                "ts": ev.fingerprint.read_at,
                "down_s": ev.down_s,
                "evidence": ev.evidence,
            }
        )

    def _on_loop(self, ev: LoopDetected) -> None:
        record = loop_incident(ev, self._config.store_text)
        self.remember(record)  # in the ring now; its line once its outcome is known
        self._loops.add(ev.request_id, ev.attempt, record)

    def _on_finished(self, ev: RequestFinished) -> None:
        if len(self._loops):  # per request: nothing more unless a loop waits
            self._loops.finish(ev.request_id)

    def _on_audit(self, ev: AuditCompleted) -> None:
        if ev.verdict.verdict != "identical":
            self.record(audit_incident(ev))

    def record(self, incident: dict[str, Any]) -> None:
        self.remember(incident)
        self.write(incident)

    def remember(self, incident: dict[str, Any]) -> None:
        """Into the ring, with which configuration produced it and which process saw it."""
        if self._upstream is not None and "upstream" not in incident:
            incident["upstream"] = self._upstream
        if self._process and "process" not in incident:
            incident["process"] = self._process
        self._ring.append(incident)
        self.changes += 1

    def write(self, incident: dict[str, Any]) -> None:
        """Queue one line for the file's writer (the ring is for incidents only, not tallies):
        serialized here, written by the writer's task, never in the caller's call."""
        self.changes += 1  # a loop's record settled, a cause merged in: the ring's records too
        if self._file is not None:
            self._file.put(orjson.dumps(incident) + b"\n")

    def recent(self, limit: int) -> list[dict[str, Any]]:
        items = list(self._ring)[-limit:] if limit > 0 else []
        items.reverse()
        return items

    def start(self) -> None:
        """The file's writer task (with the app's other background tasks)."""
        if self._file is not None:
            self._file.start()

    async def drained(self) -> None:
        """Until every line queued so far is in the file (the writer must be running)."""
        if self._file is not None:
            await self._file.drained()

    async def close(self) -> None:
        """Loops still waiting for an outcome are written as they stand, then the writer
        writes what is queued and stops: a graceful stop loses no incident."""
        self._loops.finish_all()
        if self._file is not None:
            await self._file.close()

    def select(self, query: IncidentQuery) -> list[dict[str, Any]]:
        """The newest ``query.limit`` incidents of the ring that match ``query``, newest first."""
        return select(reversed(self._ring), query)


def select(newest_first: Iterable[dict[str, Any]], query: IncidentQuery) -> list[dict[str, Any]]:
    """The first ``query.limit`` of ``newest_first`` that match ``query`` (what
    ``/detproxy/incidents`` answers: proxy/observe/view.py)."""
    if query.limit <= 0:
        return []
    found = []
    for record in newest_first:
        if query.matches(record):
            found.append(record)
            if len(found) == query.limit:
                break
    return found


class QueryError(ValueError):
    """A query parameter of ``/detproxy/incidents`` it cannot use; the message says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class IncidentQuery:
    """What ``/detproxy/incidents`` returns. ``verdict`` is an audit's verdict, or the kind of a
    loop or an upstream change (as the explorer's list has it)."""

    limit: int = DEFAULT_LIMIT
    kind: str | None = None
    verdict: str | None = None
    mode: str | None = None
    model: str | None = None

    def matches(self, record: dict[str, Any]) -> bool:
        kind = record.get("kind")
        if self.kind is not None and kind != self.kind:
            return False
        if self.verdict is not None:
            verdict = record.get("verdict") if kind == "audit" else kind
            if verdict != self.verdict:
                return False
        if self.mode is not None and record.get("mode") != self.mode:
            return False
        return self.model is None or record.get("model") == self.model


def _one_of(param: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise QueryError(param, f"{param} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def parse_query(pairs: Iterable[tuple[str, str]]) -> IncidentQuery:
    """``/detproxy/incidents``'s query: unknown names, repeats and values it does not know are
    refused (a typo must not silently return everything); an empty value means unset."""
    seen: dict[str, str] = {}
    for name, value in pairs:
        if name not in QUERY_PARAMS:
            raise QueryError(
                name, f"unknown query parameter {name!r}; known: {', '.join(QUERY_PARAMS)}"
            )
        if name in seen:
            raise QueryError(name, f"{name} given more than once")
        seen[name] = value
    values = {k: v for k, v in seen.items() if v != ""}
    limit = DEFAULT_LIMIT
    raw = values.get("limit")
    if raw is not None:
        if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
            raise QueryError("limit", f"limit must be a non-negative integer; got {raw!r}")
        limit = int(raw)
    model = values.get("model")
    if model is not None and (len(model) > MAX_MODEL_CHARS or not model.isprintable()):
        raise QueryError("model", f"model must be printable and at most {MAX_MODEL_CHARS} chars")
    kind, verdict, mode = values.get("kind"), values.get("verdict"), values.get("mode")
    return IncidentQuery(
        limit=limit,
        kind=_one_of("kind", kind, KINDS) if kind is not None else None,
        verdict=_one_of("verdict", verdict, VERDICT_CHOICES) if verdict is not None else None,
        mode=_one_of("mode", mode, MODES) if mode is not None else None,
        model=model,
    )
