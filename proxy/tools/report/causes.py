"""What each divergence cause (SPEC 1.14) means and what to do about it: the words that
``detproxy report`` and the incident explorer print beside the counts."""

from __future__ import annotations

from typing import Any

from proxy.attribution.evidence import CAUSES

UNTRIAGED = "untriaged"  # an audit incident that triage has not decided (yet, or ever)

MEANING = {
    "intrinsic": "serial cold replays at batch 1 differ from each other: a kernel race",
    "batch": "serial replays agree; it diverges only with other requests in the batch",
    "prefix_cache": "cold agrees with cold, warm with warm; cold differs from warm",
    "speculative": "with speculation and without it differ, each self-consistent",
    "recipe_change": "the upstream's identity (what loaded) changed between the two runs",
    "unknown": "the evidence did not decide",
    UNTRIAGED: "triage has not reached this incident",
}

ACTION = {
    "intrinsic": "a bug: report it to the engine with the evidence and patch or pin the kernel;"
    " this pages",
    "batch": "the price of dynamic batching: accept it, or run batch-invariant mode (20-60% less"
    " throughput); paged only when the recipe is declared batch_invariant",
    "prefix_cache": "set cache_salt per tenant, or turn prefix caching off for audited traffic",
    "speculative": "switch speculative decoding off, or accept that it is not greedy-equivalent",
    "recipe_change": "check what loaded (detproxy report's engine section, /detproxy/status"
    " engine) against what was declared",
    "unknown": "supply the missing evidence named on each incident (a quiet moment, a longer"
    " [attribution] max_wait_s or a larger budget, the engine's cached-token count, a reference"
    " upstream); later incidents of the same request are triaged with it, or run detproxy"
    " diagnose",
    UNTRIAGED: "raise [attribution] triage_rate or its budgets to reach more incidents",
}


def cause_order(cause: str) -> tuple[int, str]:
    """The known causes in SPEC order, then any other name, then untriaged."""
    if cause == UNTRIAGED:
        return (len(CAUSES) + 1, cause)
    return (CAUSES.index(cause), cause) if cause in CAUSES else (len(CAUSES), cause)


def missing_evidence(evidence: Any) -> str | None:
    """What an ``unknown`` verdict says was missing, in one line (None where it says nothing)."""
    if not isinstance(evidence, dict):
        return None
    for key in ("missing", "missing_evidence", "why"):
        value = evidence.get(key)
        if isinstance(value, str) and value:
            return value
        if isinstance(value, list | tuple) and value:
            return ", ".join(str(v) for v in value)
    return None
