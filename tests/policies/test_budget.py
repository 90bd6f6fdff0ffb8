from __future__ import annotations

from policies.budget import RetryBudget


def test_retries_are_a_share_of_recent_requests() -> None:
    now = [1000.0]
    budget = RetryBudget(0.1, window_s=60, min_retries=2, clock=lambda: now[0])
    for _ in range(50):
        budget.record_request()
    assert [budget.try_spend() for _ in range(6)] == [True] * 5 + [False]  # 10% of 50
    now[0] += 61  # the window moved on: the old requests and retries no longer count
    assert [budget.try_spend() for _ in range(3)] == [True, True, False]  # the floor of 2


def test_no_requests_no_ratio_only_the_floor() -> None:
    budget = RetryBudget(0.5, min_retries=0, clock=lambda: 5.0)
    assert not budget.try_spend()
