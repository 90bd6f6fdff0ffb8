"""What a comparison of a primary and its shadow concluded (the comparator's result types)."""

from __future__ import annotations

from dataclasses import dataclass

import xxhash

from proxy.audit.outcome import ChoiceOutcome

# Severity order; "incomparable" stands apart from the ladder.
VERDICTS = ("identical", "logprob_drift", "text_divergence", "answer_divergence", "incomparable")


@dataclass(frozen=True, slots=True)
class Divergence:
    index: int  # first divergent token index (character index when either side lacks tokens)
    primary_token: str | None  # None past that side's end, and in character mode
    shadow_token: str | None
    primary_top: tuple[tuple[str, float | None], ...]  # None: an unknown value (NaN, null)
    shadow_top: tuple[tuple[str, float | None], ...]
    margin: float | None  # primary's top-1 minus top-2 logprob there (None: unknown)


@dataclass(frozen=True, slots=True)
class Verdict:
    verdict: str
    reason: str | None  # why incomparable, or a short note ("unknown_logprobs": some were)
    divergence: Divergence | None  # text/answer divergence, or logprob_drift's first index
    # nats over the common identical-token prefix; None without logprobs or where unknown
    max_abs_logprob_delta: float | None
    primary_hash: str  # xxh3-128 hex of reasoning + "\x00" + content ("" without a choice)
    shadow_hash: str
    primary_tokens: int | None
    shadow_tokens: int | None
    primary_answer: str | None = None
    shadow_answer: str | None = None
    choice: int = 0  # the choice index this verdict is about


def output_hash(choice: ChoiceOutcome) -> str:
    text = choice.reasoning + "\x00" + choice.content
    return str(xxhash.xxh3_128_hexdigest(text.encode("utf-8", "surrogatepass")))
