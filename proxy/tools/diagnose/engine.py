"""Which engine answers, and how to ask it for a cold or a warm prefill.

vLLM (and the emulator): a fresh ``cache_salt`` makes a request share no prefix-cache block;
without one, a replay after a priming request hits the cache. llama.cpp's server:
``cache_prompt: false`` recomputes the whole prompt, ``true`` reuses the slot's KV. The kind is
read as ``proxy.engine.fingerprint`` reads it (``/version``, ``/props``), else from
``/v1/models``' ``owned_by``.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from proxy.engine import fingerprint

VLLM, LLAMA_CPP, UNKNOWN = "vllm", "llama.cpp", "unknown"


@dataclass(frozen=True, slots=True)
class Engine:
    kind: str  # vllm, llama.cpp or unknown
    version: str | None
    fingerprint: str  # the fingerprint's identity digest: what runs, as the endpoints say it
    identity: dict[str, Any]

    @property
    def can_run_cold(self) -> bool:
        return self.kind in (VLLM, LLAMA_CPP)

    def cold(self) -> dict[str, Any]:
        """Fields that make one request miss every cache (a fresh salt each call)."""
        if self.kind == VLLM:
            return {"cache_salt": f"detproxy-diagnose-{uuid.uuid4().hex}"}
        if self.kind == LLAMA_CPP:
            return {"cache_prompt": False}
        return {}

    def warm(self) -> dict[str, Any]:
        """Fields that let a request reuse what an identical earlier one cached."""
        if self.kind == LLAMA_CPP:
            return {"cache_prompt": True}
        return {}

    @property
    def how_cold(self) -> str:
        if self.kind == VLLM:
            return "a fresh cache_salt per request"
        if self.kind == LLAMA_CPP:
            return "cache_prompt: false"
        return "no way known (engine not recognised from /version, /props or /v1/models)"


def _owned_by(models: Any) -> str | None:
    data = models.get("data") if isinstance(models, dict) else None
    for entry in data if isinstance(data, list) else []:
        if isinstance(entry, dict) and isinstance(entry.get("owned_by"), str):
            return str(entry["owned_by"]).lower()
    return None


def identify(version: Any, models: Any, props: Any) -> Engine:
    """From the bodies of ``/version``, ``/v1/models`` and ``/props`` (None where absent)."""
    fp = fingerprint.build(version, models, props, {}, None)
    kind = fp.kind
    if kind == UNKNOWN:
        owner = _owned_by(models)
        if owner == "vllm":
            kind = VLLM
        elif owner in ("llamacpp", "llama.cpp", "llama-cpp"):
            kind = LLAMA_CPP
    return Engine(kind, fp.version, fp.fingerprint, dict(fp.identity))
