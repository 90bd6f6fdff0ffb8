"""The recovery budget: the extra tokens loop recoveries make the engine generate, bounded.

A recovery (a retry, a continuation) costs what the engine generates for it. Per model, over a
sliding window, recoveries may spend at most ``share`` of the tokens that model's client
requests generated, and always at least ``floor_tokens``: a looping model cannot multiply the
engine's load, and ordinary recoveries, even at the loop rates thinking models have (half of
open-ended prompts), are never refused. A recovery reserves an estimate when it is decided
(a burst of loops arriving together is bounded too) and is settled with what it really
generated once its attempt ended.

Counts live in one-second buckets per model, so memory is fixed per model; models are capped
(the model name is client-controlled), the overflow sharing one account.
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
    __slots__ = ("generated", "spent", "stamp")

    def __init__(self, window: int) -> None:
        self.generated = [0] * window
        self.spent = [0] * window
        self.stamp = [0] * window


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

    def record_generated(self, model: str, tokens: int) -> None:
        """A client request's own attempt generated ``tokens``."""
        if tokens > 0:
            account, slot = self._slot(model)
            account.generated[slot] += tokens

    def try_reserve(self, model: str, tokens: int) -> bool:
        """Reserve ``tokens`` for a recovery if the model's account has room."""
        use = self.use(model)
        if use.spent + tokens > use.allowed:
            return False
        account, slot = self._slot(model)
        account.spent[slot] += tokens
        return True

    def settle(self, model: str, reserved: int, actual: int) -> None:
        """A recovery's attempt ended: what it generated replaces what it had reserved."""
        if reserved == actual:
            return
        account, slot = self._slot(model)
        account.spent[slot] += actual - reserved

    def use(self, model: str) -> BudgetUse:
        account = self._accounts.get(self._key(model))
        if account is None:
            return BudgetUse(0, 0, self._floor)
        oldest = int(self._clock()) - self._window
        live = [i for i, s in enumerate(account.stamp) if s > oldest]
        generated = sum(account.generated[i] for i in live)
        spent = max(0, sum(account.spent[i] for i in live))
        return BudgetUse(generated, spent, max(self._floor, int(self._share * generated)))

    def snapshot(self) -> dict[str, dict[str, int]]:
        """Per model, for ``/detproxy/status``."""
        out = {}
        for model in self._accounts:
            use = self.use(model)
            out[model] = {"generated": use.generated, "spent": use.spent, "allowed": use.allowed}
        return out

    def _key(self, model: str) -> str:
        if model in self._accounts or len(self._accounts) < MAX_MODELS:
            return model
        return OVERFLOW

    def _slot(self, model: str) -> tuple[_Account, int]:
        key = self._key(model)
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = _Account(self._window)
        second = int(self._clock())
        slot = second % self._window
        if account.stamp[slot] != second:
            account.stamp[slot] = second
            account.generated[slot] = account.spent[slot] = 0
        return account, slot
