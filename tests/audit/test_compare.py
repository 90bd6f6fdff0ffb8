"""The comparator: every verdict with its exact index, tokens, margin and delta."""

from __future__ import annotations

import math

import pytest
import xxhash

from proxy.audit.compare import (
    VERDICTS,
    Divergence,
    Verdict,
    compare_choices,
    compare_outcomes,
    output_hash,
)
from proxy.audit.extract import build_extractor
from proxy.audit.outcome import ChoiceOutcome, Outcome, TokenLogprob

Top = list[tuple[str, float]]


def tok(token: str, logprob: float, top: Top | None = None) -> TokenLogprob:
    return TokenLogprob(token, logprob, tuple(top if top is not None else [(token, logprob)]))


def choice(
    tokens: list[TokenLogprob] | None,
    finish: str | None = "stop",
    content: str | None = None,
    reasoning: str = "",
    index: int = 0,
) -> ChoiceOutcome:
    if content is None:
        content = "".join(t.token for t in tokens or [])
    return ChoiceOutcome(
        index, content, reasoning, tuple(tokens) if tokens is not None else None, finish
    )


BASE = [
    tok("The", -0.5, [("The", -0.5), ("A", -1.25)]),
    tok(" date", -0.25, [(" date", -0.25), (" day", -2.0)]),
    tok(" is", -0.125, [(" is", -0.125), (" was", -3.0), (":", -3.5)]),
    tok(" May", -1.0, [(" May", -1.0), (" June", -1.125)]),
]


def test_verdict_names() -> None:
    assert VERDICTS == (
        "identical",
        "logprob_drift",
        "text_divergence",
        "answer_divergence",
        "incomparable",
    )


def test_identical() -> None:
    v = compare_choices(choice(BASE), choice(list(BASE)))
    h = output_hash(choice(BASE))
    assert v == Verdict("identical", None, None, 0.0, h, h, 4, 4)
    assert h == xxhash.xxh3_128_hexdigest(b"\x00The date is May")
    assert len(h) == 32


def test_logprob_drift_on_chosen_and_top() -> None:
    shadow = list(BASE)
    shadow[2] = tok(" is", -0.125, [(" is", -0.125), (" was", -3.5), (":", -3.5)])
    shadow[3] = tok(" May", -1.25, [(" May", -1.25), (" June", -1.125)])
    v = compare_choices(choice(BASE), choice(shadow))
    assert v.verdict == "logprob_drift"
    assert v.divergence == Divergence(2, " is", " is", BASE[2].top, shadow[2].top, 2.875)
    assert v.max_abs_logprob_delta == 0.5  # " was": -3.0 vs -3.5 outweighs " May": 0.25


def test_drift_from_topk_membership_or_length_only() -> None:
    shadow = list(BASE)
    shadow[1] = tok(" date", -0.25, [(" date", -0.25)])  # one entry fewer
    v = compare_choices(choice(BASE), choice(shadow))
    assert v.verdict == "logprob_drift"
    assert v.divergence is not None and v.divergence.index == 1
    assert v.max_abs_logprob_delta == 0.0  # nothing matched by token string differs
    shadow[1] = tok(" date", -0.25, [(" day", -2.0), (" date", -0.25)])  # order only
    assert compare_choices(choice(BASE), choice(shadow)).verdict == "logprob_drift"


def test_minus_9999() -> None:
    a = [tok("x", -9999.0, [("x", -9999.0), ("y", -9999.0)])]
    assert compare_choices(choice(a), choice(list(a))).verdict == "identical"
    b = [tok("x", -9999.0, [("x", -9999.0), ("y", -7.0)])]
    v = compare_choices(choice(a), choice(b))
    assert (v.verdict, v.max_abs_logprob_delta) == ("logprob_drift", math.inf)
    assert v.divergence is not None and v.divergence.margin == 0.0
    c = [tok("x", -3.0, [("x", -3.0), ("y", -9999.0)])]
    v = compare_choices(choice(a), choice(c))
    assert v.max_abs_logprob_delta == math.inf
    assert compare_choices(choice(c), choice(a)).max_abs_logprob_delta == math.inf
    # below -9999.0 is minus infinity too: a difference there is drift, but not a delta
    d = [tok("x", -1e10, [("x", -1e10), ("y", -9999.0)])]
    v = compare_choices(choice(a), choice(d))
    assert (v.verdict, v.max_abs_logprob_delta) == ("logprob_drift", 0.0)


def test_text_divergence_with_margin_and_prefix_delta() -> None:
    shadow = list(BASE)
    shadow[1] = tok(" date", -0.5, [(" date", -0.5), (" day", -2.0)])  # drift before the flip
    shadow[3] = tok(" June", -1.0, [(" June", -1.0), (" May", -1.125)])
    v = compare_choices(choice(BASE), choice(shadow))
    assert v.verdict == "text_divergence"
    assert v.divergence == Divergence(3, " May", " June", BASE[3].top, shadow[3].top, 0.125)
    assert v.max_abs_logprob_delta == 0.25
    assert v.primary_hash != v.shadow_hash
    one = [tok("a", -0.5, [("a", -0.5)])]
    v = compare_choices(choice(one), choice([tok("b", -0.5)]))
    assert v.divergence is not None and v.divergence.index == 0 and v.divergence.margin is None
    assert v.max_abs_logprob_delta == 0.0


def test_margin_uses_the_two_largest_values() -> None:
    top = [("b", -0.75), ("a", -0.5), ("c", -3.0)]  # engine order: sampled token first
    v = compare_choices(choice([tok("b", -0.75, top)]), choice([tok("a", -0.5)]))
    assert v.divergence is not None and v.divergence.margin == 0.25


@pytest.mark.parametrize(
    ("short_finish", "long_finish", "verdict"),
    [
        ("stop", "length", "text_divergence"),
        ("stop", "stop", "text_divergence"),
        ("length", "stop", "text_divergence"),
        ("length", "length", "incomparable"),
        ("abort", "length", "incomparable"),
        ("error", "stop", "incomparable"),
        (None, "stop", "incomparable"),
        ("stop", "abort", "incomparable"),
    ],
)
def test_strict_prefix(short_finish: str | None, long_finish: str | None, verdict: str) -> None:
    short, long = choice(BASE[:2], short_finish), choice(BASE, long_finish)
    for primary, shadow in ((short, long), (long, short)):
        v = compare_choices(primary, shadow)
        assert v.verdict == verdict
        assert v.max_abs_logprob_delta == 0.0
        if verdict == "incomparable":
            assert v.divergence is None and v.reason and "different lengths" in v.reason
        else:
            assert v.divergence is not None and v.divergence.index == 2
            present = (v.divergence.primary_token, v.divergence.shadow_token)
            assert present == ((None, " is") if primary is short else (" is", None))
            assert v.divergence.margin == (None if primary is short else 2.875)


def test_first_token_only() -> None:
    shadow = [BASE[0]]
    v = compare_choices(choice(BASE), choice(shadow, "length"), first_token_only=True)
    assert (v.verdict, v.max_abs_logprob_delta, v.divergence) == ("identical", 0.0, None)
    assert v.primary_hash != v.shadow_hash and (v.primary_tokens, v.shadow_tokens) == (4, 1)
    drift = [tok("The", -0.5, [("The", -0.5), ("A", -1.5)])]
    v = compare_choices(choice(BASE), choice(drift, "length"), first_token_only=True)
    assert v.verdict == "logprob_drift" and v.max_abs_logprob_delta == 0.25
    assert v.divergence == Divergence(0, "The", "The", BASE[0].top, drift[0].top, 0.75)
    flip = [tok("A", -0.5)]
    v = compare_choices(choice(BASE), choice(flip, "length"), first_token_only=True)
    assert v.verdict == "text_divergence" and v.divergence is not None
    assert (v.divergence.index, v.divergence.primary_token, v.divergence.shadow_token) == (
        0,
        "The",
        "A",
    )
    # without first_token_only the same pair is a length question, not identical
    assert compare_choices(choice(BASE), choice(shadow, "length")).verdict == "text_divergence"
    v = compare_choices(choice(None, content="x"), choice(shadow), first_token_only=True)
    assert v.verdict == "incomparable"


def test_first_token_only_empty_sides() -> None:
    assert (
        compare_choices(choice([]), choice([], "stop"), first_token_only=True).verdict
        == "identical"
    )
    v = compare_choices(choice([], "stop"), choice(BASE[:1], "length"), first_token_only=True)
    assert v.verdict == "text_divergence" and v.divergence is not None
    assert (v.divergence.primary_token, v.divergence.shadow_token) == (None, "The")
    v = compare_choices(choice([], "abort"), choice(BASE[:1], "length"), first_token_only=True)
    assert v.verdict == "incomparable"


def test_text_mode_character_index() -> None:
    p = choice(None, content="The date is May", reasoning="think")
    assert compare_choices(p, p).verdict == "identical"
    assert compare_choices(p, p).max_abs_logprob_delta is None
    s = choice(BASE, content="The date is June", reasoning="think")  # one side has tokens
    v = compare_choices(p, s)
    assert v.verdict == "text_divergence"
    assert v.divergence == Divergence(17, None, None, (), (), None)  # 5 + 12
    assert (v.primary_tokens, v.shadow_tokens, v.max_abs_logprob_delta) == (None, 4, None)
    r = choice(None, content="The date is May", reasoning="thinks")
    assert compare_choices(p, r).divergence == Divergence(5, None, None, (), (), None)


def test_text_mode_prefixes() -> None:
    short = choice(None, "stop", content="The date")
    long = choice(None, "length", content="The date is")
    v = compare_choices(short, long)
    assert v.verdict == "text_divergence" and v.divergence is not None
    assert v.divergence.index == 8
    assert compare_choices(choice(None, "abort", content="The"), long).verdict == "incomparable"
    # reasoning cut short with nothing after it is a prefix; with content after it, not
    cut = choice(None, "length", reasoning="abc", content="")
    full = choice(None, "stop", reasoning="abcdef", content="X")
    v = compare_choices(cut, full)
    assert v.verdict == "text_divergence" and v.divergence is not None
    assert v.divergence.index == 3
    cut_abort = choice(None, "abort", reasoning="abc", content="")
    assert compare_choices(cut_abort, full).verdict == "incomparable"
    ended = choice(None, "abort", reasoning="abc", content="Y")
    v = compare_choices(ended, full)
    assert v.verdict == "text_divergence" and v.divergence is not None
    assert v.divergence.index == 3


def test_answer_divergence_vs_same_answer() -> None:
    ex = build_extractor("json:$.date")
    p = choice(None, content='{"date": "2024-05-01", "note": "a"}')
    same = choice(None, content='{"date": "2024-05-01", "note": "b"}')
    other = choice(None, content='{"date": "2024-06-01", "note": "a"}')
    v = compare_choices(p, same, extractor=ex)
    assert (v.verdict, v.primary_answer, v.shadow_answer) == (
        "text_divergence",
        '"2024-05-01"',
        '"2024-05-01"',
    )
    v = compare_choices(p, other, extractor=ex)
    assert (v.verdict, v.primary_answer, v.shadow_answer) == (
        "answer_divergence",
        '"2024-05-01"',
        '"2024-06-01"',
    )
    assert v.divergence == Divergence(16, None, None, (), (), None)  # "2024-0[5]"
    assert compare_choices(p, p, extractor=ex).primary_answer == '"2024-05-01"'
    assert compare_choices(p, p).primary_answer is None
    broken = choice(None, content='{"date": ')
    assert compare_choices(p, broken, extractor=ex).verdict == "answer_divergence"
    # drift never becomes an answer divergence, and the prefill probe extracts nothing
    drift = compare_choices(choice(BASE), choice([*BASE[:3], tok(" May", -1.5)]), extractor=ex)
    assert drift.verdict == "logprob_drift"
    v = compare_choices(choice(BASE), choice([tok("A", -1.0)]), extractor=ex, first_token_only=True)
    assert (v.verdict, v.primary_answer) == ("text_divergence", None)


def test_compare_outcomes_errors_and_missing_choices() -> None:
    a0, a1 = choice(BASE, index=0), choice(BASE[:2], index=1)
    ok = Outcome((a0, a1))
    vs = compare_outcomes(ok, Outcome((), error="boom"))
    assert [(v.verdict, v.choice, v.reason) for v in vs] == [
        ("incomparable", 0, "shadow error: boom"),
        ("incomparable", 1, "shadow error: boom"),
    ]
    assert vs[0].primary_hash == output_hash(a0) and vs[0].shadow_hash == ""
    vs = compare_outcomes(Outcome((), error="incomplete"), ok)
    assert [(v.verdict, v.reason) for v in vs] == [("incomparable", "primary error: incomplete")]
    vs = compare_outcomes(ok, Outcome((choice(BASE[:1], index=1), choice(BASE, index=2))))
    assert [(v.choice, v.verdict) for v in vs] == [
        (0, "incomparable"),
        (1, "text_divergence"),
        (2, "incomparable"),
    ]
    assert vs[0].reason == "shadow has no choice 0" and vs[2].reason == "primary has no choice 2"
    vs = compare_outcomes(ok, Outcome((a1, a0)), first_token_only=True)
    assert [(v.choice, v.verdict) for v in vs] == [(0, "identical"), (1, "identical")]
    assert compare_outcomes(Outcome(()), Outcome(())) == []
