"""Pure-function properties of the pseudo-model and the config (no server)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.tools.emulator import EmulatorConfig, KnobsError
from proxy.tools.emulator.model import (
    DRIFT_AMPLITUDE,
    ChoiceGenerator,
    ChoicePlan,
    Sampling,
    drifted,
    log_softmax,
    natural_length,
    prompt_key,
    raw_logits,
)
from proxy.tools.emulator.vocab import split_text, vocabulary


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


def test_a_misspelt_knob_is_named_with_every_valid_one() -> None:
    with pytest.raises(KnobsError) as exc:
        EmulatorConfig().with_knobs_header('{"flip_prob": 1}')
    said = str(exc.value)
    assert "flip_prob: not a knob (did you mean flip_probability?)" in said, said
    assert all(name in said for name in EmulatorConfig.model_fields), said


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40), st.integers(0, 300), st.integers(0, 2**63))
def test_drift_keeps_a_greedy_argmax_and_is_gpu_sized(prompt: str, pos: int, seed: int) -> None:
    logits = raw_logits(prompt_key("m", prompt), pos, -1, ())
    top = max(logits, key=lambda t: (logits[t], -t))
    moved = drifted(logits, seed, pos, top)
    assert moved == drifted(logits, seed, pos, top)  # seeded
    assert max(moved, key=lambda t: (moved[t], -t)) == top
    before, after = dict(log_softmax(logits)), dict(log_softmax(moved))
    deltas = [abs(after[t] - before[t]) for t in logits]
    assert 0 < max(deltas) < 2 * DRIFT_AMPLITUDE + 1
    # Forcing another token makes it the argmax (a batch divergence).
    second = sorted(logits, key=lambda t: (-logits[t], t))[1]
    forced = drifted(logits, seed, pos, second, force=True)
    assert max(forced, key=lambda t: (forced[t], -t)) == second


def test_batch_probability_grows_with_inflight() -> None:
    plan = ChoicePlan("r", 0, 1, 10, 0, 10, batch_slope=0.2)
    gen = ChoiceGenerator(plan, Sampling(temperature=0.0), random.Random())
    assert [gen.batch_probability(n) for n in (1, 2, 3, 6, 20)] == pytest.approx(
        [0.0, 0.2, 0.4, 1.0, 1.0]
    )
    off = ChoiceGenerator(ChoicePlan("r", 0, 1, 10, 0, 10), Sampling(0.0), random.Random())
    assert off.batch_probability(50) == 0.0
