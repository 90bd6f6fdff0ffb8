"""The attempt loop that streamed and whole answers share.

One client request is answered by one upstream attempt, or by several when a policy retries
(a loop's recovery). ``run_attempts`` is the one place that decides an attempt's end, accounts
what it generated, builds the next attempt's body (a restart, or a continuation of the kept
prefix) and bounds the count; how an attempt is read and shown is the answer's
(``proxy.answer.WholeAnswer``, ``proxy.streaming.StreamedAnswer``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from policies.base import Decision, Retry, Trigger
from proxy.config import Settings
from proxy.events import EventBus
from proxy.exchange import Exchange, Lifecycle
from proxy.http.upstream import Upstream
from proxy.loops.continuation import Continued
from proxy.loops.recovery import Recovery
from proxy.relay.inspectors import InspectorFactory

# A hard stop under whatever the policies decide; their own budgets are tighter.
MAX_ATTEMPTS = 8


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
    """How one attempt ended, for the loop to decide on."""

    generated: int | None  # tokens it generated; None: not an answer (nothing to account)
    decision: Decision | None = None  # taken while it ran (a stream's loop trigger)
    decide: bool = False  # no decision yet: ask the policies about its end
    trigger: Trigger | None = None  # a whole answer's loop, found once it was read
    status: int = 200
    answer: dict[str, Any] | None = None  # a whole answer, parsed

    def __init__(
        self,
        generated: int | None,
        decision: Decision | None = None,
        decide: bool = False,
        trigger: Trigger | None = None,
        status: int = 200,
        answer: dict[str, Any] | None = None,
    ) -> None:
        # Written out: mypyc compiles this one; the generated one runs interpreted (README
        # "The compiled build"). The fields above and these arguments are the same, in order.
        self.generated = generated
        self.decision = decision
        self.decide = decide
        self.trigger = trigger
        self.status = status
        self.answer = answer


class Answer(Protocol):
    """How one exchange's attempts are read and shown to its client."""

    exchange: Exchange

    async def attempt(self) -> AttemptEnd | None:
        """Read or relay the current attempt; None when it failed and the answer has what to
        give the client."""

    def generated_text(self) -> str | None:
        """What the attempt that ended generated in its trigger's channel (a continuation's
        prefix is cut from it); None when it was not kept."""

    def generated_reasoning(self) -> str | None:
        """The reasoning of the attempt that ended (a chat answer's, where it was kept): a
        continued content goes on after it."""

    async def retry(self, body: bytes, continued: Continued | None, decision: Retry) -> bool:
        """Send the next attempt (``continued``: what it goes on from, None for a restart);
        False when it could not be sent and the answer has what to give the client."""


async def run_attempts(answer: Answer, recovery: Recovery) -> Decision | None:
    """Attempts until one is not retried; returns the last one's decision (None: the last
    attempt failed, nothing to act on)."""
    ex = answer.exchange
    attempts = ex.attempts
    assert attempts is not None and ex.retry_base is not None
    while True:
        end = await answer.attempt()
        if end is None:
            return None
        decision = end.decision
        if end.decide:
            decision = recovery.decide(attempts, end.trigger, end.status, end.answer)
        if end.generated is not None:
            recovery.attempt_ended(attempts, end.generated)
        if not isinstance(decision, Retry) or attempts.count >= MAX_ATTEMPTS:
            return decision
        body, continued = recovery.next_attempt(
            attempts,
            decision,
            ex.retry_base,
            answer.generated_text(),
            answer.generated_reasoning(),
        )
        attempts.count += 1
        ex.ticket = None  # an answer produced under overrides is not audited
        if not await answer.retry(orjson.dumps(body), continued, decision):
            return None
