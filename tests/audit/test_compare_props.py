"""Comparator properties: a choice against itself is identical; swapping sides keeps the verdict."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.audit.compare import compare_choices
from proxy.audit.extract import build_extractor
from proxy.audit.outcome import ChoiceOutcome, TokenLogprob

token_text = st.sampled_from(["a", "b", " c", "", "é", "\n"])
logprob = st.sampled_from([0.0, -0.25, -0.5, -1.0, -9999.0]) | st.floats(
    min_value=-20.0, max_value=0.0, allow_nan=False
)
token = st.builds(
    TokenLogprob,
    token_text,
    logprob,
    st.lists(st.tuples(token_text, logprob), max_size=3).map(tuple),
)
finish = st.sampled_from(["stop", "length", "abort", None])


@st.composite
def choices(draw: st.DrawFn) -> ChoiceOutcome:
    tokens = draw(st.none() | st.lists(token, max_size=6).map(tuple))
    if tokens is not None and draw(st.booleans()):
        content = "".join(t.token for t in tokens)
    else:
        content = draw(st.text(alphabet='ab{}":1 ', max_size=8))
    reasoning = draw(st.text(alphabet="ab", max_size=3))
    return ChoiceOutcome(0, content, reasoning, tokens, draw(finish))


@st.composite
def related_pairs(draw: st.DrawFn) -> tuple[ChoiceOutcome, ChoiceOutcome]:
    """Two choices that often share a prefix, so every branch gets exercised."""
    a = draw(choices())
    b = draw(choices())
    if a.tokens is not None and b.tokens is not None and draw(st.booleans()):
        cut = draw(st.integers(0, len(a.tokens)))
        b = ChoiceOutcome(0, b.content, b.reasoning, a.tokens[:cut] + b.tokens, b.finish_reason)
    if draw(st.booleans()):
        b = ChoiceOutcome(0, a.content[: len(b.content)], a.reasoning, b.tokens, b.finish_reason)
    return a, b


EXTRACTOR = build_extractor('regex:"a":(\\d)')


@settings(max_examples=200, deadline=None)
@given(choices(), st.booleans())
def test_self_comparison_is_identical(x: ChoiceOutcome, first: bool) -> None:
    if first and x.tokens is None:
        return
    v = compare_choices(x, x, extractor=EXTRACTOR, first_token_only=first)
    assert v.verdict == "identical"
    assert v.divergence is None
    assert v.max_abs_logprob_delta == (0.0 if x.tokens is not None else None)
    assert v.primary_hash == v.shadow_hash


@settings(max_examples=300, deadline=None)
@given(related_pairs(), st.booleans(), st.booleans())
def test_swapping_sides_keeps_verdict_and_index(
    pair: tuple[ChoiceOutcome, ChoiceOutcome], first: bool, extract: bool
) -> None:
    a, b = pair
    ex = EXTRACTOR if extract else None
    ab = compare_choices(a, b, extractor=ex, first_token_only=first)
    ba = compare_choices(b, a, extractor=ex, first_token_only=first)
    assert ab.verdict == ba.verdict
    assert ab.max_abs_logprob_delta == ba.max_abs_logprob_delta
    assert (ab.divergence is None) == (ba.divergence is None)
    if ab.divergence is not None and ba.divergence is not None:
        assert ab.divergence.index == ba.divergence.index
        assert ab.divergence.primary_token == ba.divergence.shadow_token
        assert ab.divergence.primary_top == ba.divergence.shadow_top
    assert (ab.primary_hash, ab.shadow_hash) == (ba.shadow_hash, ba.primary_hash)
    assert (ab.primary_answer, ab.shadow_answer) == (ba.shadow_answer, ba.primary_answer)
    if ab.verdict == "identical":
        assert ab.divergence is None
    if ab.verdict in ("logprob_drift", "text_divergence", "answer_divergence"):
        assert ab.divergence is not None
