"""A self-contained SVG chart of a sweep (or an HTML page around it): no dependencies.

Top: output tok/s against concurrency, one dot per repeat, a bar from min to max and a line
through the means; levels whose spread is wide are marked in red. Bottom: TTFT p50 the same way.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

from proxy.tools.sweep.render import HEADERS, footer_lines, header_lines, rows

WIDTH = 760
LEFT, RIGHT = 90, 40
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf")
RED = "#d62728"


def _nice_step(span: float) -> float:
    raw = span / 5 if span > 0 else 1.0
    mag = 10.0 ** math.floor(math.log10(raw))
    return next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw)


def _x_scale(levels: Sequence[int]) -> Callable[[float], float]:
    lo, hi = min(levels), max(levels)
    span_px = WIDTH - LEFT - RIGHT - 60
    if hi == lo:
        return lambda c: LEFT + 30 + span_px / 2
    geometric = lo > 0 and hi / lo >= 4
    f: Callable[[float], float] = math.log if geometric else float
    a, b = f(lo), f(hi)
    return lambda c: LEFT + 30 + (f(c) - a) / (b - a) * span_px


def _text(x: float, y: float, s: str, **attrs: str) -> str:
    extra = "".join(f' {k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f'<text x="{x:.1f}" y="{y:.1f}"{extra}>{escape(s)}</text>'


def _panel(
    levels: list[dict[str, Any]],
    values: Callable[[dict[str, Any]], list[float | None]],
    top: float,
    height: float,
    y_label: str,
    fmt: str,
    mark_spread: bool,
) -> list[str]:
    """One plot: dots per repeat, min-max bars, a mean line; ``values(level)`` per repeat."""
    x = _x_scale([lv["concurrency"] for lv in levels])
    every = [v for lv in levels for v in values(lv) if v is not None]
    step = _nice_step(max(every, default=1.0) * 1.1)
    y_max = step * math.ceil(max(every, default=1.0) * 1.1 / step) or step
    bottom = top + height

    def y(v: float) -> float:
        return bottom - v / y_max * height

    out = [
        f'<rect x="{LEFT}" y="{top}" width="{WIDTH - LEFT - RIGHT}" height="{height}"'
        ' fill="#fafafa" stroke="#999"/>'
    ]
    tick = 0.0
    while tick <= y_max + 1e-9:
        out.append(
            f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(tick):.1f}" y2="{y(tick):.1f}"'
            ' stroke="#e3e3e3"/>'
        )
        out.append(_text(LEFT - 6, y(tick) + 4, format(tick, fmt), text_anchor="end"))
        tick += step
    mid = top + height / 2
    out.append(_text(22, mid, y_label, text_anchor="middle", transform=f"rotate(-90 22 {mid:.1f})"))
    means: list[tuple[float, float]] = []
    for lv in levels:
        cx = x(lv["concurrency"])
        out.append(_text(cx, bottom + 16, str(lv["concurrency"]), text_anchor="middle"))
        vals = values(lv)
        present = [v for v in vals if v is not None]
        if not present:
            continue
        wide = mark_spread and lv["spread_warning"]
        colour = RED if wide else "#555"
        lo, hi = min(present), max(present)
        out.append(
            f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y(lo):.1f}" y2="{y(hi):.1f}"'
            f' stroke="{colour}" stroke-width="{3 if wide else 1.5}"/>'
        )
        n = len(vals)
        for i, v in enumerate(vals):
            if v is None:
                continue
            dx = (i - (n - 1) / 2) * 5
            out.append(
                f'<circle cx="{cx + dx:.1f}" cy="{y(v):.1f}" r="4"'
                f' fill="{PALETTE[i % len(PALETTE)]}" fill-opacity="0.85" stroke="#fff"/>'
            )
        means.append((cx, y(sum(present) / len(present))))
        if wide:
            spread = lv["tokens_per_s"]["spread"]
            out.append(_text(cx, y(hi) - 9, f"spread {spread:.0%}", text_anchor="middle", fill=RED))
    if means:
        pts = " ".join(f"{px:.1f},{py:.1f}" for px, py in means)
        out.append(f'<polyline points="{pts}" fill="none" stroke="#222" stroke-width="2"/>')
        out.extend(
            f'<rect x="{px - 3:.1f}" y="{py - 3:.1f}" width="6" height="6" fill="#222"/>'
            for px, py in means
        )
    return out


def _short(summary: dict[str, Any]) -> str:
    fp = str(summary.get("fingerprint") or "")[:8]
    return f"{summary.get('kind')} {summary.get('version') or '?'} ({fp})"


def to_svg(report: dict[str, Any]) -> str:
    levels: list[dict[str, Any]] = report["levels"]
    repeats = int(report["config"]["repeats"])
    fp = report["fingerprint"]
    head = header_lines(report)
    parts = [
        _text(LEFT, 24, head[0], font_size="16", font_weight="bold"),
        _text(LEFT, 42, head[1], fill="#444"),
        _text(LEFT, 58, head[2], fill="#444"),
    ]
    top = 76.0
    if fp["changed"]:
        parts.append(
            f'<rect x="{LEFT}" y="{top - 6}" width="{WIDTH - LEFT - RIGHT}" height="22"'
            f' fill="{RED}"/>'
        )
        parts.append(
            _text(
                LEFT + 8,
                top + 10,
                "UPSTREAM CHANGED DURING THE SWEEP: "
                f"{_short(fp['before'])} -> {_short(fp['after'])}",
                fill="#fff",
                font_weight="bold",
            )
        )
        top += 26
    # legend
    lx = LEFT
    for i in range(repeats):
        parts.append(
            f'<circle cx="{lx + 5}" cy="{top + 8}" r="4" fill="{PALETTE[i % len(PALETTE)]}"/>'
        )
        parts.append(_text(lx + 13, top + 12, f"repeat {i + 1}"))
        lx += 80
    parts.append(
        f'<line x1="{lx}" x2="{lx + 22}" y1="{top + 8}" y2="{top + 8}" stroke="#222"'
        ' stroke-width="2"/>'
    )
    parts.append(_text(lx + 28, top + 12, "mean   | bar: min to max"))
    top += 26

    def rates(lv: dict[str, Any]) -> list[float | None]:
        return [run["tokens_per_s"] for run in lv["runs"]]

    def ttft_ms(lv: dict[str, Any]) -> list[float | None]:
        return [None if (t := run["ttft_s"]["p50"]) is None else t * 1000 for run in lv["runs"]]

    main_h, small_h = 280.0, 130.0
    parts += _panel(levels, rates, top, main_h, "output tokens/s (sustained)", "g", True)
    top += main_h + 22
    parts.append(_text(WIDTH / 2, top + 12, "concurrent requests", text_anchor="middle"))
    top += 34
    parts += _panel(levels, ttft_ms, top, small_h, "TTFT p50 (ms)", "g", False)
    top += small_h + 22
    parts.append(_text(WIDTH / 2, top + 12, "concurrent requests", text_anchor="middle"))
    height = top + 28
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height:.0f}"'
        f' viewBox="0 0 {WIDTH} {height:.0f}" font-family="sans-serif" font-size="12">\n'
        f'<rect width="100%" height="100%" fill="#fff"/>\n{body}\n</svg>\n'
    )


def to_html(report: dict[str, Any]) -> str:
    head = header_lines(report)
    table = ["<table>", "<tr>" + "".join(f"<th>{escape(h)}</th>" for h in HEADERS) + "</tr>"]
    for row in rows(report):
        cls = ' class="warn"' if row[-1] else ""
        table.append(f"<tr{cls}>" + "".join(f"<td>{escape(c)}</td>" for c in row) + "</tr>")
    table.append("</table>")
    notes = "".join(
        f'<p class="{"warn" if line.startswith("WARNING") else "note"}">{escape(line)}</p>'
        for line in footer_lines(report)
    )
    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(head[0])}</title><style>"
        "body{font-family:sans-serif;margin:2em;color:#222}"
        "table{border-collapse:collapse}td,th{padding:3px 10px;text-align:right;"
        "border-bottom:1px solid #ddd}tr.warn td{color:#d62728;font-weight:bold}"
        "p.warn{color:#d62728;font-weight:bold}p.note{color:#666}"
        "</style></head><body>\n"
        f"<h1>{escape(head[0])}</h1>\n"
        + "".join(f"<div>{escape(line)}</div>" for line in head[1:])
        + f"\n{to_svg(report)}\n"
        + "\n".join(table)
        + f"\n{notes}\n</body></html>\n"
    )


def write_chart(path: str, report: dict[str, Any]) -> None:
    text = to_html(report) if path.lower().endswith((".html", ".htm")) else to_svg(report)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
