from __future__ import annotations

from policies.budget import MAX_MODELS, BudgetUse, RecoveryBudget


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_recoveries_spend_at_most_a_share_of_what_the_model_generated() -> None:
    clock = Clock()
    budget = RecoveryBudget(share=0.5, floor_tokens=100, window_s=60, clock=clock)
    budget.record_generated("m", 1000)
    assert budget.use("m") == BudgetUse(generated=1000, spent=0, allowed=500)
    assert budget.try_reserve("m", 300)
    assert not budget.try_reserve("m", 300)  # 600 > 500
    assert budget.try_reserve("m", 200)
    assert budget.try_reserve("other", 100)  # another model's account: the floor
    assert not budget.try_reserve("other", 1)


def test_the_floor_always_allows_recoveries() -> None:
    budget = RecoveryBudget(share=0.0, floor_tokens=1024, clock=Clock())
    assert budget.try_reserve("m", 1024)
    assert not budget.try_reserve("m", 1)


def test_settling_replaces_the_estimate_with_what_was_generated() -> None:
    budget = RecoveryBudget(share=0.0, floor_tokens=1000, clock=Clock())
    assert budget.try_reserve("m", 800)
    assert not budget.try_reserve("m", 800)
    budget.settle("m", reserved=800, actual=150)  # the retry stopped early
    assert budget.use("m").spent == 150
    assert budget.try_reserve("m", 800)
    budget.settle("m", reserved=800, actual=0)  # a retry never sent gives it all back
    assert budget.use("m").spent == 150


def test_the_window_slides() -> None:
    clock = Clock()
    budget = RecoveryBudget(share=1.0, floor_tokens=0, window_s=10, clock=clock)
    budget.record_generated("m", 100)
    assert budget.try_reserve("m", 100)
    clock.now += 5
    assert not budget.try_reserve("m", 1)
    clock.now += 6  # the first second left the window: nothing generated, nothing spent
    assert budget.use("m") == BudgetUse(0, 0, 0)
    budget.record_generated("m", 10)
    assert budget.try_reserve("m", 10)


def test_models_are_capped() -> None:
    budget = RecoveryBudget(share=0.0, floor_tokens=1, clock=Clock())
    for i in range(MAX_MODELS):
        assert budget.try_reserve(f"m{i}", 1)
    assert budget.try_reserve("new-1", 1)  # the overflow account
    assert not budget.try_reserve("new-2", 1)  # shares it
    assert len(budget.snapshot()) == MAX_MODELS + 1


def test_the_other_replicas_totals_count_in_every_decision() -> None:
    clock = Clock()
    budget = RecoveryBudget(share=0.5, floor_tokens=0, window_s=60, clock=clock)
    budget.record_generated("m", 100)
    assert budget.use("m") == BudgetUse(100, 0, 50)
    # Two other replicas generated 300 tokens and spent 140 on recoveries.
    budget.set_others({"m": (300, 140)})
    assert budget.use("m") == BudgetUse(400, 140, 200)
    assert budget.try_reserve("m", 60)
    assert not budget.try_reserve("m", 1)  # 140 + 60 of 200: the fleet's budget is spent
    assert budget.local_totals() == {"m": (100, 60)}  # what this replica publishes: its own
    budget.set_others({})  # the others went away
    assert budget.use("m") == BudgetUse(100, 60, 50)


def test_a_model_only_the_others_saw_is_in_the_snapshot() -> None:
    budget = RecoveryBudget(share=1.0, floor_tokens=10, window_s=60, clock=Clock())
    budget.set_others({"elsewhere": (40, 5)})
    assert budget.snapshot() == {"elsewhere": {"generated": 40, "spent": 5, "allowed": 40}}
    assert budget.local_totals() == {}
