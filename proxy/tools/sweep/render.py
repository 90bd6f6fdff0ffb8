"""The report as a plain table (default) or GitHub markdown."""

from __future__ import annotations

from typing import Any

from proxy.tools.sweep.recipe import describe_recipe
from proxy.tools.sweep.stats import describe

HEADERS = (
    "conc",
    "tok/s mean",
    "min",
    "max",
    "spread",
    "TTFT p50",
    "TTFT p95",
    "ITL p50",
    "ITL p95",
    "req",
    "cut",
    "err",
    "",
)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def rows(report: dict[str, Any]) -> list[list[str]]:
    out = []
    for level in report["levels"]:
        rate = level["tokens_per_s"]
        spread = rate["spread"]
        out.append(
            [
                str(level["concurrency"]),
                _rate(rate["mean"]),
                _rate(rate["min"]),
                _rate(rate["max"]),
                "-" if spread is None else f"{spread:.1%}",
                _ms(level["ttft_s"]["p50"]),
                _ms(level["ttft_s"]["p95"]),
                _ms(level["itl_s"]["p50"]),
                _ms(level["itl_s"]["p95"]),
                str(level["requests"]),
                str(level["cut"]),
                str(level["errors"]),
                "WIDE SPREAD" if level["spread_warning"] else "",
            ]
        )
    return out


def header_lines(report: dict[str, Any]) -> list[str]:
    cfg, fp = report["config"], report["fingerprint"]
    lines = [
        f"detproxy sweep: {report['model']} at {report['upstream']}",
        f"{cfg['duration_s']:g} s per level, {cfg['repeats']} repeats, max_tokens"
        f" {cfg['max_tokens']}, elapsed {report['elapsed_s']:.1f} s",
        f"upstream before: {describe(fp['before'])}",
    ]
    if fp["changed"]:
        lines.append(f"upstream after:  {describe(fp['after'])}  <-- CHANGED DURING THE SWEEP")
    else:
        lines.append("upstream after:  unchanged")
    recipe = report.get("recipe")
    if recipe is not None:  # what loaded, read from the engine (reports before it: none)
        lines.append(f"recipe (what loaded, from {recipe['read_from']}):")
        lines.append(f"  before: {describe_recipe(recipe['before'])}")
        if recipe["moved"]:
            moved = ", ".join(recipe["moved"])
            lines.append(f"  after:  {describe_recipe(recipe['after'])}  <-- MOVED: {moved}")
        elif recipe["after"] != recipe["before"]:
            lines.append(f"  after:  {describe_recipe(recipe['after'])}")
    return lines


def footer_lines(report: dict[str, Any]) -> list[str]:
    lines = [f"WARNING: {w['message']}" for w in report["warnings"]]
    if report["config"]["repeats"] < 2:
        lines.append("note: spread needs --repeats 2 or more")
    lines.append(
        "tok/s: output tokens within the window / window; requests in flight at the deadline"
        " are cut; spread = (max - min) / mean across repeats"
    )
    return lines


def to_text(report: dict[str, Any]) -> str:
    table = [list(HEADERS), *rows(report)]
    widths = [max(len(row[i]) for row in table) for i in range(len(HEADERS))]
    body = []
    for row in table:
        cells = [
            cell.ljust(widths[i]) if i == len(row) - 1 else cell.rjust(widths[i])
            for i, cell in enumerate(row)
        ]
        body.append("  ".join(cells).rstrip())
    return "\n".join([*header_lines(report), "", *body, "", *footer_lines(report)]) + "\n"


def to_markdown(report: dict[str, Any]) -> str:
    head = header_lines(report)
    lines = [f"### {head[0]}", "", *(f"{line}  " for line in head[1:]), ""]
    lines.append("| " + " | ".join(h or "note" for h in HEADERS) + " |")
    lines.append("|" + "---:|" * (len(HEADERS) - 1) + "---|")
    for row in rows(report):
        lines.append("| " + " | ".join(row) + " |")
    lines.append("")
    for line in footer_lines(report):
        lines.append(f"> **{line}**" if line.startswith("WARNING") else f"_{line}_")
        lines.append("")
    return "\n".join(lines)
