"""The deterministic pseudo-model.

At every position the candidate set and its pseudo-logits are a pure function of (prompt key,
position, previous token id, recently generated tokens), so the same request always produces the
same tokens and bit-identical logprobs unless an injection fires. Reported logprobs are the raw
distribution (vLLM's default ``raw_logprobs`` mode: before penalties and temperature).

Injections, as measured on GPUs (shared/reference/gpu-llama-server.md):

- logprob drift: from one position to the end of the answer every reported logprob moves (the
  chosen token's by up to about 1 nat, typically 0.05-0.5; others in the top-k by up to about
  3), while the chosen tokens, and so the text, stay the same;
- batch effects: under concurrency a greedy choice's logprobs drift from the step the batch
  hit it (with a probability that grows with the number of requests in flight), and its text
  diverges (the rank-2 token becomes the argmax) at a position among the first ten;
- a flip: the rank-2 token at a fixed position.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass
from typing import Any, Literal

import xxhash

from .injections import InjectionKind, InjectionRecord
from .vocab import Piece, vocabulary

Channel = Literal["reasoning", "content"]

CANDIDATES = 24
RECENT = 3
DRIFT_AMPLITUDE = 1.5  # nats of logit noise at most (see the module docstring)
GREEDY_EPS = 1e-5
_LOOP_MARGIN = 2.5
_TWO53 = float(1 << 53)


@dataclass(frozen=True, slots=True)
class Candidate:
    token_id: int
    text: str
    logprob: float


@dataclass(frozen=True, slots=True)
class Step:
    """One generated token with its raw distribution (best first)."""

    position: int
    channel: Channel
    token_id: int
    text: str
    logprob: float
    candidates: tuple[Candidate, ...]


@dataclass(frozen=True, slots=True)
class Sampling:
    temperature: float
    top_p: float = 1.0
    top_k: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS or self.top_k == 1

    @property
    def penalised(self) -> bool:
        return (
            self.presence_penalty > 0 or self.frequency_penalty > 0 or self.repetition_penalty > 1.0
        )


@dataclass(frozen=True, slots=True)
class LoopPlan:
    channel: Channel
    after_tokens: int
    unit: tuple[Piece, ...]
    detect_repeats: int | None = None


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    request_id: str
    index: int
    prompt_key: int
    max_tokens: int
    reasoning_tokens: int
    natural_tokens: int | None
    flip_position: int | None = None
    drift_from: int | None = None  # logprob drift from this position on
    loop: LoopPlan | None = None
    # Batch effects: per-in-flight-request slope of the divergence probability (None: off),
    # the choice's uniform draw, and the first position they can hit.
    batch_slope: float | None = None
    batch_draw: float = 1.0
    batch_from: int = 0
    drift_seed: int = 0
    loop_escaped: bool = False  # a loop was due, and a penalty or temperature ended it
    # Recipe-dependent divergences (greedy only): the runner-up token at this position because
    # the prompt was found in the prefix cache (warm), or because speculative decoding is on.
    warm_position: int | None = None
    warm_cached_tokens: int = 0
    speculative_position: int | None = None


def prompt_key(model: str, text: str) -> int:
    return int(xxhash.xxh64_intdigest(f"{model}\x00{text}".encode()))


def natural_length(key: int) -> int:
    """Number of content tokens the model emits before its pseudo-EOS (12..60)."""
    return 12 + (key >> 11) % 49


def raw_logits(key: int, position: int, prev: int, recent: tuple[int, ...]) -> dict[int, float]:
    """Pseudo-logits over the candidate set at one position (a pure function)."""
    h = int(xxhash.xxh64_intdigest(f"{position}:{prev}".encode(), seed=key))
    size = len(vocabulary())
    logits: dict[int, float] = {}
    i = 0
    while len(logits) < CANDIDATES:
        v = int(xxhash.xxh64_intdigest(i.to_bytes(8, "little"), seed=h))
        i += 1
        tid = v % size
        if tid in logits:
            continue
        u = (v >> 11) / _TWO53
        logits[tid] = 1.0 + 4.0 * u if not logits else -9.0 * u
    for j, tid in enumerate(recent):
        v = int(xxhash.xxh64_intdigest((1000 + j).to_bytes(8, "little"), seed=h))
        value = -2.0 + 4.0 * ((v >> 11) / _TWO53)
        logits[tid] = max(logits.get(tid, -math.inf), value)
    return logits


def log_softmax(logits: dict[int, float]) -> list[tuple[int, float]]:
    """(token id, logprob) sorted best first (ties broken by token id)."""
    top = max(logits.values())
    lse = top + math.log(math.fsum(math.exp(v - top) for v in logits.values()))
    return sorted(((t, v - lse) for t, v in logits.items()), key=lambda tv: (-tv[1], tv[0]))


def _unit(seed: int, position: int, token_id: int) -> float:
    return (int(xxhash.xxh64_intdigest(f"{position}:{token_id}".encode(), seed=seed)) >> 11) / (
        _TWO53
    )


def drifted(
    logits: dict[int, float], seed: int, position: int, keep: int, force: bool = False
) -> dict[int, float]:
    """Logits moved by seeded noise of up to DRIFT_AMPLITUDE nats, token ``keep`` still the
    highest when it was (a greedy choice stays the argmax), or made the highest (``force``)."""
    amp = DRIFT_AMPLITUDE * (0.4 + 0.6 * _unit(seed, position, -1))
    out = {t: v + (2.0 * _unit(seed, position, t) - 1.0) * amp for t, v in logits.items()}
    if force or logits[keep] >= max(logits.values()):
        cap = out[keep] - 0.01
        for t, v in out.items():
            if t != keep and v > cap:
                out[t] = cap
    return out


class ChoiceGenerator:
    """Generates the tokens of one choice, one ``step`` at a time."""

    def __init__(self, plan: ChoicePlan, sampling: Sampling, rng: random.Random) -> None:
        self.plan = plan
        self.sampling = sampling
        self._rng = rng
        self.position = 0
        self._prev = -1
        self._counts: Counter[int] = Counter()
        self._recent: tuple[int, ...] = ()
        self._channel_counts: Counter[str] = Counter()
        self._loop_emitted = 0
        self._drift_from = plan.drift_from
        self._batch_p: float | None = None  # the batch effect's probability, once it hit
        self._batch_at: int | None = None  # where its text diverged
        self.finish_reason: str | None = None
        self.stop_reason: str | None = None
        self.events: list[InjectionRecord] = []
        self.texts: list[str] = []

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def _event(self, kind: InjectionKind, detail: dict[str, Any], inflight: int) -> None:
        rec = InjectionRecord(
            self.plan.request_id, kind, self.plan.index, self.position, detail, inflight
        )
        self.events.append(rec)

    def _channel(self) -> Channel:
        loop = self.plan.loop
        if loop is not None and loop.channel == "reasoning":
            return "reasoning"
        return "reasoning" if self.position < self.plan.reasoning_tokens else "content"

    def _loop_piece(self, channel: Channel) -> Piece | None:
        loop = self.plan.loop
        if loop is None or loop.channel != channel:
            return None
        if self._channel_counts[channel] < loop.after_tokens:
            return None
        return loop.unit[self._loop_emitted % len(loop.unit)]

    def _finish(self, reason: str, stop_reason: str | None = None) -> None:
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def _due(self) -> tuple[str, str | None] | None:
        """The (finish_reason, stop_reason) the choice ends with before its next token, if any."""
        plan = self.plan
        if self.position >= plan.max_tokens:
            return ("length", None)
        channel = self._channel()
        piece = self._loop_piece(channel)
        loop = plan.loop
        natural = plan.natural_tokens
        endless = loop is not None and (piece is not None or loop.channel == channel)
        stop_at = None if endless or natural is None else plan.reasoning_tokens + natural
        if stop_at is not None and self.position >= stop_at:
            return ("stop", None)
        repeats = None if loop is None or piece is None else loop.detect_repeats
        if (
            loop is not None
            and repeats is not None
            and self._loop_emitted >= len(loop.unit) * repeats
        ):
            return ("repetition", "repetition_detected")
        return None

    def finish_due(self) -> bool:
        """Whether the choice is over (or ends before producing another token): the engine
        knows this with the last token, so that token's chunk carries ``finish_reason``."""
        return self.done or self._due() is not None

    def step(self, inflight: int) -> Step | None:
        """Produce the next token, or None (and set finish_reason) when the choice is over."""
        if self.done:
            return None
        due = self._due()
        if due is not None:
            if due[0] == "repetition":
                assert self.plan.loop is not None
                self._event(
                    "engine_repetition", {"repeats": self.plan.loop.detect_repeats}, inflight
                )
            self._finish(*due)
            return None
        channel = self._channel()
        return self._generate(channel, self._loop_piece(channel), inflight)

    def _generate(self, channel: Channel, piece: Piece | None, inflight: int) -> Step:
        plan = self.plan
        pos = self.position
        logits = raw_logits(plan.prompt_key, pos, self._prev, self._recent)
        extra_text: dict[int, str] = {}
        if piece is not None:
            logits[piece.token_id] = max(logits.values()) + _LOOP_MARGIN
            extra_text[piece.token_id] = piece.text
            if self._loop_emitted == 0 and plan.loop is not None:
                detail = {
                    "channel": channel,
                    "unit": "".join(p.text for p in plan.loop.unit),
                    "after_tokens": plan.loop.after_tokens,
                }
                self._event("loop", detail, inflight)
        chosen = self._choose(logits, inflight, piece)
        if pos == plan.drift_from:
            amplitude = {"from_position": pos, "amplitude_nats": DRIFT_AMPLITUDE}
            self._event("logprob_jitter", amplitude, inflight)
        if self._drift_from is not None and pos >= self._drift_from:
            # A batch divergence is drift that made the rank-2 token the argmax.
            logits = drifted(logits, plan.drift_seed, pos, chosen, pos == self._batch_at)
        dist = log_softmax(logits)
        vocab = vocabulary()

        def text_of(tid: int) -> str:
            return extra_text.get(tid) or vocab.text(tid)

        cands = tuple(Candidate(t, text_of(t), lp) for t, lp in dist)
        chosen_lp = next(c.logprob for c in cands if c.token_id == chosen)
        step = Step(pos, channel, chosen, text_of(chosen), chosen_lp, cands)
        self._advance(step, piece is not None)
        return step

    def batch_probability(self, inflight: int) -> float:
        """The chance that batch composition changes this choice: min(1, slope * others)."""
        slope = self.plan.batch_slope
        if slope is None:
            return 0.0
        return min(1.0, slope * max(inflight - 1, 0))

    def _choose(self, logits: dict[int, float], inflight: int, piece: Piece | None) -> int:
        if piece is not None:
            return piece.token_id  # stuck in the loop: a penalty or temperature did not help
        s = self.sampling
        processed = self._penalised(logits)
        order = sorted(processed, key=lambda t: (-processed[t], t))
        if not s.greedy:
            return self._sample(processed, order)
        pos = self.position
        plan = self.plan
        if pos == plan.flip_position:
            self._event("flip", self._flip_detail(order), inflight)
            return order[1]
        if pos == plan.warm_position:
            detail = self._flip_detail(order) | {"cached_tokens": plan.warm_cached_tokens}
            self._event("prefix_cache", detail, inflight)
            return order[1]
        if pos == plan.speculative_position:
            self._event("speculative", self._flip_detail(order), inflight)
            return order[1]
        if self._batch_p is None:
            p = self.batch_probability(inflight)
            if plan.batch_draw < p:
                # The batch changed this request's numerics: its logprobs drift from here on,
                # and its text diverges at the first near-tie (position batch_from or later).
                self._batch_p = p
                self._event("batch_drift", {"probability": p}, inflight)
                if self._drift_from is None or self._drift_from > pos:
                    self._drift_from = pos
        if self._batch_p is not None and self._batch_at is None and pos >= plan.batch_from:
            self._batch_at = pos
            detail = self._flip_detail(order) | {"probability": self._batch_p}
            self._event("batch_divergence", detail, inflight)
            return order[1]
        return order[0]

    def _flip_detail(self, order: list[int]) -> dict[str, Any]:
        vocab = vocabulary()
        return {
            "from_token_id": order[0],
            "to_token_id": order[1],
            "from_token": vocab.text(order[0]),
            "to_token": vocab.text(order[1]),
        }

    def _penalised(self, logits: dict[int, float]) -> dict[int, float]:
        s = self.sampling
        if not s.penalised and s.repetition_penalty == 1.0:
            return logits
        out = dict(logits)
        for tid, value in logits.items():
            count = self._counts.get(tid, 0)
            if count == 0:
                continue
            rp = s.repetition_penalty
            v = value / rp if value > 0 else value * rp
            out[tid] = v - s.frequency_penalty * count - s.presence_penalty
        return out

    def _sample(self, processed: dict[int, float], order: list[int]) -> int:
        s = self.sampling
        if s.top_k > 0:
            order = order[: s.top_k]
        top = processed[order[0]]
        weights = [math.exp((processed[t] - top) / s.temperature) for t in order]
        total = math.fsum(weights)
        if s.top_p < 1.0:
            keep, acc = 0, 0.0
            for w in weights:
                keep += 1
                acc += w / total
                if acc >= s.top_p:
                    break
            order, weights = order[:keep], weights[:keep]
            total = math.fsum(weights)
        r = self._rng.random() * total
        for tid, w in zip(order, weights, strict=True):
            r -= w
            if r <= 0:
                return tid
        return order[-1]

    def _advance(self, step: Step, looping: bool) -> None:
        self.position += 1
        self._prev = step.token_id
        self._counts[step.token_id] += 1
        self._channel_counts[step.channel] += 1
        if looping:
            self._loop_emitted += 1
        if step.token_id < len(vocabulary()):
            recent = [t for t in self._recent if t != step.token_id]
            self._recent = (*recent, step.token_id)[-RECENT:]
        self.texts.append(step.text)
