"""From recorded windows to the report: per-run figures, per-level spread, warnings."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from proxy.tools.sweep.load import Window

SCHEMA = "detproxy.sweep/1"


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _r(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(value, digits)


def _quantiles(values: Sequence[float]) -> dict[str, float | None]:
    return {"p50": _r(percentile(values, 0.5)), "p95": _r(percentile(values, 0.95))}


def _ttfts(window: Window) -> list[float]:
    return [t for r in window.records if (t := r.ttft) is not None]


def _gaps(window: Window) -> list[float]:
    return [g for r in window.records for g in r.gaps]


def run_summary(window: Window) -> dict[str, Any]:
    tokens = window.tokens()
    errors = [r.error for r in window.records if r.error is not None]
    return {
        "repeat": window.repeat,
        "concurrency": window.concurrency,
        "window_s": _r(window.duration_s),
        "tokens": tokens,
        "tokens_per_s": _r(tokens / window.duration_s, 3),
        "requests": sum(1 for r in window.records if r.done),
        "cut": sum(1 for r in window.records if not r.done and r.error is None),
        "errors": len(errors),
        "error_samples": [msg for msg, _ in Counter(errors).most_common(3)],
        "ttft_s": _quantiles(_ttfts(window)),
        "itl_s": _quantiles(_gaps(window)),
    }


def level_summary(
    concurrency: int, windows: Sequence[Window], spread_warn: float
) -> dict[str, Any]:
    runs = [run_summary(w) for w in windows]
    rates = [float(run["tokens_per_s"]) for run in runs]
    mean = sum(rates) / len(rates)
    lo, hi = min(rates), max(rates)
    spread = (hi - lo) / mean if len(rates) > 1 and mean > 0 else None
    return {
        "concurrency": concurrency,
        "tokens_per_s": {
            "mean": _r(mean, 3),
            "min": _r(lo, 3),
            "max": _r(hi, 3),
            "spread": _r(spread, 4),
        },
        "spread_warning": spread is not None and spread > spread_warn,
        "ttft_s": _quantiles([t for w in windows for t in _ttfts(w)]),
        "itl_s": _quantiles([g for w in windows for g in _gaps(w)]),
        "requests": sum(run["requests"] for run in runs),
        "cut": sum(run["cut"] for run in runs),
        "errors": sum(run["errors"] for run in runs),
        "runs": runs,
    }


def warnings_for(
    levels: Sequence[dict[str, Any]], fingerprint: dict[str, Any], spread_warn: float
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if fingerprint["changed"]:
        before, after = fingerprint["before"], fingerprint["after"]
        out.append(
            {
                "kind": "fingerprint_changed",
                "message": "the upstream changed during the sweep (a redeploy or a silent"
                f" fallback): {describe(before)} -> {describe(after)}; the figures mix two"
                " configurations",
            }
        )
    for level in levels:
        c, rate = level["concurrency"], level["tokens_per_s"]
        if level["spread_warning"]:
            out.append(
                {
                    "kind": "wide_spread",
                    "concurrency": c,
                    "message": f"concurrency {c}: tok/s ranged {rate['min']:.1f} to"
                    f" {rate['max']:.1f} across repeats, a spread of {rate['spread']:.0%}"
                    f" (threshold {spread_warn:.0%}): an unstable configuration",
                }
            )
        if not rate["max"]:
            out.append(
                {
                    "kind": "no_tokens",
                    "concurrency": c,
                    "message": f"concurrency {c}: no output token arrived within any window"
                    " (try a longer --duration)",
                }
            )
        if level["errors"]:
            samples = {s for run in level["runs"] for s in run["error_samples"]}
            out.append(
                {
                    "kind": "errors",
                    "concurrency": c,
                    "message": f"concurrency {c}: {level['errors']} failed requests"
                    f" ({'; '.join(sorted(samples)[:2])})",
                }
            )
    return out


def describe(summary: dict[str, Any]) -> str:
    """``llama.cpp b1234 (fp 1a2b3c4d)`` from a ``Fingerprint.summary()``."""
    version = summary.get("version") or "?"
    return f"{summary.get('kind')} {version} (fp {summary.get('fingerprint')})"
