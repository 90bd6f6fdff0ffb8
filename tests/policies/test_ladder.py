from __future__ import annotations

from policies.base import Abort, Continue, PolicyContext, Retry, Trigger
from policies.budget import RecoveryBudget
from policies.ladder import DEFAULT_RETRY_TOKENS, Ladder, LoopLadderPolicy

LOOP = Trigger("proxy", "content", 0, 36, 8, 120, "unit")


def ctx(
    attempt: int,
    model: str = "qwen3-8b",
    trigger: Trigger | None = LOOP,
    max_attempts: int | None = None,
) -> PolicyContext:
    return PolicyContext("chat", model, True, attempt, 200, trigger, max_attempts=max_attempts)


def test_the_ladder_climbs_then_gives_up() -> None:
    ladder = Ladder(attempts=({"presence_penalty": 1.5}, {"temperature": 0.6}))
    policy = LoopLadderPolicy([ladder], RecoveryBudget(1.0, floor_tokens=10**6))
    cost = DEFAULT_RETRY_TOKENS
    assert policy.decide(ctx(1, max_attempts=5)) == Retry(
        "loop (proxy, content)", {"presence_penalty": 1.5}, reserved_tokens=cost
    )
    assert policy.decide(ctx(2, max_attempts=5)) == Retry(
        "loop (proxy, content)", {"temperature": 0.6}, reserved_tokens=cost
    )
    assert policy.decide(ctx(3, max_attempts=5)) == Abort("attempts_exhausted")
    assert policy.decide(ctx(1, trigger=None)) == Continue()


def test_the_requests_attempt_cap_and_on_exhausted_observe() -> None:
    """The cap comes with the context (the request's [loops] max_attempts), not the ladder."""
    ladder = Ladder(on_exhausted="observe")
    budget = RecoveryBudget(1.0, floor_tokens=10**6)
    policy = LoopLadderPolicy([ladder], budget)
    assert isinstance(policy.decide(ctx(1, max_attempts=2)), Retry)
    spent = budget.use("qwen3-8b").spent
    assert policy.decide(ctx(2, max_attempts=2)) == Continue("attempts_exhausted")
    assert budget.use("qwen3-8b").spent == spent, "a capped retry reserved budget"
    assert policy.exhausted == {"attempts_exhausted": 1}


def test_model_patterns_first_match_wins() -> None:
    policy = LoopLadderPolicy(
        [Ladder(models="qwen3-*", action="abort"), Ladder(models="*", action="observe")],
        RecoveryBudget(1.0),
    )
    assert policy.decide(ctx(1, "qwen3-8b")) == Abort("loop")
    assert policy.decide(ctx(1, "llama")) == Continue("observe")
    assert LoopLadderPolicy([Ladder(models="x")], RecoveryBudget(1.0)).decide(ctx(1)) == Continue(
        "observe"
    )


def test_budget_exhaustion_gives_up() -> None:
    policy = LoopLadderPolicy([Ladder()], RecoveryBudget(0.0, floor_tokens=1000))
    limited = PolicyContext("chat", "m", True, 1, 200, LOOP, max_tokens=600)
    decision = policy.decide(limited)
    assert isinstance(decision, Retry) and decision.reserved_tokens == 600
    assert policy.decide(limited) == Abort("budget_exhausted")  # 1200 > 1000
    assert policy.exhausted == {"budget_exhausted": 1}


def test_a_retry_without_max_tokens_reserves_the_default_estimate() -> None:
    policy = LoopLadderPolicy([Ladder()], RecoveryBudget(0.0, floor_tokens=DEFAULT_RETRY_TOKENS))
    decision = policy.decide(ctx(1))
    assert isinstance(decision, Retry) and decision.reserved_tokens == DEFAULT_RETRY_TOKENS
    assert policy.decide(ctx(1)) == Abort("budget_exhausted")
