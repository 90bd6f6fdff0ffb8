"""The follow-up experiments of one divergent audit, and the evidence they give.

Runs, one at a time (``Runner`` waits for a quiet moment before each and says whether the run
was alone): serial cold replays (a fresh ``cache_salt`` each on vLLM-like engines,
``cache_prompt: false`` on llama.cpp's server), stopping early once they disagree; then a
priming run and warm replays (the same request without a salt); then replays to the reference
upstream, where one is configured. Outputs are grouped with the audit's own comparator
(``proxy.audit.compare``) at the audit's level: text for a text or answer divergence, the
logprobs too for a logprob drift, the first token only in prefill mode.

Replays stop shortly after the point that matters (``replay_limit``): ``margin`` tokens past
the first token where the audit's primary and shadow parted. Every run, the full-length primary
and shadow among them, is then compared over that window only (``compare_runs``): a run cut by
its limit agrees with a longer one that is the same over the tokens it has, while one that
stopped (end of sequence) inside the window still differs from one that went on. Variation that
begins only past the window is not seen: the cause found is that of the divergence the audit
saw, and the evidence names the window.

A duplicate request's earlier answer is known by its digests only (``Earlier``): the replays
are grouped with it by their own digests at the audit's level (token or text hash, the logprob
hash too for a logprob drift), so they run whole (a digest is not compared with a prefix).
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.attribution.case import Diverged, TriageCase
from proxy.attribution.evidence import Evidence, Parted, Run
from proxy.audit.auditor import compare_digests
from proxy.audit.compare import Verdict, compare_choices
from proxy.audit.outcome import ChoiceOutcome, Outcome
from proxy.audit.store import ChoiceDigest, digest_choice

# The fields that bound a request's generation (chat takes either; completions max_tokens).
LIMIT_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclass(frozen=True, slots=True)
class Observed:
    """One run as it went: its answer (None: ``error`` says why none came, or, for a run known
    by its digests only, a duplicate's earlier answer, ``digests`` stand for it)."""

    name: str
    target: str  # same | reference
    cache: str  # cold | warm | unknown
    alone: bool | None
    inflight: int | None
    identity: str | None
    outcome: Outcome | None
    error: str | None = None
    digests: tuple[ChoiceDigest, ...] | None = None  # per choice, in order


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


def warm_body(
    body: Mapping[str, Any], method: str | None, salt: str | None = None
) -> dict[str, Any]:
    """The request with the prompt cache on. On a salted engine, under ``salt``: one of the
    experiment's own, shared by its priming run and its warm replays, so they read the cache
    the priming run wrote alone, never what the primary's prefill left in the client's
    tenant (a batched primary's cache read back warm reproduces the primary: real vLLM 0.23,
    H100, 2026-12-07)."""
    out = dict(body)
    if method == "cache_prompt":
        out["cache_prompt"] = True
    elif method == "cache_salt" and salt is not None:
        out["cache_salt"] = salt
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


def divergent_position(case: TriageCase, diverged: Diverged) -> int | None:
    """The first token index where the audit's primary and shadow parted on this choice (the
    audit's own comparison); None where it is not a token index (no logprobs on a side)."""
    primary, shadow = _choice(case.primary, diverged.choice), _choice(case.shadow, diverged.choice)
    if primary is None or shadow is None or primary.tokens is None or shadow.tokens is None:
        return None
    divergence = compare_choices(
        primary, shadow, first_token_only=case.mode == "prefill"
    ).divergence
    return divergence.index if divergence is not None else None


def _lists_every_token(outcome: Outcome) -> bool:
    """The logprobs list every token the usage counts (one each may go unlisted: an end of
    sequence): else a token index is not a position in what max_tokens counts (an engine
    that leaves the reasoning's tokens out), and a cut could end before it."""
    if outcome.completion_tokens is None:
        return True
    listed = sum(len(c.tokens) for c in outcome.choices if c.tokens is not None)
    return listed + len(outcome.choices) >= outcome.completion_tokens


def replay_limit(case: TriageCase, margin: int) -> int | None:
    """The token limit the replays run with: ``margin`` tokens past the last of the diverged
    choices' first divergent tokens, where that is below the request's own limit. None: the
    replays run whole (a prefill audit, already one token; an answer divergence, decided by
    the whole answer; a position not known, or not one max_tokens counts to; a request limit
    as short or not an integer; a duplicate, whose earlier answer is a digest of the whole)."""
    if case.mode == "prefill" or case.earlier is not None or not case.diverged:
        return None
    if not (_lists_every_token(case.primary) and _lists_every_token(case.shadow)):
        return None
    positions: list[int] = []
    for d in case.diverged:
        if d.verdict == "answer_divergence":
            return None
        position = divergent_position(case, d)
        if position is None:
            return None
        positions.append(position)
    window = max(positions) + 1 + margin
    for key in LIMIT_FIELDS:
        own = case.body.get(key)
        if own is None:
            continue
        if not isinstance(own, int) or isinstance(own, bool) or own <= window:
            return None
    return window


def request_limit(body: Mapping[str, Any]) -> int | None:
    """The limit a request sets itself (max_completion_tokens before max_tokens, as vLLM
    reads them); None where it sets none."""
    for key in reversed(LIMIT_FIELDS):
        own = body.get(key)
        if isinstance(own, int) and not isinstance(own, bool):
            return own
    return None


def limited_body(body: Mapping[str, Any], limit: int | None) -> dict[str, Any]:
    """``body`` with its limit (each of ``LIMIT_FIELDS`` it sets; max_tokens where it sets
    none) at ``limit``; unchanged for None. ``replay_limit`` only gives limits below the
    request's own."""
    out = dict(body)
    if limit is None:
        return out
    present = [key for key in LIMIT_FIELDS if body.get(key) is not None]
    for key in present or ["max_tokens"]:
        out[key] = limit
    return out


def _cut(choice: ChoiceOutcome, n: int) -> ChoiceOutcome:
    """The choice as a run cut after its first ``n`` tokens would have ended."""
    tokens = choice.tokens
    if tokens is None or len(tokens) <= n:
        return choice
    return ChoiceOutcome(
        choice.index, choice.content, choice.reasoning, tokens[:n], "length", choice.stop_reason
    )


def _text_prefix(short: ChoiceOutcome, long: ChoiceOutcome) -> bool:
    if not short.content:
        return long.reasoning.startswith(short.reasoning)
    return short.reasoning == long.reasoning and long.content.startswith(short.content)


def _within(a: ChoiceOutcome, b: ChoiceOutcome, window: int) -> tuple[ChoiceOutcome, ChoiceOutcome]:
    """Both choices over the first ``window`` tokens, and a choice cut short by a limit
    (finish ``length``) against the other over its own tokens only."""
    if a.tokens is not None and b.tokens is not None:
        a, b = _cut(a, window), _cut(b, window)
        assert a.tokens is not None and b.tokens is not None
        shorter = a if len(a.tokens) < len(b.tokens) else b
        assert shorter.tokens is not None
        if len(a.tokens) != len(b.tokens) and shorter.finish_reason == "length":
            a, b = _cut(a, len(shorter.tokens)), _cut(b, len(shorter.tokens))
        return a, b
    # Without tokens on a side (a replay that lost its logprobs): by text, a run cut by its
    # limit against the same text of the other.
    size_a = len(a.reasoning) + len(a.content)
    size_b = len(b.reasoning) + len(b.content)
    if size_a == size_b:
        return a, b
    short_c, long_c = (a, b) if size_a < size_b else (b, a)
    if short_c.finish_reason != "length" or not _text_prefix(short_c, long_c):
        return a, b
    cut = ChoiceOutcome(
        long_c.index, short_c.content, short_c.reasoning, None, "length", long_c.stop_reason
    )
    return (short_c, cut) if short_c is a else (cut, short_c)


def compare_runs(
    a: ChoiceOutcome, b: ChoiceOutcome, first_token_only: bool, window: int | None = None
) -> Verdict:
    """The audit's comparator over the runs' first ``window`` tokens (None: whole)."""
    if window is not None and not first_token_only:
        a, b = _within(a, b, window)
    return compare_choices(a, b, first_token_only=first_token_only)


def agree(
    a: ChoiceOutcome,
    b: ChoiceOutcome,
    level: str,
    first_token_only: bool,
    window: int | None = None,
) -> bool:
    found = compare_runs(a, b, first_token_only, window).verdict
    if found == "identical":
        return True
    return level == "text" and found == "logprob_drift"


def _position(
    a: ChoiceOutcome, b: ChoiceOutcome, first_token_only: bool, window: int | None
) -> int | None:
    divergence = compare_runs(a, b, first_token_only, window).divergence
    return divergence.index if divergence is not None else None


def disagree_already(
    runs: list[Observed],
    diverged: tuple[Diverged, ...],
    first_token_only: bool,
    window: int | None = None,
) -> bool:
    """Cold runs disagree for every diverged choice: no more runs are needed."""
    for d in diverged:
        level = level_of(d.verdict)
        choices = [c for c in (_choice(r.outcome, d.choice) for r in runs) if c is not None]
        if not any(not agree(choices[0], c, level, first_token_only, window) for c in choices[1:]):
            return False
    return True


def observed_of_audit(
    case: TriageCase, primary_identity: str | None, shadow_identity: str | None
) -> list[Observed]:
    """The primary and the shadow as runs: the primary's cache state is known where the engine
    reported its cached prompt tokens (vLLM's ``--enable-prompt-tokens-details``: it ran as the
    client sent it), or, cold, where the client's own ``cache_salt`` had never been sent
    before; whether others shared its batch only when they were in flight as it started or
    ended (alone between the two is not known). A duplicate's earlier answer stands where the
    shadow would (``earlier``), known by its digests, in what conditions the store recorded
    (``shadow_identity``: the upstream's identity when it ran, None where not known)."""
    reference = case.target != "same"
    crowd = max(case.primary_inflight, case.primary_inflight_end)
    cached = case.primary.cached_tokens
    if cached is None and case.primary_cold_salt:
        cached = 0
    primary = Observed(
        "primary",
        "same",
        "unknown" if cached is None else "warm" if cached > 0 else "cold",
        False if crowd > 1 else None,
        crowd,
        primary_identity,
        case.primary,
    )
    earlier = case.earlier
    if earlier is not None:
        crowded = earlier.inflight is not None and earlier.inflight > 1
        return [
            primary,
            Observed(
                "earlier",
                "same",
                earlier.cache,
                False if crowded else None,
                earlier.inflight,
                shadow_identity,
                None,
                digests=earlier.digests,
            ),
        ]
    return [
        primary,
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
    limit: int | None = None  # the replays' token limit (replay_limit); None: the request's


async def run_experiments(
    case: TriageCase, plan: Plan, runner: Runner
) -> tuple[list[Observed], tuple[str, ...]]:
    """The replays, one at a time, and what could not be gathered; raises ``GaveUp`` when the
    first could not be made."""
    first_token_only = case.mode == "prefill"
    request = limited_body(case.body, plan.limit)
    done: list[Observed] = []
    try:
        cold_state = "cold" if plan.cold_method is not None else "unknown"
        cold: list[Observed] = []
        for i in range(plan.cold_replays):
            body = cold_body(request, plan.cold_method)
            cold.append(await runner.run(f"cold-{i + 1}", "same", cold_state, body))
            done.append(cold[-1])
            if len(cold) >= 2 and disagree_already(
                cold, case.diverged, first_token_only, plan.limit
            ):
                return done, ()  # intrinsic: the other experiments cannot change that
        if plan.cold_method is not None and plan.warm_replays > 0:
            salt = uuid.uuid4().hex
            # Under a salt of its own the priming run is cold; llama.cpp's slot may hold the
            # prompt from the cold replays, so there it is of unknown state.
            prime_state = "cold" if plan.cold_method == "cache_salt" else "unknown"
            prime = warm_body(request, plan.cold_method, salt)
            done.append(await runner.run("prime", "same", prime_state, prime))
            for i in range(plan.warm_replays):
                body = warm_body(request, plan.cold_method, salt)
                done.append(await runner.run(f"warm-{i + 1}", "same", "warm", body))
        if plan.reference:
            for i in range(plan.reference_replays):
                body = cold_body(request, plan.cold_method)
                done.append(await runner.run(f"reference-{i + 1}", "reference", "cold", body))
    except GaveUp as exc:
        if not done:
            raise
        return done, (f"replays after the first {len(done)}: {exc.reason}",)
    return done, ()


def _digest(run: Observed, index: int) -> ChoiceDigest | None:
    """A run known by its digests: the one of choice ``index`` (digests are in choice order)."""
    digests = run.digests
    if run.outcome is not None or digests is None or not 0 <= index < len(digests):
        return None
    return digests[index]


def agree_digests(a: ChoiceDigest, b: ChoiceDigest, level: str) -> bool:
    """Two outputs known by digests agree at ``level`` as the duplicate check would call them
    identical (text) or identical but for their logprobs (text level only). Same tokens with
    a logprob not known agree on the text only."""
    found = compare_digests(a, b).verdict
    if found == "identical":
        return True
    return level == "text" and found in ("logprob_drift", "incomparable")


def _agree_any(
    a: ChoiceOutcome | ChoiceDigest,
    b: ChoiceOutcome | ChoiceDigest,
    level: str,
    first_token_only: bool,
    window: int | None,
) -> bool:
    """``agree`` where both are outputs; by digests where either is known by its digest only
    (never over a window: a digest is of the whole output)."""
    if isinstance(a, ChoiceOutcome) and isinstance(b, ChoiceOutcome):
        return agree(a, b, level, first_token_only, window)
    assert window is None, "a digest is compared whole"
    da = a if isinstance(a, ChoiceDigest) else digest_choice(a)
    db = b if isinstance(b, ChoiceDigest) else digest_choice(b)
    return agree_digests(da, db, level)


def _position_any(
    a: ChoiceOutcome | ChoiceDigest,
    b: ChoiceOutcome | ChoiceDigest,
    first_token_only: bool,
    window: int | None,
) -> int | None:
    if isinstance(a, ChoiceOutcome) and isinstance(b, ChoiceOutcome):
        return _position(a, b, first_token_only, window)
    return None  # a digest says they differ, not where


def build_evidence(
    runs: list[Observed],
    diverged: Diverged,
    first_token_only: bool,
    cold_method: str | None,
    speculative: bool | None,
    missing: tuple[str, ...],
    *,
    limit: int | None = None,
    request_limit: int | None = None,
) -> Evidence:
    """Group the runs' outputs for one diverged choice (the first run of a group stands for
    it) over the replays' ``limit`` tokens (None: whole) and say where each group parts from
    the first. ``request_limit``: the limit the request itself set, for the record."""
    level = level_of(diverged.verdict)
    representatives: list[ChoiceOutcome | ChoiceDigest] = []
    out: list[Run] = []
    for r in runs:
        choice = _choice(r.outcome, diverged.choice) or _digest(r, diverged.choice)
        group: int | None = None
        error = r.error
        if choice is not None:
            for g, rep in enumerate(representatives):
                if _agree_any(rep, choice, level, first_token_only, limit):
                    group = g
                    break
            else:
                group = len(representatives)
                representatives.append(choice)
        elif error is None:
            error = f"no choice {diverged.choice}" if r.outcome is not None else "no answer"
        out.append(Run(r.name, r.target, r.cache, r.alone, group, r.inflight, r.identity, error))
    parted = tuple(
        Parted(0, g, _position_any(representatives[0], rep, first_token_only, limit))
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
        limit if limit is not None else request_limit,
        limit,
    )
