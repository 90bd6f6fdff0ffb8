"""The statistics of a report: Wilson intervals, quantiles, position and delta summaries."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

Z95 = 1.959963984540054  # two-sided 95% normal quantile
NEAR_TIE_NATS = 0.1  # a divergence whose primary top-1/top-2 margin is below this is a near tie
BUCKETS: tuple[tuple[str, int, int | None], ...] = (
    ("0", 0, 0),
    ("1-3", 1, 3),
    ("4-15", 4, 15),
    ("16-63", 16, 63),
    ("64-255", 64, 255),
    ("256+", 256, None),
)


def wilson(k: int, n: int, z: float = Z95) -> tuple[float, float] | None:
    """The Wilson score interval of ``k`` successes in ``n`` trials; None when ``n`` is 0."""
    if n <= 0:
        return None
    if not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n, got k={k}, n={n}")
    p = k / n
    z2 = z * z
    denom = 1 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    low = 0.0 if k == 0 else max(0.0, center - half)
    high = 1.0 if k == n else min(1.0, center + half)
    return low, high


def proportion(k: int, n: int, of: str) -> dict[str, Any]:
    """``k`` of ``n`` (``of`` names the denominator) with its rate and 95% Wilson interval."""
    ci = wilson(k, n)
    return {
        "count": k,
        "denominator": n,
        "of": of,
        "rate": k / n if n else None,
        "ci_low": ci[0] if ci else None,
        "ci_high": ci[1] if ci else None,
    }


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); ``values`` sorted."""
    if not values:
        raise ValueError("quantile of no values")
    h = (len(values) - 1) * q
    lo = math.floor(h)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (h - lo) * (values[hi] - values[lo])


def histogram(positions: Sequence[int]) -> list[dict[str, Any]]:
    out = []
    for label, lo, hi in BUCKETS:
        n = sum(1 for p in positions if p >= lo and (hi is None or p <= hi))
        out.append({"bucket": label, "count": n})
    return out


def position_summary(positions: Sequence[int], margins: Sequence[float | None]) -> dict[str, Any]:
    """First divergent token indices of text/answer divergences, and how many were near ties."""
    values = sorted(positions)
    known = [m for m in margins if m is not None]
    ties = sum(1 for m in known if m < NEAR_TIE_NATS)
    return {
        "count": len(values),
        "min": values[0] if values else None,
        "median": quantile(values, 0.5) if values else None,
        "p90": quantile(values, 0.9) if values else None,
        "max": values[-1] if values else None,
        "histogram": histogram(values),
        "near_tie": {
            "threshold_nats": NEAR_TIE_NATS,
            "count": ties,
            "with_margin": len(known),
            "share": ties / len(known) if known else None,
        },
    }


def delta_summary(deltas: Sequence[float | None]) -> dict[str, Any]:
    """Quantiles of max |delta logprob| (nats); None values (unknown or +inf) counted apart."""
    values = sorted(d for d in deltas if d is not None)
    return {
        "count": len(values),
        "null": len(deltas) - len(values),
        "p50": quantile(values, 0.5) if values else None,
        "p90": quantile(values, 0.9) if values else None,
        "p99": quantile(values, 0.99) if values else None,
        "max": values[-1] if values else None,
    }
