"""The recovery budget: the extra tokens loop recoveries make the engine generate, bounded.

A recovery (a retry, a continuation) costs what the engine generates for it. Per model, over a
sliding window, recoveries may spend at most ``share`` of the tokens that model's client
requests generated, and always at least ``floor_tokens``: a looping model cannot multiply the
engine's load, and ordinary recoveries, even at the loop rates thinking models have (half of
open-ended prompts), are never refused. A recovery reserves an estimate when it is decided
(a burst of loops arriving together is bounded too) and is settled with what it really
generated once its attempt ended.

Counts live in one-second buckets per model with running totals, so memory is fixed per model
and each call costs O(1); models are capped (the model name is client-controlled), the
overflow sharing one account.

Replicas share the budget through ``proxy.loops.budget_sync``: each publishes its own window
totals (``local_totals``) and adds the others' (``set_others``), so every decision stays local
and O(1), the fleet's totals at most one sync interval old.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

MAX_MODELS = 256
OVERFLOW = "other"


@dataclass(frozen=True, slots=True)
class BudgetUse:
    """One model's account over the window."""

    generated: int  # tokens its client requests generated (first attempts)
    spent: int  # tokens its recoveries generated or hold reserved
    allowed: int  # max(floor, share * generated)


class _Account:
    """One model's window: per-second buckets and their running totals, so reading and
    recording cost O(1) (a second that passed is subtracted once, when the window moves)."""

    __slots__ = ("generated", "generated_total", "second", "spent", "spent_total")

    def __init__(self, window: int, second: int) -> None:
        self.generated = [0] * window
        self.spent = [0] * window
        self.generated_total = 0
        self.spent_total = 0
        self.second = second  # the newest second the buckets hold

    def advance(self, second: int) -> None:
        if second == self.second:
            return  # the usual call: the window has not moved since the last one
        window = len(self.generated)
        if second - self.second >= window:
            self.generated = [0] * window
            self.spent = [0] * window
            self.generated_total = self.spent_total = 0
        else:
            for s in range(self.second + 1, second + 1):
                slot = s % window
                self.generated_total -= self.generated[slot]
                self.spent_total -= self.spent[slot]
                self.generated[slot] = self.spent[slot] = 0
        self.second = max(self.second, second)


class RecoveryBudget:
    def __init__(
        self,
        share: float = 1.0,
        floor_tokens: int = 32768,
        window_s: int = 300,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._share = share
        self._floor = floor_tokens
        self._window = max(1, int(window_s))
        self._clock = clock
        self._accounts: dict[str, _Account] = {}
        # The other replicas' window totals per model: (generated, spent), as last synced.
        self._others: dict[str, tuple[int, int]] = {}

    def record_generated(self, model: str, tokens: int) -> None:
        """A client request's own attempt generated ``tokens``."""
        if tokens > 0:
            account, slot = self._slot(model)
            account.generated[slot] += tokens
            account.generated_total += tokens

    def try_reserve(self, model: str, tokens: int) -> bool:
        """Reserve ``tokens`` for a recovery if the model's account has room."""
        use = self.use(model)
        if use.spent + tokens > use.allowed:
            return False
        account, slot = self._slot(model)
        account.spent[slot] += tokens
        account.spent_total += tokens
        return True

    def settle(self, model: str, reserved: int, actual: int) -> None:
        """A recovery's attempt ended: what it generated replaces what it had reserved."""
        if reserved == actual:
            return
        account, slot = self._slot(model)
        account.spent[slot] += actual - reserved
        account.spent_total += actual - reserved

    def use(self, model: str) -> BudgetUse:
        key = self._key(model)
        account = self._accounts.get(key)
        generated, spent = self._others.get(key, (0, 0))
        if account is not None:
            account.advance(int(self._clock()))
            generated += account.generated_total
            spent += max(0, account.spent_total)
        return BudgetUse(generated, spent, max(self._floor, int(self._share * generated)))

    def local_totals(self) -> dict[str, tuple[int, int]]:
        """This replica's own window totals per model: (generated, spent)."""
        second = int(self._clock())
        out = {}
        for model, account in self._accounts.items():
            account.advance(second)
            out[model] = (account.generated_total, max(0, account.spent_total))
        return out

    def set_others(self, others: dict[str, tuple[int, int]]) -> None:
        """The other replicas' window totals per model, replacing the last ones."""
        capped: dict[str, tuple[int, int]] = {}
        for model, totals in others.items():
            if model in self._accounts or len(capped) < MAX_MODELS:
                capped[model] = totals
        self._others = capped

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per model, for ``/detproxy/status``."""
        out = {}
        for model in self._accounts.keys() | self._others.keys():
            use = self.use(model)
            out[model] = {"generated": use.generated, "spent": use.spent, "allowed": use.allowed}
        return out

    def _key(self, model: str) -> str:
        if model in self._accounts or len(self._accounts) < MAX_MODELS:
            return model
        return OVERFLOW

    def _slot(self, model: str) -> tuple[_Account, int]:
        key = self._key(model)
        second = int(self._clock())
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = _Account(self._window, second)
        account.advance(second)
        return account, second % self._window
