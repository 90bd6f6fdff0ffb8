"""What ``detproxy serve`` logs: its configuration at start, one line per notable event, an
optional access log, as text or as one JSON object per line.

The ``EventLog`` subscribes to the bus like the metrics do: it reads events already
published and never reaches into the pipeline. An event that can repeat (an upstream that
refuses every request, a model that loops) is logged at most once per ``log.repeat_s`` per
kind (and model), at INFO or WARNING; the repeats left out go to DEBUG, and the next line that
is let through says how many there were. A log line carries request ids, models, counts and
statuses: never a header, a prompt or an output.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Hashable
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

from proxy.config import LogConfig, ServerConfig, Settings
from proxy.engine.expect import mismatch_record
from proxy.events import (
    AuditCompleted,
    CauseAttributed,
    ClientDisconnected,
    EngineFactsRead,
    EventBus,
    FallbackSent,
    InjectionFailed,
    InjectionSuspended,
    InspectionStopped,
    LoopDetected,
    PolicyActed,
    RecoveryBudgetUsed,
    RequestFinished,
    ShadowDropped,
    SharedStoreFailed,
    TemplateProbed,
    TriageDropped,
    UpstreamFailed,
    UpstreamFingerprinted,
)
from proxy.http.admin import serves_all
from proxy.redact import mask_url

EVENTS = "detproxy.events"
ACCESS = "detproxy.access"
LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}
LEVELS["error"] = logging.ERROR
MAX_TEXT = 128  # a client-chosen string (a model name, a request id) in a line, at most
MAX_KEYS = 1024  # distinct (kind, model) keys the rate limit remembers

# ---------------------------------------------------------------------------------------------
# Formatting


def clean(value: str) -> str:
    """A client-chosen string made safe for one log line: no control characters (a newline
    would forge a line), at most ``MAX_TEXT`` characters."""
    if len(value) > MAX_TEXT:
        value = value[: MAX_TEXT - 3] + "..."
    if not value.isprintable():
        value = value.encode("unicode_escape").decode("ascii")
    return value


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg``, the
    worker's index under ``--workers``, and the fields the line was logged with
    (``extra={"fields": {...}}``)."""

    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self._worker = worker

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds")
        line: dict[str, Any] = {
            "ts": ts.replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if self._worker is not None:
            line["worker"] = self._worker
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(line, default=str).decode()


def configure(config: LogConfig, worker: int | None = None, stream: TextIO | None = None) -> None:
    """The root logger as ``config`` says: its level, and one handler writing text or JSON
    lines to ``stream`` (stderr), replacing any other."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if config.format == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        tag = "" if worker is None else f" [worker {worker}]"
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{tag}: %(message)s")
        )
    logging.basicConfig(level=LEVELS[config.level], handlers=[handler], force=True)


# ---------------------------------------------------------------------------------------------
# The start-up summary


def _share(rate: float) -> str:
    return f"{rate * 100:g}%"


def _host_port(address: str, port: int) -> str:
    """``address:port``, an IPv6 address in brackets."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _admin_line(server: ServerConfig, at: tuple[str, int] | None) -> tuple[str, str, bool]:
    """What the listener of the admin endpoints serves, in words; where it is bound; whether
    it serves all of them (``proxy.http.admin.serves_all``)."""
    separate = server.admin_port is not None
    if at is None and server.admin_port is not None:  # as configured: a name is not resolved
        at = (server.admin_address(), server.admin_port)
    elif at is None:
        at = (server.host, server.port)
    where = _host_port(*at)
    if not serves_all(server.admin_token, at[0]):
        return (
            f"admin endpoints: health and metrics only on {where} (not loopback, no"
            " server.admin_token); set it to open status, incidents and the explorer, or serve"
            " them on server.admin_port at a loopback server.admin_host",
            where,
            False,
        )
    on = f"on {where}" if separate else f"under /detproxy/ on the main port ({where})"
    if server.admin_token:
        return f"admin endpoints {on}, token required", where, True
    return f"admin endpoints {on}, no token (loopback: only this machine connects)", where, True


def startup_lines(
    settings: Settings, on_disk: bool = True, admin_at: tuple[str, int] | None = None
) -> list[tuple[str, dict[str, Any]]]:
    """What the effective configuration does, in a few lines (message, structured fields),
    with no secret in them: logged once detproxy listens. ``on_disk``: whether the incident
    log could open its file (the default path falls back to memory when it cannot);
    ``admin_at``: the address and port the admin endpoints' listener is bound to (as
    configured when not given)."""
    audit, loops, inc, server = settings.audit, settings.loops, settings.incidents, settings.server
    per_model = ", ".join(f"{clean(k)} {_share(v)}" for k, v in audit.model_rates.items())
    share = _share(audit.sample_rate) + (f" (per model: {per_model})" if per_model else "")
    rates = (audit.sample_rate, *audit.model_rates.values())
    audited = audit.at_least_every_s > 0 or any(r > 0 for r in rates)
    target = mask_url(audit.reference_url) if audit.reference_url else "the upstream"
    if audited:
        schedule: str = audit.schedule
        if schedule == "quiet":
            schedule += f" (within {audit.quiet_deadline_s:g}s)"
        floor = ""
        if audit.at_least_every_s > 0:
            floor = f" (and one per model every {audit.at_least_every_s:g}s at least)"
        audit_msg = (
            f"audit: {share} of deterministic requests{floor} replayed to {target},"
            f" {audit.shadow_mode}"
            f" shadows, {schedule} schedule; budgets: {audit.max_concurrent_shadows} at once,"
            f" {audit.max_shadows_per_s:g}/s, shadow tokens <= {audit.max_token_share:g} x"
            f" deterministic requests' tokens + {audit.token_allowance}, queue {audit.queue_size}"
        )
    else:
        audit_msg = "audit: no replays (audit.sample_rate and at_least_every_s are 0)"
    audit_msg += "; passive checks " + ("on" if audit.passive_checks else "off")
    ladders = loops.ladder_list()
    policy = ", ".join(f"{clean(lad.models)}: {lad.action}" for lad in ladders)
    loops_msg = (
        f"loops: {policy}; recovery budget {loops.recovery_token_share:g} x client tokens"
        f" + {loops.recovery_token_floor} tokens per {loops.recovery_window_s}s"
        f" ({loops.recovery_budget_store})"
        if loops.enabled
        else "loops: not watched (loops.enabled = false)"
    )
    if inc.path and not on_disk:
        incidents_msg = (
            f"incidents: memory only (the last {inc.ring_size}): {inc.path} cannot be written;"
            " set DETPROXY_STATE_DIR or incidents.path to a writable place"
        )
    elif inc.path:
        incidents_msg = (
            f"incidents: {inc.path} (rotated at {inc.max_bytes // (1024 * 1024)} MiB,"
            f" {inc.backups} kept)"
        )
    else:
        incidents_msg = f"incidents: memory only (the last {inc.ring_size}), no file"
    admin, admin_where, admin_all = _admin_line(server, admin_at)
    log_msg = f"log: {settings.log.level}, {settings.log.format}" + (
        ", access log on" if settings.log.access_log else ""
    )
    return [
        (
            audit_msg,
            {
                "sample_rate": audit.sample_rate,
                "model_rates": dict(audit.model_rates),
                "shadow_mode": audit.shadow_mode,
                "schedule": audit.schedule,
                "max_concurrent_shadows": audit.max_concurrent_shadows,
                "max_shadows_per_s": audit.max_shadows_per_s,
                "max_token_share": audit.max_token_share,
                "at_least_every_s": audit.at_least_every_s,
            },
        ),
        (
            loops_msg,
            {
                "loops_enabled": loops.enabled,
                "loop_policy": [lad.action for lad in ladders],
                "recovery_token_share": loops.recovery_token_share,
                "recovery_token_floor": loops.recovery_token_floor,
            },
        ),
        (incidents_msg, {"incidents_path": inc.path if on_disk else None}),
        (
            f"{admin}; {log_msg}",
            {
                "admin_port": server.admin_port,
                "admin_token": bool(server.admin_token),
                "admin_address": admin_where,
                "admin_all": admin_all,  # false: health and metrics only
                "log_level": settings.log.level,
                "access_log": settings.log.access_log,
            },
        ),
    ]


# ---------------------------------------------------------------------------------------------
# Events


class Repeats:
    """At most one line per key every ``every_s`` seconds. ``admit`` answers None for a
    repeat to leave out, else how many were left out since the last line of that key. Keys
    (a model is the client's choice) are bounded: past ``max_keys`` the stale ones are
    forgotten, and while all are fresh, new keys share one."""

    def __init__(
        self, every_s: float, clock: Callable[[], float], max_keys: int = MAX_KEYS
    ) -> None:
        self._every_s = every_s
        self._clock = clock
        self._max_keys = max_keys
        self._keys: dict[Hashable, list[float]] = {}  # key -> [last line at, left out since]

    @property
    def key_count(self) -> int:
        """How many keys are held (at most ``max_keys``)."""
        return len(self._keys)

    def admit(self, key: Hashable) -> int | None:
        now = self._clock()
        entry = self._keys.get(key)
        if entry is None:
            if len(self._keys) >= self._max_keys:
                self._forget(now)
                if len(self._keys) >= self._max_keys:
                    key = ("overflow",)
                    entry = self._keys.get(key)
            if entry is None:
                self._keys[key] = [now, 0]
                return 0
        if now - entry[0] >= self._every_s:
            left_out = int(entry[1])
            entry[0], entry[1] = now, 0
            return left_out
        entry[1] += 1
        return None

    def _forget(self, now: float) -> None:
        stale = [k for k, (at, _) in self._keys.items() if now - at >= self._every_s]
        for key in stale:
            del self._keys[key]


SHADOW_DROPS = {
    "queue_full": "the shadow queue is full (audit.queue_size)",
    "rate_limit": "audit.max_shadows_per_s reached",
    "token_budget": "audit.max_token_share reached: replays are held to that share of tokens",
    "quiet_deadline": "the upstream was not quiet within audit.quiet_deadline_s",
    "upstream_error": "the upstream failed the replay",
    "timeout": "the replay took longer than audit.shadow_timeout_s",
    "injection_suspended": "logprobs are suspended for this model",
    "injection_failed": "the upstream refused the logprobs a replay needs",
    "internal_error": "detproxy failed to replay it (a bug: please report it)",
}
# What each cause means for the operator (SPEC 1.14), said with the cause.
CAUSE_ADVICE = {
    "intrinsic": "serial cold replays at batch 1 differ: a nondeterministic kernel in the engine"
    " (a bug to report)",
    "batch": "replays alone agree, runs beside other requests differ: batch composition (a"
    " batch-invariant mode removes it, at a throughput cost)",
    "prefix_cache": "a prefix-cache hit is not bit-identical to a cold prefill (cache_salt per"
    " tenant, or no prefix caching for audited traffic)",
    "speculative": "speculative decoding is not output-equivalent to greedy here (turn it off"
    " or accept it)",
    "recipe_change": "the upstream changed between the primary and its replay",
    "unknown": "the evidence does not decide",
}
TRIAGE_DROPS = {
    "queue_full": "the triage queue is full (attribution.queue_size experiments waiting)",
    "rate_limit": "attribution.max_per_minute left no start within attribution.max_wait_s",
    "token_budget": "attribution.max_token_share did not free within attribution.max_wait_s",
    "quiet_deadline": "no quiet moment within attribution.quiet_deadline_s",
    "other_worker": "another worker's experiment on the request did not end within"
    " attribution.max_wait_s",
    "error": "triage failed (a bug: please report it)",
    "shutdown": "detproxy stopped first",
}
UPSTREAM_FAILURES = {
    "refused": "refused the connection",
    "reset": "closed the connection",
    "timeout": "timed out",
    "error": "failed",
}


class EventLog:
    """Logs what an operator wants to know from the events on the bus: upstream failures,
    inspection stopped, refused injections, suspensions and fallbacks, loops and what was done
    about them, exhausted budgets, dropped replays, divergent audits, shared stores that fail,
    the upstream's identity, the chat templates read before a closed reasoning; and, with
    ``access_log``, every finished request."""

    def __init__(
        self,
        config: LogConfig,
        upstream: str = "",
        clock: Callable[[], float] = time.monotonic,
        logger: logging.Logger | None = None,
        access: logging.Logger | None = None,
    ) -> None:
        self._log = logger or logging.getLogger(EVENTS)
        self._access = access or logging.getLogger(ACCESS)
        self._access_on = config.access_log
        self._upstream = mask_url(upstream) or "(unknown)"
        self._repeats = Repeats(config.repeat_s, clock)
        self._mismatched: frozenset[tuple[str, str, str]] = frozenset()  # said last

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(EngineFactsRead, self._engine_facts)
        bus.subscribe(UpstreamFailed, self._upstream_failed)
        bus.subscribe(InspectionStopped, self._inspection_stopped)
        bus.subscribe(InjectionFailed, self._injection_failed)
        bus.subscribe(InjectionSuspended, self._injection_suspended)
        bus.subscribe(FallbackSent, self._fallback)
        bus.subscribe(LoopDetected, self._loop)
        bus.subscribe(PolicyActed, self._policy)
        bus.subscribe(ShadowDropped, self._shadow_dropped)
        bus.subscribe(SharedStoreFailed, self._shared_store)
        bus.subscribe(UpstreamFingerprinted, self._fingerprinted)
        bus.subscribe(AuditCompleted, self._audited)
        bus.subscribe(CauseAttributed, self._cause)
        bus.subscribe(TriageDropped, self._triage_dropped)
        bus.subscribe(TemplateProbed, self._template)
        # Per request: only when asked for (an access log, or DEBUG).
        debug = self._log.isEnabledFor(logging.DEBUG)
        if self._access_on or debug:
            bus.subscribe(RequestFinished, self._finished)
        if debug:
            bus.subscribe(ClientDisconnected, self._disconnected)
            bus.subscribe(RecoveryBudgetUsed, self._budget_used)

    # -- how a line goes out ----------------------------------------------------------------

    def _emit(self, level: int, key: Hashable | None, msg: str, **fields: Any) -> None:
        """``msg`` at ``level``; with a ``key``, at most once per ``repeat_s`` (the repeats
        at DEBUG), saying how many were left out since the last one."""
        if key is not None:
            left_out = self._repeats.admit(key)
            if left_out is None:
                level = logging.DEBUG
            elif left_out:
                msg += f" ({left_out} more like it since the last such line)"
                fields["repeats_left_out"] = left_out
        if self._log.isEnabledFor(level):
            self._log.log(level, msg, extra={"fields": fields})

    # -- the handlers -----------------------------------------------------------------------

    def _upstream_failed(self, ev: UpstreamFailed) -> None:
        if ev.kind == "loop":
            self._upstream_loop(ev)
            return
        what = UPSTREAM_FAILURES.get(ev.kind, ev.kind)
        when = "before its response headers" if ev.stage == "headers" else "mid-response"
        self._emit(
            logging.WARNING,
            ("upstream_failed", ev.kind, ev.stage),
            f"upstream {self._upstream} {what} {when} ({ev.endpoint} request)",
            event="upstream_failed",
            endpoint=ev.endpoint,
            kind=ev.kind,
            stage=ev.stage,
        )

    def _upstream_loop(self, ev: UpstreamFailed) -> None:
        """A request this detproxy sent came back to it (proxy/selfloop.py): a configuration
        that cannot work, said once (then once per ``repeat_s``, with the count)."""
        self._emit(
            logging.ERROR,
            ("upstream_loop",),
            f"upstream {self._upstream} points back at this detproxy: a request it sent there"
            f" came back ({ev.endpoint} request), answered 508 Loop Detected and not forwarded"
            " again; point upstream.url at the engine",
            event="upstream_loop",
            endpoint=ev.endpoint,
            upstream=self._upstream,
        )

    def _inspection_stopped(self, ev: InspectionStopped) -> None:
        self._emit(
            logging.WARNING,
            ("inspection_stopped", ev.reason),
            f"inspection of a {ev.endpoint} response stopped ({ev.reason}): its bytes were"
            " relayed as they came, without audit or loop watch",
            event="inspection_stopped",
            endpoint=ev.endpoint,
            reason=ev.reason,
        )

    def _injection_failed(self, ev: InjectionFailed) -> None:
        # ev.reason is the upstream's message, which may quote the request: not logged.
        model = clean(ev.model)
        self._emit(
            logging.WARNING,
            ("injection_failed", model, ev.kind),
            f"upstream answered {ev.status} to the {ev.kind} detproxy adds to model {model}'s"
            " requests; the client's own request was sent instead",
            event="injection_failed",
            model=model,
            endpoint=ev.endpoint,
            kind=ev.kind,
            status=ev.status,
        )

    def _injection_suspended(self, ev: InjectionSuspended) -> None:
        model = clean(ev.model)
        if ev.suspended:
            msg = (
                f"adding {ev.kind} to model {model}'s requests is suspended for"
                f" {ev.seconds:g}s after repeated refusals by the upstream"
            )
            level = logging.WARNING
        else:
            msg = f"trying {ev.kind} on model {model}'s requests again"
            level = logging.INFO
        self._emit(
            level,
            None,
            msg,
            event="injection_suspended",
            model=model,
            kind=ev.kind,
            suspended=ev.suspended,
            seconds=ev.seconds,
        )

    def _template(self, ev: TemplateProbed) -> None:
        """What detproxy learnt of a model's chat template before closing its reasoning."""
        model = clean(ev.model)
        if ev.drops_reasoning is False:
            level = logging.DEBUG
            msg = f"model {model}'s chat template keeps assistant reasoning"
        elif ev.drops_reasoning:
            level = logging.INFO
            msg = (
                f"model {model}'s chat template drops the reasoning of assistant messages:"
                " close_reasoning continues on the prompt it renders (/v1/completions)"
            )
        else:
            level = logging.INFO
            msg = (
                f"model {model}'s chat template could not be read (no vLLM /tokenize):"
                " close_reasoning continues as an assistant message"
            )
        self._emit(
            level,
            ("template", model),
            msg,
            event="template_probed",
            model=model,
            drops_reasoning=ev.drops_reasoning,
        )

    def _fallback(self, ev: FallbackSent) -> None:
        model = clean(ev.model)
        if ev.outcome == "recovered":
            level, key = logging.DEBUG, None
            msg = f"fallback for model {model}: the client's own request succeeded ({ev.status})"
        else:
            level, key = logging.INFO, ("fallback", model, ev.outcome)
            msg = (
                f"fallback for model {model}: the client's own request failed too"
                f" ({ev.status}); the upstream's error was relayed"
            )
        self._emit(
            level,
            key,
            msg,
            event="fallback",
            model=model,
            endpoint=ev.endpoint,
            status=ev.status,
            outcome=ev.outcome,
        )

    def _loop(self, ev: LoopDetected) -> None:
        model, rid, trig = clean(ev.model), clean(ev.request_id), ev.trigger
        shape = f", period {trig.period} x {trig.repeats}" if trig.period and trig.repeats else ""
        self._emit(
            logging.INFO,
            ("loop", model, trig.source),
            f"loop in model {model}'s {trig.channel} (found by {trig.source}{shape}),"
            f" attempt {ev.attempt}, request {rid}",
            event="loop",
            request_id=rid,
            model=model,
            endpoint=ev.endpoint,
            stream=ev.stream,
            attempt=ev.attempt,
            channel=trig.channel,
            source=trig.source,
        )

    def _policy(self, ev: PolicyActed) -> None:
        model, rid = clean(ev.model), clean(ev.request_id)
        fields = {
            "event": "policy",
            "request_id": rid,
            "model": model,
            "action": ev.action,
            "outcome": ev.outcome,
            "attempt": ev.attempt,
        }
        if ev.outcome == "budget_exhausted":
            done = "relayed as it came" if ev.action == "observe" else "aborted"
            self._emit(
                logging.WARNING,
                ("budget_exhausted", model),
                f"recovery budget of model {model} exhausted: a loop was {done} instead of"
                f" retried (loops.recovery_token_share, recovery_token_floor), request {rid}",
                **fields,
            )
        elif ev.action == "retry" and ev.outcome == "recovered":
            self._emit(
                logging.INFO,
                ("recovered", model, ev.strategy),
                f"loop recovered for model {model}: attempt {ev.attempt} ({ev.strategy}),"
                f" request {rid}",
                strategy=ev.strategy,
                **fields,
            )
        elif ev.action == "abort" or ev.outcome == "error":
            self._emit(
                logging.WARNING,
                ("policy", model, ev.action, ev.outcome),
                f"loop in model {model}'s answer: {ev.action}, {ev.outcome.replace('_', ' ')}"
                f" after attempt {ev.attempt}, request {rid}",
                **fields,
            )
        else:  # looped again (the next attempt says more), observe (the loop line said it)
            self._emit(
                logging.DEBUG,
                None,
                f"policy for model {model}: {ev.action} -> {ev.outcome}, attempt"
                f" {ev.attempt}, request {rid}",
                **fields,
            )

    def _shadow_dropped(self, ev: ShadowDropped) -> None:
        level = logging.DEBUG if ev.reason == "shutdown" else logging.INFO
        why = SHADOW_DROPS.get(ev.reason, ev.reason)
        self._emit(
            level,
            ("shadow_dropped", ev.reason),
            f"audit replay dropped: {why}",
            event="shadow_dropped",
            model=clean(ev.model),
            reason=ev.reason,
        )

    def _shared_store(self, ev: SharedStoreFailed) -> None:
        self._emit(
            logging.WARNING,
            ("shared_store", ev.store),
            f"the {ev.store} store the replicas share (Redis) failed ({ev.reason}): this"
            " replica decides alone until it answers",
            event="shared_store_failed",
            store=ev.store,
            reason=ev.reason,
        )

    def _engine_facts(self, ev: EngineFactsRead) -> None:
        """A WARNING when the set of unmet declarations changes (not on every reading); an
        INFO when the last one is met again."""
        now = frozenset((str(m.field), repr(m.expected), repr(m.loaded)) for m in ev.mismatches)
        if now == self._mismatched:
            return
        self._mismatched = now
        if not now:
            self._emit(
                logging.INFO,
                None,
                "engine: every declared [upstream.expect] field is met",
                event="engine_expectation_met",
            )
            return
        said = "; ".join(
            f"{m.field}: declared {m.expected!r}, loaded {m.loaded!r}" for m in ev.mismatches
        )
        self._emit(
            logging.WARNING,
            None,
            f"engine does not run what [upstream.expect] declares: {said}",
            event="engine_mismatch",
            mismatches=[mismatch_record(m) for m in ev.mismatches],
        )

    def _fingerprinted(self, ev: UpstreamFingerprinted) -> None:
        if ev.previous is not None:  # a change is logged where it is found (engine/fingerprint)
            return
        fp = ev.fingerprint
        models = ", ".join(clean(m) for m in fp.models) or "no model listed"
        version = f" {fp.version}" if fp.version else ""
        self._emit(
            logging.INFO,
            None,
            f"upstream {self._upstream} is {fp.kind}{version}, serving {models}",
            event="upstream_identified",
            kind=fp.kind,
            version=fp.version,
            models=[clean(m) for m in fp.models],
            fingerprint=fp.fingerprint,
        )

    def _audited(self, ev: AuditCompleted) -> None:
        verdict = ev.verdict
        model, rid = clean(ev.model), clean(ev.request_id)
        divergent = verdict.verdict in ("text_divergence", "answer_divergence")
        at = ""
        if divergent and verdict.divergence is not None:
            at = f" at token {verdict.divergence.index}"
        self._emit(
            logging.INFO if divergent else logging.DEBUG,
            ("audit", model, verdict.verdict) if divergent else None,
            f"audit of model {model}: {verdict.verdict}{at} ({ev.mode}), request {rid}",
            event="audit",
            request_id=rid,
            model=model,
            mode=ev.mode,
            verdict=verdict.verdict,
            choice=ev.choice,
        )

    def _cause(self, ev: CauseAttributed) -> None:
        model, rid = clean(ev.model), clean(ev.request_id)
        why = CAUSE_ADVICE.get(ev.cause, ev.cause)
        if ev.revises is not None:
            why += f" (triaged again once its budget freed; it was {ev.revises})"
        missing = ev.evidence.get("missing") if ev.cause == "unknown" else None
        if isinstance(missing, list) and missing:
            why += "; missing: " + "; ".join(str(m) for m in missing)
        self._emit(
            logging.WARNING if ev.cause == "intrinsic" else logging.INFO,
            ("cause", model, ev.cause),
            f"cause of model {model}'s {ev.verdict} ({ev.mode}), request {rid}: {ev.cause}: {why}",
            event="cause",
            request_id=rid,
            model=model,
            mode=ev.mode,
            choice=ev.choice,
            verdict=ev.verdict,
            cause=ev.cause,
        )

    def _triage_dropped(self, ev: TriageDropped) -> None:
        level = logging.DEBUG if ev.reason == "shutdown" else logging.INFO
        self._emit(
            level,
            ("triage_dropped", ev.reason),
            f"triage of a divergent audit dropped: {TRIAGE_DROPS.get(ev.reason, ev.reason)}",
            event="triage_dropped",
            model=clean(ev.model),
            reason=ev.reason,
        )

    def _finished(self, ev: RequestFinished) -> None:
        rid = clean(ev.request_id)
        model = clean(ev.model) or "-"
        msg = (
            f"{ev.endpoint} {model} {ev.status} {'stream' if ev.stream else 'whole'}"
            f" {'deterministic' if ev.deterministic else 'sampled'} {ev.duration_s * 1000:.1f}ms"
            f" {ev.outcome} {rid or '-'}"
        )
        log = self._access if self._access_on else self._log
        level = logging.INFO if self._access_on else logging.DEBUG
        if log.isEnabledFor(level):
            fields = {
                "event": "request",
                "endpoint": ev.endpoint,
                "model": model,
                "status": ev.status,
                "stream": ev.stream,
                "deterministic": ev.deterministic,
                "duration_s": round(ev.duration_s, 6),
                "first_byte_s": None if ev.first_byte_s is None else round(ev.first_byte_s, 6),
                "outcome": ev.outcome,
                "request_id": rid,
            }
            log.log(level, msg, extra={"fields": fields})

    def _disconnected(self, ev: ClientDisconnected) -> None:
        self._emit(
            logging.DEBUG,
            None,
            f"client left before its {ev.endpoint} response ended; upstream closed",
            event="client_disconnected",
            endpoint=ev.endpoint,
            stream=ev.stream,
        )

    def _budget_used(self, ev: RecoveryBudgetUsed) -> None:
        model = clean(ev.model)
        self._emit(
            logging.DEBUG,
            None,
            f"recovery budget of model {model}: {ev.spent} of {ev.allowed} tokens spent",
            event="recovery_budget",
            model=model,
            spent=ev.spent,
            allowed=ev.allowed,
        )
