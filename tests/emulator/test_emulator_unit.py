"""Pure-function properties of the pseudo-model and the config (no server)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.emulator import EmulatorConfig, KnobsError
from proxy.emulator.model import (
    ChoiceGenerator,
    ChoicePlan,
    Sampling,
    log_softmax,
    natural_length,
    prompt_key,
    raw_logits,
)
from proxy.emulator.vocab import split_text, vocabulary


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80), st.integers(0, 500), st.integers(-1, 400))
def test_logits_are_pure_and_realistic(prompt: str, position: int, prev: int) -> None:
    key = prompt_key("m", prompt)
    first = log_softmax(raw_logits(key, position, prev, ()))
    assert first == log_softmax(raw_logits(key, position, prev, ()))
    lps = [lp for _, lp in first]
    assert lps == sorted(lps, reverse=True)
    assert math.isclose(math.fsum(math.exp(lp) for lp in lps), 1.0, rel_tol=1e-12)
    assert -1.6 < lps[0] < 0 and lps[-1] > -20
    assert len({t for t, _ in first}) == len(first) >= 24
    assert 12 <= natural_length(key) <= 60


@settings(max_examples=30, deadline=None)
@given(st.text(min_size=1, max_size=60))
def test_greedy_generation_is_reproducible(prompt: str) -> None:
    def run() -> tuple[list[str], list[float]]:
        plan = ChoicePlan("r", 0, prompt_key("m", prompt), 50, 0, natural_length(1))
        gen = ChoiceGenerator(plan, Sampling(temperature=0.0), random.Random())
        steps = []
        while (step := gen.step(1)) is not None:
            steps.append(step)
        assert gen.finish_reason in {"stop", "length"}
        return [s.text for s in steps], [s.logprob for s in steps]

    assert run() == run()


def test_vocabulary_shape() -> None:
    vocab = vocabulary()
    assert 250 <= len(vocab) <= 400
    assert len(set(vocab.tokens)) == len(vocab)
    assert vocab.tokens[0] == " the" and "." in vocab.tokens
    assert split_text("Hi, you  there.") == ["Hi", ",", " you", "  there", "."]


def test_knobs_header_validation() -> None:
    cfg = EmulatorConfig()
    assert cfg.with_knobs_header(None) is cfg
    assert cfg.with_knobs_header('{"fault": "http_503"}').fault == "http_503"
    with pytest.raises(KnobsError):
        cfg.with_knobs_header('{"fault": "nope"}')
    with pytest.raises(KnobsError):
        cfg.with_knobs_header('{"token_latency_s": -1}')
