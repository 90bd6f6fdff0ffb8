"""Render a report (the dict ``build_report`` returns) as terminal text or GitHub markdown.

Both formats are drawn from the same blocks (headings, paragraphs, tables), so they carry the
same figures as ``--json``.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any

MODES_ORDER = ("full", "prefill", "n_choices", "duplicate")
TEXT_WIDTH = 100


@dataclass(frozen=True, slots=True)
class Heading:
    text: str
    level: int


@dataclass(frozen=True, slots=True)
class Para:
    text: str


@dataclass(frozen=True, slots=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    right: tuple[bool, ...]  # right-align this column (numbers)


Block = Heading | Para | Table


def pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.2f}%"


def num(value: float | None) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.4g}"


def token(value: str | None) -> str:
    return "n/a" if value is None else json.dumps(value, ensure_ascii=False)


def printable(text: str) -> str:
    """Escape control characters (model names and request ids come from clients)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _mode_key(mode: str) -> tuple[int, str]:
    return (MODES_ORDER.index(mode) if mode in MODES_ORDER else len(MODES_ORDER), mode)


def _counts(sec: dict[str, Any]) -> list[Block]:
    verdicts = list(sec["verdicts"])
    rows = []
    for mode in sorted(sec["verdicts_by_mode"], key=_mode_key):
        counts = sec["verdicts_by_mode"][mode]
        rows.append((mode, str(sum(counts.values())), *(str(counts.get(v, 0)) for v in verdicts)))
    rows.append(("total", str(sum(sec["verdicts"].values())), *map(str, sec["verdicts"].values())))
    if sec["counts_from"] == "tally":
        lead, column = f"Audited: {sec['audited']} (from tallies).", "audited"
    else:
        lead, column = "Audited: unknown (no tallies); incident lines by mode and verdict:", "lines"
    right = (False, *([True] * (len(verdicts) + 1)))
    return [Para(lead), Table(("mode", column, *verdicts), tuple(rows), right)]


def _rates(sec: dict[str, Any]) -> list[Block]:
    if sec["rates"] is None:
        return [Para("Rates: n/a (denominators unknown without tally lines).")]
    named = [(v, p) for v, p in sec["rates"].items()]
    named += [("TARr (raw-output agreement)", sec["tar_r"])]
    named += [("TARa (answer agreement)", sec["tar_a"])]
    rows = tuple(
        (
            name,
            str(p["count"]),
            f"{p['of']} {p['denominator']}",
            pct(p["rate"]),
            f"{pct(p['ci_low'])} - {pct(p['ci_high'])}",
        )
        for name, p in named
    )
    head = ("measure", "count", "of", "rate", "95% Wilson CI")
    return [
        Para(f"Rates (comparable = all but incomparable = {sec['comparable']}):"),
        Table(head, rows, (False, True, False, True, False)),
    ]


def _positions(sec: dict[str, Any]) -> list[Block]:
    pos, delta = sec["positions"], sec["logprob_delta"]
    tie = pos["near_tie"]
    out: list[Block] = [
        Para(
            f"Divergence positions (first divergent token of text/answer divergences):"
            f" count {pos['count']}, min {num(pos['min'])}, median {num(pos['median'])},"
            f" p90 {num(pos['p90'])}, max {num(pos['max'])}."
        )
    ]
    if pos["count"]:
        buckets = pos["histogram"]
        out.append(
            Table(
                tuple(b["bucket"] for b in buckets),
                (tuple(str(b["count"]) for b in buckets),),
                tuple(True for _ in buckets),
            )
        )
    out.append(
        Para(
            f"Near-tie flips (margin < {tie['threshold_nats']} nats): {tie['count']} of"
            f" {tie['with_margin']} with a margin ({pct(tie['share'])}). Max |delta logprob|"
            f" (nats, {delta['count']} lines, {delta['null']} null = unknown or inf):"
            f" p50 {num(delta['p50'])}, p90 {num(delta['p90'])}, p99 {num(delta['p99'])},"
            f" max {num(delta['max'])}."
        )
    )
    return out


def _loops(sec: dict[str, Any]) -> list[Block]:
    loops = sec["loops"]
    where = "tallies" if loops["counts_from"] == "tally" else "loop lines"
    out: list[Block] = [Para(f"Loops: {loops['total']} (from {where}).")]
    rows = tuple(
        (ch, src, str(n))
        for ch, by_src in loops["by_channel_source"].items()
        for src, n in by_src.items()
    )
    if rows:
        out.append(Table(("channel", "source", "count"), rows, (False, False, True)))
    acts = sec["policy_actions"]
    if acts is None:
        out.append(Para("Policy actions: n/a (only tallies count them)."))
        return out
    rec = acts["recovery"]
    aborts = ", ".join(f"{k} {n}" for k, n in acts["aborts"].items()) or "none"
    out.append(
        Para(
            f"Policy actions: recovered {acts['recovered']} of {acts['retried']} retried"
            f" ({pct(rec['rate'])}, 95% CI {pct(rec['ci_low'])} - {pct(rec['ci_high'])});"
            f" aborts: {aborts}; observed {acts['observed']}."
        )
    )
    strategies = sec.get("recovery_strategies") or {}
    by_strategy = tuple(
        (
            str(name),
            str(st["retried"]),
            str(st["recovered"]),
            pct(st["recovery"]["rate"]),
            "-" if st["generated_per_retry"] is None else f"{st['generated_per_retry']:.0f}",
            str(st["kept_tokens"]),
        )
        for name, st in strategies.items()
    )
    if by_strategy:
        out.append(
            Table(
                ("strategy", "retried", "recovered", "rate", "tokens per retry", "tokens kept"),
                by_strategy,
                (False, True, True, True, True, True),
            )
        )
    return out


def section_blocks(title: str, sec: dict[str, Any]) -> list[Block]:
    return [
        Heading(title, 2),
        *_counts(sec),
        *_rates(sec),
        *_positions(sec),
        *_loops(sec),
    ]


def _worst(items: list[dict[str, Any]]) -> list[Block]:
    head: tuple[str, ...] = ("#", "request_id", "model", "mode", "verdict", "index", "primary")
    head = (*head, "shadow")
    head = (*head, "margin", "delta", "time")
    rows = tuple(
        (
            str(i),
            w["request_id"],
            w["model"],
            w["mode"],
            w["verdict"],
            num(w["index"]),
            token(w["primary_token"]),
            token(w["shadow_token"]),
            num(w["margin"]),
            num(w["delta"]),
            w["time"],
        )
        for i, w in enumerate(items, 1)
    )
    right = (True, False, False, False, False, True, False, False, True, True, False)
    return [Table(head, rows, right)] if rows else [Para("None.")]


def blocks(report: dict[str, Any]) -> list[Block]:
    lines = report["lines"]
    out: list[Block] = [
        Heading("detproxy report", 1),
        Para(
            f"Files: {', '.join(report['files'])}. Lines: {lines['read']} ({lines['audit']}"
            f" audit, {lines['loop']} loop, {lines['tally']} tally from"
            f" {len(report['processes'])} process(es)); ignored: {lines['malformed']}"
            f" malformed, {lines['unknown_kind']} unknown kind, {lines['duplicate']} duplicate."
        ),
    ]
    span = report["time_range"]
    if span is not None:
        out.append(Para(f"Time range: {span['first']} to {span['last']} (UTC)."))
    if report["model_filter"] is not None:
        out.append(Para(f"Model filter: {report['model_filter']}"))
    for model, sec in report["models"].items():
        out += section_blocks(f"Model {model}", sec)
    out += section_blocks("All models", report["all_models"])
    out.append(Heading("Shadows dropped (all models)", 2))
    dropped = report["shadows_dropped"]
    if dropped is None:
        out.append(Para("n/a (no tally lines)."))
    elif dropped:
        rows = tuple((r, str(n)) for r, n in dropped.items())
        out.append(Table(("reason", "count"), rows, (False, True)))
    else:
        out.append(Para("None."))
    out.append(Heading(f"Worst items (top {len(report['worst'])})", 2))
    out += _worst(report["worst"])
    if report["notes"]:
        out.append(Heading("Notes", 2))
        out += [Para(f"- {n}") for n in report["notes"]]
    return out


def _text_table(t: Table) -> list[str]:
    t = Table(tuple(map(printable, t.headers)), tuple(_clean_row(r) for r in t.rows), t.right)
    widths = [max(len(r[i]) for r in (t.headers, *t.rows)) for i in range(len(t.headers))]

    def line(cells: tuple[str, ...]) -> str:
        parts = [
            c.rjust(w) if right else c.ljust(w)
            for c, w, right in zip(cells, widths, t.right, strict=True)
        ]
        return "  ".join(parts).rstrip()

    return [line(t.headers), "  ".join("-" * w for w in widths), *map(line, t.rows)]


def to_text(items: list[Block]) -> str:
    out: list[str] = []
    for b in items:
        if isinstance(b, Heading):
            title = printable(b.text)
            out += ["", title, ("=" if b.level == 1 else "-") * len(title)]
        elif isinstance(b, Para):
            indent = "  " if b.text.startswith("- ") else ""
            text = printable(b.text)
            out += ["", textwrap.fill(text, TEXT_WIDTH, subsequent_indent=indent)]
        else:
            out += ["", *("  " + s for s in _text_table(b))]
    return "\n".join(out).strip("\n") + "\n"


def _clean_row(row: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(map(printable, row))


def _md_cell(cell: str) -> str:
    return printable(cell).replace("|", "\\|").replace("\n", " ")


def to_markdown(items: list[Block]) -> str:
    out: list[str] = []
    for b in items:
        if isinstance(b, Heading):
            out += ["#" * b.level + " " + printable(b.text), ""]
        elif isinstance(b, Para):
            out += [printable(b.text), ""]
        else:
            out.append("| " + " | ".join(map(_md_cell, b.headers)) + " |")
            out.append("|" + "|".join("---:" if r else "---" for r in b.right) + "|")
            out += ["| " + " | ".join(map(_md_cell, row)) + " |" for row in b.rows]
            out.append("")
    return "\n".join(out).strip("\n") + "\n"
