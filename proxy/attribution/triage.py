"""Triage: which divergent audits get follow-up experiments, when, and at what cost.

The auditor offers each shadow that diverged, and each duplicate request whose answer
differed from the earlier one's (``offer``; mode ``duplicate``, the earlier answer known by
its digests, its replays run whole). A share (``triage_rate``) is taken.
One experiment explains every incident of the same request on the same recipe (the request
less its ``cache_salt``, the upstream's identity when the primary ran): a case joins the
experiment that is waiting or running for it, or reads the replays of one that ran within
``reuse_s``; a burst of divergences usually comes from a handful of prompts. Experiments run
one at a time (serial replays are the experiment), in the order they came, paced by
``max_per_minute`` and held to a token budget (a share of the deterministic primaries' tokens
plus an allowance): a burst waits in the queue instead of being refused, up to
``max_wait_s``; only what still does not fit then (or finds ``queue_size`` experiments
already waiting) is dropped and counted (``TriageDropped``), and its incident still gets a
cause: decided from the primary and the shadow alone (a recipe change needs no replay), else
``unknown`` naming the budget. An experiment takes the engine whole while it runs (no shadow is
sent until it ends, in any worker: ``proxy.audit.turns``, so a burst's queue of shadows cannot
starve it), and each replay
waits for a quiet moment (few or no client requests in flight, no shadow on the wire), up to a
deadline; one right after a replay that ran alone goes
at once while it is still quiet (the settle held through that replay). Replays stop
``replay_margin_tokens`` past the audit's first divergent token (``experiments.replay_limit``),
and the token budget counts them so. Where both sides of every incident it explains are known
cold (a new ``cache_salt`` of the client's, the shadow's own), an experiment runs no warm
replays: the cache was no switch between the two sides. A triage that fails is logged,
counted (reason ``error``) and never reaches a client request.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import random
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.attribution.account import LocalAccount, TriageAccount
from proxy.attribution.case import TriageCase
from proxy.attribution.cold import cold_method
from proxy.attribution.decide import decide
from proxy.attribution.evidence import evidence_record
from proxy.attribution.experiments import (
    GaveUp,
    Observed,
    Plan,
    build_evidence,
    observed_of_audit,
    replay_limit,
    request_limit,
    run_experiments,
)
from proxy.attribution.shared import Claim, SharedExperiments, SharedResult
from proxy.audit.outcome import outcome_from_response, outcome_tokens
from proxy.audit.shadow import (
    ProxyLoad,
    Replayed,
    ShadowScheduler,
    replay,
    wait_quiet,
)
from proxy.audit.turns import EngineTurns, LocalTurns
from proxy.config import AttributionConfig, AuditConfig
from proxy.engine.identity import Fingerprint
from proxy.engine.load import EngineCounts
from proxy.events import CauseAttributed, EventBus, TriageDropped, UpstreamFingerprinted
from proxy.hashing import canonical_request_key
from proxy.http.upstream import Upstream
from proxy.tasks import TaskOwner

log = logging.getLogger(__name__)

_READINGS = 256  # identity readings kept to say which identity a past run ran on
CASES_PER_EXPERIMENT = 1024  # incidents one experiment explains at most (bounded memory)
_KEPT_EXPERIMENTS = 256  # finished experiments kept for reuse_s, newest last
# Gave up for these: the incidents end unknown naming it, and are triaged again when it frees.
_AGAIN = frozenset(("queue_full", "rate_limit", "token_budget", "other_worker"))
_BUDGET_POLL_S = 1.0  # how often a waiting experiment looks at the token budget again
_ENGINE_READ_AFTER_S = 0.02  # a replay's company is read this long after it was sent

Key = tuple[str, str, str | None]  # (mode, the request less its salt, upstream identity)


@dataclass(slots=True)
class _Experiment:
    """One request's replays on one recipe, and the incidents they explain."""

    key: Key
    cases: list[TriageCase]
    queued_at: float  # monotonic
    plan: Plan | None = None  # what its replays run (their limit, the warm ones), as it started
    reserved: int = 0  # tokens taken from the budget as it started (the worst case)
    # Given up once for a budget: the cause each (request id, choice) was published with
    # (unknown, naming the budget); triaged again when the budget frees, it is revised.
    earlier: dict[tuple[str, int], str] | None = None

    def revises(self, case: TriageCase) -> dict[int, str] | None:
        earlier = self.earlier
        if earlier is None:
            return None
        return {choice: cause for (rid, choice), cause in earlier.items() if rid == case.request_id}


@dataclass(frozen=True, slots=True)
class _Finished:
    """An experiment's replays, kept to explain later incidents of the same request."""

    replays: tuple[Observed, ...]
    missing: tuple[str, ...]
    plan: Plan
    at: float  # monotonic
    experiment: str  # the request whose replays these are


class Triage:
    def __init__(  # noqa: PLR0913 (what it reuses of the app, one argument each)
        self,
        config: AttributionConfig,
        audit: AuditConfig,
        bus: EventBus,
        upstream: Upstream,
        load: ProxyLoad,
        *,
        reference: Upstream | None = None,
        scheduler: ShadowScheduler | None = None,
        upstream_running: Callable[[], Awaitable[int | None]] | None = None,
        engine_running: Callable[[], Awaitable[int | None]] | None = None,
        engine_counts: Callable[[], Awaitable[EngineCounts | None]] | None = None,
        sees_all: bool = True,
        rng: random.Random | None = None,
        account: TriageAccount | None = None,
        turns: EngineTurns | None = None,
        shared: SharedExperiments | None = None,
    ) -> None:
        self._config = config
        self._audit = audit
        self._bus = bus
        self._upstream = upstream
        self._reference = reference
        self._load = load
        self._scheduler = scheduler
        # Each experiment takes the engine whole, shadows held (the scheduler's turns, every
        # worker's where several share them).
        if turns is None:
            turns = scheduler.turns if scheduler is not None else LocalTurns(1)
        self._turns: EngineTurns = turns
        self._upstream_running = upstream_running
        # The engine's own count of requests running (vLLM, llama-server --metrics), read
        # while each replay runs: what detproxy does not see (other workers, other clients)
        # shares a batch too. ``sees_all``: this process is the engine's only detproxy
        # client (one worker), so its own counts can say "alone" where the engine cannot.
        self._engine_running = engine_running
        # Read before and after each replay: nothing running at either end and one request
        # finished between them (the replay) says it ran alone, however short it was (a read
        # while it runs can come after a short replay ended: vLLM's /metrics is slow).
        self._engine_counts = engine_counts
        self._sees_all = sees_all
        self._rng = rng or random.Random()
        self._waiting: OrderedDict[Key, _Experiment] = OrderedDict()  # in the order they came
        # Given up for a budget, to be triaged again when it frees (oldest first, queue_size).
        self._again: OrderedDict[Key, _Experiment] = OrderedDict()
        self._wake = asyncio.Event()
        self._current_run: _Experiment | None = None
        self._finished: OrderedDict[Key, _Finished] = OrderedDict()
        self._account: TriageAccount = account or LocalAccount(config)
        # serve's workers: one experiment per request and recipe for the whole server
        self._shared = shared
        self._tasks = TaskOwner("triage")
        self._readings: deque[tuple[float, Fingerprint]] = deque(maxlen=_READINGS)
        self.running = False
        # What the experiment at the queue's head waits for now (None: nothing): rate_limit,
        # token_budget, turn (a shadow or another worker's experiment on the engine), quiet.
        self.waiting_for: str | None = None
        self.triaged = 0  # experiments whose replays ran
        self.explained = 0  # incidents decided with an experiment's replays (shared or reused)
        self.offered = 0
        self.primary_tokens = 0  # counted here only where no shadow scheduler counts them

    def count_primary_tokens(self, tokens: int) -> None:
        """A deterministic primary's tokens, with no shadow scheduler to count them: the
        token budget's base (passive checks only)."""
        self.primary_tokens += tokens

    # -- wiring -------------------------------------------------------------------------------

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(UpstreamFingerprinted, self._fingerprinted)

    def _fingerprinted(self, ev: UpstreamFingerprinted) -> None:
        self._readings.append((ev.fingerprint.read_at, ev.fingerprint))

    def start(self) -> None:
        self._tasks.spawn(self._worker(), name="worker")

    async def close(self) -> None:
        await self._tasks.close()
        left = [c for e in self._waiting.values() for c in e.cases]
        running = self._current_run
        if running is not None:
            left += running.cases
        self._waiting.clear()
        for c in left:
            self._bus.publish(TriageDropped(c.model, "shutdown"))

    @property
    def queued(self) -> int:
        """Experiments waiting to start."""
        return len(self._waiting)

    def status(self) -> dict[str, Any]:
        return {
            "offered": self.offered,
            "triaged": self.triaged,
            "explained": self.explained,
            "queued": self.queued,
            "waiting_incidents": sum(len(e.cases) for e in self._waiting.values()),
            # unknown for a budget: triaged again when it frees
            "again_incidents": sum(len(e.cases) for e in self._again.values()),
            "running": self.running,
            # a count per reason (0 or 1 here), so that the workers' add up
            "waiting_for": {self.waiting_for: 1} if self.waiting_for else {},
            "tokens": self.tokens,
            "token_budget": self.token_budget,
        }

    # -- budgets ------------------------------------------------------------------------------

    @property
    def tokens(self) -> int:
        """Triage tokens spent (reserved as an experiment starts), the server's."""
        return self._account.tokens()

    def _primary_tokens(self) -> int:
        scheduler = self._scheduler
        return scheduler.primary_tokens if scheduler is not None else self.primary_tokens

    @property
    def token_budget(self) -> float:
        return self._account.budget(self._primary_tokens())

    def _plan(
        self, case: TriageCase | None = None, limit: int | None = None, warm: bool = True
    ) -> Plan:
        """What to run; for ``case``, replays cut to its ``replay_limit`` (or to ``limit``,
        an experiment's, where given); ``warm``: with the warm replays."""
        cfg = self._config
        if case is not None and limit is None:
            limit = replay_limit(case, cfg.replay_margin_tokens)
        return Plan(
            cfg.cold_replays,
            cfg.warm_replays if warm else 0,
            cfg.reference_replays,
            self._cold_method(),
            self._reference is not None,
            limit,
        )

    def _runs_planned(self, plan: Plan) -> int:
        warm = 1 + plan.warm_replays if plan.cold_method and plan.warm_replays else 0
        return plan.cold_replays + warm + (plan.reference_replays if plan.reference else 0)

    def _cost(self, case: TriageCase, plan: Plan) -> int:
        per_run = case.estimated_tokens
        prompt = case.primary.prompt_tokens
        if plan.limit is not None and prompt is not None:
            per_run = min(per_run, prompt + plan.limit)  # replays cut short cost less
        return per_run * self._runs_planned(plan)

    def _key(self, case: TriageCase) -> Key:
        """The same request on the same recipe: the salt is left out (triage sets its own on
        every replay, so the client's changes nothing the experiment measures). The mode is
        kept: a duplicate's replays run whole, a shadow's may be cut short."""
        body = {k: v for k, v in case.body.items() if k != "cache_salt"}
        return (case.mode, canonical_request_key(body), self._identity_at(case.primary_at))

    def _case_limit(self, case: TriageCase) -> int | None:
        return replay_limit(case, self._config.replay_margin_tokens)

    def _needs_warm(self, case: TriageCase) -> bool:
        """Whether warm replays can tell anything of ``case``: not where both its sides are
        known cold (the client's own new ``cache_salt`` or the engine's count of cached
        tokens, and the shadow's fresh salt): the cache was then no switch between them, and
        the cold replays alone decide (a batch beside them, or intrinsic noise)."""
        return any(run.cache != "cold" for run in self._audit_runs(case))

    def _experiment_plan(self, experiment: _Experiment) -> Plan:
        """The replays that explain every incident of ``experiment`` (as it would start now)."""
        warm = any(self._needs_warm(c) for c in experiment.cases)
        return self._plan(limit=self._fix_limit(experiment), warm=warm)

    def _covers(self, plan: Plan, case: TriageCase) -> bool:
        """Replays run to ``plan`` explain ``case``: cut at its limit (None: whole), they
        reach past where ``case`` diverged, and they have the warm replays where it needs
        them."""
        if plan.warm_replays < self._config.warm_replays and self._needs_warm(case):
            return False
        if plan.limit is None:
            return True
        own = self._case_limit(case)
        return own is not None and own <= plan.limit

    def offer(self, case: TriageCase) -> None:
        """From the auditor (a shadow worker, off the request path): take it or drop it,
        never wait, never raise into the audit."""
        try:
            self._offer(case)
        except Exception:
            log.exception("triage of %s could not be queued", case.request_id)
            self._bus.publish(TriageDropped(case.model, "error"))

    def _offer(self, case: TriageCase) -> None:
        if self._config.triage_rate < 1.0 and self._rng.random() >= self._config.triage_rate:
            return  # not sampled: the incident has no cause
        self.offered += 1
        runs = self._audit_runs(case)
        primary, shadow = runs[0].identity, runs[1].identity
        if primary is not None and shadow is not None and primary != shadow:
            self._attribute(case, runs, (), self._plan())  # a recipe change: no replay needed
            return
        key = self._key(case)
        if self._reuse(key, case):
            return
        running = self._current_run
        if running is not None and running.key == key and self._joins(running, case):
            return
        waiting = self._waiting.get(key)
        if waiting is not None:
            if not self._joins(waiting, case):  # it holds all it may: this one does not fit
                self._give_up_all(_Experiment(key, [case], time.monotonic()), "queue_full")
            return
        if len(self._waiting) >= self._config.queue_size:
            self._give_up_all(_Experiment(key, [case], time.monotonic()), "queue_full")
            return
        self._waiting[key] = _Experiment(key, [case], time.monotonic())
        self._wake.set()

    def _joins(self, experiment: _Experiment, case: TriageCase) -> bool:
        if len(experiment.cases) >= CASES_PER_EXPERIMENT:
            return False
        if experiment.plan is not None and not self._covers(experiment.plan, case):
            return False
        experiment.cases.append(case)
        return True

    def _reuse(self, key: Key, case: TriageCase, revises: dict[int, str] | None = None) -> bool:
        """Decide ``case`` from the replays of an experiment on the same request and recipe
        that finished within ``reuse_s``."""
        finished = self._finished.get(key)
        if finished is None and self._shared is not None:
            finished = self._from_shared(key)
        if finished is None:
            return False
        if time.monotonic() - finished.at > self._config.reuse_s:
            del self._finished[key]
            return False
        if not self._covers(finished.plan, case):
            return False
        self.explained += 1
        runs = self._audit_runs(case) + list(finished.replays)
        self._attribute(
            case, runs, finished.missing, finished.plan, finished.experiment, revises=revises
        )
        return True

    def _keep(self, key: Key, finished: _Finished) -> None:
        self._finished[key] = finished
        self._finished.move_to_end(key)
        while len(self._finished) > _KEPT_EXPERIMENTS:
            self._finished.popitem(last=False)

    def _from_shared(self, key: Key) -> _Finished | None:
        """Another worker's replays of ``key`` (or this one's), kept here as its own."""
        assert self._shared is not None
        result = self._shared.finished(key)
        if result is None:
            return None
        age = max(0.0, time.time() - result.at)
        finished = _Finished(
            result.replays, result.missing, result.plan, time.monotonic() - age, result.experiment
        )
        self._keep(key, finished)
        return finished

    async def _claimed(self, experiment: _Experiment) -> Claim | None:
        """serve's workers: this worker's claim on the experiment, or None where another
        worker's replays explained its incidents (waited for while that worker runs it, up
        to ``max_wait_s`` from when it was queued)."""
        shared = self._shared
        assert shared is not None
        deadline = experiment.queued_at + self._config.max_wait_s
        while True:
            claim = shared.claim(experiment.key)
            if self._from_shared(experiment.key) is not None:
                experiment.cases = [
                    c
                    for c in experiment.cases
                    if not self._reuse(experiment.key, c, experiment.revises(c))
                ]
                if not experiment.cases:
                    if claim is not None:
                        claim.release()
                    return None
            if claim is not None:
                return claim
            if time.monotonic() >= deadline:
                self._give_up_all(experiment, "other_worker")
                return None
            await asyncio.sleep(_BUDGET_POLL_S)

    # -- the experiment -----------------------------------------------------------------------

    def _identity_at(self, t: float) -> str | None:
        i = bisect.bisect_right([r[0] for r in self._readings], t)
        return self._readings[i - 1][1].fingerprint if i > 0 else None

    def _current(self) -> Fingerprint | None:
        return self._readings[-1][1] if self._readings else None

    def _cold_method(self) -> str | None:
        return cold_method(self._config.cold_method, self._current(), self._audit)

    def _speculative(self) -> bool | None:
        fp = self._current()
        value = fp.identity.get("speculative") if fp is not None else None
        return value if isinstance(value, bool) else None

    def _audit_runs(self, case: TriageCase) -> list[Observed]:
        other_at: float | None = case.shadow_at
        if case.earlier is not None:
            other_at = case.earlier.at  # None: the store did not record when it ran
        other = self._identity_at(other_at) if other_at is not None else None
        return observed_of_audit(case, self._identity_at(case.primary_at), other)

    def _attribute(
        self,
        case: TriageCase,
        runs: list[Observed],
        missing: tuple[str, ...],
        plan: Plan,
        experiment: str | None = None,
        revises: dict[int, str] | None = None,
    ) -> dict[int, str]:
        """Publish the cause of each diverged choice (what was published, by choice).
        ``experiment``: the request whose replays these are (its ``X-Request-Id`` +
        ``-triage-<run>`` upstream), where they were another incident's. ``revises``: the
        causes published for these choices before (triaged again)."""
        published: dict[int, str] = {}
        first_token_only = case.mode == "prefill"
        speculative = self._speculative()
        upstream = self._identity_at(case.primary_at)
        for d in case.diverged:
            evidence = build_evidence(
                runs,
                d,
                first_token_only,
                plan.cold_method,
                speculative,
                missing,
                limit=plan.limit,
                request_limit=request_limit(case.body),
            )
            found = decide(evidence)
            record = evidence_record(evidence, found)
            if experiment is not None:
                record["experiment"] = experiment
            earlier = revises.get(d.choice) if revises is not None else None
            if earlier is not None:
                record["revises"] = earlier
            published[d.choice] = found.cause
            self._bus.publish(
                CauseAttributed(
                    request_id=case.request_id,
                    model=case.model,
                    mode=case.mode,
                    choice=d.choice,
                    verdict=d.verdict,
                    cause=found.cause,
                    evidence=record,
                    timestamp=time.time(),
                    audit_ts=d.audit_ts,
                    upstream=upstream,
                    revises=earlier,
                )
            )
        return published

    def _give_up_all(self, experiment: _Experiment, reason: str, missing: str = "") -> None:
        """Its incidents end with what the primary and the shadow alone say (``unknown``,
        naming ``missing``: by default the budget ``reason``); for a budget, the experiment is
        kept to be triaged again when it frees. One given up before goes back there silently:
        its incidents said so already."""
        if experiment.earlier is not None and reason in _AGAIN:
            self._defer(experiment)
            return
        missing = missing or f"triage budget: {reason} (triaged again when it frees)"
        earlier: dict[tuple[str, int], str] = {}
        for c in experiment.cases:
            self._bus.publish(TriageDropped(c.model, reason))
            causes = self._attribute(
                c, self._audit_runs(c), (missing,), self._plan(), revises=experiment.revises(c)
            )
            for choice, cause in causes.items():
                earlier[(c.request_id, choice)] = cause
        if reason in _AGAIN:
            experiment.earlier = earlier
            self._defer(experiment)

    def _defer(self, experiment: _Experiment) -> None:
        """Keep it to be triaged again when the budget frees (``_next``); past
        ``queue_size`` such experiments, the oldest stay as they were published."""
        experiment.plan, experiment.reserved = None, 0
        kept = self._again.get(experiment.key)
        if kept is not None and kept is not experiment:
            room = CASES_PER_EXPERIMENT - len(kept.cases)
            kept.cases.extend(experiment.cases[:room])
            if kept.earlier is not None and experiment.earlier is not None:
                kept.earlier.update(experiment.earlier)
            experiment = kept
        self._again[experiment.key] = experiment
        self._again.move_to_end(experiment.key)
        while len(self._again) > self._config.queue_size:
            self._again.popitem(last=False)

    def _budget_frees(self) -> _Experiment | None:
        """The oldest experiment given up for a budget, where the budget would start it
        now."""
        if not self._again:
            return None
        experiment = next(iter(self._again.values()))
        plan = self._experiment_plan(experiment)
        cost = self._cost(experiment.cases[0], plan)
        if not self._account.could_start(cost, self._primary_tokens()):
            return None
        del self._again[experiment.key]
        experiment.queued_at = time.monotonic()
        return experiment

    async def _next(self) -> _Experiment:
        """The next experiment: the oldest waiting, else one given up for a budget that has
        freed (looked at every ``_BUDGET_POLL_S`` while any is kept)."""
        while True:
            if self._waiting:
                return self._waiting.popitem(last=False)[1]
            again = self._budget_frees()
            if again is not None:
                return again
            self._wake.clear()
            if not self._again:
                await self._wake.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _BUDGET_POLL_S)

    async def _worker(self) -> None:
        while True:
            experiment = await self._next()
            self._current_run = experiment
            claim: Claim | None = None
            try:
                if self._shared is not None:
                    claim = await self._claimed(experiment)
                    if claim is None:
                        continue  # explained by another worker's replays, or given up
                if await self._admitted(experiment):
                    self.running = True
                    await self._triage(experiment)
            except Exception as exc:
                log.exception("triage of %s failed", experiment.cases[0].request_id)
                self._give_up_all(experiment, "error", f"triage failed: {type(exc).__name__}")
            finally:
                if claim is not None:
                    claim.release()
                self.running = False
                self.waiting_for = None
                self._current_run = None

    def _fix_limit(self, experiment: _Experiment) -> int | None:
        """The replays' limit: the furthest any of its incidents needs (None: whole)."""
        limits = [self._case_limit(c) for c in experiment.cases]
        return None if any(x is None for x in limits) else max(x for x in limits if x is not None)

    async def _admitted(self, experiment: _Experiment) -> bool:
        """Wait for the rate, up to ``max_wait_s`` from when the experiment was queued; past
        it, every incident it would explain ends ``unknown`` naming the budget it waited for.
        Over the token budget, they end so at once (the first time) and the experiment is kept
        to be triaged again when the budget frees."""
        deadline = experiment.queued_at + self._config.max_wait_s
        while True:
            plan = self._experiment_plan(experiment)
            cost = self._cost(experiment.cases[0], plan)
            held = self._account.start(cost, self._primary_tokens())
            self.waiting_for = held
            if held is None:
                experiment.plan, experiment.reserved = plan, cost
                return True
            if held == "token_budget" and experiment.earlier is None:
                self.waiting_for = None
                # The token budget frees as the primaries' tokens grow or the window moves:
                # minutes maybe. Its incidents say so now (unknown, naming it) rather than
                # having no cause meanwhile, and are triaged again when it frees.
                self._give_up_all(experiment, held)
                return False
            wait = _BUDGET_POLL_S if held == "token_budget" else self._account.wait_s()
            left = deadline - time.monotonic()
            if left <= 0:
                self.waiting_for = None
                self._give_up_all(experiment, held)
                return False
            await asyncio.sleep(min(wait, left))

    async def _triage(self, experiment: _Experiment) -> None:
        first = experiment.cases[0]
        admitted = experiment.plan
        assert admitted is not None
        # the engine's way to run cold read again as the replays start
        plan = self._plan(limit=admitted.limit, warm=admitted.warm_replays > 0)
        reserved = experiment.reserved
        self.waiting_for = "turn"
        try:
            turn = await self._turns.experiment(self._audit.quiet_poll_s)  # the engine, whole
        finally:
            self.waiting_for = None
        try:
            replays, missing = await run_experiments(first, plan, _Runner(self, first))
        except GaveUp as exc:
            self._account.settle(-reserved)  # nothing was sent
            self._give_up_all(experiment, exc.reason, f"no quiet moment: {exc.reason}")
            return
        finally:
            turn.release()
        # The reservation was the worst case (every run to the replay limit): the budget counts
        # what the engine said the replays cost, the estimate for a run with no answer.
        per_run = reserved // max(1, self._runs_planned(plan))
        spent = sum(per_run if r.outcome is None else outcome_tokens(r.outcome) for r in replays)
        self._account.settle(spent - reserved)
        self.triaged += 1
        finished = _Finished(tuple(replays), missing, plan, time.monotonic(), first.request_id)
        self._keep(experiment.key, finished)
        if self._shared is not None:
            result = SharedResult(tuple(replays), missing, plan, time.time(), first.request_id)
            try:
                self._shared.publish(experiment.key, result)
            except OSError:
                log.exception("triage: cannot share the replays of %s", first.request_id)
        for c in experiment.cases:
            self.explained += 1
            runs = self._audit_runs(c) + replays
            self._attribute(c, runs, missing, plan, first.request_id, revises=experiment.revises(c))

    def _still_quiet(self) -> bool:
        """Quiet now, by what detproxy counts itself (no upstream reading configured)."""
        scheduler = self._scheduler
        return (
            self._audit.quiet_max_upstream_running is None
            and self._load.inflight <= self._config.quiet_max_inflight
            and not (scheduler is not None and scheduler.sending > 0)
        )

    async def _quiet(self, settled: bool = False) -> bool:
        """Wait for a quiet moment. ``settled``: the previous replay of this triage ran alone
        (no client request in flight as it started or started while it ran, no shadow), so
        the load has stayed low since the wait before it settled: where it is still low and
        only detproxy's own counts are read, that settle holds and is not waited again."""
        if settled and self._still_quiet():
            return True
        self.waiting_for = "quiet"
        try:
            return await self._wait_quiet()
        finally:
            self.waiting_for = None

    async def _wait_quiet(self) -> bool:
        audit = self._audit
        scheduler = self._scheduler
        running = self._upstream_running if audit.quiet_max_upstream_running is not None else None
        return await wait_quiet(
            self._load,
            self._config.quiet_max_inflight,
            running,
            audit.quiet_max_upstream_running,
            settle_s=audit.quiet_settle_s,
            deadline_s=self._config.quiet_deadline_s,
            poll_s=audit.quiet_poll_s,
            busy=(lambda: scheduler.sending > 0) if scheduler is not None else None,
        )

    async def send(
        self,
        case: TriageCase,
        name: str,
        target: str,
        cache: str,
        body: Mapping[str, Any],
        settled: bool = False,
    ) -> Observed:
        if not await self._quiet(settled):
            raise GaveUp("quiet_deadline")
        upstream = self._reference if target == "reference" else self._upstream
        assert upstream is not None
        scheduler = self._scheduler
        shadows_before = scheduler.sent if scheduler is not None else 0
        shadows_running = scheduler.sending if scheduler is not None else 0
        headers = dict(case.headers)
        headers["X-Request-Id"] = f"{case.request_id}-triage-{name}"
        identity = None
        if target == "same":
            fp = self._current()
            identity = fp.fingerprint if fp is not None else None
        same = target == "same"
        before = await self._engine_read() if same else None
        sent, engine_count = await self._replay_counted(
            upstream, case.raw_path, headers, body, same
        )
        if isinstance(sent, str):
            return Observed(name, target, cache, None, None, identity, None, sent)
        after = await self._engine_read() if before is not None else None
        if engine_count is None and _alone_between(before, after):
            engine_count = 1  # nothing else ran on the engine from before it to after it
        shadows = scheduler is not None and (scheduler.sent != shadows_before or shadows_running)
        alone = self._alone(not sent.overlapped and not shadows, engine_count)
        if sent.status != 200 or not isinstance(sent.parsed, dict):
            error = f"HTTP {sent.status}"
            return Observed(name, target, cache, alone, sent.inflight, identity, None, error)
        outcome = outcome_from_response(case.endpoint, sent.parsed)
        return Observed(name, target, cache, alone, sent.inflight, identity, outcome)

    async def _replay_counted(
        self,
        upstream: Upstream,
        raw_path: str,
        headers: Mapping[str, str],
        body: Mapping[str, Any],
        count: bool,
    ) -> tuple[Replayed | str, int | None]:
        """The replay, and the engine's running count read once while it runs (None: not
        read, or not exported)."""
        timeout = self._config.replay_timeout_s
        sending = self._tasks.spawn(
            replay(upstream, self._load, raw_path, headers, body, timeout), name="replay"
        )
        reading: int | None = None
        try:
            if count and self._engine_running is not None:
                try:
                    await asyncio.wait({sending}, timeout=_ENGINE_READ_AFTER_S)
                    if not sending.done():
                        reading = await self._engine_running()
                except Exception:
                    log.debug("the engine's running count could not be read", exc_info=True)
                if sending.done():
                    reading = None  # read after the replay ended: nothing of its company
                elif reading == 0:
                    # The replay is running, so 0 is a count from before it: vLLM updates its
                    # gauges once per engine step (H100, 2026-12-07: every replay read 0 at
                    # 20 ms). Not a reading: the counts either side decide.
                    reading = None
            return await sending, reading
        finally:
            if not sending.done():  # cancelled (shutdown): the replay goes with it
                sending.cancel()

    async def _engine_read(self) -> EngineCounts | None:
        if self._engine_counts is None:
            return None
        try:
            return await self._engine_counts()
        except Exception:
            log.debug("the engine's counts could not be read", exc_info=True)
            return None

    def _alone(self, by_own_counts: bool, engine_count: int | None) -> bool | None:
        """Alone by detproxy's counts and by the engine's, read while the replay ran: more
        than one running there is company detproxy did not see. Without a reading, detproxy's
        counts stand only where it sees all the engine's traffic of its own (one worker)."""
        if not by_own_counts or (engine_count is not None and engine_count > 1):
            return False
        if engine_count == 1:
            return True
        return True if self._sees_all else None


def _alone_between(before: EngineCounts | None, after: EngineCounts | None) -> bool:
    """Nothing running just before a replay was sent nor just after it ended, and exactly one
    request finished between the two reads (the replay): no other request overlapped it."""
    if before is None or after is None or before.finished is None or after.finished is None:
        return False
    return before.running == 0 and after.running == 0 and after.finished - before.finished == 1


class _Runner:
    """The experiments' way to the upstream, for one case: each replay after one that ran
    alone goes without waiting for the settle again (``Triage._quiet``)."""

    def __init__(self, triage: Triage, case: TriageCase) -> None:
        self._triage = triage
        self._case = case
        self._settled = False

    async def run(self, name: str, target: str, cache: str, body: Mapping[str, Any]) -> Observed:
        observed = await self._triage.send(self._case, name, target, cache, body, self._settled)
        self._settled = observed.alone is True
        return observed
