"""From the evidence to one verdict per cause (pure).

A prompt counts for a cause only when the switch that cause names is the one difference, as
live triage decides it: per prompt and per switch, the runs that differ in that switch alone
are expressed as triage's ``Run``s, grouped with its comparator (``agree``, at the logprobs
level: diagnose compares outputs bit for bit) and read by its decider
(``proxy.attribution.decide``). ``intrinsic``: the serial cold replays at batch 1 (or the
prefill probe's vectors) alone; ``batch``: those and the replays beside fillers at one level;
``prefix_cache``: those, the priming run (cold, its own salt) and the warm replays alone;
``speculative``: those and the reference's replays (the operator's --reference is this recipe
without speculation). ``recipe_change`` when the upstream's identity moved while diagnose ran.
A divergence no switch explains is ``unknown``, with what was missing. The numbers (spreads,
margins, positions) are diagnose's own.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.attribution.decide import decide as decide_switch
from proxy.attribution.evidence import CAUSES, Attribution, Evidence, Run
from proxy.attribution.experiments import agree
from proxy.audit.compare import compare_choices
from proxy.audit.outcome import ChoiceOutcome
from proxy.tools.diagnose.engine import Engine
from proxy.tools.diagnose.experiments import PromptEvidence
from proxy.tools.probe import Vector, summarise

FOUND, NOT_FOUND, NOT_TESTED, UNDECIDED = "found", "not_found", "not_tested", "unknown"

RECOMMENDATIONS = {
    "intrinsic": (
        "run-to-run nondeterminism alone at batch 1 is a bug (a kernel race, e.g. a racy top-k"
        " or split-K reduction): report it to the engine with these numbers (the prefill probe"
        " reproduces it in seconds) and patch or switch the kernel (attention/sampler backend);"
        " batch-invariant modes do not fix a race."
    ),
    "batch": (
        "the price of dynamic batching: accept it (audit answers, not bits), or run a"
        " batch-invariant mode (vLLM VLLM_BATCH_INVARIANT=1, SGLang"
        " --enable-deterministic-inference; llama.cpp per-slot KV, --no-kv-unified) at 20-60%"
        " of throughput by vLLM's and SGLang's own measurements."
    ),
    "prefix_cache": (
        "a prefix-cache hit is not bit-identical to a cold prefill: give each tenant its own"
        " cache_salt (vLLM) so no tenant's answer depends on another's cache, or turn caching"
        " off for audited traffic (vLLM --no-enable-prefix-caching, llama.cpp"
        " cache_prompt: false), at the cost of recomputed prefills."
    ),
    "speculative": (
        "the upstream and the reference differ while each agrees with itself: speculative"
        " decoding (or another recipe difference between them) is not output-equivalent to"
        " plain greedy; switch it off for traffic that must reproduce, or accept it and declare"
        " it ([upstream.expect] speculative)."
    ),
    "recipe_change": (
        "the upstream's identity changed while diagnose ran (a restart, a new model or"
        " version): the other verdicts mix two recipes; run again on a steady upstream."
    ),
    "unknown": "divergence no single switch explains: run again with what is missing.",
}


@dataclass(frozen=True, slots=True)
class Spread:
    """A group of replays against its first one."""

    runs: int
    distinct: int  # bitwise-distinct outputs (tokens and logprobs)
    distinct_texts: int
    first_position: int | None  # first divergent token index over the group (None: identical)
    margin: float | None  # top-1 minus top-2 logprob of the first run there
    max_delta: float | None  # nats, over common identical-token prefixes

    @property
    def agrees(self) -> bool:
        return self.distinct == 1


def _text(choice: ChoiceOutcome) -> str:
    return choice.reasoning + "\x00" + choice.content


def spread(base: ChoiceOutcome, group: Sequence[ChoiceOutcome]) -> Spread:
    """``group`` against ``base`` (``base`` counts as one of the outputs)."""
    outputs = {base, *group}
    texts = {_text(c) for c in outputs}
    first: int | None = None
    margin: float | None = None
    delta: float | None = 0.0
    for other in group:
        if other == base:
            continue
        v = compare_choices(base, other)
        if v.divergence is not None and (first is None or v.divergence.index < first):
            first, margin = v.divergence.index, v.divergence.margin
        if v.max_abs_logprob_delta is None:
            continue
        delta = max(delta or 0.0, v.max_abs_logprob_delta)
    return Spread(len(group) + 1, len(outputs), len(texts), first, margin, delta)


def self_spread(group: Sequence[ChoiceOutcome]) -> Spread:
    return spread(group[0], group[1:])


def vector_margin(vector: Vector) -> float | None:
    values = sorted((v for _, v in vector[1] if v is not None and math.isfinite(v)), reverse=True)
    return values[0] - values[1] if len(values) >= 2 else None


@dataclass(frozen=True, slots=True)
class CauseVerdict:
    cause: str
    status: str  # found, not_found, not_tested, unknown
    prompts_tested: int = 0
    prompts_affected: int = 0
    distinct_outputs: int = 0  # the most distinct outputs one affected prompt gave
    text_changed: int = 0  # affected prompts whose text (not only logprobs) changed
    first_position: int | None = None  # tokens, the earliest over affected prompts
    margins: tuple[float, ...] = ()  # top-1 minus top-2 at each affected prompt's divergence
    max_delta: float | None = None  # nats
    evidence: tuple[str, ...] = ()  # one line per affected prompt
    missing: str | None = None  # what could not be measured
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def recommendation(self) -> str | None:
        return RECOMMENDATIONS[self.cause] if self.status == FOUND else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "cause": self.cause,
            "status": self.status,
            "prompts_tested": self.prompts_tested,
            "prompts_affected": self.prompts_affected,
            "distinct_outputs": self.distinct_outputs,
            "text_changed": self.text_changed,
            "first_divergent_position": self.first_position,
            "margins": list(self.margins),
            "max_delta_nats": self.max_delta,
            "evidence": list(self.evidence),
            "missing": self.missing,
            "recommendation": self.recommendation,
            **self.detail,
        }


class _Tally:
    """The affected prompts of one cause, folded into a verdict."""

    def __init__(self, cause: str) -> None:
        self.cause = cause
        self.tested = 0
        self.affected = 0
        self.distinct = 0
        self.text = 0
        self.first: int | None = None
        self.margins: list[float] = []
        self.delta: float | None = None
        self.lines: list[str] = []

    def add(self, index: int, what: str, s: Spread) -> None:
        self.affected += 1
        self.distinct = max(self.distinct, s.distinct)
        self.text += s.distinct_texts > 1
        if s.first_position is not None:
            self.first = (
                s.first_position if self.first is None else min(self.first, s.first_position)
            )
        if s.margin is not None:
            self.margins.append(s.margin)
        if s.max_delta is not None:
            self.delta = max(self.delta or 0.0, s.max_delta)
        self.lines.append(f"prompt {index + 1}: {what}: {describe(s)}")

    def verdict(
        self, missing: str | None = None, undecided: bool = False, **detail: Any
    ) -> CauseVerdict:
        if self.affected:
            status = FOUND
        elif undecided:
            status = UNDECIDED
        elif self.tested == 0:
            status = NOT_TESTED
        else:
            status = NOT_FOUND
        return CauseVerdict(
            self.cause,
            status,
            self.tested,
            self.affected,
            self.distinct,
            self.text,
            self.first,
            tuple(self.margins),
            self.delta,
            tuple(self.lines),
            missing,
            detail,
        )


def describe(s: Spread) -> str:
    parts = [f"{s.distinct} distinct of {s.runs}"]
    if s.distinct_texts > 1:
        parts.append(f"{s.distinct_texts} texts")
    elif s.distinct > 1:
        parts.append("same text, logprobs differ")
    if s.first_position is not None:
        parts.append(f"first divergent token {s.first_position}")
    if s.margin is not None:
        parts.append(f"margin {s.margin:.3g}")
    if s.max_delta is not None and s.distinct > 1:
        parts.append(f"max delta {s.max_delta:.3g} nats")
    return ", ".join(parts)


@dataclass(frozen=True, slots=True)
class Diagnosis:
    verdicts: tuple[CauseVerdict, ...]
    prompts: int

    @property
    def causes(self) -> tuple[CauseVerdict, ...]:
        return tuple(v for v in self.verdicts if v.status == FOUND)

    @property
    def stable(self) -> bool:
        return not self.causes


def _prefill_spread(vectors: Sequence[Vector], prompt: str) -> Spread:
    r = summarise(prompt, 1, vectors, len(vectors))
    tokens = len(r.first_tokens)
    margin = vector_margin(vectors[0]) if vectors else None
    return Spread(
        len(vectors),
        r.distinct_vectors,
        tokens,
        0 if not r.stable else None,
        margin,
        r.max_abs_delta,
    )


# One run as diagnose made it: name, target, cache, alone, requests in flight, its output.
_Made = tuple[str, str, str, bool, int | None, Any]
LEVEL = "logprobs"  # diagnose tells outputs apart bit for bit: tokens and their logprobs


def _agree(a: ChoiceOutcome, b: ChoiceOutcome) -> bool:
    return agree(a, b, LEVEL, first_token_only=False)


def switch(
    made: Sequence[_Made],
    cold_method: str | None,
    speculative: bool | None = None,
    same: Callable[[Any, Any], bool] = _agree,
) -> Attribution:
    """Triage's decider on the runs of one switch: outputs grouped as triage groups them (the
    first run of a group stands for it)."""
    representatives: list[Any] = []
    runs: list[Run] = []
    for name, target, cache, alone, inflight, output in made:
        group = next((g for g, rep in enumerate(representatives) if same(rep, output)), None)
        if group is None:
            group = len(representatives)
            representatives.append(output)
        runs.append(Run(name, target, cache, alone, group, inflight))
    return decide_switch(Evidence("logprob_drift", LEVEL, tuple(runs), cold_method, speculative))


class _Decider:
    """Walks the prompts once, each tally taking what its switch shows (triage's decider on
    the runs that differ in that switch alone)."""

    def __init__(self, engine: Engine, reference_given: bool = False) -> None:
        self.engine = engine
        self.method = engine.cold_method
        # --reference is the same recipe without speculation: the operator's word that the
        # upstream speculates where the reference does not.
        self.speculative = True if reference_given else None
        self.intrinsic = _Tally("intrinsic")
        self.batch = _Tally("batch")
        self.cache = _Tally("prefix_cache")
        self.spec = _Tally("speculative")
        self.unknown = _Tally("unknown")
        self.unknown_missing: list[str] = []
        self.prefill: list[dict[str, Any]] = []
        self.batch_levels: set[int] = set()

    def serial(self, i: int, ev: PromptEvidence) -> bool:
        """Intrinsic (or unknown) from the prefill probe and the serial replays; True when
        this prompt's serial replays cannot serve as the reference of the other switches."""
        self.intrinsic.tested += 1
        pre = _prefill_spread(ev.prefill, ev.prompt) if ev.prefill else None
        if pre is not None:
            self.prefill.append(
                {
                    "prompt": i + 1,
                    "distinct_vectors": pre.distinct,
                    "first_token_flips": pre.distinct_texts > 1,
                    "max_delta_nats": pre.max_delta,
                    "margin": pre.margin,
                }
            )
        ser = self_spread(ev.serial)
        cold = self.engine.can_run_cold
        if switch(self._alone(ev), self.method).cause == "intrinsic":
            # Without a way to run cold, the first replay may have prefilled cold and the rest
            # warm: only the later ones, among themselves, show a race.
            later = ser if cold or len(ev.serial) <= 2 else self_spread(ev.serial[1:])
            self.intrinsic.add(
                i, "serial cold replays" if cold else "serial replays after the first", later
            )
            return True
        if cold:
            probe = [
                (f"prefill-{k + 1}", "same", "cold", True, None, v)
                for k, v in enumerate(ev.prefill)
            ]
            if pre is not None and switch(probe, self.method, same=operator.eq).cause == (
                "intrinsic"
            ):
                self.intrinsic.add(i, "prefill probe", pre)
                return True
            return False
        if not ser.agrees:
            self.unknown.add(i, "the first serial replay differs from the later ones", ser)
            self.unknown_missing.append(
                f"prompt {i + 1}: intrinsic or prefix_cache ({self.engine.how_cold})"
            )
            return True
        return False

    def _alone(self, ev: PromptEvidence) -> list[_Made]:
        """The serial replays, alone, one at a time: cold; without a way to run cold, the
        first of unknown cache state and the later ones after it (warm, where it caches)."""
        cold = self.engine.can_run_cold
        return [
            (
                f"cold-{k + 1}" if cold else f"replay-{k + 1}",
                "same",
                "cold" if cold else ("unknown" if k == 0 else "warm"),
                True,
                None,
                c,
            )
            for k, c in enumerate(ev.serial)
        ]

    def _other(self, i: int, what: str, found: Attribution, s: Spread) -> None:
        """Runs of one switch that differ where the decider names another cause (or none)."""
        self.unknown.add(i, f"{what} ({found.cause}: {found.reason})", s)
        why = "; ".join(found.missing) or found.reason
        self.unknown_missing.append(f"prompt {i + 1}: {what}: {why}")

    def concurrent(self, i: int, ev: PromptEvidence) -> None:
        if not ev.concurrent:
            return
        self.batch.tested += 1
        worst: Spread | None = None
        parted: list[int] = []
        # Without a way to run cold, they are sent as the later serial replays are.
        cache = "cold" if self.engine.can_run_cold else "warm"
        for level, group in sorted(ev.concurrent.items()):
            crowded: list[_Made] = [
                (f"crowded-{level}-{k + 1}", "same", cache, False, level, c)
                for k, c in enumerate(group)
            ]
            s = spread(ev.serial[0], group)
            if switch(self._alone(ev) + crowded, self.method).cause == "batch":
                parted.append(level)
                worst = s if worst is None or s.distinct > worst.distinct else worst
        if worst is not None:
            self.batch_levels.update(parted)
            self.batch.add(i, f"beside fillers at concurrency {','.join(map(str, parted))}", worst)

    def warm(self, i: int, ev: PromptEvidence) -> None:
        if ev.warm is None:
            return
        self.cache.tested += 1
        made = self._alone(ev)
        if ev.prime is not None:  # cold under the experiment's own salt, else not known
            cold = "cold" if self.method == "cache_salt" else "unknown"
            made.append(("prime", "same", cold, True, None, ev.prime))
        made += [(f"warm-{k + 1}", "same", "warm", True, None, c) for k, c in enumerate(ev.warm)]
        found = switch(made, self.method)
        s = spread(ev.serial[0], ev.warm)
        if found.cause == "prefix_cache":
            self.cache.add(i, "warm replays against cold", s)
        elif not s.agrees or not self_spread(ev.warm).agrees:
            self._other(i, "warm replays against cold", found, s)

    def reference(self, i: int, ev: PromptEvidence) -> None:
        if ev.reference is None:
            return
        own = self_spread(ev.reference)
        if not own.agrees:
            self.unknown.add(i, "reference replays differ among themselves", own)
            self.unknown_missing.append(f"prompt {i + 1}: a reference that agrees with itself")
            return
        self.spec.tested += 1
        made = self._alone(ev) + [
            (f"reference-{k + 1}", "reference", "cold", True, None, c)
            for k, c in enumerate(ev.reference)
        ]
        found = switch(made, self.method, self.speculative)
        s = spread(ev.serial[0], ev.reference[:1])
        if found.cause == "speculative":
            self.spec.add(i, "upstream against reference", s)
        elif not s.agrees:
            self._other(i, "upstream against reference", found, s)


def decide(
    evidence: Sequence[PromptEvidence],
    engine: Engine,
    levels: Sequence[int],
    identity_after: Engine | None = None,
    reference_given: bool = False,
) -> Diagnosis:
    d = _Decider(engine, reference_given)
    for i, ev in enumerate(evidence):
        if d.serial(i, ev):
            continue  # the other switches need serial replays that agree
        d.concurrent(i, ev)
        d.warm(i, ev)
        d.reference(i, ev)
    some = bool(evidence)
    concurrent = any(lv > 1 for lv in levels)
    verdicts = [
        d.intrinsic.verdict(
            None if engine.can_run_cold else f"cold replays: {engine.how_cold}",
            prefill=d.prefill,
        ),
        d.batch.verdict(
            "a level above 1 in --concurrency"
            if not concurrent
            else (None if d.batch.tested else "prompts whose serial replays agree"),
            undecided=some and concurrent and d.batch.tested == 0,
            levels=[lv for lv in levels if lv > 1],
            divergent_levels=sorted(d.batch_levels),
        ),
        d.cache.verdict(
            f"cold prefills: {engine.how_cold}"
            if not engine.can_run_cold
            else (None if d.cache.tested else "prompts whose serial replays agree"),
            undecided=some and engine.can_run_cold and d.cache.tested == 0,
        ),
        d.spec.verdict(
            "--reference (the same recipe without speculation)"
            if not reference_given
            else (None if d.spec.tested else "prompts that agree with themselves on both"),
            undecided=some and reference_given and d.spec.tested == 0,
        ),
        _recipe(evidence, engine, identity_after),
    ]
    d.unknown.tested = len(evidence)
    verdicts.append(d.unknown.verdict("; ".join(d.unknown_missing) or None))
    verdicts.sort(key=lambda v: CAUSES.index(v.cause))  # triage's one list, in its order
    return Diagnosis(tuple(verdicts), len(evidence))


def _recipe(
    evidence: Sequence[PromptEvidence], engine: Engine, after: Engine | None
) -> CauseVerdict:
    if after is None:
        return CauseVerdict("recipe_change", NOT_TESTED, missing="a reading after the replays")
    if after.fingerprint == engine.fingerprint:
        return CauseVerdict("recipe_change", NOT_FOUND, len(evidence))
    return CauseVerdict(
        "recipe_change",
        FOUND,
        len(evidence),
        len(evidence),
        evidence=(f"identity {engine.fingerprint} before, {after.fingerprint} after",),
        detail={"before": engine.identity, "after": after.identity},
    )
