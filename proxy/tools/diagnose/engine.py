"""Which engine answers: its kind and version, as ``proxy.engine.fingerprint`` reads them
(``/version``, ``/props``), else the kind from ``/v1/models``' ``owned_by``.

How to run it cold is the triage's one choice (``proxy.attribution.cold.cold_method``, auto):
vLLM (and the emulator) a fresh ``cache_salt`` per request, llama.cpp's server
``cache_prompt: false``; the request fields are ``proxy.attribution.experiments``'
``cold_body``/``warm_body``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from proxy.attribution.cold import cold_method
from proxy.config import AuditConfig
from proxy.engine import fingerprint
from proxy.engine.identity import Fingerprint

VLLM, LLAMA_CPP, UNKNOWN = "vllm", "llama.cpp", "unknown"


@dataclass(frozen=True, slots=True)
class Engine:
    kind: str  # vllm, llama.cpp or unknown
    version: str | None
    fingerprint: str  # the fingerprint's identity digest: what runs, as the endpoints say it
    identity: dict[str, Any]

    reading: Fingerprint  # what was read, its kind as told above

    @property
    def cold_method(self) -> str | None:
        """cache_salt, cache_prompt or None: the triage's choice (auto) for this engine."""
        return cold_method("auto", self.reading, AuditConfig())

    @property
    def can_run_cold(self) -> bool:
        return self.cold_method is not None

    @property
    def how_cold(self) -> str:
        method = self.cold_method
        if method == "cache_salt":
            return "a fresh cache_salt per request"
        if method == "cache_prompt":
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
    return Engine(kind, fp.version, fp.fingerprint, dict(fp.identity), replace(fp, kind=kind))
