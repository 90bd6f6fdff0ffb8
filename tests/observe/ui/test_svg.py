"""The charts' SVG: every y-axis label fits inside the chart (a fixed left margin cut
``100.00%`` off)."""

from __future__ import annotations

import re

import pytest

from proxy.observe.ui.overview import InflightPoint
from proxy.observe.ui.svg import MIN_LEFT, inflight_curve, label_px, left_edge, timeline
from proxy.observe.ui.timeline import Column


def y_labels(svg: str) -> list[tuple[float, str]]:
    """The right-aligned tick labels left of the plot: (their x, their text)."""
    return [
        (float(x), text)
        for x, text in re.findall(
            r'<text class="tick" x="([\d.]+)" y="[\d.]+" text-anchor="end">([^<]*)</text>', svg
        )
        if not text.startswith("rate ") and float(x) < MIN_LEFT * 2
    ]


@pytest.mark.parametrize("rate", [1.0, 0.5, 0.0123])
def test_the_inflight_curves_rate_label_fits_left_of_the_plot(rate: float) -> None:
    svg = inflight_curve([InflightPoint(1, 10_000, round(10_000 * rate), 0)])
    labels = y_labels(svg)
    assert [text for _, text in labels] == [f"{100 * rate:.2f}%", "0"]
    for x, text in labels:
        assert x - label_px(text) >= 0, f"{text!r} drawn from x={x - label_px(text):.1f}"


def test_the_timelines_count_label_fits_and_a_narrow_one_keeps_the_margin() -> None:
    cols = [Column(0.0, 60.0, (("text_divergence", 123456789),))]
    for x, text in y_labels(timeline(cols, (), 0.0, 60.0, False)):
        assert x - label_px(text) >= 0, text
    assert left_edge("0", "12") == MIN_LEFT


def test_a_label_is_measured_as_wider_than_the_common_fonts_draw_it() -> None:
    # DejaVu Sans at 10 px (the usual system-ui fallback on Linux): digits 6.4 px, "." 3.2 px,
    # "%" 9.5 px; "100.00%" is about 44 px wide, more than the 40 px the old margin left it.
    assert label_px("100.00%") >= 5 * 6.4 + 3.2 + 9.5
