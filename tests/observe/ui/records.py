"""Incident records as detproxy makes them (``proxy.observe.incidents``), for the UI tests."""

from __future__ import annotations

from typing import Any

from policies.base import Trigger
from proxy.audit.verdict import Divergence, Verdict
from proxy.events import AuditCompleted, LoopDetected, PolicyActed
from proxy.observe.incidents import acted, audit_incident, loop_incident

UPSTREAM = {"fingerprint": "0123456789abcdef", "kind": "vllm", "version": "0.17.1", "models": []}


def audit(
    rid: str = "req-1",
    *,
    ts: float = 1_700_000_000.0,
    model: str = "m1",
    mode: str = "full",
    verdict: str = "text_divergence",
    index: int = 3,
    tokens: tuple[str | None, str | None] = (" cat", " dog"),
    primary_top: tuple[tuple[str, float | None], ...] = ((" cat", -0.69), (" dog", -0.71)),
    shadow_top: tuple[tuple[str, float | None], ...] = ((" dog", -0.60), (" cat", -0.80)),
    margin: float | None = 0.02,
    delta: float | None = 0.31,
    texts: tuple[str, str] | None = None,
    prompt: str | None = None,
    inflight: int = 4,
    overlapped: bool | None = True,
    upstream: dict[str, Any] | None = UPSTREAM,
) -> dict[str, Any]:
    divergence = Divergence(index, tokens[0], tokens[1], primary_top, shadow_top, margin)
    v = Verdict(
        verdict=verdict,
        reason=None,
        divergence=divergence if verdict != "incomparable" else None,
        max_abs_logprob_delta=delta,
        primary_hash="a" * 32,
        shadow_hash="b" * 32,
        primary_tokens=16,
        shadow_tokens=16,
    )
    ev = AuditCompleted(
        request_id=rid,
        model=model,
        endpoint="chat",
        mode=mode,
        choice=0,
        verdict=v,
        request_key="k" * 32,
        inflight_primary=inflight,
        inflight_shadow=1,
        primary_latency_s=0.25,
        shadow_latency_s=0.5,
        target="same",
        timestamp=ts,
        shadow_overlapped=overlapped,
        prompt=prompt if texts is not None else None,
        primary_text=texts[0] if texts is not None else None,
        shadow_text=texts[1] if texts is not None else None,
    )
    record = audit_incident(ev)
    if upstream is not None:
        record["upstream"] = upstream
    return record


def loop(
    rid: str = "loop-1",
    *,
    ts: float = 1_700_000_100.0,
    model: str = "m1",
    unit: str | None = " and then the model repeats itself.",
    period: int = 35,
    repeats: int = 6,
    start_offset: int = 20,
    attempt: int = 1,
    action: str = "",
    outcome: str | None = None,
    strategy: str = "",
    retry_tokens: int | None = None,
) -> dict[str, Any]:
    """A loop as detected (``action``: what was decided), with ``outcome`` as the policy's
    ``PolicyActed`` gives it where known."""
    trigger = Trigger("proxy", "content", 0, period, repeats, start_offset, unit)
    ev = LoopDetected(rid, model, "chat", True, attempt, trigger, ts, action)
    record = loop_incident(ev, store_text=unit is not None)
    if outcome is not None:
        attempts = attempt + 1 if action == "retry" else attempt
        acted(record, PolicyActed(rid, model, action, outcome, attempts, strategy))
        record["retry_tokens"] = retry_tokens
    return record


def change(
    ts: float = 1_700_000_050.0, before: str = "0123456789abcdef", after: str = "fedcba9876543210"
) -> dict[str, Any]:
    return {
        "kind": "upstream_change",
        "ts": ts,
        "before": {
            "fingerprint": before,
            "kind": "vllm",
            "version": "0.17.1",
            "models": ["m1"],
            "identity": {"version": "0.17.1", "max_model_len": 4096},
        },
        "after": {
            "fingerprint": after,
            "kind": "vllm",
            "version": "0.17.2",
            "models": ["m1"],
            "identity": {"version": "0.17.2", "max_model_len": 4096},
        },
    }
