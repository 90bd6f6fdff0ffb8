"""The attempts of one client request, as one object: ``Attempts``.

One client request is answered by one upstream attempt, or by several when a policy retries
(a loop's recovery). ``Attempts`` is their lifecycle; the answer that reads them
(``proxy.streaming.StreamedAnswer``, ``proxy.answer.WholeAnswer``) drives it through named
transitions, and ``run_attempts`` is the loop that does:

- ``started()``: an attempt starts; its loop watch (None: nothing watched).
- ``decided(trigger)``: a loop was found (a stream's relay reports it while the attempt runs:
  its plan's ``on_trigger``), or an answer ended: the policies decide, a retry reserves its
  recovery budget, and no retry goes past the request's one attempt cap.
- ``ended(end)``: the attempt ended; its tokens are accounted (the client's own attempt adds to
  what the model generated, a recovery's settles what it reserved).
- ``retried(decision, generated)``: the next attempt (a restart, or a continuation of what the
  attempt that ended generated), and what goes in its place if it is refused:
  ``proxy.loops.next_attempt``, a pure function of what was asked, the loop, the retry and what
  was generated and shown.
- ``refused()``: the retry could not be sent (its upstream failed or refused it): what it
  reserved is released; the client gets the answer it had, or its own request.

The cap is ``[loops] max_attempts``; the policies see it (``PolicyContext.max_attempts``) so
that a ladder gives up in its own way, and a retry a policy still asks for at the cap is not
sent.

``Attempts`` owns the request's recovery and reaches through nothing for it: it is given one
``proxy.loops.context.RecoveryContext`` (the loop settings as plain values, and the seams it
acts through: the policies, the event bus, the recovery budget and its gauge, as Protocols).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from policies.base import CONTINUE, Abort, Decision, PolicyContext, Retry, Trigger
from proxy.config import Settings
from proxy.events import (
    EventBus,
    LoopDetected,
    PolicyActed,
    RecoveryBudgetUsed,
    RecoveryTokens,
)
from proxy.exchange import Exchange, Lifecycle
from proxy.http.upstream import Upstream
from proxy.loops.context import RecoveryContext
from proxy.loops.next_attempt import Asked, Generated, NextAttempt, next_attempt
from proxy.loops.recovery import Recovery
from proxy.loops.watch import EMPTY, LoopWatch
from proxy.relay.inspectors import InspectorFactory


@dataclass(frozen=True, slots=True)
class Stages:
    """The app-wide parts every exchange passes through (one instance per app)."""

    settings: Settings
    upstream: Upstream
    bus: EventBus
    recovery: Recovery
    lifecycle: Lifecycle
    inspector_factories: Sequence[InspectorFactory]
    clock: Callable[[], float]

    def now(self, ex: Exchange) -> float:
        """Seconds since the exchange started."""
        return self.clock() - ex.t0


@dataclass(slots=True)
class AttemptEnd:
    """How one attempt ended, for ``Attempts.ended``."""

    generated: int | None  # tokens it generated; None: not an answer (nothing to account)
    decision: Decision | None = None  # taken while it ran (a stream's loop trigger)
    decide: bool = False  # no decision yet: ask the policies about its end
    trigger: Trigger | None = None  # a whole answer's loop, found once it was read
    status: int = 200
    answer: dict[str, Any] | None = None  # a whole answer, parsed
    # A whole answer's: it ended ``stop`` with nothing of its own (a continuation's own text,
    # before its prefix joined it), as a retry's stream that stops empty is a trigger.
    empty: bool = False
    # A retry's answer that ended clean: how (``proxy.loops.verdict``); None: recovered.
    ending: str | None = None

    def __init__(
        self,
        generated: int | None,
        decision: Decision | None = None,
        decide: bool = False,
        trigger: Trigger | None = None,
        status: int = 200,
        answer: dict[str, Any] | None = None,
        *,
        empty: bool = False,
        ending: str | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per attempt, it pays (README).
        self.generated = generated
        self.decision = decision
        self.decide = decide
        self.trigger = trigger
        self.status = status
        self.answer = answer
        self.empty = empty
        self.ending = ending


__all__ = ["AttemptEnd", "Attempts", "Generated", "NextAttempt", "Stages", "run_attempts"]


class Attempts:
    """The upstream attempts of one client request (one, unless a policy retried)."""

    def __init__(
        self,
        context: RecoveryContext,
        request_id: str,
        model: str,
        endpoint: str,
        stream: bool,
        max_tokens: int | None,
        retry_base: dict[str, Any],
    ) -> None:
        self._context = context
        self.request_id = request_id
        self.model = model
        self.endpoint = endpoint
        self.stream = stream
        self.max_tokens = max_tokens  # the client request's limit, when it set one
        self.retry_base = retry_base  # the client's request, which a retry's overrides apply to
        self.max_attempts = context.settings.max_attempts  # the one cap
        self.count = 1  # the attempt now running (1: the client's own request)
        self.looped = False  # some attempt had a trigger
        self.pending_retry = False  # a retry's outcome is known when the next attempt ends
        self.trigger: Trigger | None = None  # the last attempt's
        self.fell_back = False  # a retry was refused: the client's own request was sent instead
        # Recovery-budget tokens reserved for an attempt not yet ended: attempt -> tokens.
        self.reserved: dict[int, int] = {}
        self.strategy = "restart"  # how the pending (or last) retry recovers
        self.kept_tokens = 0  # the tokens a continuation kept
        self.generated = 0  # the tokens the last attempt generated (set when it ended)
        self.history: list[str] = []  # the outcome of each policy action, in order

    @property
    def recovered(self) -> bool:
        return self.looped and not self.pending_retry and self.history[-1:] == ["recovered"]

    # -- the transitions ---------------------------------------------------------------------

    def started(self) -> LoopWatch | None:
        """An attempt starts: its loop watch. A streamed retry's answer that stops with
        nothing in it is a trigger too (no recovery: the ladder goes on); a fallback (the
        client's own request, the retry refused) is relayed as it comes."""
        if self.fell_back:
            return None
        return self._context.settings.watch(self.endpoint, self.stream and self.count > 1)

    def decided(
        self,
        trigger: Trigger | None,
        status: int = 200,
        answer: Mapping[str, Any] | None = None,
        empty: bool = False,
        ending: str | None = None,
    ) -> Decision:
        """The attempt stopped on ``trigger``, or ended (``trigger`` None, ``answer`` a whole
        one's): what the policies make of it. Settles a pending retry's outcome first."""
        context = self._context
        if self.pending_retry:
            self.pending_retry = False
            empty = trigger is None and status == 200 and empty
            if empty or (trigger is not None and trigger.source == EMPTY):
                outcome = "empty"
            elif trigger is not None:
                outcome = "looped_again"
            else:
                outcome = ending or "recovered"  # how the answer ended (proxy.loops.verdict)
            self._acted("retry", outcome)
            if empty:
                # Recovered means an answer: the ladder goes on from an empty one.
                trigger = Trigger(EMPTY, "content", 0)
        self.trigger = trigger
        policies = context.policies
        if trigger is None and (self.stream or not policies.reads_clean_answers):
            return CONTINUE
        decision = policies.decide(
            PolicyContext(
                self.endpoint,
                self.model,
                self.stream,
                self.count,
                status,
                trigger,
                answer,
                self.max_tokens,
                self.max_attempts,
            )
        )
        if isinstance(decision, Retry):
            if decision.reserved_tokens:
                self.reserved[self.count + 1] = decision.reserved_tokens
            if self.count >= self.max_attempts:
                # The one cap: a retry past it is not sent (the ladder gives up before it).
                self._settle(0, self.count + 1)
                decision = CONTINUE if trigger is None else Abort("attempts_exhausted")
        if trigger is None:
            # Nothing to recover from; a non-streamed answer may still interest a policy.
            return decision
        self.looped = True
        if trigger.source != EMPTY:  # an empty answer is no loop: the retry's outcome says it
            context.bus.publish(
                LoopDetected(
                    self.request_id,
                    self.model,
                    self.endpoint,
                    self.stream,
                    self.count,
                    trigger,
                    time.time(),
                    _action(decision),
                )
            )
        if isinstance(decision, Retry):
            self.pending_retry = True
        elif isinstance(decision, Abort):
            self._acted("abort", decision.reason or "loop")
            if trigger.source == EMPTY:
                # No loop to cut: the empty answer goes to the client as it came.
                return CONTINUE
        else:
            self._acted("observe", decision.reason or "observe")
        return decision

    def ended(self, end: AttemptEnd) -> Decision | None:
        """The attempt ended: decided (unless it was while it ran) and its tokens accounted.
        Returns what to do next (None: nothing to act on)."""
        decision = end.decision
        if end.decide:
            decision = self.decided(end.trigger, end.status, end.answer, end.empty, end.ending)
        if end.generated is not None:
            self._account(end.generated)
        return decision

    def retried(self, decision: Retry, generated: Generated) -> NextAttempt:
        """The next attempt (its body, what it continues, what goes in its place if refused),
        from what the attempt that ended ``generated``: one decision, made here."""
        # What a retry needs of the request, as plain values (made only when one is sent).
        settings = self._context.settings
        asked = Asked(
            self.endpoint,
            self.retry_base,
            settings.markers(self.model),
            settings.one_path,
            settings.detector,
        )
        nxt = next_attempt(asked, self.trigger, decision, generated)
        self.strategy = nxt.strategy
        self.kept_tokens = nxt.kept_tokens
        self.count += 1
        return nxt

    def refused(self, fallback: bool = False) -> None:
        """The retry was not sent (its upstream failed or refused it): its outcome is an
        error and what it reserved is released. ``fallback``: the client's own request is
        sent in its place (and relayed as it comes)."""
        if self.pending_retry:
            self.pending_retry = False
            self._acted("retry", "error")
        self._settle(0)
        if fallback:
            self.fell_back = True

    # -- the accounting ----------------------------------------------------------------------

    def _account(self, tokens: int) -> None:
        """The attempt generated ``tokens``: the client's own request adds to what the model
        generated, a recovery's settles what it reserved."""
        context = self._context
        self.generated = tokens
        if self.count > 1:
            context.bus.publish(
                RecoveryTokens(
                    self.model,
                    self.strategy,
                    tokens,
                    self.kept_tokens,
                    self.request_id,
                    self.count,
                )
            )
        budget = context.budget
        if budget is None:
            return
        if self.count == 1:
            budget.record_generated(self.model, tokens)
        self._settle(tokens, self.count)

    def _settle(self, tokens: int, attempt: int | None = None) -> None:
        """Settle the reservation of ``attempt`` with the ``tokens`` it generated; ``attempt``
        None releases every reservation left (attempts that will not be sent)."""
        context = self._context
        budget = context.budget
        if budget is None:
            return
        settled = False
        for number in list(self.reserved) if attempt is None else [attempt]:
            reserved = self.reserved.pop(number, 0)
            if reserved:
                budget.settle(self.model, reserved, tokens)
                settled = True
        if context.gauge.due(self.model, settled or self.count > 1):
            use = budget.use(self.model)
            context.bus.publish(RecoveryBudgetUsed(self.model, use.spent, use.allowed))

    def _acted(self, action: str, outcome: str) -> None:
        self.history.append(outcome)
        self._context.bus.publish(
            PolicyActed(
                self.request_id,
                self.model,
                action,
                outcome,
                self.count,
                self.strategy if action == "retry" else "",
            )
        )


def _action(decision: Decision) -> str:
    """A decision on a loop as ``PolicyActed`` names its action."""
    if isinstance(decision, Retry):
        return "retry"
    return "abort" if isinstance(decision, Abort) else "observe"


class Answer(Protocol):
    """How one exchange's attempts are read and shown to its client."""

    exchange: Exchange
    attempts: Attempts

    async def attempt(self) -> AttemptEnd | None:
        """Read or relay the current attempt; None when it failed and the answer has what to
        give the client."""

    def generated(self) -> Generated:
        """What the attempt that ended generated, for a retry to go on from."""

    async def retry(self, nxt: NextAttempt, decision: Retry) -> bool:
        """Send the next attempt (``nxt.continued``: what it goes on from, None for a restart;
        ``nxt.fallbacks``: what goes in its place where that fits the answer); False when it
        could not be sent (``Attempts.refused``) and the answer has what to give the client."""


async def run_attempts(answer: Answer) -> Decision | None:
    """Attempts until one is not retried; returns the last one's decision (None: the last
    attempt failed, nothing to act on)."""
    attempts = answer.attempts
    while True:
        end = await answer.attempt()
        if end is None:
            return None
        decision = attempts.ended(end)
        if not isinstance(decision, Retry):
            return decision
        nxt = attempts.retried(decision, answer.generated())
        answer.exchange.ticket = None  # an answer produced under overrides is not audited
        if not await answer.retry(nxt, decision):
            return None
