"""A global retry budget: retries may be at most a share of recent requests.

Counts live in one-second buckets over a sliding window, so memory is fixed and a burst of
loops cannot multiply upstream load: beyond the budget, policies give up instead of retrying.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class RetryBudget:
    def __init__(
        self,
        ratio: float,
        window_s: int = 60,
        min_retries: int = 3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._ratio = ratio
        self._window = window_s
        self._min = min_retries
        self._clock = clock
        self._requests = [0] * window_s
        self._retries = [0] * window_s
        self._stamp = [0] * window_s

    def _slot(self) -> int:
        second = int(self._clock())
        slot = second % self._window
        if self._stamp[slot] != second:
            self._stamp[slot] = second
            self._requests[slot] = self._retries[slot] = 0
        return slot

    def _totals(self) -> tuple[int, int]:
        oldest = int(self._clock()) - self._window
        live = [i for i in range(self._window) if self._stamp[i] > oldest]
        return sum(self._requests[i] for i in live), sum(self._retries[i] for i in live)

    def record_request(self) -> None:
        self._requests[self._slot()] += 1

    def try_spend(self) -> bool:
        """Take one retry from the budget if there is room."""
        slot = self._slot()
        requests, retries = self._totals()
        if retries + 1 > max(self._min, self._ratio * requests):
            return False
        self._retries[slot] += 1
        return True
