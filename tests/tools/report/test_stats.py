"""The statistics behind ``detproxy report``: Wilson intervals, quantiles, histograms."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.tools.report.stats import (
    delta_summary,
    histogram,
    position_summary,
    proportion,
    quantile,
    wilson,
)


def test_wilson_known_values() -> None:
    zero = wilson(0, 10)
    assert zero is not None
    assert zero[0] == 0.0
    assert zero[1] == pytest.approx(0.2775, abs=5e-5)
    half = wilson(5, 10)
    assert half is not None
    assert half[0] == pytest.approx(0.2366, abs=5e-5)
    assert half[1] == pytest.approx(0.7634, abs=5e-5)
    full = wilson(10, 10)
    assert full is not None
    assert full[0] == pytest.approx(1 - 0.2775, abs=5e-5)
    assert full[1] == 1.0


def test_wilson_no_trials_and_bad_counts() -> None:
    assert wilson(0, 0) is None
    with pytest.raises(ValueError):
        wilson(11, 10)
    with pytest.raises(ValueError):
        wilson(-1, 10)


@given(st.integers(min_value=1, max_value=10_000), st.data())
def test_wilson_contains_the_estimate(n: int, data: st.DataObject) -> None:
    k = data.draw(st.integers(min_value=0, max_value=n))
    ci = wilson(k, n)
    assert ci is not None
    low, high = ci
    assert 0.0 <= low <= k / n <= high <= 1.0
    mirror = wilson(n - k, n)
    assert mirror is not None
    assert mirror[0] == pytest.approx(1 - high, abs=1e-12)


def test_proportion_names_its_denominator() -> None:
    p = proportion(3, 12, "comparable")
    assert p["count"] == 3 and p["denominator"] == 12 and p["of"] == "comparable"
    assert p["rate"] == 0.25
    assert proportion(0, 0, "audited")["rate"] is None
    assert proportion(0, 0, "audited")["ci_low"] is None


def test_quantile_interpolates() -> None:
    assert quantile([5.0], 0.9) == 5.0
    assert quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert quantile([0.0, 10.0], 0.9) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        quantile([], 0.5)


def test_histogram_bucket_edges() -> None:
    got = histogram([0, 1, 3, 4, 15, 16, 63, 64, 255, 256, 10_000])
    assert [(b["bucket"], b["count"]) for b in got] == [
        ("0", 1),
        ("1-3", 2),
        ("4-15", 2),
        ("16-63", 2),
        ("64-255", 2),
        ("256+", 2),
    ]


def test_position_and_delta_summaries() -> None:
    pos = position_summary([7, 0, 3], [0.05, None, 0.1])
    assert (pos["count"], pos["min"], pos["median"], pos["max"]) == (3, 0, 3, 7)
    assert pos["near_tie"] == {"threshold_nats": 0.1, "count": 1, "with_margin": 2, "share": 0.5}
    empty = position_summary([], [])
    assert empty["median"] is None and empty["near_tie"]["share"] is None
    d = delta_summary([None, 1.0, 3.0])
    assert d["count"] == 2 and d["null"] == 1 and d["p50"] == 2.0 and d["max"] == 3.0
    assert math.isclose(d["p90"], 2.8)
