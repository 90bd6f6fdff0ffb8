"""Inline SVG charts (strings): verdicts over time with the fingerprint band, the batch-effects
curve, top-k bars, a loop's repeats. Every label is escaped; colours come from CSS classes."""

from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from html import escape

import orjson

from proxy.observe.ui.incident import TopEntry
from proxy.observe.ui.overview import InflightPoint
from proxy.observe.ui.timeline import Column, Span

UNSTABLE = ("logprob_drift", "text_divergence", "answer_divergence", "incomparable")
MAX_LOOP_MARKS = 100
TICK_PX = 10  # the tick labels' font size (CSS .chart .tick)
# Widths of the labels' characters in ems, a little over those of common sans-serif fonts
# (the page names no font: the widest it may get); any other character: GLYPH_EM.
GLYPH_EMS = {".": 0.35, ",": 0.35, ":": 0.35, " ": 0.35, "%": 1.0, "+": 0.75}
GLYPH_EM = 0.65
MIN_LEFT = 44  # the plots' left edge when every label is narrower


def _clock(ts: float, span: float) -> str:
    moment = datetime.fromtimestamp(ts, UTC)
    return moment.strftime("%H:%M:%S" if span < 3 * 86400 else "%m-%d %H:%M")


def _f(x: float) -> str:
    return f"{x:.1f}"


def pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.2f}%"


def label_px(label: str) -> float:
    """How wide a tick label may be drawn, in px (an upper estimate)."""
    return TICK_PX * sum(GLYPH_EMS.get(c, GLYPH_EM) for c in label)


def left_edge(*labels: str) -> int:
    """The plot's left edge: room for the widest y-axis label, drawn right-aligned 4 px before
    it (a narrow fixed margin cut ``100.00%`` off at the chart's left side)."""
    return max(MIN_LEFT, math.ceil(max(map(label_px, labels), default=0.0)) + 8)


def timeline(
    cols: Sequence[Column],
    spans: Sequence[Span],
    start: float,
    end: float,
    with_denominators: bool,
) -> str:
    """Non-identical audits per column (stacked by verdict), the rate line where identical
    audits are counted too, and under it the upstream's fingerprint band."""
    width, height, top, plot_h, band_h = 760, 210, 10, 130, 22
    peak = max((sum(c.count(v) for v in UNSTABLE) for c in cols), default=0) or 1
    left = left_edge(str(peak), "0")
    plot_w = width - left - 10
    n = max(len(cols), 1)
    col_w = plot_w / n
    rates = [c.rate for c in cols] if with_denominators else []
    rate_peak = max((r for r in rates if r is not None), default=0.0) or 1.0
    out = [
        f'<svg class="chart timeline" viewBox="0 0 {width} {height}" role="img"'
        ' aria-label="verdicts over time">',
        f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{width - 10}"'
        f' y2="{top + plot_h}"/>',
        f'<text class="tick" x="{left - 4}" y="{top + 8}" text-anchor="end">{peak}</text>',
        f'<text class="tick" x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>',
    ]
    for i, col in enumerate(cols):
        y = float(top + plot_h)
        x = left + i * col_w
        for verdict in UNSTABLE:
            count = col.count(verdict)
            if not count:
                continue
            h = plot_h * count / peak
            y -= h
            tip = f"{count} {verdict} at {_clock(col.start, end - start)}"
            out.append(
                f'<rect class="bar v-{verdict}" x="{_f(x + 1)}" y="{_f(y)}"'
                f' width="{_f(max(col_w - 2, 1))}" height="{_f(h)}"><title>{escape(tip)}'
                "</title></rect>"
            )
    line = [
        (left + (i + 0.5) * col_w, top + plot_h - plot_h * r / rate_peak, r)
        for i, r in enumerate(rates)
        if r is not None
    ]
    if line:
        path = " ".join(f"{_f(px)},{_f(py)}" for px, py, _ in line)
        out.append(f'<polyline class="rate" points="{path}"/>')
        for px, py, r in line:
            out.append(
                f'<circle class="rate-dot" cx="{_f(px)}" cy="{_f(py)}" r="2.5"><title>'
                f"{pct(r)} not identical</title></circle>"
            )
        out.append(
            f'<text class="tick rate-tick" x="{width - 12}" y="{top + 8}" text-anchor="end">'
            f"rate {pct(rate_peak)}</text>"
        )
    scale = plot_w / (end - start) if end > start else 0.0
    band_y = top + plot_h + 8
    for i, span in enumerate(spans):
        until = spans[i + 1].first if i + 1 < len(spans) else max(span.last, end)
        x0 = left + (span.first - start) * scale
        x1 = max(left + (until - start) * scale, x0 + 2)
        label = f"{span.fingerprint} {span.kind or ''} {span.version or ''}".strip()
        out.append(
            f'<rect class="fp fp-{i % 4}" x="{_f(x0)}" y="{band_y}" width="{_f(x1 - x0)}"'
            f' height="{band_h}"><title>{escape(label)}</title></rect>'
            f'<text class="fp-label" x="{_f(x0 + 3)}" y="{band_y + 15}">'
            f"{escape(span.fingerprint[:8])}</text>"
        )
        if i:
            out.append(
                f'<line class="fp-change" x1="{_f(x0)}" y1="{top}" x2="{_f(x0)}"'
                f' y2="{band_y + band_h}"><title>upstream changed to {escape(label)}</title></line>'
            )
    if end > start:
        for frac, anchor in ((0.0, "start"), (0.5, "middle"), (1.0, "end")):
            ts = start + frac * (end - start)
            out.append(
                f'<text class="tick" x="{_f(left + frac * plot_w)}" y="{height - 4}"'
                f' text-anchor="{anchor}">{_clock(ts, end - start)}</text>'
            )
    out.append("</svg>")
    return "".join(out)


def inflight_curve(points: Sequence[InflightPoint]) -> str:
    """Per number of requests in flight at the primary: the non-identical rate (or, without
    denominators, the count of incidents), with the sample size on each bar."""
    width, height, top, plot_h = 760, 170, 14, 120
    known = all(p.comparable is not None for p in points)
    values = [(p.rate or 0.0) if known else float(p.unstable) for p in points]
    peak = max(values, default=0.0) or 1.0
    head = pct(peak) if known else f"{peak:.0f}"
    left = left_edge(head, "0")
    plot_w = width - left - 10
    bar_w = min(plot_w / max(len(points), 1), 60.0)
    out = [
        f'<svg class="chart inflight" viewBox="0 0 {width} {height}" role="img"'
        ' aria-label="divergence rate by requests in flight">',
        f'<line class="axis" x1="{left}" y1="{top + plot_h}" x2="{width - 10}"'
        f' y2="{top + plot_h}"/>',
        f'<text class="tick" x="{left - 4}" y="{top + 8}" text-anchor="end">{head}</text>',
        f'<text class="tick" x="{left - 4}" y="{top + plot_h}" text-anchor="end">0</text>',
    ]
    for i, (p, value) in enumerate(zip(points, values, strict=True)):
        h = plot_h * value / peak
        x = left + i * bar_w
        if known:
            tip = (
                f"{p.label} in flight: {p.unstable} of {p.comparable} not identical ({pct(p.rate)})"
            )
            note = f"n={p.comparable}"
        else:
            tip = f"{p.label} in flight: {p.unstable} incident(s)"
            note = str(p.unstable)
        out.append(
            f'<rect class="bar inflight-bar" x="{_f(x + 2)}" y="{_f(top + plot_h - h)}"'
            f' width="{_f(max(bar_w - 4, 1))}" height="{_f(h)}"><title>{escape(tip)}</title></rect>'
            f'<text class="tick" x="{_f(x + bar_w / 2)}" y="{top + plot_h + 14}"'
            f' text-anchor="middle">{escape(p.label)}</text>'
            f'<text class="tick small" x="{_f(x + bar_w / 2)}" y="{_f(top + plot_h - h - 3)}"'
            f' text-anchor="middle">{escape(note)}</text>'
        )
    out.append(
        f'<text class="tick" x="{left + plot_w / 2}" y="{height - 2}" text-anchor="middle">'
        "requests in flight at the primary</text></svg>"
    )
    return "".join(out)


def _logprob(value: float | None) -> str:
    if value is None:
        return "unknown"
    return "-inf" if math.isinf(value) else f"{value:.4f}"


def topk_bars(entries: Sequence[TopEntry], side: str) -> str:
    """One side's top-k at the divergence: a bar per token, its length the probability."""
    row_h, label_w, bar_w = 22, 170, 280
    height = row_h * max(len(entries), 1) + 6
    width = label_w + bar_w + 150
    out = [
        f'<svg class="chart topk" data-side="{escape(side)}" viewBox="0 0 {width} {height}"'
        f' role="img" aria-label="{escape(side)} top-k">'
    ]
    for i, entry in enumerate(entries):
        y = 3 + i * row_h
        label = orjson.dumps(entry.token).decode()
        if len(label) > 28:
            label = label[:27] + "…"
        cls = "bar topk-bar" + (" chosen" if entry.chosen else "")
        prob = entry.probability
        out.append(
            f'<text class="tok" x="{label_w - 6}" y="{y + 15}" text-anchor="end">{escape(label)}'
            f"</text>"
            f'<rect class="{cls}" x="{label_w}" y="{y + 2}" width="{_f(max(bar_w * prob, 1))}"'
            f' height="{row_h - 6}"><title>{escape(label)}: logprob {_logprob(entry.logprob)}'
            f"</title></rect>"
            f'<text class="tick" x="{label_w + bar_w + 6}" y="{y + 15}">'
            f"{_logprob(entry.logprob)} ({100 * prob:.1f}%)</text>"
        )
    out.append("</svg>")
    return "".join(out)


def loop_strip(start_offset: int | None, period: int, repeats: int) -> str:
    """The looping channel's text as a strip: what came before, then each repeat marked."""
    width, height, left = 760, 44, 4
    plot_w = width - 2 * left
    before = max(start_offset or 0, 0)
    covered = period * repeats
    scale = plot_w / max(before + covered, 1)
    out = [
        f'<svg class="chart loop" viewBox="0 0 {width} {height}" role="img"'
        ' aria-label="where the loop is">',
        f'<rect class="before" x="{left}" y="6" width="{_f(before * scale)}" height="20">'
        f"<title>{before} characters before the loop</title></rect>",
    ]
    marks = min(repeats, MAX_LOOP_MARKS)
    unit_w = covered * scale / marks if marks else 0.0
    for i in range(marks):
        x = left + before * scale + i * unit_w
        out.append(
            f'<rect class="loop-unit u-{i % 2}" x="{_f(x)}" y="6" width="{_f(max(unit_w, 0.5))}"'
            f' height="20"><title>repeat {i + 1}</title></rect>'
        )
    out.append(
        f'<text class="tick" x="{left}" y="{height - 4}">0</text>'
        f'<text class="tick" x="{_f(left + before * scale)}" y="{height - 4}">{before}</text>'
        f'<text class="tick" x="{width - left}" y="{height - 4}" text-anchor="end">'
        f"{before + covered} chars</text></svg>"
    )
    return "".join(out)
