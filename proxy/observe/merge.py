"""One server's figures from its workers' (``serve --workers N``): pure functions over what
each worker publishes (``proxy.observe.fleet``) and what the answering one holds.

Counts add up: audits, verdicts, modes, causes, loops, shadows dropped, triage's counts (its
tokens and budget are one ledger for the server: the answering worker's), the incidents
recorded and written, a memory recovery budget's accounts (each worker holds its
share of the floor, ``proxy.workers.worker_budgets``). A worker that exited (the supervisor
restarted it) still counts for what it counted, as its Prometheus counters do, but not for what
is going on now (requests in flight, shadows queued, triage's budget). What is the same for
every worker (the version, the upstream and what it loaded, the configuration) is the
answering worker's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.observe.kinds import ENGINE_MISMATCH, UPSTREAM_CHANGE, UPSTREAM_RESTART

# What is going on now, not a count of what happened: a worker that exited has none of it.
GAUGES: dict[str, tuple[str, ...]] = {
    "shadow": ("queued", "running"),
    "triage": ("queued", "running", "waiting_incidents", "again_incidents", "waiting_for"),
}
# The server's already, as every worker reports it (triage's ledger is one for the server,
# proxy/attribution/account.py): the answering worker's, not a sum.
SERVERS: dict[str, tuple[str, ...]] = {"triage": ("tokens", "token_budget")}
TOP_GAUGES = ("inflight", "tasks", "passive_pending")
# Sections whose numbers add up across workers.
SUMMED = ("shadow", "causes", "triage", "incidents")
# Workers read the upstream each on its own schedule (upstream.fingerprint_interval_s, 30 s by
# default): one event seen by all of them is seen within this long.
SAME_EVENT_S = 90.0


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One worker's published status: ``status`` as its ``/detproxy/status`` (no ``config``)."""

    index: int
    pid: int
    alive: bool
    age_s: float  # since it was published (0: the answering worker's own, live)
    status: Mapping[str, Any]


def add_into(total: dict[str, Any], part: Mapping[str, Any]) -> dict[str, Any]:
    """``part``'s numbers added to ``total``'s, key by key, nested dicts alike (a boolean is
    true where either is; a value that is not a number is the first one seen)."""
    for key, value in part.items():
        have = total.get(key)
        if isinstance(value, Mapping):
            total[key] = add_into(dict(have) if isinstance(have, Mapping) else {}, value)
        elif isinstance(value, bool) or isinstance(have, bool):
            total[key] = bool(have) or bool(value)
        elif isinstance(value, int | float) and isinstance(have, int | float):
            total[key] = have + value
        elif have is None:
            total[key] = value
    return total


def _summed(parts: Iterable[Mapping[str, Any] | None]) -> dict[str, Any] | None:
    total: dict[str, Any] | None = None
    for part in parts:
        if part is not None:
            total = add_into(total if total is not None else {}, part)
    return total


def merge_audit(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``status.audit``: the counts summed, the rate computed again from the summed verdicts
    (as ``AuditTally.snapshot`` computes it)."""
    out = _summed(parts) or {
        "audits": 0,
        "verdicts": {},
        "modes": {},
        "shadows_dropped": {},
        "loops": 0,
    }
    verdicts: Mapping[str, int] = out.get("verdicts") or {}
    comparable = sum(n for v, n in verdicts.items() if v != "incomparable")
    unstable = sum(n for v, n in verdicts.items() if v not in ("identical", "incomparable"))
    out["nondeterminism_rate"] = unstable / comparable if comparable else None
    return out


def merge_injection(parts: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """``status.injection``, per model and kind: suspended where any worker suspended it (for
    the longest time left), failures summed, the last failure the latest one."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for part in parts:
        for model, kinds in part.items():
            for kind, state in kinds.items():
                have = out.setdefault(model, {}).get(kind)
                if have is None:
                    out[model][kind] = dict(state)
                    continue
                left = [s for s in (have["suspended_for_s"], state["suspended_for_s"]) if s]
                merged = {
                    "suspended": bool(have["suspended"] or state["suspended"]),
                    "suspended_for_s": max(left) if left else None,
                    "failures_in_a_row": max(have["failures_in_a_row"], state["failures_in_a_row"]),
                    "failures_total": have["failures_total"] + state["failures_total"],
                }
                latest = max(have, state, key=lambda s: s.get("last_failed_at") or 0.0)
                for key in ("last_status", "last_reason", "last_failed_at"):
                    merged[key] = latest.get(key)
                out[model][kind] = merged
    return out


def _without_gauges(status: Mapping[str, Any]) -> dict[str, Any]:
    """A worker that exited: its counts, none of its gauges."""
    out = {k: v for k, v in status.items() if k not in TOP_GAUGES}
    for section, names in GAUGES.items():
        value = status.get(section)
        if isinstance(value, Mapping):
            out[section] = {k: v for k, v in value.items() if k not in names}
    return out


def worker_line(worker: WorkerStatus, answering: bool) -> dict[str, Any]:
    """``status.workers[i]``: who it is and its own main figures."""
    status = worker.status
    audit = status.get("audit") or {}
    incidents = status.get("incidents") or {}
    return {
        "index": worker.index,
        "pid": worker.pid,
        "alive": worker.alive,
        "answered": answering,
        "age_s": round(worker.age_s, 3),
        "uptime_s": status.get("uptime_s"),
        "inflight": status.get("inflight", 0) if worker.alive else 0,
        "audits": audit.get("audits", 0),
        "loops": audit.get("loops", 0),
        "incidents": incidents.get("recorded", 0),
    }


def merge_status(own: Mapping[str, Any], peers: Sequence[WorkerStatus]) -> dict[str, Any]:
    """``/detproxy/status`` for the whole server: ``own`` (the answering worker's, with its
    ``worker``, ``config`` and what every worker sees alike) and the others' added up, each
    worker's main figures under ``workers``."""
    me = own["worker"]
    mine = WorkerStatus(me["index"], me["pid"], True, 0.0, own)
    everyone = [mine, *peers]
    counted = [w.status if w.alive else _without_gauges(w.status) for w in everyone]
    live = [w.status for w in everyone if w.alive]
    out = dict(own)
    for key in TOP_GAUGES:
        out[key] = sum(int(s.get(key) or 0) for s in live)
    out["uptime_s"] = max(float(s.get("uptime_s") or 0.0) for s in live)
    out["audit"] = merge_audit(s["audit"] for s in counted if s.get("audit"))
    for section in SUMMED:
        out[section] = _summed(
            {k: v for k, v in (s.get(section) or {}).items() if k not in SERVERS.get(section, ())}
            for s in counted
            if s.get(section) is not None
        )
        mine_now = own.get(section)
        if out[section] is not None and isinstance(mine_now, Mapping):
            for key in SERVERS.get(section, ()):
                out[section][key] = mine_now.get(key)
    out["injection"] = merge_injection(s.get("injection") or {} for s in live)
    store = own.get("recovery_budget_store") or {}
    if store.get("store", "memory") == "memory":  # each worker's own account, its share
        out["recovery_budget"] = _summed(s.get("recovery_budget") for s in live) or {}
    # else: Redis or the workers' folder shares one account, which every worker reports whole.
    out["workers"] = sorted(
        (worker_line(w, w is mine) for w in everyone), key=lambda w: (w["index"], -w["alive"])
    )
    return out


def _seen_by_all(record: Mapping[str, Any]) -> tuple[Any, ...] | None:
    """What tells one upstream event from another, for the kinds every worker records of the
    same event (each reads the upstream); None for the others (each worker's own)."""
    kind = record.get("kind")

    def fingerprint(key: str) -> Any:
        value = record.get(key)
        return value.get("fingerprint") if isinstance(value, Mapping) else None

    if kind == UPSTREAM_CHANGE:
        return (kind, fingerprint("before"), fingerprint("after"))
    if kind == UPSTREAM_RESTART:
        return (kind, fingerprint("upstream"))
    if kind == ENGINE_MISMATCH:
        return (kind, record.get("recipe"), repr(record.get("mismatches")))
    return None


def merge_records(
    lists: Iterable[Sequence[dict[str, Any]]], same_event_s: float = SAME_EVENT_S
) -> list[dict[str, Any]]:
    """Incidents of every worker's ring, newest first (by ``ts``). An upstream change, restart
    or engine mismatch that several workers recorded (each reads the upstream on its own
    schedule) is listed once, as the first worker saw it: the same one again within
    ``same_event_s`` of that first sighting is another worker's."""
    merged = [record for records in lists for record in records]
    merged.sort(key=lambda r: float(r.get("ts") or 0.0))
    first: dict[tuple[Any, ...], float] = {}
    kept = []
    for record in merged:
        key = _seen_by_all(record)
        if key is not None:
            ts = float(record.get("ts") or 0.0)
            seen = first.get(key)
            if seen is not None and ts - seen <= same_event_s:
                continue
            first[key] = ts
        kept.append(record)
    kept.reverse()
    return kept


def merge_counters(
    parts: Iterable[Iterable[Sequence[Any]]],
) -> Counter[tuple[str, ...]]:
    """Tally counters published as ``[k1, ..., kn, count]`` rows, summed by key."""
    out: Counter[tuple[str, ...]] = Counter()
    for rows in parts:
        for row in rows:
            out[tuple(str(k) for k in row[:-1])] += int(row[-1])
    return out


def counter_rows(counter: Mapping[tuple[str, ...], int]) -> list[list[Any]]:
    """A tally counter as rows to publish: ``[k1, ..., kn, count]``."""
    return [[*key, n] for key, n in counter.items()]
