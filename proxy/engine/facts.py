"""What an engine says it loaded: a frozen bag of named facts, where each was read, and the
warnings that matter (unknown and deprecated variables, fallbacks, a failed start).

A fact the engine did not say is absent (unknown), never guessed."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

FIELDS: tuple[str, ...] = (
    "engine",
    "version",
    "model",
    "dtype",
    "quantization",
    "attention_backend",
    "flash_attn_version",
    "moe_backend",
    "linear_backend",
    "compilation_mode",
    "cudagraph_mode",
    "cudagraphs",
    "enforce_eager",
    "prefix_caching",
    "chunked_prefill",
    "speculative",
    "speculative_draft",
    "num_speculative_tokens",
    "batch_invariant",
    "kv_cache_dtype",
    "non_default_args",
    "backends",  # llama.cpp: the ggml backends loaded
    "gpu_layers",  # llama.cpp: "N/M" layers offloaded
)
# What decides stability (and so the upstream's identity); the model and version are already in
# the fingerprint, the operator's arguments are how, not what.
RECIPE: tuple[str, ...] = tuple(f for f in FIELDS if f not in ("non_default_args",))
# The source of a fact detproxy measured (an active check, proxy.engine.invariance) rather than
# read from the engine's own account: what the engine does, not what it loaded, so not part of
# the recipe's digest.
CHECKED = "active_check"


def _union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(dict.fromkeys((*a, *b)))


def _canon(value: Any) -> str:
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k!s}:{_canon(value[k])}" for k in sorted(value, key=str)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_canon(v) for v in value) + "]"
    return repr(value)


@dataclass(frozen=True, slots=True)
class EngineFacts:
    values: Mapping[str, Any] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    unknown_env: tuple[str, ...] = ()
    deprecated: tuple[str, ...] = ()
    fallbacks: tuple[str, ...] = ()
    start_failed: bool = False

    def merged(self, other: EngineFacts) -> EngineFacts:
        """``other``'s known (not None) values win; the lists are united, order kept."""
        values = dict(self.values)
        sources = dict(self.sources)
        for key, value in other.values.items():
            if value is None:
                continue
            values[key] = value
            if key in other.sources:
                sources[key] = other.sources[key]
        return EngineFacts(
            values,
            sources,
            _union(self.unknown_env, other.unknown_env),
            _union(self.deprecated, other.deprecated),
            _union(self.fallbacks, other.fallbacks),
            self.start_failed or other.start_failed,
        )

    def ordered(self) -> dict[str, Any]:
        """The known values, FIELDS first in display order, then any others by name."""
        out = {k: self.values[k] for k in FIELDS if k in self.values}
        for k in sorted(self.values):
            out.setdefault(k, self.values[k])
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "facts": {k: _jsonable(v) for k, v in self.ordered().items()},
            "sources": dict(self.sources),
            "unknown_env": list(self.unknown_env),
            "deprecated": list(self.deprecated),
            "fallbacks": list(self.fallbacks),
            "start_failed": self.start_failed,
        }

    def digest(self) -> str:
        """xxh3-64 (hex) over the recipe's known values (not those measured: ``CHECKED``), the
        unknown variables, the fallbacks and a failed start: equal recipes, equal digests,
        whatever order they were read in."""
        parts = [
            f"{k}={_canon(self.values[k])}"
            for k in RECIPE
            if self.values.get(k) is not None and self.sources.get(k) != CHECKED
        ]
        parts.append("unknown_env=" + ",".join(sorted(self.unknown_env)))
        parts.append("fallbacks=" + ",".join(sorted(self.fallbacks)))
        parts.append(f"start_failed={self.start_failed}")
        return xxhash.xxh3_64_hexdigest("\n".join(parts).encode())


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [_jsonable(v) for v in value]
    return repr(value)
