"""The policy chain: who is asked, and about what."""

from __future__ import annotations

from policies.base import Abort, Continue, Decision, PolicyChain, PolicyContext, Trigger
from policies.budget import RecoveryBudget
from policies.ladder import Ladder, LoopLadderPolicy

LOOP = Trigger("proxy", "content", 0)


def ctx(trigger: Trigger | None) -> PolicyContext:
    return PolicyContext("chat", "m", False, 1, 200, trigger, {"choices": []})


class Record:
    def __init__(self, name: str, decision: Decision, triggers_only: bool = False) -> None:
        self.name = name
        self.decision = decision
        self.triggers_only = triggers_only
        self.asked: list[Trigger | None] = []

    def decide(self, ctx: PolicyContext) -> Decision:
        self.asked.append(ctx.trigger)
        return self.decision


def test_policies_that_only_act_on_triggers_are_not_asked_about_clean_answers() -> None:
    only = Record("only", Abort("loop"), triggers_only=True)
    every = Record("every", Continue())
    chain = PolicyChain([only, every])
    assert chain.reads_clean_answers
    assert chain.decide(ctx(None)) == Continue()
    assert (only.asked, every.asked) == ([], [None])
    assert chain.decide(ctx(LOOP)) == Abort("loop")
    assert only.asked == [LOOP]
    assert not PolicyChain([only]).reads_clean_answers
    assert not PolicyChain().reads_clean_answers


def test_the_loop_ladder_only_acts_on_triggers() -> None:
    ladder = LoopLadderPolicy([Ladder(action="abort")], RecoveryBudget())
    assert ladder.decide(ctx(None)) == Continue()
    assert not PolicyChain([ladder]).reads_clean_answers
