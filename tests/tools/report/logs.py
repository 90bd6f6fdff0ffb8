"""Incident-log lines as detproxy writes them, for the report tests."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import orjson


def audit(
    rid: str,
    verdict: str,
    *,
    ts: float,
    model: str = "qwen3-8b",
    mode: str = "full",
    index: int | None = None,
    margin: float | None = None,
    delta: float | None = None,
    tokens: tuple[str | None, str | None] = ("yes", "no"),
) -> dict[str, Any]:
    divergence = None
    if index is not None:
        divergence = {
            "index": index,
            "primary_token": tokens[0],
            "shadow_token": tokens[1],
            "primary_top": [[tokens[0], -0.1], [tokens[1], -0.2]],
            "shadow_top": [[tokens[1], -0.1]],
            "margin": margin,
        }
    return {
        "kind": "audit",
        "ts": ts,
        "request_id": rid,
        "model": model,
        "endpoint": "/v1/chat/completions",
        "mode": mode,
        "choice": 0,
        "verdict": verdict,
        "reason": None,
        "divergence": divergence,
        "max_abs_logprob_delta": delta,
        "primary_hash": "a" * 32,
        "shadow_hash": "b" * 32,
        "primary_tokens": 40,
        "shadow_tokens": 41,
        "primary_answer": None,
        "shadow_answer": None,
        "request_key": "k",
        "inflight_primary": 1,
        "inflight_shadow": 0,
        "shadow_overlapped": False,
        "primary_latency_s": 0.5,
        "shadow_latency_s": 0.6,
        "target": "primary",
    }


def loop(rid: str, *, ts: float, model: str, channel: str, source: str) -> dict[str, Any]:
    return {
        "kind": "loop",
        "ts": ts,
        "request_id": rid,
        "model": model,
        "endpoint": "/v1/chat/completions",
        "stream": True,
        "attempt": 1,
        "source": source,
        "channel": channel,
        "choice": 0,
        "period": 4,
        "repeats": 12,
        "start_offset": 100,
    }


def tally(process: str, ts: float, audits: dict[str, Any], **rest: Any) -> dict[str, Any]:
    return {
        "kind": "tally",
        "process": process,
        "started": ts - 50,
        "ts": ts,
        "audits": audits,
        "loops": rest.get("loops", {}),
        "policy_actions": rest.get("policy_actions", {}),
        "shadows_dropped": rest.get("shadows_dropped", {}),
        **{k: rest[k] for k in ("recoveries", "recovery_tokens") if k in rest},
    }


def write(path: Path, items: list[dict[str, Any] | bytes], *, compress: bool = False) -> Path:
    body = b"".join(
        item if isinstance(item, bytes) else orjson.dumps(item) + b"\n" for item in items
    )
    path.write_bytes(gzip.compress(body) if compress else body)
    return path
