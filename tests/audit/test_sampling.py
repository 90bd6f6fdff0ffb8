from __future__ import annotations

import random

from proxy.audit.sampling import MAX_MODELS, Sampler
from proxy.config import AuditConfig
from proxy.hashing import canonical_request_key


def keys(n: int) -> list[str]:
    return [
        canonical_request_key({"messages": [{"role": "user", "content": f"q{i}"}]})
        for i in range(n)
    ]


def test_hash_sampling_is_stable_and_close_to_the_rate() -> None:
    sampler = Sampler(AuditConfig(sample_rate=0.25, at_least_every_s=0))
    first = [sampler.should_audit("m", k) for k in keys(4000)]
    again = [sampler.should_audit("m", k) for k in keys(4000)]
    assert first == again  # the same request is always (or never) audited
    assert 0.22 < sum(first) / len(first) < 0.28


def test_random_sampling_draws_each_time() -> None:
    config = AuditConfig(sample_rate=0.5, sample_by="random", at_least_every_s=0)
    sampler = Sampler(config, rng=random.Random(1))
    key = keys(1)[0]
    draws = [sampler.should_audit("m", key) for _ in range(400)]
    assert 150 < sum(draws) < 250


def test_per_model_rates_first_match_wins() -> None:
    sampler = Sampler(
        AuditConfig(
            sample_rate=0.0,
            at_least_every_s=0,
            model_rates={"qwen3-*": 1.0, "qwen*": 0.0, "llama-?b": 1.0},
        )
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


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_defaults_audit_five_percent_and_one_a_minute_per_model() -> None:
    config = AuditConfig()
    assert (config.sample_rate, config.at_least_every_s) == (0.05, 60.0)
    assert (config.max_token_share, config.token_allowance) == (0.1, 8192)


def test_the_floor_audits_a_repeated_prompt_the_hash_never_picks() -> None:
    clock = Clock()
    sampler = Sampler(AuditConfig(sample_rate=0.05, at_least_every_s=60), clock=clock)
    rate_only = Sampler(AuditConfig(sample_rate=0.05, at_least_every_s=0))
    key = next(k for k in keys(200) if not rate_only.should_audit("m", k))
    picks = []
    for _ in range(300):  # one request a second for five minutes, always the same prompt
        picks.append(sampler.should_audit("m", key))
        clock.now += 1.0
    assert [i for i, p in enumerate(picks) if p] == [0, 60, 120, 180, 240], (
        "the floor must pick the first request and then one a minute"
    )


def test_an_audit_the_rate_started_resets_the_floor_and_models_are_apart() -> None:
    clock = Clock()
    sampler = Sampler(AuditConfig(sample_rate=0.0, at_least_every_s=10), clock=clock)
    key = keys(1)[0]
    assert sampler.should_audit("a", key) and sampler.should_audit("b", key)  # each its own
    assert not sampler.should_audit("a", key), "a burst gets one floor audit, not one each"
    clock.now += 9.0
    sampler.started("a")  # an audit of "a" (picked by its rate) started
    clock.now += 2.0
    assert not sampler.should_audit("a", key), "11 s after the floor's audit but 2 s after one"
    assert sampler.should_audit("b", key)
    clock.now += 8.0
    assert sampler.should_audit("a", key)


def test_zero_turns_the_floor_off_and_a_model_rate_of_zero_opts_the_model_out() -> None:
    key = keys(1)[0]
    off = Sampler(AuditConfig(sample_rate=0.0, at_least_every_s=0))
    assert not any(off.should_audit("m", key) for _ in range(3))
    sampler = Sampler(AuditConfig(sample_rate=0.0, model_rates={"secret-*": 0.0}))
    assert not sampler.should_audit("secret-model", key)
    assert sampler.should_audit("public-model", key)


def test_floor_state_is_bounded_whatever_model_names_clients_send() -> None:
    clock = Clock()
    sampler = Sampler(AuditConfig(sample_rate=0.0, at_least_every_s=60), clock=clock)
    key = keys(1)[0]
    picked = sum(sampler.should_audit(f"model-{i}", key) for i in range(3 * MAX_MODELS))
    assert len(sampler.floor_models) <= MAX_MODELS + 1
    # the first MAX_MODELS have their own entry; all the others share one floor audit
    assert picked == MAX_MODELS + 1
    clock.now += 61.0  # a minute later the stale entries make room for new names again
    assert sampler.should_audit("a-new-model", key)
    assert "a-new-model" in sampler.floor_models
