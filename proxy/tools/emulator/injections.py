"""Injection records and the per-app mutable state (counters, records, the injection RNG)."""

from __future__ import annotations

import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

from .vocab import Piece, vocabulary

InjectionKind = Literal[
    "flip",
    "logprob_jitter",
    "batch_drift",
    "batch_divergence",
    "loop",
    "engine_repetition",
    "fault",
    "nan_logprobs",
    "loop_escape",
    "prefix_cache",
    "speculative",
    # A continuation of a closed reasoning: detail {"endpoint", "reasoning"}, the reasoning
    # its prompt holds as the template rendered it ("" where the template dropped it).
    "closed_reasoning",
]


MAX_CACHED_BLOCKS = 200_000
MAX_PIECES = 200_000


@dataclass(frozen=True, slots=True)
class InjectionRecord:
    """One thing the emulator did on purpose to a request."""

    request_id: str
    kind: InjectionKind
    choice: int | None
    position: int | None
    detail: dict[str, Any]
    inflight: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "kind": self.kind,
            "choice": self.choice,
            "position": self.position,
            "detail": dict(self.detail),
            "inflight": self.inflight,
        }


@dataclass(slots=True)
class EmulatorState:
    """Everything one emulator app mutates while serving (one instance per app)."""

    seed: int
    rng: random.Random = field(init=False)
    # When this emulator's process started (a real server's process collector says so).
    started_at: float = field(default_factory=time.time)
    running: int = 0
    # What /metrics says is running: like vLLM's gauges, set once per engine step, so a request
    # just sent is not counted before its first token (prefill) and one just finished is not
    # counted after its last.
    running_reported: int = 0
    completed: int = 0
    aborted: int = 0
    faulted: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    records: list[InjectionRecord] = field(default_factory=list)
    # Prefix cache (vLLM counts tokens): queried prompt tokens, tokens found cached, and the
    # cached block hashes.
    prefix_queries: int = 0
    prefix_hits: int = 0
    cached_blocks: set[int] = field(default_factory=set)
    # How often each sampled (unseeded) request content was seen: the loop-escape "attempt".
    seen: Counter[int] = field(default_factory=Counter)
    # Speculative decoding: engine steps that drafted, tokens drafted, drafts accepted (and by
    # draft position).
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted: int = 0
    spec_accepted_per_pos: Counter[int] = field(default_factory=Counter)
    # The text of the token ids /tokenize handed out beyond the vocabulary (they are hashes):
    # a prompt of token ids reads back as its text.
    pieces: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def record(self, rec: InjectionRecord) -> None:
        self.records.append(rec)

    def prefix_lookup(self, tokens: int, blocks: tuple[int, ...], block_size: int) -> int:
        """Count one prompt's prefix-cache lookup and cache its blocks; return the hit tokens.

        Like vLLM, a hit is a run of leading full blocks, and the last prompt token is always
        computed (so a prompt is never wholly a hit)."""
        hits = 0
        for i, h in enumerate(blocks):
            if (i + 1) * block_size > tokens - 1 or h not in self.cached_blocks:
                break
            hits += block_size
        if len(self.cached_blocks) > MAX_CACHED_BLOCKS:
            self.cached_blocks.clear()  # eviction, crudely
        self.cached_blocks.update(blocks)
        self.prefix_queries += tokens
        self.prefix_hits += hits
        return hits

    def learn(self, pieces: list[Piece]) -> None:
        """Remember the text of ids /tokenize handed out."""
        if len(self.pieces) > MAX_PIECES:
            self.pieces.clear()
        for piece in pieces:
            self.pieces[piece.token_id] = piece.text

    def decode(self, ids: list[int]) -> str:
        """The text of token ids (an id never handed out reads as ``<id>``)."""
        vocab = vocabulary()
        return "".join(
            vocab.text(i) if 0 <= i < len(vocab) else self.pieces.get(i, f"<{i}>") for i in ids
        )

    def spec_step(self, accepted: int, drafted: int) -> None:
        """One engine step of one request with speculative decoding."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafted
        self.spec_accepted += accepted
        for pos in range(accepted):
            self.spec_accepted_per_pos[pos] += 1

    def stats(self) -> dict[str, int]:
        return {
            "running": self.running,
            "completed": self.completed,
            "aborted": self.aborted,
            "faulted": self.faulted,
            "requests": self.requests,
        }

    def injections(self, request_id: str | None = None) -> list[dict[str, Any]]:
        """The records, in the order they happened; only one request's with ``request_id`` (the
        X-Request-Id it was sent with: what was injected into that run, the truth a test reads
        per request)."""
        return [r.to_dict() for r in self.records if request_id in (None, r.request_id)]

    def reset(self) -> None:
        """Clear records and counters (the running gauge reflects live requests and stays)."""
        self.rng = random.Random(self.seed)
        self.completed = self.aborted = self.faulted = self.requests = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.finished.clear()
        self.records.clear()
        self.prefix_queries = self.prefix_hits = 0
        self.cached_blocks.clear()
        self.seen.clear()
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted = 0
        self.spec_accepted_per_pos.clear()
