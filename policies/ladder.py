"""The loop ladder: on a loop, retry with the next attempt's sampling overrides, then give up.

Ladders are chosen per model by glob pattern (first match wins). Attempt ``k`` that looped
is followed by attempt ``k + 1`` with ``attempts[k - 1]``'s overrides, within the request's
attempt cap (``PolicyContext.max_attempts``) and the model's recovery budget (extra generated
tokens, ``policies.budget``).
What happens when retrying is not possible is the ladder's ``on_exhausted`` action: ``abort``
(end cleanly) or ``observe`` (let it run).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from policies.base import Abort, Continue, Decision, PolicyContext, Retry
from policies.budget import RecoveryBudget
from proxy.config import DEFAULT_ATTEMPTS, SAMPLING_FIELDS, STRATEGIES

__all__ = [
    "DEFAULT_ATTEMPTS",
    "DEFAULT_RETRY_TOKENS",
    "SAMPLING_FIELDS",
    "STRATEGIES",
    "Ladder",
    "LoopLadderPolicy",
]

# What a retry of a request without max_tokens is assumed to cost until it ends (then the
# budget is settled with what it generated).
DEFAULT_RETRY_TOKENS = 4096


@dataclass(frozen=True, slots=True)
class Ladder:
    models: str = "*"
    action: str = "retry"  # retry | abort | observe
    attempts: tuple[Mapping[str, Any], ...] = DEFAULT_ATTEMPTS
    on_exhausted: str = "abort"  # abort | observe


@dataclass
class LoopLadderPolicy:
    ladders: Sequence[Ladder]
    budget: RecoveryBudget
    name: str = "loop-ladder"
    exhausted: dict[str, int] = field(default_factory=dict)
    triggers_only: ClassVar[bool] = True  # a clean answer is always Continue()

    def ladder_for(self, model: str) -> Ladder | None:
        return next((lad for lad in self.ladders if fnmatch.fnmatchcase(model, lad.models)), None)

    def decide(self, ctx: PolicyContext) -> Decision:
        if ctx.trigger is None:
            return Continue()
        ladder = self.ladder_for(ctx.model)
        if ladder is None or ladder.action == "observe":
            return Continue("observe")
        if ladder.action == "abort":
            return Abort("loop")
        step = ctx.attempt - 1
        capped = ctx.max_attempts is not None and ctx.attempt >= ctx.max_attempts
        if step >= len(ladder.attempts) or capped:
            return self._give_up(ladder, "attempts_exhausted")
        estimate = ctx.max_tokens or DEFAULT_RETRY_TOKENS
        if not self.budget.try_reserve(ctx.model, estimate):
            return self._give_up(ladder, "budget_exhausted")
        overrides = dict(ladder.attempts[step])
        strategy = str(overrides.pop("strategy", "restart"))
        return Retry(
            f"loop ({ctx.trigger.source}, {ctx.trigger.channel})",
            overrides,
            reserved_tokens=estimate,
            strategy=strategy,
        )

    def _give_up(self, ladder: Ladder, why: str) -> Decision:
        self.exhausted[why] = self.exhausted.get(why, 0) + 1
        return Abort(why) if ladder.on_exhausted == "abort" else Continue(why)
