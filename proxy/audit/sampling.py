"""Which deterministic requests get audited: by rate, per model, by request hash or at random."""

from __future__ import annotations

import fnmatch
import random

from proxy.config import AuditConfig
from proxy.hashing import unit_interval


class Sampler:
    def __init__(self, config: AuditConfig, rng: random.Random | None = None) -> None:
        self._default = config.sample_rate
        self._patterns = list(config.model_rates.items())
        self._by_hash = config.sample_by == "hash"
        self._rng = rng or random.Random()
        self._cache: dict[str, float] = {}

    def rate_for(self, model: str) -> float:
        rate = self._cache.get(model)
        if rate is None:
            rate = next(
                (r for p, r in self._patterns if fnmatch.fnmatchcase(model, p)), self._default
            )
            if len(self._cache) < 1024:  # model names are client-controlled
                self._cache[model] = rate
        return rate

    def should_audit(self, model: str, request_key: str) -> bool:
        rate = self.rate_for(model)
        if rate <= 0.0:
            return False
        if rate >= 1.0:
            return True
        point = unit_interval(request_key) if self._by_hash else self._rng.random()
        return point < rate
