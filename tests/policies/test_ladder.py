from __future__ import annotations

from policies.base import Abort, Continue, PolicyContext, Retry, Trigger
from policies.budget import RetryBudget
from policies.ladder import Ladder, LoopLadderPolicy

LOOP = Trigger("proxy", "content", 0, 36, 8, 120, "unit")


def ctx(attempt: int, model: str = "qwen3-8b", trigger: Trigger | None = LOOP) -> PolicyContext:
    return PolicyContext("chat", model, True, attempt, 200, trigger)


def test_the_ladder_climbs_then_gives_up() -> None:
    ladder = Ladder(attempts=({"presence_penalty": 1.5}, {"temperature": 0.6}))
    policy = LoopLadderPolicy([ladder], RetryBudget(1.0, min_retries=10), max_attempts=5)
    assert policy.decide(ctx(1)) == Retry("loop (proxy, content)", {"presence_penalty": 1.5})
    assert policy.decide(ctx(2)) == Retry("loop (proxy, content)", {"temperature": 0.6})
    assert policy.decide(ctx(3)) == Abort("attempts_exhausted")
    assert policy.decide(ctx(1, trigger=None)) == Continue()


def test_max_attempts_and_on_exhausted_observe() -> None:
    ladder = Ladder(on_exhausted="observe")
    policy = LoopLadderPolicy([ladder], RetryBudget(1.0, min_retries=10), max_attempts=2)
    assert isinstance(policy.decide(ctx(1)), Retry)
    assert policy.decide(ctx(2)) == Continue("attempts_exhausted")


def test_model_patterns_first_match_wins() -> None:
    policy = LoopLadderPolicy(
        [Ladder(models="qwen3-*", action="abort"), Ladder(models="*", action="observe")],
        RetryBudget(1.0),
    )
    assert policy.decide(ctx(1, "qwen3-8b")) == Abort("loop")
    assert policy.decide(ctx(1, "llama")) == Continue("observe")
    assert LoopLadderPolicy([Ladder(models="x")], RetryBudget(1.0)).decide(ctx(1)) == Continue(
        "observe"
    )


def test_budget_exhaustion_gives_up() -> None:
    policy = LoopLadderPolicy([Ladder()], RetryBudget(0.0, min_retries=1))
    assert isinstance(policy.decide(ctx(1)), Retry)
    assert policy.decide(ctx(1)) == Abort("budget_exhausted")
    assert policy.exhausted == {"budget_exhausted": 1}
