"""The comparator: a primary and its shadow replay, choice by choice, to a verdict (pure).

Severity ladder: identical < logprob_drift (same tokens, logprob vectors differ bitwise) <
text_divergence (tokens differ) < answer_divergence (the extracted answers differ), plus
incomparable (errors, missing choices, different lengths for reasons other than divergence).

Logprobs compare by exact float equality; -9999.0 (vLLM's minus infinity, and anything below)
counts as minus infinity in deltas: both sides -> 0, one side only -> inf.

An unknown logprob (None: vLLM's NaN, sent as null; or any non-finite float) proves neither
sameness nor drift. Tokens still compare, so a flip is still text_divergence at its index; drift
needs a difference between values known on both sides; same tokens with nothing but unknown
values to tell them apart are incomparable (reason ``unknown_logprobs``). A max |delta| over
positions with unknown values, and a margin over a top-k with one, are unknown: None.
"""

from __future__ import annotations

import math

from proxy.audit.extract import AnswerExtractor
from proxy.audit.logprobs import known
from proxy.audit.outcome import NEG_INF_LOGPROB, ChoiceOutcome, Outcome, TokenLogprob
from proxy.audit.verdict import VERDICTS, Divergence, Verdict, output_hash

__all__ = [
    "UNKNOWN_LOGPROBS",
    "VERDICTS",
    "Divergence",
    "Verdict",
    "compare_choices",
    "compare_outcomes",
    "output_hash",
]

_ENDED = ("stop", "length")


# What one comparison found: verdict, reason, divergence, max |delta logprob|.
_Found = tuple[str, str | None, Divergence | None, float | None]

# The reason (or note) of a verdict over logprob values some of which were unknown.
UNKNOWN_LOGPROBS = "unknown_logprobs"

_Top = tuple[tuple[str, float | None], ...]


def _delta(a: float, b: float) -> float:
    """|a - b| of two known values, -9999.0 and below counting as minus infinity."""
    if a == b:
        return 0.0
    a_inf = a <= NEG_INF_LOGPROB
    b_inf = b <= NEG_INF_LOGPROB
    if a_inf and b_inf:
        return 0.0
    if a_inf or b_inf:
        return math.inf
    return abs(a - b)


def _top_known(top: _Top) -> bool:
    return all(known(value) for _, value in top)


def _position(a: TokenLogprob, b: TokenLogprob) -> tuple[bool, bool, float]:
    """Two entries of the same token: (a known difference, a value unknown, the largest
    |delta| over the values known on both sides: the chosen token's and the top-k entries
    both sides list). Where a value is unknown, only known pairs can show a difference."""
    unknown = not (
        known(a.logprob) and known(b.logprob) and _top_known(a.top) and _top_known(b.top)
    )
    if not unknown and a.logprob == b.logprob and a.top == b.top:
        return False, False, 0.0
    differs = False
    worst = 0.0
    if known(a.logprob) and known(b.logprob):
        assert a.logprob is not None and b.logprob is not None
        if a.logprob != b.logprob:
            differs = True
            worst = _delta(a.logprob, b.logprob)
    if a.top and b.top:
        theirs: dict[str, float | None] = {}
        for token, value in b.top:
            theirs.setdefault(token, value)
        seen: set[str] = set()
        for token, value in a.top:
            if token in seen or token not in theirs:
                continue
            seen.add(token)
            other = theirs[token]
            if known(value) and known(other):
                assert value is not None and other is not None
                if value != other:
                    differs = True
                    worst = max(worst, _delta(value, other))
    if not unknown:
        differs = True  # the top-k lists differ in membership, order or length
    return differs, unknown, worst


def _margin(top: _Top) -> float | None:
    """Top-1 minus top-2; unknown (None) when a value of the list is."""
    if len(top) < 2:
        return None
    first = second = -math.inf
    for _, value in top:
        if not known(value):
            return None
        assert value is not None
        if value > first:
            first, second = value, first
        elif value > second:
            second = value
    return first - second


def _token_divergence(
    i: int, primary: tuple[TokenLogprob, ...], shadow: tuple[TokenLogprob, ...]
) -> Divergence:
    a = primary[i] if i < len(primary) else None
    b = shadow[i] if i < len(shadow) else None
    top_a = a.top if a is not None else ()
    return Divergence(
        i,
        a.token if a is not None else None,
        b.token if b is not None else None,
        top_a,
        b.top if b is not None else (),
        _margin(top_a),
    )


def _prefix_found(
    short_finish: str | None,
    long_finish: str | None,
    short_len: int,
    long_len: int,
    divergence: Divergence,
    delta: float | None,
) -> _Found:
    """One output is a strict prefix of the other: a divergence only when the shorter one
    really ended there (stop), or both ended normally for different reasons."""
    if (
        short_finish in _ENDED
        and long_finish in _ENDED
        and (short_finish != long_finish or short_finish == "stop")
    ):
        note = f"one side ended ({short_finish}) at {short_len} where the other went on"
        return ("text_divergence", note, divergence, delta)
    reason = f"different lengths ({short_len} vs {long_len}; shorter ended with {short_finish})"
    return ("incomparable", reason, None, delta)


def _compare_tokens(
    primary: tuple[TokenLogprob, ...],
    shadow: tuple[TokenLogprob, ...],
    primary_finish: str | None,
    shadow_finish: str | None,
) -> _Found:
    delta = 0.0
    drift_at = -1
    unknown = False
    common = min(len(primary), len(shadow))
    for i in range(common):
        a = primary[i]
        b = shadow[i]
        if a.token != b.token:
            divergence = _token_divergence(i, primary, shadow)
            if unknown:
                return ("text_divergence", UNKNOWN_LOGPROBS, divergence, None)
            return ("text_divergence", None, divergence, delta)
        differs, unknown_here, worst = _position(a, b)
        if differs and drift_at < 0:
            drift_at = i
        unknown = unknown or unknown_here
        delta = max(delta, worst)
    note = UNKNOWN_LOGPROBS if unknown else None
    found_delta = None if unknown else delta
    if len(primary) == len(shadow):
        if drift_at >= 0:
            divergence = _token_divergence(drift_at, primary, shadow)
            return ("logprob_drift", note, divergence, found_delta)
        if unknown:
            return ("incomparable", UNKNOWN_LOGPROBS, None, None)
        return ("identical", None, None, 0.0)
    divergence = _token_divergence(common, primary, shadow)
    if len(primary) < len(shadow):
        found = _prefix_found(
            primary_finish, shadow_finish, len(primary), len(shadow), divergence, found_delta
        )
    else:
        found = _prefix_found(
            shadow_finish, primary_finish, len(shadow), len(primary), divergence, found_delta
        )
    if unknown and found[0] == "text_divergence":
        return (found[0], f"{found[1]}; {UNKNOWN_LOGPROBS}", found[2], found[3])
    return found


def _compare_first(
    primary: tuple[TokenLogprob, ...],
    shadow: tuple[TokenLogprob, ...],
    primary_finish: str | None,
    shadow_finish: str | None,
) -> _Found:
    if primary and shadow:
        a, b = primary[0], shadow[0]
        if a.token != b.token:
            return ("text_divergence", None, _token_divergence(0, primary, shadow), 0.0)
        differs, unknown, worst = _position(a, b)
        if differs:
            found = _token_divergence(0, primary, shadow)
            if unknown:
                return ("logprob_drift", UNKNOWN_LOGPROBS, found, None)
            return ("logprob_drift", None, found, worst)
        if unknown:
            return ("incomparable", UNKNOWN_LOGPROBS, None, None)
        return ("identical", None, None, 0.0)
    if not primary and not shadow:
        return ("identical", None, None, 0.0)
    empty_finish = primary_finish if not primary else shadow_finish
    if empty_finish == "stop":
        note = "one side stopped before its first token"
        return ("text_divergence", note, _token_divergence(0, primary, shadow), 0.0)
    return ("incomparable", f"empty output (finish_reason {empty_finish})", None, 0.0)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the prefixes a[:lo] are equal, a[:hi] are not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


def _char_divergence(index: int) -> Divergence:
    return Divergence(index, None, None, (), (), None)


def _compare_text(primary: ChoiceOutcome, shadow: ChoiceOutcome) -> _Found:
    """Reasoning, then content; the index counts characters of reasoning + content."""
    if primary.reasoning != shadow.reasoning:
        a, b = primary.reasoning, shadow.reasoning
        i = _first_difference(a, b)
        shorter = primary if len(a) < len(b) else shadow
        if i < min(len(a), len(b)) or shorter.content:
            return ("text_divergence", None, _char_divergence(i), None)
        offset = 0
    elif primary.content != shadow.content:
        a, b = primary.content, shadow.content
        offset = len(primary.reasoning)
        i = _first_difference(a, b)
        if i < min(len(a), len(b)):
            return ("text_divergence", None, _char_divergence(offset + i), None)
        shorter = primary if len(a) < len(b) else shadow
    else:
        return ("identical", None, None, None)
    longer = shadow if shorter is primary else primary
    short_len = len(shorter.reasoning) + len(shorter.content)
    long_len = len(longer.reasoning) + len(longer.content)
    return _prefix_found(
        shorter.finish_reason,
        longer.finish_reason,
        short_len,
        long_len,
        _char_divergence(offset + i),
        None,
    )


def compare_choices(
    primary: ChoiceOutcome,
    shadow: ChoiceOutcome,
    *,
    extractor: AnswerExtractor | None = None,
    first_token_only: bool = False,
) -> Verdict:
    """One choice of the primary against the same choice of its shadow.

    ``first_token_only`` is the prefill probe (shadow ran with max_tokens=1): only index 0 is
    compared, and extractors are not applied (one token holds no answer).
    """
    p_tokens, s_tokens = primary.tokens, shadow.tokens
    found: _Found
    if p_tokens is not None and s_tokens is not None:
        compare = _compare_first if first_token_only else _compare_tokens
        found = compare(p_tokens, s_tokens, primary.finish_reason, shadow.finish_reason)
    elif first_token_only:
        found = ("incomparable", "first-token comparison needs logprobs on both sides", None, None)
    else:
        found = _compare_text(primary, shadow)
    verdict, reason, divergence, delta = found
    primary_answer = shadow_answer = None
    if extractor is not None and not first_token_only:
        primary_answer = extractor.extract(primary.content)
        shadow_answer = extractor.extract(shadow.content)
        if verdict == "text_divergence" and primary_answer != shadow_answer:
            verdict = "answer_divergence"
    return Verdict(
        verdict,
        reason,
        divergence,
        delta,
        output_hash(primary),
        output_hash(shadow),
        len(p_tokens) if p_tokens is not None else None,
        len(s_tokens) if s_tokens is not None else None,
        primary_answer,
        shadow_answer,
        primary.index,
    )


def _incomparable(
    reason: str, index: int, primary: ChoiceOutcome | None, shadow: ChoiceOutcome | None
) -> Verdict:
    def count(choice: ChoiceOutcome | None) -> int | None:
        return len(choice.tokens) if choice is not None and choice.tokens is not None else None

    return Verdict(
        "incomparable",
        reason,
        None,
        None,
        output_hash(primary) if primary is not None else "",
        output_hash(shadow) if shadow is not None else "",
        count(primary),
        count(shadow),
        choice=index,
    )


def compare_outcomes(
    primary: Outcome,
    shadow: Outcome,
    *,
    extractor: AnswerExtractor | None = None,
    first_token_only: bool = False,
) -> list[Verdict]:
    """One verdict per choice index: the primary's choices in order, then any the shadow has
    alone. An error on either side makes every verdict incomparable (at least one verdict)."""
    shadow_by_index: dict[int, ChoiceOutcome] = {}
    for choice in shadow.choices:
        shadow_by_index.setdefault(choice.index, choice)
    if primary.error is not None or shadow.error is not None:
        reason = (
            f"primary error: {primary.error}"
            if primary.error is not None
            else f"shadow error: {shadow.error}"
        )
        if not primary.choices:
            return [_incomparable(reason, 0, None, shadow.choices[0] if shadow.choices else None)]
        return [
            _incomparable(reason, c.index, c, shadow_by_index.get(c.index)) for c in primary.choices
        ]
    verdicts: list[Verdict] = []
    seen: set[int] = set()
    for choice in primary.choices:
        if choice.index in seen:
            continue
        seen.add(choice.index)
        other = shadow_by_index.get(choice.index)
        if other is None:
            reason = f"shadow has no choice {choice.index}"
            verdicts.append(_incomparable(reason, choice.index, choice, None))
        else:
            verdicts.append(
                compare_choices(
                    choice, other, extractor=extractor, first_token_only=first_token_only
                )
            )
    for index in sorted(set(shadow_by_index) - seen):
        reason = f"primary has no choice {index}"
        verdicts.append(_incomparable(reason, index, None, shadow_by_index[index]))
    return verdicts
