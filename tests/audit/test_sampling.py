from __future__ import annotations

import random

from proxy.audit.sampling import Sampler
from proxy.config import AuditConfig
from proxy.hashing import canonical_request_key


def keys(n: int) -> list[str]:
    return [
        canonical_request_key({"messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(n)
    ]


def test_hash_sampling_is_stable_and_close_to_the_rate() -> None:
    sampler = Sampler(AuditConfig(sample_rate=0.25))
    first = [sampler.should_audit("m", k) for k in keys(4000)]
    again = [sampler.should_audit("m", k) for k in keys(4000)]
    assert first == again  # the same request is always (or never) audited
    assert 0.22 < sum(first) / len(first) < 0.28


def test_random_sampling_draws_each_time() -> None:
    sampler = Sampler(AuditConfig(sample_rate=0.5, sample_by="random"), rng=random.Random(1))
    key = keys(1)[0]
    draws = [sampler.should_audit("m", key) for _ in range(400)]
    assert 150 < sum(draws) < 250


def test_per_model_rates_first_match_wins() -> None:
    sampler = Sampler(
        AuditConfig(sample_rate=0.0, model_rates={"qwen3-*": 1.0, "qwen*": 0.0, "llama-?b": 1.0})
    )
    key = keys(1)[0]
    assert sampler.should_audit("qwen3-8b", key)
    assert not sampler.should_audit("qwen2-7b", key)
    assert sampler.should_audit("llama-8b", key)
    assert not sampler.should_audit("other", key)


def test_key_ignores_delivery_fields_only() -> None:
    base = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "x"}]}
    key = canonical_request_key(base)
    assert canonical_request_key(base | {"stream": True, "stream_options": {}}) == key
    assert canonical_request_key(dict(reversed(list(base.items())))) == key
    assert canonical_request_key(base | {"max_tokens": 5}) != key
