"""What an upstream says it is: one reading, the value ``proxy.engine.fingerprint`` makes.

A leaf module (it imports nothing of detproxy's), so that the events that carry a reading
(``proxy.events``) can import it while the module that reads it publishes them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Fingerprint:
    kind: str  # vllm | llama.cpp | unknown
    version: str | None
    models: tuple[str, ...]
    identity: Mapping[str, Any]  # what the hash covers
    load: Mapping[str, float] = field(default_factory=dict)  # gauges; not part of the hash
    fingerprint: str = ""
    read_at: float = 0.0

    def summary(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "kind": self.kind,
            "version": self.version,
            "models": list(self.models),
        }
