"""Comparator properties over generated pairs with a known injected difference.

Each property builds the shadow from the primary by one known change (a token flip, a logprob
moved, a truncation, a character changed, values made unknown) and requires the verdict, the
index and the delta that change implies. A comparator that always says identical, or that
ignores logprobs, or tokens, fails them; so do the sanity properties it would pass alone (a
choice against itself is identical, swapping sides keeps the verdict).
"""

from __future__ import annotations

import math

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from proxy.audit.compare import UNKNOWN_LOGPROBS, compare_choices
from proxy.audit.extract import build_extractor
from proxy.audit.outcome import ChoiceOutcome, TokenLogprob

# Multi-character tokens: a token index is not a character index, so a comparator that falls
# back to the text when it has tokens gets the index wrong.
token_text = st.sampled_from(["a", "b", " c", "", "é", "\n", "ab", " the", "12"])
logprob = st.sampled_from([0.0, -0.25, -0.5, -1.0, -9999.0]) | st.floats(
    min_value=-20.0, max_value=0.0, allow_nan=False
)
# A top-k list names each token once, so a value moved there is that token's only value.
top = st.lists(st.tuples(token_text, logprob), max_size=3, unique_by=lambda p: p[0]).map(tuple)
token = st.builds(TokenLogprob, token_text, logprob, top)
finish = st.sampled_from(["stop", "length", "abort", None])
sequence = st.lists(token, min_size=1, max_size=8)


def _choice(
    tokens: list[TokenLogprob] | None, finish: str | None = "stop", content: str = ""
) -> ChoiceOutcome:
    if tokens is not None:
        content = "".join(t.token for t in tokens)
    return ChoiceOutcome(0, content, "", tuple(tokens) if tokens is not None else None, finish)


def _expected_delta(a: float, b: float) -> float:
    """The spec's rule: -9999.0 and below is minus infinity (both sides 0, one side inf)."""
    a_inf, b_inf = a <= -9999.0, b <= -9999.0
    if a_inf and b_inf:
        return 0.0
    if a_inf or b_inf:
        return math.inf
    return abs(a - b)


@st.composite
def choices(draw: st.DrawFn) -> ChoiceOutcome:
    tokens = draw(st.none() | st.lists(token, max_size=6))
    if tokens is not None and draw(st.booleans()):
        content = "".join(t.token for t in tokens)
    else:
        content = draw(st.text(alphabet='ab{}":1 ', max_size=8))
    reasoning = draw(st.text(alphabet="ab", max_size=3))
    return ChoiceOutcome(
        0, content, reasoning, tuple(tokens) if tokens is not None else None, draw(finish)
    )


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


@st.composite
def flipped(draw: st.DrawFn) -> tuple[list[TokenLogprob], list[TokenLogprob], int, float]:
    """A shadow equal to the primary up to index i, a different token at i, anything after;
    optionally one logprob moved before i. Returns (primary, shadow, i, expected delta)."""
    primary = draw(sequence)
    i = draw(st.integers(0, len(primary) - 1))
    other = draw(token_text.filter(lambda t: t != primary[i].token))
    shadow = list(primary[:i])
    shadow.append(TokenLogprob(other, draw(logprob), draw(top)))
    shadow += draw(st.lists(token, max_size=3))
    delta = 0.0
    if i > 0 and draw(st.booleans()):
        j = draw(st.integers(0, i - 1))
        old = primary[j].logprob
        assert old is not None
        new = draw(logprob.filter(lambda v: v != old))
        shadow[j] = TokenLogprob(primary[j].token, new, primary[j].top)
        delta = _expected_delta(old, new)
    return primary, shadow, i, delta


@settings(max_examples=300, deadline=None)
@given(flipped(), finish, finish)
def test_a_flipped_token_is_text_divergence_at_its_index(
    case: tuple[list[TokenLogprob], list[TokenLogprob], int, float],
    primary_finish: str | None,
    shadow_finish: str | None,
) -> None:
    primary, shadow, i, delta = case
    v = compare_choices(_choice(primary, primary_finish), _choice(shadow, shadow_finish))
    assert v.verdict == "text_divergence"
    assert v.divergence is not None
    assert v.divergence.index == i
    assert (v.divergence.primary_token, v.divergence.shadow_token) == (
        primary[i].token,
        shadow[i].token,
    )
    assert (v.divergence.primary_top, v.divergence.shadow_top) == (primary[i].top, shadow[i].top)
    assert v.max_abs_logprob_delta == delta
    assert (v.primary_tokens, v.shadow_tokens) == (len(primary), len(shadow))
    # the prefill probe sees index 0 only
    first = compare_choices(_choice(primary), _choice(shadow), first_token_only=True)
    if i == 0:
        assert first.verdict == "text_divergence"
        assert first.divergence is not None and first.divergence.index == 0
    elif shadow[0] == primary[0]:
        assert first.verdict == "identical"
    else:  # the logprob moved before the flip was the first one
        assert (first.verdict, first.max_abs_logprob_delta) == ("logprob_drift", delta)


@st.composite
def drifted(draw: st.DrawFn) -> tuple[list[TokenLogprob], list[TokenLogprob], int, float]:
    """Same tokens; one value at index i (the chosen token's or a top-k entry's) moved."""
    primary = draw(sequence)
    i = draw(st.integers(0, len(primary) - 1))
    at = primary[i]
    shadow = list(primary)
    slot = draw(st.integers(-1, len(at.top) - 1))  # -1: the chosen token's logprob
    old = at.logprob if slot < 0 else at.top[slot][1]
    assert old is not None
    new = draw(logprob.filter(lambda v: v != old))
    if slot < 0:
        shadow[i] = TokenLogprob(at.token, new, at.top)
    else:
        moved = list(at.top)
        moved[slot] = (moved[slot][0], new)
        shadow[i] = TokenLogprob(at.token, at.logprob, tuple(moved))
    return primary, shadow, i, _expected_delta(old, new)


@settings(max_examples=300, deadline=None)
@given(drifted(), st.booleans())
def test_a_moved_logprob_is_drift_at_its_index(
    case: tuple[list[TokenLogprob], list[TokenLogprob], int, float], swap: bool
) -> None:
    primary, shadow, i, delta = case
    if swap:
        primary, shadow = shadow, primary
    v = compare_choices(_choice(primary), _choice(shadow))
    assert v.verdict == "logprob_drift"
    assert v.reason is None
    assert v.divergence is not None and v.divergence.index == i
    assert v.divergence.primary_token == v.divergence.shadow_token == primary[i].token
    assert v.max_abs_logprob_delta == delta
    first = compare_choices(_choice(primary), _choice(shadow), first_token_only=True)
    assert first.verdict == ("logprob_drift" if i == 0 else "identical")
    assert first.max_abs_logprob_delta == (delta if i == 0 else 0.0)


@settings(max_examples=200, deadline=None)
@given(sequence, st.data())
def test_a_truncated_shadow_diverges_where_it_stopped(
    primary: list[TokenLogprob], data: st.DataObject
) -> None:
    k = data.draw(st.integers(0, len(primary) - 1))
    primary_finish = data.draw(st.sampled_from(["stop", "length"]))
    shadow_finish = data.draw(finish)
    v = compare_choices(_choice(primary, primary_finish), _choice(primary[:k], shadow_finish))
    if shadow_finish == "stop" or (shadow_finish == "length" and primary_finish == "stop"):
        # the shorter one really ended there: a divergence at k
        assert v.verdict == "text_divergence"
        assert v.divergence is not None and v.divergence.index == k
        assert (v.divergence.primary_token, v.divergence.shadow_token) == (primary[k].token, None)
        assert v.max_abs_logprob_delta == 0.0
    else:  # cut short (length on both, abort, unknown): not a divergence
        assert v.verdict == "incomparable"
        assert v.divergence is None


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="ab c1", min_size=1, max_size=12), st.data())
def test_a_changed_character_without_logprobs_diverges_at_it(
    text: str, data: st.DataObject
) -> None:
    i = data.draw(st.integers(0, len(text) - 1))
    other = data.draw(st.sampled_from("xyz"))
    changed = text[:i] + other + text[i + 1 :]
    for reasoning in (False, True):
        if reasoning:  # the index counts reasoning then content
            a = ChoiceOutcome(0, "tail", text, None, "stop")
            b = ChoiceOutcome(0, "tail", changed, None, "stop")
        else:
            a = ChoiceOutcome(0, text, "think", None, "stop")
            b = ChoiceOutcome(0, changed, "think", None, "stop")
        v = compare_choices(a, b)
        assert v.verdict == "text_divergence"
        assert v.divergence is not None
        assert v.divergence.index == (i if reasoning else len("think") + i)
        assert v.max_abs_logprob_delta is None


@settings(max_examples=100, deadline=None)
@given(st.text(alphabet="ab ", max_size=6), st.integers(0, 9), st.integers(0, 9))
def test_a_changed_answer_is_answer_divergence(prefix: str, x: int, y: int) -> None:
    assume(x != y)
    a = ChoiceOutcome(0, f'{prefix}{{"a":{x}}}', "", None, "stop")
    b = ChoiceOutcome(0, f'{prefix}{{"a":{y}}}', "", None, "stop")
    v = compare_choices(a, b, extractor=EXTRACTOR)
    assert v.verdict == "answer_divergence"
    assert (v.primary_answer, v.shadow_answer) == (str(x), str(y))
    assert v.divergence is not None and v.divergence.index == len(prefix) + 5
    assert compare_choices(a, b).verdict == "text_divergence"  # no extractor: text only


def _null_some(tokens: list[TokenLogprob], draw: st.DrawFn) -> tuple[list[TokenLogprob], bool]:
    """Some values made unknown (None); whether any was."""
    out: list[TokenLogprob] = []
    any_null = False
    for t in tokens:
        chosen = None if draw(st.booleans()) else t.logprob
        alts = tuple((alt, None if draw(st.booleans()) else v) for alt, v in t.top)
        any_null = any_null or chosen is None or any(v is None for _, v in alts)
        out.append(TokenLogprob(t.token, chosen, alts))
    return out, any_null


@settings(max_examples=300, deadline=None)
@given(sequence, st.data())
def test_unknown_values_never_make_drift(primary: list[TokenLogprob], data: st.DataObject) -> None:
    a, a_null = _null_some(primary, data.draw)
    b, b_null = _null_some(primary, data.draw)
    v = compare_choices(_choice(a), _choice(b))
    if not (a_null or b_null):
        assert v.verdict == "identical"
        return
    assert (v.verdict, v.reason) == ("incomparable", UNKNOWN_LOGPROBS)
    assert v.divergence is None and v.max_abs_logprob_delta is None
    first = compare_choices(_choice(a), _choice(b), first_token_only=True)
    assert first.verdict in ("identical", "incomparable")
    assert first.verdict != "logprob_drift"


@settings(max_examples=300, deadline=None)
@given(flipped(), st.data())
def test_unknown_values_keep_the_flip_and_its_index(
    case: tuple[list[TokenLogprob], list[TokenLogprob], int, float], data: st.DataObject
) -> None:
    primary, shadow, i, delta = case
    a, _ = _null_some(primary, data.draw)
    b, _ = _null_some(shadow, data.draw)
    v = compare_choices(_choice(a), _choice(b))
    assert v.verdict == "text_divergence"
    assert v.divergence is not None and v.divergence.index == i
    prefix_unknown = any(
        t.logprob is None or any(x is None for _, x in t.top) for t in a[:i] + b[:i]
    )
    if prefix_unknown:
        assert v.max_abs_logprob_delta is None and v.reason == UNKNOWN_LOGPROBS
    else:
        assert v.max_abs_logprob_delta == delta and v.reason is None
    values = [x for _, x in a[i].top]
    if len(values) < 2 or None in values:
        assert v.divergence.margin is None
    else:
        ranked = sorted((x for x in values if x is not None), reverse=True)
        assert v.divergence.margin == ranked[0] - ranked[1]
