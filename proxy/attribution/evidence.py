"""What triage observed of one divergent audit: each run of the request and how it ran.

A run is the primary, the shadow, or a follow-up replay. Runs whose outputs agree at the
audit's level (the text for a text or answer divergence, the logprobs too for a logprob drift,
the first token in prefill mode) share a ``group``; ``decide`` reads only these facts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

CAUSES = ("intrinsic", "batch", "prefix_cache", "speculative", "recipe_change", "unknown")


@dataclass(frozen=True, slots=True)
class Run:
    """One run of the audited request.

    ``cache``: cold (a fresh ``cache_salt``, or ``cache_prompt: false``), warm (after a
    priming run, without salt) or unknown. ``alone``: True when nothing else of detproxy's
    (client request, shadow) ran beside it; False when something did; None when unknown.
    ``group``: outputs that agree share one; None when the run gave no answer (``error``).
    """

    name: str  # primary | shadow | cold-N | prime | warm-N | reference-N
    target: str  # same | reference
    cache: str
    alone: bool | None
    group: int | None
    inflight: int | None = None  # detproxy's client requests in flight when it was sent
    identity: str | None = None  # the upstream's fingerprint when it ran
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "target": self.target,
            "cache": self.cache,
            "alone": self.alone,
            "group": self.group,
            "inflight": self.inflight,
            "identity": self.identity,
        }
        if self.error is not None:
            out["error"] = self.error
        return out


@dataclass(frozen=True, slots=True)
class Parted:
    """Where two groups' outputs part: the first divergent position (token index, or
    character index without logprobs), None when unknown."""

    group_a: int
    group_b: int
    position: int | None


@dataclass(frozen=True, slots=True)
class Evidence:
    verdict: str  # the audit's: logprob_drift | text_divergence | answer_divergence
    level: str  # text | logprobs | first_token: what "agree" meant
    runs: tuple[Run, ...]
    cold_method: str | None  # cache_salt | cache_prompt | None: no way to run cold
    speculative: bool | None  # the upstream says it runs speculative decoding
    missing: tuple[str, ...] = ()  # what the experiments could not gather, and why
    parted: tuple[Parted, ...] = ()
    # The token limit the replays ran with (None: the request set none), and the first tokens
    # every run was compared over when replays were cut short (None: whole outputs).
    replay_max_tokens: int | None = None
    compared_tokens: int | None = None

    def run(self, name: str) -> Run | None:
        for r in self.runs:
            if r.name == name:
                return r
        return None


@dataclass(frozen=True, slots=True)
class Attribution:
    cause: str  # one of CAUSES
    reason: str  # in words: the evidence that decided
    missing: tuple[str, ...] = ()  # for unknown: the evidence that would have decided


def evidence_record(evidence: Evidence, attribution: Attribution) -> dict[str, Any]:
    """``cause_evidence`` as the incident carries it."""
    return {
        "reason": attribution.reason,
        "missing": list(attribution.missing),
        "level": evidence.level,
        "cold_method": evidence.cold_method,
        "speculative": evidence.speculative,
        "runs": [r.as_dict() for r in evidence.runs],
        "groups": len({r.group for r in evidence.runs if r.group is not None}),
        "parted": [
            {"groups": [p.group_a, p.group_b], "position": p.position} for p in evidence.parted
        ],
        "replay_max_tokens": evidence.replay_max_tokens,
        "compared_tokens": evidence.compared_tokens,
    }
