"""Frozen events and the bus that carries them to subscribers (metrics, incident log).

The pipeline publishes; subscribers never reach back into it. A subscriber that raises is
isolated: the failure is logged and counted, the request goes on (mitmproxy's ``safecall``).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

# Imported at run time, not only for the type checker: compiled (mypyc), a dataclass's field
# types are looked up when its module loads.
from policies.base import Trigger
from proxy.audit.verdict import Verdict
from proxy.engine.identity import Fingerprint

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RequestStarted:
    """Fires when a client request arrives, before anything is read."""

    endpoint: str

    def __init__(self, endpoint: str) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "endpoint", endpoint)


@dataclass(frozen=True, slots=True)
class RequestClassified:
    """Fires once per client request, as soon as its labels are known: when its body has been
    classified (chat, completions), when it starts (any other path), or when it is refused
    before that (a bad request: model "", stream and deterministic false)."""

    endpoint: str  # "chat" | "completions" | "other"
    model: str
    stream: bool
    deterministic: bool

    def __init__(self, endpoint: str, model: str, stream: bool, deterministic: bool) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "deterministic", deterministic)


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """Fires once per client request, after the last byte was sent (or the client left)."""

    endpoint: str  # "chat" | "completions" | "other"
    model: str
    stream: bool
    deterministic: bool
    status: int
    outcome: str  # ok | upstream_error | client_error | client_disconnect | bad_request
    duration_s: float
    first_byte_s: float | None  # upstream headers (non-stream) or first SSE event (stream)
    request_id: str = ""  # the client's X-Request-Id, else detproxy's own; "" before one was given

    def __init__(  # noqa: PLR0913, PLR0917 (the generated one took them so: callers pass them so)
        self,
        endpoint: str,
        model: str,
        stream: bool,
        deterministic: bool,
        status: int,
        outcome: str,
        duration_s: float,
        first_byte_s: float | None,
        request_id: str = "",
    ) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "stream", stream)
        object.__setattr__(self, "deterministic", deterministic)
        object.__setattr__(self, "status", status)
        object.__setattr__(self, "outcome", outcome)
        object.__setattr__(self, "duration_s", duration_s)
        object.__setattr__(self, "first_byte_s", first_byte_s)
        object.__setattr__(self, "request_id", request_id)


@dataclass(frozen=True, slots=True)
class UpstreamFailed:
    """The upstream refused, reset, timed out or broke; ``stage`` says when."""

    endpoint: str
    kind: str  # refused | reset | timeout | error
    stage: str  # headers | body


@dataclass(frozen=True, slots=True)
class InspectionStopped:
    """Inspection of one response stopped (malformed SSE/JSON, oversized event); bytes flow on."""

    endpoint: str
    reason: str  # malformed_sse | malformed_json | event_too_large | inspector_error


@dataclass(frozen=True, slots=True)
class ClientDisconnected:
    """The client went away before the response ended; the upstream connection was closed."""

    endpoint: str
    stream: bool


E = TypeVar("E")
Handler = Callable[[Any], None]


class EventBus:
    def __init__(self) -> None:
        self._subscribers: dict[type, list[Handler]] = {}
        self.failures: Counter[str] = Counter()

    def subscribe(self, event_type: type[E], handler: Callable[[E], None]) -> None:
        self._subscribers.setdefault(event_type, []).append(handler)

    def publish(self, event: object) -> None:
        for handler in self._subscribers.get(type(event), ()):
            try:
                handler(event)
            except Exception:
                name = getattr(handler, "__qualname__", repr(handler))
                self.failures[name] += 1
                log.exception("event subscriber %s failed on %s", name, type(event).__name__)


@dataclass(frozen=True, slots=True)
class AuditCompleted:
    """One choice of one audited request was compared with its replay (or its passive twin).

    ``mode`` is how the second answer was obtained: ``full`` or ``prefill`` (a shadow),
    ``n_choices`` (another choice of the same greedy request), ``duplicate`` (the same
    deterministic request seen earlier in the window).
    """

    request_id: str
    model: str
    endpoint: str
    mode: str
    choice: int
    verdict: Verdict
    request_key: str
    inflight_primary: int
    inflight_shadow: int | None
    primary_latency_s: float | None
    shadow_latency_s: float | None
    target: str  # "same" or the reference upstream's URL
    timestamp: float
    shadow_overlapped: bool | None = None  # a client request ran during the shadow
    prompt: str | None = None  # only when incidents.store_text is on
    primary_text: str | None = None
    shadow_text: str | None = None

    def __init__(  # noqa: PLR0913, PLR0917 (one argument per field)
        self,
        request_id: str,
        model: str,
        endpoint: str,
        mode: str,
        choice: int,
        verdict: Verdict,
        request_key: str,
        inflight_primary: int,
        inflight_shadow: int | None,
        primary_latency_s: float | None,
        shadow_latency_s: float | None,
        target: str,
        timestamp: float,
        shadow_overlapped: bool | None = None,
        prompt: str | None = None,
        primary_text: str | None = None,
        shadow_text: str | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per audited choice, it pays (README).
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "choice", choice)
        object.__setattr__(self, "verdict", verdict)
        object.__setattr__(self, "request_key", request_key)
        object.__setattr__(self, "inflight_primary", inflight_primary)
        object.__setattr__(self, "inflight_shadow", inflight_shadow)
        object.__setattr__(self, "primary_latency_s", primary_latency_s)
        object.__setattr__(self, "shadow_latency_s", shadow_latency_s)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "timestamp", timestamp)
        object.__setattr__(self, "shadow_overlapped", shadow_overlapped)
        object.__setattr__(self, "prompt", prompt)
        object.__setattr__(self, "primary_text", primary_text)
        object.__setattr__(self, "shadow_text", shadow_text)


@dataclass(frozen=True, slots=True)
class ShadowDropped:
    """A shadow that was not replayed or not answered, and why."""

    model: str
    # queue_full | rate_limit | token_budget | quiet_deadline | upstream_error | timeout | shutdown
    # | injection_suspended | injection_failed (the upstream refused the logprobs a shadow needs)
    reason: str


@dataclass(frozen=True, slots=True)
class ShadowQueue:
    """The shadow scheduler's occupancy after a change."""

    queued: int
    running: int


@dataclass(frozen=True, slots=True)
class LoopDetected:
    """A repetition loop in one attempt: seen by detproxy, reported by the engine, or a
    runaway (the token limit reached after reasoning, with no content)."""

    request_id: str
    model: str
    endpoint: str
    stream: bool
    attempt: int
    trigger: Trigger
    timestamp: float
    action: str = ""  # what the policies decided: retry | abort | observe ("" not said)


@dataclass(frozen=True, slots=True)
class PolicyActed:
    """A policy's decision on a loop, with its outcome once known.

    ``action``: retry | abort | observe. ``outcome``: for retry, recovered (the next attempt
    ended without a loop), looped_again or error; for abort and observe, why (loop,
    attempts_exhausted, budget_exhausted, observe).
    """

    request_id: str
    model: str
    action: str
    outcome: str
    attempt: int
    strategy: str = ""  # for retry: restart | continue | close_reasoning (how it recovered)


@dataclass(frozen=True, slots=True)
class UpstreamFingerprinted:
    """A reading of what the upstream says it is; ``changed`` when its identity moved."""

    fingerprint: Fingerprint
    previous: Fingerprint | None
    changed: bool


@dataclass(frozen=True, slots=True)
class UpstreamUnreachable:
    """The upstream stopped saying what it is (refused, timed out, loading, or none of its
    identity endpoints answered): once per outage, when it starts. ``was_up``: False while
    detproxy has not read an identity yet (it started before its engine)."""

    reason: str
    since: float
    was_up: bool


@dataclass(frozen=True, slots=True)
class UpstreamRestarted:
    """The same identity answered again: from a process started since the last reading
    (``evidence`` "process_start_time"), or after an outage ("outage"). ``down_s``: how long
    no identity was read, None where no outage was seen. A new identity is a change
    (``UpstreamFingerprinted.changed``), never a restart."""

    fingerprint: Fingerprint
    down_s: float | None
    evidence: str


@dataclass(frozen=True, slots=True)
class EngineFactsRead:
    """What the engine says it loaded changed (its log, its endpoints, merged), held against
    ``[upstream.expect]``. ``facts``: a ``proxy.engine.facts.EngineFacts`` (typed loosely so
    that this module does not load the parsers); ``mismatches``: ``proxy.engine.expect``'s
    ``Mismatch`` for each declared field not met; ``unknown_fields``: declared fields that
    nothing has said yet; ``declared``: every declared field (for the gauge's zeros)."""

    facts: Any
    mismatches: tuple[Any, ...]
    unknown_fields: tuple[str, ...]
    declared: tuple[str, ...]
    read_at: float


@dataclass(frozen=True, slots=True)
class StreamTimed:
    """How fast a completed stream came, as the client saw it, and how busy detproxy was.

    ``inflight`` counts detproxy's requests in flight when this one arrived (itself included);
    ``tokens_per_s`` is the decode rate between the first and the last token.
    """

    endpoint: str
    model: str
    inflight: int
    ttft_s: float
    inter_token_s: float | None
    tokens: int
    tokens_per_s: float | None

    def __init__(
        self,
        endpoint: str,
        model: str,
        inflight: int,
        ttft_s: float,
        inter_token_s: float | None,
        tokens: int,
        tokens_per_s: float | None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per stream, it pays (README).
        object.__setattr__(self, "endpoint", endpoint)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "inflight", inflight)
        object.__setattr__(self, "ttft_s", ttft_s)
        object.__setattr__(self, "inter_token_s", inter_token_s)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "tokens_per_s", tokens_per_s)


@dataclass(frozen=True, slots=True)
class InjectionFailed:
    """The upstream refused a request detproxy had altered (``kind``: logprobs |
    repetition_detection) where the client's own request, sent instead, succeeded."""

    model: str
    endpoint: str
    kind: str
    status: int  # the altered request's status; 200 for a stream that failed before its first event
    reason: str  # the upstream's error message, shortened


@dataclass(frozen=True, slots=True)
class InjectionSuspended:
    """Adding ``kind`` to ``model``'s requests was suspended for ``seconds`` (``suspended``)
    after repeated failures, or is being tried again (not ``suspended``)."""

    model: str
    kind: str
    suspended: bool
    seconds: float
    reason: str


@dataclass(frozen=True, slots=True)
class FallbackSent:
    """The client's own request went upstream in place of an altered one that failed;
    ``outcome`` is ``recovered`` (it succeeded) or ``same_error`` (refused too: relayed)."""

    model: str
    endpoint: str
    status: int
    outcome: str


@dataclass(frozen=True, slots=True)
class RecoveryBudgetUsed:
    """A model's recovery budget after an attempt ended: tokens its recoveries generated (or
    hold reserved) over the window, and what the window allows."""

    model: str
    spent: int
    allowed: int


@dataclass(frozen=True, slots=True)
class SharedStoreFailed:
    """A store shared by the replicas (Redis) did not answer; the replica went on alone."""

    store: str  # recovery_budget
    reason: str  # the exception's type


@dataclass(frozen=True, slots=True)
class RecoveryTokens:
    """A recovery's attempt ended: what it made the engine generate, and (``continue``) the
    tokens before the loop it kept instead of generating them again."""

    model: str
    strategy: str  # restart | continue | close_reasoning
    generated: int
    kept: int
    request_id: str = ""  # the client request it recovers
    attempt: int = 0  # the recovery's attempt (2: the first retry)


@dataclass(frozen=True, slots=True)
class CauseAttributed:
    """Triage decided why one choice of an audited request diverged (SPEC 1.14).

    ``cause``: intrinsic | batch | prefix_cache | speculative | recipe_change | unknown;
    ``evidence``: the incident's ``cause_evidence`` (the runs, which agreed, where they parted,
    in-flight counts, and for unknown what was missing). ``upstream``: the fingerprint the
    primary ran on, where read."""

    request_id: str
    model: str
    mode: str
    choice: int
    verdict: str
    cause: str
    evidence: dict[str, Any]
    timestamp: float
    audit_ts: float  # the audit incident's "ts": with request_id, mode and choice, its key
    upstream: str | None = None
    # Triaged again (its budget freed): the cause published for this incident before, which
    # this one replaces (``unknown``, naming the budget).
    revises: str | None = None


@dataclass(frozen=True, slots=True)
class TriageDropped:
    """A divergent audit that triage could not run its experiments for, and why:
    queue_full | rate_limit | token_budget | quiet_deadline | other_worker | error | shutdown."""

    model: str
    reason: str


@dataclass(frozen=True, slots=True)
class TemplateProbed:
    """What the engine's /tokenize said of a model's chat template, asked once per model
    before its first closed reasoning (proxy/loops/rendered.py): whether it drops the
    reasoning of assistant messages (then close_reasoning continues on the rendered prompt);
    None where it could not say (no vLLM /tokenize: the chat continuation stays)."""

    model: str
    drops_reasoning: bool | None
