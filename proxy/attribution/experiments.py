"""The follow-up experiments of one divergent audit, and the evidence they give.

Runs, one at a time (``Runner`` waits for a quiet moment before each and says whether the run
was alone): serial cold replays (a fresh ``cache_salt`` each on vLLM-like engines,
``cache_prompt: false`` on llama.cpp's server), stopping early once they disagree; then a
priming run and warm replays (the same request without a salt); then replays to the reference
upstream, where one is configured. Outputs are grouped with the audit's own comparator
(``proxy.audit.compare``) at the audit's level: text for a text or answer divergence, the
logprobs too for a logprob drift, the first token only in prefill mode.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.attribution.case import Diverged, TriageCase
from proxy.attribution.evidence import Evidence, Parted, Run
from proxy.audit.compare import compare_choices
from proxy.audit.outcome import ChoiceOutcome, Outcome


@dataclass(frozen=True, slots=True)
class Observed:
    """One run as it went: its answer (None: ``error`` says why none came)."""

    name: str
    target: str  # same | reference
    cache: str  # cold | warm | unknown
    alone: bool | None
    inflight: int | None
    identity: str | None
    outcome: Outcome | None
    error: str | None = None


class GaveUp(Exception):
    """No run could be made: ``reason`` (quiet_deadline, ...) is what was missing."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class Runner(Protocol):
    async def run(
        self, name: str, target: str, cache: str, body: Mapping[str, Any]
    ) -> Observed: ...


def cold_body(body: Mapping[str, Any], method: str | None) -> dict[str, Any]:
    out = dict(body)
    if method == "cache_salt":
        out["cache_salt"] = uuid.uuid4().hex
    elif method == "cache_prompt":
        out["cache_prompt"] = False
    return out


def warm_body(body: Mapping[str, Any], method: str | None) -> dict[str, Any]:
    """The request as a client sends it: no salt of triage's (the client's own stays), the
    prompt cache on."""
    out = dict(body)
    if method == "cache_prompt":
        out["cache_prompt"] = True
    return out


def _choice(outcome: Outcome | None, index: int) -> ChoiceOutcome | None:
    if outcome is None or outcome.error is not None:
        return None
    for c in outcome.choices:
        if c.index == index:
            return c
    return None


def level_of(verdict: str) -> str:
    return "logprobs" if verdict == "logprob_drift" else "text"


def agree(a: ChoiceOutcome, b: ChoiceOutcome, level: str, first_token_only: bool) -> bool:
    found = compare_choices(a, b, first_token_only=first_token_only).verdict
    if found == "identical":
        return True
    return level == "text" and found == "logprob_drift"


def _position(a: ChoiceOutcome, b: ChoiceOutcome, first_token_only: bool) -> int | None:
    divergence = compare_choices(a, b, first_token_only=first_token_only).divergence
    return divergence.index if divergence is not None else None


def disagree_already(
    runs: list[Observed], diverged: tuple[Diverged, ...], first_token_only: bool
) -> bool:
    """Cold runs disagree for every diverged choice: no more runs are needed."""
    for d in diverged:
        level = level_of(d.verdict)
        choices = [c for c in (_choice(r.outcome, d.choice) for r in runs) if c is not None]
        if not any(not agree(choices[0], c, level, first_token_only) for c in choices[1:]):
            return False
    return True


def observed_of_audit(
    case: TriageCase, primary_identity: str | None, shadow_identity: str | None
) -> list[Observed]:
    """The primary and the shadow as runs: the primary's cache state is never known (it ran
    as the client sent it) and whether others shared its batch is known only when they were
    in flight as it started or ended (alone between the two is not known)."""
    reference = case.target != "same"
    crowd = max(case.primary_inflight, case.primary_inflight_end)
    return [
        Observed(
            "primary",
            "same",
            "unknown",
            False if crowd > 1 else None,
            crowd,
            primary_identity,
            case.primary,
        ),
        Observed(
            "shadow",
            "reference" if reference else "same",
            "cold" if case.shadow_cold else "unknown",
            case.shadow_alone,
            case.shadow_inflight,
            None if reference else shadow_identity,
            case.shadow,
        ),
    ]


@dataclass(frozen=True, slots=True)
class Plan:
    cold_replays: int
    warm_replays: int
    reference_replays: int
    cold_method: str | None
    reference: bool  # a reference upstream is configured


async def run_experiments(
    case: TriageCase, plan: Plan, runner: Runner
) -> tuple[list[Observed], tuple[str, ...]]:
    """The replays, one at a time, and what could not be gathered; raises ``GaveUp`` when the
    first could not be made."""
    first_token_only = case.mode == "prefill"
    done: list[Observed] = []
    try:
        cold_state = "cold" if plan.cold_method is not None else "unknown"
        cold: list[Observed] = []
        for i in range(plan.cold_replays):
            body = cold_body(case.body, plan.cold_method)
            cold.append(await runner.run(f"cold-{i + 1}", "same", cold_state, body))
            done.append(cold[-1])
            if len(cold) >= 2 and disagree_already(cold, case.diverged, first_token_only):
                return done, ()  # intrinsic: the other experiments cannot change that
        if plan.cold_method is not None and plan.warm_replays > 0:
            done.append(await runner.run("prime", "same", "unknown", warm_body(case.body, None)))
            for i in range(plan.warm_replays):
                body = warm_body(case.body, plan.cold_method)
                done.append(await runner.run(f"warm-{i + 1}", "same", "warm", body))
        if plan.reference:
            for i in range(plan.reference_replays):
                body = cold_body(case.body, plan.cold_method)
                done.append(await runner.run(f"reference-{i + 1}", "reference", "cold", body))
    except GaveUp as exc:
        if not done:
            raise
        return done, (f"replays after the first {len(done)}: {exc.reason}",)
    return done, ()


def build_evidence(
    runs: list[Observed],
    diverged: Diverged,
    first_token_only: bool,
    cold_method: str | None,
    speculative: bool | None,
    missing: tuple[str, ...],
) -> Evidence:
    """Group the runs' outputs for one diverged choice (the first run of a group stands for
    it) and say where each group parts from the first."""
    level = level_of(diverged.verdict)
    representatives: list[ChoiceOutcome] = []
    out: list[Run] = []
    for r in runs:
        choice = _choice(r.outcome, diverged.choice)
        group: int | None = None
        error = r.error
        if choice is not None:
            for g, rep in enumerate(representatives):
                if agree(rep, choice, level, first_token_only):
                    group = g
                    break
            else:
                group = len(representatives)
                representatives.append(choice)
        elif error is None:
            error = f"no choice {diverged.choice}" if r.outcome is not None else "no answer"
        out.append(Run(r.name, r.target, r.cache, r.alone, group, r.inflight, r.identity, error))
    parted = tuple(
        Parted(0, g, _position(representatives[0], rep, first_token_only))
        for g, rep in enumerate(representatives[1:], start=1)
    )
    return Evidence(
        diverged.verdict,
        level + (" (first token)" if first_token_only else ""),
        tuple(out),
        cold_method,
        speculative,
        missing,
        parted,
    )
