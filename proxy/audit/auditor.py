"""The audit of one request: plan it, then compare what came back with its replay or twin.

``plan`` runs before the request goes upstream (classify, sample, inject logprobs);
``primary_done`` runs once the client has its answer: passive checks (n > 1 choices,
duplicates) at once, and a shadow replay handed to the scheduler. Results leave as
``AuditCompleted`` events; nothing here knows about metrics or the incident log.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.attribution.case import TRIAGED, Diverged, Earlier, TriageCase
from proxy.audit.compare import UNKNOWN_LOGPROBS, Verdict, compare_choices, output_hash
from proxy.audit.extract import AnswerExtractor, build_extractor
from proxy.audit.inject import needs_injection, plan_logprobs
from proxy.audit.outcome import ChoiceOutcome, Outcome, outcome_completion_tokens, outcome_tokens
from proxy.audit.salts import SaltsSeen
from proxy.audit.sampling import Sampler
from proxy.audit.shadow import ShadowJob, ShadowResult, ShadowScheduler
from proxy.audit.store import (
    Answered,
    ChoiceDigest,
    DuplicateStore,
    MemoryDuplicateStore,
    digest_outcome,
)
from proxy.classify import RequestView
from proxy.config import Settings
from proxy.events import AuditCompleted, EventBus, ShadowDropped
from proxy.hashing import canonical_request_key
from proxy.injection import LOGPROBS, InjectionGuard
from proxy.tasks import TaskOwner

SHADOW_HEADER = "X-Detproxy-Shadow"


@dataclass(frozen=True, slots=True)
class AuditTicket:
    """The audit's plan for one request."""

    request_id: str
    view: RequestView
    request_key: str
    upstream_body: dict[str, Any]  # what the primary sent upstream (logprobs injected or not)
    raw_path: str
    shadow: bool  # sampled for a shadow replay
    injected: bool  # detproxy added logprobs: strip them from the client's answer
    inflight: int
    authorization: str | None
    started: float
    cold_salt: bool = False  # the client's own cache_salt, never sent before: it ran cold

    def __init__(  # noqa: PLR0913 (one argument per field)
        self,
        *,
        request_id: str,
        view: RequestView,
        request_key: str,
        upstream_body: dict[str, Any],
        raw_path: str,
        shadow: bool,
        injected: bool,
        inflight: int,
        authorization: str | None,
        started: float,
        cold_salt: bool = False,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "view", view)
        object.__setattr__(self, "request_key", request_key)
        object.__setattr__(self, "upstream_body", upstream_body)
        object.__setattr__(self, "raw_path", raw_path)
        object.__setattr__(self, "shadow", shadow)
        object.__setattr__(self, "injected", injected)
        object.__setattr__(self, "inflight", inflight)
        object.__setattr__(self, "authorization", authorization)
        object.__setattr__(self, "started", started)
        object.__setattr__(self, "cold_salt", cold_salt)


class Auditor:
    def __init__(  # noqa: PLR0913 (what it is wired to, one argument each)
        self,
        settings: Settings,
        bus: EventBus,
        scheduler: ShadowScheduler | None,
        store: DuplicateStore | None,
        inflight: Callable[[], int],
        target: str = "same",
        guard: InjectionGuard | None = None,
        *,
        triage: Callable[[TriageCase], None] | None = None,
        count_primary_tokens: Callable[[int], None] | None = None,
        salts: SaltsSeen | None = None,
        sees_server: bool | None = None,
    ) -> None:
        """``inflight``: the server's client requests in flight; ``sees_server``: it counts
        every worker's (one process, or the workers' shared counts; default: one process)."""
        self._settings = settings
        self._sees_server = settings.server.one_process if sees_server is None else sees_server
        self._triage = triage  # takes the shadows that diverged (proxy.attribution)
        # Where no shadow scheduler counts the deterministic primaries' tokens (passive
        # checks only), triage's token budget does.
        self._count_primary_tokens = count_primary_tokens
        self._guard = guard
        self._audit = settings.audit
        self._passive_checks = settings.audit.passive_checks  # read per request: once here
        self._bus = bus
        self._scheduler = scheduler
        self._store = store
        self._inflight = inflight
        self._target = target
        self._sampler = Sampler(settings.audit)
        # The salts the server sent (proxy/audit/salts.py: the workers' shared table where
        # there are several); none given, this process's own where it is the only one.
        if salts is None and settings.server.one_process:
            salts = SaltsSeen()
        self._salts = salts
        self._tasks = TaskOwner("passive")
        self._extractor: AnswerExtractor | None = (
            build_extractor(settings.audit.answer_extractor)
            if settings.audit.answer_extractor
            else None
        )

    def plan(
        self,
        view: RequestView,
        body: dict[str, Any],
        request_id: str,
        raw_path: str,
        authorization: str | None,
    ) -> AuditTicket | None:
        cold_salt = self._first_salt(body)
        if not view.deterministic:
            return None
        key = canonical_request_key(body)
        shadow = (
            self._scheduler is not None
            and self._sampler.should_audit(view.model, key)
            and self._injection_allowed(view, body)
            and self._scheduler.admit(view.model)
        )
        if not shadow and not self._passive_checks:
            return None
        upstream_body, injected = body, False
        if shadow:
            self._sampler.started(view.model)
            lp = plan_logprobs(
                view.endpoint,
                body,
                self._audit.inject_top_logprobs,
                self._settings.upstream.max_logprobs,
            )
            upstream_body, injected = lp.body, lp.injected
        return AuditTicket(
            request_id=request_id,
            view=view,
            request_key=key,
            upstream_body=upstream_body,
            raw_path=raw_path,
            shadow=shadow,
            injected=injected,
            inflight=self._inflight(),
            authorization=authorization,
            started=time.monotonic(),
            cold_salt=cold_salt,
        )

    def _first_salt(self, body: dict[str, Any]) -> bool:
        """Every request's own salt is recorded (a sampled one warms its tenant too)."""
        salt = body.get("cache_salt")
        salts = self._salts
        return salts is not None and isinstance(salt, str) and salts.first_use(salt)

    def _injection_allowed(self, view: RequestView, body: dict[str, Any]) -> bool:
        """A shadow needs the primary's logprobs: where the upstream lately refused them for
        this model, only requests that carry their own are replayed (passive checks go on)."""
        if self._guard is None or self._guard.allows(view.model, LOGPROBS):
            return True
        if not needs_injection(view.endpoint, body):
            return True
        self._bus.publish(ShadowDropped(view.model, "injection_suspended"))
        return False

    @property
    def pending(self) -> int:
        """Passive checks still running (duplicate lookups)."""
        return len(self._tasks)

    async def close(self) -> None:
        await self._tasks.close()
        if self._store is not None:
            await self._store.close()
        if self._salts is not None:
            self._salts.close()

    # -- after the primary --------------------------------------------------------------------

    def primary_done(self, ticket: AuditTicket, outcome: Outcome) -> None:
        if outcome.error is not None or not outcome.choices:
            return
        latency = time.monotonic() - ticket.started
        if self._passive_checks:
            self._compare_choices(ticket, outcome, latency)
            store = self._store
            now = _Answer(outcome, latency, self._inflight()) if store is not None else None
            if isinstance(store, MemoryDuplicateStore) and now is not None:  # checked inline
                digests = digest_outcome(outcome)
                found = store.swap_answered(
                    _duplicate_key(ticket), digests, self._answered(ticket, now)
                )
                if found is not None:
                    self._duplicates(ticket, now, digests, *found)
            elif store is not None and now is not None:
                # Off the request path: the store is a network away (Redis).
                self._tasks.spawn(self._check_duplicate(ticket, now), name="duplicate-check")
        if self._scheduler is None:
            if self._count_primary_tokens is not None:  # triage's budget, with no shadows
                self._count_primary_tokens(outcome_tokens(outcome))
        else:
            # Every deterministic primary the audit saw is the token budget's base.
            self._scheduler.count_primary_tokens(outcome_tokens(outcome))
            if ticket.shadow:
                self._scheduler.submit(self._shadow_job(ticket, outcome, latency))

    def _emit(self, ticket: AuditTicket, seen: Compared) -> float:
        """Publish the comparison; returns its timestamp (the incident's ``ts``)."""
        verdict = seen.verdict
        timestamp = time.time()
        store_text = self._settings.incidents.store_text and verdict.verdict != "identical"
        primary, other = seen.primary, seen.other
        self._bus.publish(
            AuditCompleted(
                request_id=ticket.request_id,
                model=ticket.view.model,
                endpoint=ticket.view.endpoint,
                mode=seen.mode,
                choice=seen.choice,
                verdict=verdict,
                request_key=ticket.request_key,
                inflight_primary=ticket.inflight,
                inflight_shadow=seen.inflight_shadow,
                primary_latency_s=seen.primary_latency,
                shadow_latency_s=seen.shadow_latency,
                target=seen.target,
                timestamp=timestamp,
                shadow_overlapped=seen.overlapped,
                prompt=_prompt_text(ticket.upstream_body) if store_text else None,
                primary_text=_text(primary) if store_text and primary else None,
                shadow_text=_text(other) if store_text and other else None,
            )
        )
        return timestamp

    def _compare_choices(self, ticket: AuditTicket, outcome: Outcome, latency: float) -> None:
        first, *others = outcome.choices
        for other in others:
            verdict = compare_choices(first, other, extractor=self._extractor)
            seen = Compared(
                "n_choices",
                other.index,
                verdict,
                primary_latency=latency,
                shadow_latency=latency,
                inflight_shadow=ticket.inflight,
                primary=first,
                other=other,
            )
            self._emit(ticket, seen)

    async def _check_duplicate(self, ticket: AuditTicket, now: _Answer) -> None:
        assert self._store is not None
        digests = digest_outcome(now.outcome)
        previous = await self._store.check_and_put(_duplicate_key(ticket), digests)
        if previous is not None:
            self._duplicates(ticket, now, digests, previous, None)  # a shared store: no context

    def _answered(self, ticket: AuditTicket, now: _Answer) -> Answered:
        """How this answer ran, for the in-process store to keep beside its digests."""
        crowd = max(ticket.inflight, now.inflight_end)
        return Answered(_wall(ticket), crowd, _cache_state(ticket, now.outcome))

    def _duplicates(
        self,
        ticket: AuditTicket,
        now: _Answer,
        digests: tuple[ChoiceDigest, ...],
        previous: tuple[ChoiceDigest, ...],
        answered: Answered | None,
    ) -> None:
        diverged: list[Diverged] = []
        for index, (mine, before) in enumerate(zip(digests, previous, strict=False)):
            verdict = compare_digests(before, mine)
            ts = self._emit(ticket, Compared("duplicate", index, verdict, now.latency))
            if verdict.verdict in TRIAGED:
                diverged.append(Diverged(index, verdict.verdict, ts))
        if diverged and self._triage is not None:
            earlier = Earlier(previous)
            if answered is not None:
                earlier = Earlier(previous, answered.inflight, answered.cache, answered.at)
            self._triage(self._duplicate_case(ticket, now, earlier, tuple(diverged)))

    def _duplicate_case(
        self, ticket: AuditTicket, now: _Answer, earlier: Earlier, diverged: tuple[Diverged, ...]
    ) -> TriageCase:
        """A duplicate that differed from the earlier answer, for triage: replayed as the
        primary was sent (the client's salt kept, a shadow's headers and extra body), the
        earlier answer standing where the shadow would."""
        body, headers = self._shadow_request(ticket, prefill=False)
        _with_clients_salt(body, ticket)
        outcome = now.outcome
        started = _wall(ticket)
        return TriageCase(
            request_id=ticket.request_id,
            model=ticket.view.model,
            endpoint=ticket.view.endpoint,
            raw_path=ticket.raw_path,
            body=body,
            headers=headers,
            mode="duplicate",
            target="same",
            primary=outcome,
            shadow=Outcome(()),
            primary_inflight=ticket.inflight,
            primary_inflight_end=now.inflight_end,
            shadow_inflight=0,
            shadow_cold=False,
            shadow_alone=None,
            primary_at=started,
            shadow_at=started,
            estimated_tokens=outcome_tokens(outcome),
            diverged=diverged,
            primary_cold_salt=ticket.cold_salt,
            earlier=earlier,
        )

    def _shadow_job(self, ticket: AuditTicket, outcome: Outcome, latency: float) -> ShadowJob:
        prefill = self._audit.shadow_mode == "prefill"
        body, headers = self._shadow_request(ticket, prefill)
        prompt_tokens = outcome.prompt_tokens or 0
        estimate = prompt_tokens + (1 if prefill else outcome_completion_tokens(outcome))
        inflight_end = self._inflight()  # the primary's company as it ended (itself included)

        def on_result(result: ShadowResult) -> None:
            mode = "prefill" if prefill else "full"
            diverged: list[Diverged] = []
            shadow_choices = {c.index: c for c in result.outcome.choices}
            for primary in outcome.choices:
                other = shadow_choices.get(primary.index)
                if other is None or result.outcome.error is not None:
                    verdict = _incomparable(primary, result.outcome.error or "missing choice")
                else:
                    verdict = compare_choices(
                        primary, other, extractor=self._extractor, first_token_only=prefill
                    )
                seen = Compared(
                    mode,
                    primary.index,
                    verdict,
                    primary_latency=latency,
                    shadow_latency=result.latency_s,
                    inflight_shadow=result.inflight,
                    primary=primary,
                    other=other,
                    target=self._target,
                    overlapped=result.overlapped,
                )
                ts = self._emit(ticket, seen)
                if verdict.verdict in TRIAGED:
                    diverged.append(Diverged(primary.index, verdict.verdict, ts))
            if diverged and self._triage is not None:
                seen_by = _Shadowed(body, headers, outcome, result, estimate, mode, inflight_end)
                self._triage(self._triage_case(ticket, seen_by, tuple(diverged)))

        return ShadowJob(
            model=ticket.view.model,
            endpoint=ticket.view.endpoint,
            raw_path=ticket.raw_path,
            body=body,
            headers=headers,
            estimated_tokens=estimate,
            on_result=on_result,
        )

    def _triage_case(
        self, ticket: AuditTicket, seen: _Shadowed, diverged: tuple[Diverged, ...]
    ) -> TriageCase:
        audit = self._audit
        result = seen.result
        replay = dict(seen.body)
        _with_clients_salt(replay, ticket)
        cold = audit.cache_salt or audit.shadow_extra_body.get("cache_prompt") is False
        alone: bool | None = None
        if result.overlapped:
            alone = False
        elif audit.max_concurrent_shadows == 1 and self._sees_server:
            # With several workers and no shared counts, another's clients may have shared
            # the shadow's batch unseen here: not known (the triage's replays read the
            # engine's own count).
            alone = True
        now = time.time()
        return TriageCase(
            request_id=ticket.request_id,
            model=ticket.view.model,
            endpoint=ticket.view.endpoint,
            raw_path=ticket.raw_path,
            body=replay,
            headers=seen.headers,
            mode=seen.mode,
            target=self._target,
            primary=seen.primary,
            shadow=result.outcome,
            primary_inflight=ticket.inflight,
            primary_inflight_end=seen.inflight_end,
            shadow_inflight=result.inflight,
            shadow_cold=cold,
            shadow_alone=alone,
            primary_at=now - (time.monotonic() - ticket.started),
            shadow_at=now,
            estimated_tokens=seen.estimate,
            diverged=diverged,
            primary_cold_salt=ticket.cold_salt,
        )

    def _shadow_request(
        self, ticket: AuditTicket, prefill: bool
    ) -> tuple[dict[str, Any], dict[str, str]]:
        """The shadow's body and headers: the primary's request, not streamed, cold when
        ``cache_salt`` is on, one token long in prefill mode."""
        audit = self._audit
        body = {
            k: v for k, v in ticket.upstream_body.items() if k not in ("stream", "stream_options")
        }
        if isinstance(body.get("request_id"), str):
            body["request_id"] = body["request_id"] + "-shadow"
        if prefill:
            body.pop("max_completion_tokens", None)
            body["max_tokens"] = 1
        if audit.cache_salt:
            body["cache_salt"] = uuid.uuid4().hex
        body.update(audit.shadow_extra_body)
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "identity",
            "X-Request-Id": f"{ticket.request_id}-shadow",
            SHADOW_HEADER: "1",
        }
        if audit.reuse_client_auth and ticket.authorization:
            headers["Authorization"] = ticket.authorization
        elif audit.service_api_key:
            headers["Authorization"] = f"Bearer {audit.service_api_key}"
        return body, headers


@dataclass(frozen=True, slots=True)
class Compared:
    """One comparison the audit made, as an incident and the metrics see it."""

    mode: str  # full | prefill | n_choices | duplicate
    choice: int
    verdict: Verdict
    primary_latency: float | None
    shadow_latency: float | None = None
    inflight_shadow: int | None = None
    primary: ChoiceOutcome | None = None
    other: ChoiceOutcome | None = None
    target: str = "same"
    overlapped: bool | None = None

    def __init__(  # noqa: PLR0913, PLR0917 (one argument per field)
        self,
        mode: str,
        choice: int,
        verdict: Verdict,
        primary_latency: float | None,
        shadow_latency: float | None = None,
        inflight_shadow: int | None = None,
        primary: ChoiceOutcome | None = None,
        other: ChoiceOutcome | None = None,
        target: str = "same",
        overlapped: bool | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per audited choice, it pays (README).
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "choice", choice)
        object.__setattr__(self, "verdict", verdict)
        object.__setattr__(self, "primary_latency", primary_latency)
        object.__setattr__(self, "shadow_latency", shadow_latency)
        object.__setattr__(self, "inflight_shadow", inflight_shadow)
        object.__setattr__(self, "primary", primary)
        object.__setattr__(self, "other", other)
        object.__setattr__(self, "target", target)
        object.__setattr__(self, "overlapped", overlapped)


@dataclass(frozen=True, slots=True)
class _Answer:
    """A primary's answer as the duplicate check sees it."""

    outcome: Outcome
    latency: float
    inflight_end: int  # detproxy's client requests in flight as it ended (itself included)


@dataclass(frozen=True, slots=True)
class _Shadowed:
    """A shadow as it was sent and answered, for triage."""

    body: dict[str, Any]
    headers: dict[str, str]
    primary: Outcome
    result: ShadowResult
    estimate: int
    mode: str
    inflight_end: int


def _with_clients_salt(body: dict[str, Any], ticket: AuditTicket) -> None:
    """A replay's body with the client's own ``cache_salt`` as the primary sent it, or none
    (not the shadow's): a salted engine's replays set their own on top."""
    salt = ticket.upstream_body.get("cache_salt")
    if salt is None:
        body.pop("cache_salt", None)
    else:
        body["cache_salt"] = salt


def _wall(ticket: AuditTicket) -> float:
    """The wall clock when the request started."""
    return time.time() - (time.monotonic() - ticket.started)


def _cache_state(ticket: AuditTicket, outcome: Outcome) -> str:
    """The primary's prefill as detproxy knows it: the engine's cached-token count, else cold
    for a client's salt never sent before (as triage reads a primary's)."""
    cached = outcome.cached_tokens
    if cached is None and ticket.cold_salt:
        cached = 0
    return "unknown" if cached is None else "warm" if cached > 0 else "cold"


def _duplicate_key(ticket: AuditTicket) -> str:
    """Like for like: an answer with injected logprobs is only matched with its kind."""
    return f"{ticket.request_key}:{int(ticket.injected)}"


def _text(choice: ChoiceOutcome) -> str:
    return (
        choice.reasoning + choice.content
        if not choice.reasoning
        else (f"<reasoning>{choice.reasoning}</reasoning>{choice.content}")
    )


def _prompt_text(body: Mapping[str, Any]) -> str:
    prompt = body.get("messages", body.get("prompt"))
    return prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()


def _incomparable(primary: ChoiceOutcome, reason: str) -> Verdict:
    h = output_hash(primary)
    return Verdict(
        verdict="incomparable",
        reason=reason,
        divergence=None,
        max_abs_logprob_delta=None,
        primary_hash=h,
        shadow_hash="",
        primary_tokens=len(primary.tokens) if primary.tokens else None,
        shadow_tokens=None,
    )


def compare_digests(before: ChoiceDigest, now: ChoiceDigest) -> Verdict:
    """A verdict from digests alone: no position, no delta (the texts were never stored)."""
    if before.token_hash is not None and now.token_hash is not None:
        same_text = before.token_hash == now.token_hash
    else:
        same_text = before.text_hash == now.text_hash
    reason = None
    if not same_text:
        verdict = "text_divergence"
    elif any(d.token_hash is not None and d.logprob_hash is None for d in (before, now)):
        verdict, reason = "incomparable", UNKNOWN_LOGPROBS  # same tokens, a null logprob
    elif (
        before.logprob_hash is not None
        and now.logprob_hash is not None
        and before.logprob_hash != now.logprob_hash
    ):
        verdict = "logprob_drift"
    else:
        verdict = "identical"
    return Verdict(
        verdict=verdict,
        reason=reason,
        divergence=None,
        max_abs_logprob_delta=None,
        primary_hash=now.text_hash,
        shadow_hash=before.text_hash,
        primary_tokens=now.tokens,
        shadow_tokens=before.tokens,
    )
