"""``[upstream.expect]`` held against what the engine loaded.

A declared field the engine did not reveal is *unknown*, not a mismatch (never guess). A
failed start is not a recipe: it mismatches nothing by itself (the fields it did reveal
before dying are still checked); the failed start is its own incident upstream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from dataclasses import field as _field
from typing import Any

from proxy.engine.facts import EngineFacts

EXPECT_KEYS: frozenset[str] = frozenset(
    {
        "attention_backend",
        "moe_backend",
        "linear_backend",
        "quantization",
        "dtype",
        "kv_cache_dtype",
        "cudagraphs",
        "enforce_eager",
        "prefix_caching",
        "chunked_prefill",
        "speculative",
        "batch_invariant",
        "unknown_env",
    }
)
_BOOLS = frozenset(
    {"cudagraphs", "enforce_eager", "prefix_caching", "chunked_prefill", "batch_invariant"}
)
_DTYPES = {
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "float": "float32",
    "fp32": "float32",
    "f16": "float16",
    "f32": "float32",
}


@dataclass(frozen=True, slots=True)
class Mismatch:
    field: str
    expected: Any
    loaded: Any
    # What a measurement saw (an active check's account, proxy.engine.invariance), where the
    # fact came from one; not part of what the mismatch is.
    evidence: Mapping[str, Any] | None = _field(default=None, compare=False, hash=False)


def norm_text(value: Any) -> str:
    """Case-folded, ``torch.``/``AttentionBackendEnum.`` stripped, dtype aliases resolved."""
    text = str(value).strip().lower()
    for prefix in ("torch.", "attentionbackendenum."):
        if text.startswith(prefix):
            text = text[len(prefix) :]
    text = text.replace("-", "_")
    if text in ("none", "null", ""):
        return "none"
    return _DTYPES.get(text, text)


def _same(field: str, expected: Any, loaded: Any) -> bool:
    if field in _BOOLS:
        return bool(expected) is bool(loaded)
    if field == "speculative":
        if isinstance(expected, bool):
            return expected is (loaded not in (None, False))
        return loaded not in (None, False) and norm_text(expected) == norm_text(loaded)
    return norm_text(expected) == norm_text(loaded)


def check(
    expect: Mapping[str, Any], facts: EngineFacts
) -> tuple[tuple[Mismatch, ...], tuple[str, ...]]:
    """(mismatches, unknown fields), both in the order ``expect`` declares them. Keys outside
    EXPECT_KEYS are ignored here (the config refuses them)."""
    mismatches: list[Mismatch] = []
    unknown: list[str] = []
    for key, expected in expect.items():
        if key not in EXPECT_KEYS:
            continue
        if key == "unknown_env":
            # false: none allowed; true: some are expected (a mismatch when there are none? no:
            # true allows them). The log says every unknown variable, so none said is "none".
            if expected is False and facts.unknown_env:
                mismatches.append(Mismatch(key, (), facts.unknown_env))
            continue
        loaded = facts.values.get(key)
        if loaded is None:
            unknown.append(key)
        elif not _same(key, expected, loaded):
            mismatches.append(Mismatch(key, expected, loaded))
    return tuple(mismatches), tuple(unknown)


def mismatch_record(m: Mismatch) -> dict[str, Any]:
    """A mismatch as status, incidents and log lines show it (with the evidence of a measured
    one)."""
    record: dict[str, Any] = {"field": m.field, "expected": m.expected, "loaded": m.loaded}
    if m.evidence is not None:
        record["evidence"] = dict(m.evidence)
    return record
