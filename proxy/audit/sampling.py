"""Which deterministic requests get audited: by rate, per model, by request hash or at random,
and at least one per model every ``at_least_every_s``.

The floor covers what a rate cannot: hash sampling never picks a prompt that is repeated, and
5% of a handful of requests is none. A model whose last audit started longer ago than the
floor's interval (or that was never audited) gets its next deterministic request picked; the
budgets still decide whether its shadow runs.
"""

from __future__ import annotations

import fnmatch
import random
import time
from collections.abc import Callable

from proxy.config import AuditConfig
from proxy.hashing import unit_interval

MAX_MODELS = 1024  # model names are client-controlled: per-model state is capped
OVERFLOW = "\x00other"  # the floor's shared entry for models past the cap (no model's name)
PRUNE_EVERY_S = 1.0  # a full table forgets its stale entries at most this often


class Sampler:
    def __init__(
        self,
        config: AuditConfig,
        rng: random.Random | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._default = config.sample_rate
        self._patterns = list(config.model_rates.items())
        self._by_hash = config.sample_by == "hash"
        self._rng = rng or random.Random()
        self._cache: dict[str, tuple[float, bool]] = {}
        self._every = config.at_least_every_s
        self._clock = clock
        self._last: dict[str, float] = {}  # model -> when its last audit started
        self._pruned_at = float("-inf")

    @property
    def floor_models(self) -> frozenset[str]:
        """The models the floor keeps an entry for (bounded: past ``MAX_MODELS`` they share
        one, ``OVERFLOW``)."""
        return frozenset(self._last)

    def _rule(self, model: str) -> tuple[float, bool]:
        """``model``'s rate, and whether the floor applies to it: not where a ``model_rates``
        pattern gives it 0 (an operator's opt-out for that model)."""
        rule = self._cache.get(model)
        if rule is None:
            rate = next((r for p, r in self._patterns if fnmatch.fnmatchcase(model, p)), None)
            rule = (self._default, True) if rate is None else (rate, rate > 0.0)
            if len(self._cache) < MAX_MODELS:  # model names are client-controlled
                self._cache[model] = rule
        return rule

    def should_audit(self, model: str, request_key: str) -> bool:
        rate, floor = self._rule(model)
        if rate >= 1.0:
            return True
        if rate > 0.0:
            point = unit_interval(request_key) if self._by_hash else self._rng.random()
            if point < rate:
                return True
        return floor and self._floor_due(model)

    def started(self, model: str) -> None:
        """An audit of ``model`` started (its shadow was admitted): the floor waits from now."""
        if self._every > 0:
            self._last[self._slot(model)] = self._clock()

    def _floor_due(self, model: str) -> bool:
        """Is the floor's audit due for ``model``? Claimed when it is: of a burst of requests
        arriving together only one is picked, and a floor audit the budgets refuse is tried
        again an interval later, not at every request."""
        if self._every <= 0:
            return False
        now = self._clock()
        slot = self._slot(model)
        last = self._last.get(slot)
        if last is not None and now - last < self._every:
            return False
        self._last[slot] = now
        return True

    def _slot(self, model: str) -> str:
        """The floor's entry for ``model``. An entry older than the interval says what a missing
        one says (due), so a full table first forgets those; models past the cap share one."""
        last = self._last
        if model in last or len(last) < MAX_MODELS:
            return model
        now = self._clock()
        if now - self._pruned_at >= PRUNE_EVERY_S:  # a scan of the table: not at every request
            self._pruned_at = now
            cutoff = now - self._every
            for stale in [m for m, t in last.items() if t <= cutoff and m != OVERFLOW]:
                del last[stale]
        return model if len(last) < MAX_MODELS else OVERFLOW
