"""How to run a request cold (no prefix-cache hit) on the upstream: one choice, shared by the
triage's replays and the engine checks (``proxy.engine.invariance``)."""

from __future__ import annotations

from proxy.config import AuditConfig
from proxy.engine.identity import Fingerprint


def cold_method(chosen: str, current: Fingerprint | None, audit: AuditConfig) -> str | None:
    """``cache_salt`` (vLLM: a fresh salt each run), ``cache_prompt`` (llama.cpp's server:
    ``cache_prompt: false``) or None (no known way). ``chosen``: ``[attribution] cold_method``
    (auto, cache_salt, cache_prompt, none); auto goes by what the upstream says it is, then by
    what the operator set for shadows."""
    if chosen == "none":
        return None
    if chosen != "auto":
        return chosen
    if current is not None and current.kind == "vllm":
        return "cache_salt"
    if current is not None and current.kind == "llama.cpp":
        return "cache_prompt"
    if audit.cache_salt:
        return "cache_salt"  # the operator says the engine takes a salt
    if audit.shadow_extra_body.get("cache_prompt") is False:
        return "cache_prompt"
    return None
