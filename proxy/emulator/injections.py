"""Injection records and the per-app mutable state (counters, records, the injection RNG)."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Literal

InjectionKind = Literal[
    "flip",
    "logprob_jitter",
    "batch_divergence",
    "loop",
    "engine_repetition",
    "fault",
    "nan_logprobs",
]


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
    running: int = 0
    completed: int = 0
    aborted: int = 0
    faulted: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: Counter[str] = field(default_factory=Counter)
    records: list[InjectionRecord] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def record(self, rec: InjectionRecord) -> None:
        self.records.append(rec)

    def stats(self) -> dict[str, int]:
        return {
            "running": self.running,
            "completed": self.completed,
            "aborted": self.aborted,
            "faulted": self.faulted,
            "requests": self.requests,
        }

    def injections(self) -> list[dict[str, Any]]:
        return [r.to_dict() for r in self.records]

    def reset(self) -> None:
        """Clear records and counters (the running gauge reflects live requests and stays)."""
        self.rng = random.Random(self.seed)
        self.completed = self.aborted = self.faulted = self.requests = 0
        self.prompt_tokens = self.generation_tokens = 0
        self.finished.clear()
        self.records.clear()
