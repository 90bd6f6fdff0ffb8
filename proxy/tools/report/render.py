"""Render a report (the dict ``build_report`` returns) as terminal text or GitHub markdown.

Both formats are drawn from the same blocks (headings, paragraphs, tables), so they carry the
same figures as ``--json``.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import dataclass
from typing import Any

IGNORED_NOTE = "ignored "  # summary's note on skipped lines, which the header already gives
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


MODE_MEANING = {
    "full": "a shadow replay of the whole request",
    "prefill": "a replay of the first token only",
    "duplicate": "the same request sent twice by clients",
    "n_choices": "the n > 1 choices of one request",
}


def pct(rate: float | None) -> str:
    """A share as a rounded percentage (one decimal)."""
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def ci(p: dict[str, Any]) -> str:
    """The 95% Wilson interval of a proportion, ``49.2-73.4%``."""
    if p["ci_low"] is None or p["ci_high"] is None:
        return "n/a"
    return f"{100 * p['ci_low']:.1f}-{100 * p['ci_high']:.1f}%"


def num(value: float | None) -> str:
    """A count as is; anything else with three significant digits."""
    if value is None:
        return "n/a"
    if isinstance(value, int) or float(value).is_integer():
        return str(int(value))
    return f"{value:.3g}"


def plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def words(name: str) -> str:
    """``looped_again`` as ``looped again``."""
    return name.replace("_", " ")


def token(value: str | None) -> str:
    return "n/a" if value is None else json.dumps(value, ensure_ascii=False)


def when(iso_time: str) -> str:
    """``2026-12-04T06:55:45.388Z`` as ``2026-12-04 06:55:45``; anything else as it came."""
    if len(iso_time) >= 19 and iso_time[10] == "T":
        return iso_time[:10] + " " + iso_time[11:19]
    return iso_time


def printable(text: str) -> str:
    """Escape control characters (model names and request ids come from clients)."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _mode_key(mode: str) -> tuple[int, str]:
    return (MODES_ORDER.index(mode) if mode in MODES_ORDER else len(MODES_ORDER), mode)


def _counts(sec: dict[str, Any]) -> list[Block]:
    verdicts = list(sec["verdicts"])
    modes = sorted(sec["verdicts_by_mode"], key=_mode_key)
    rows = []
    for mode in modes:
        counts = sec["verdicts_by_mode"][mode]
        rows.append((mode, str(sum(counts.values())), *(str(counts.get(v, 0)) for v in verdicts)))
    total = sum(sec["verdicts"].values())
    if len(modes) != 1:
        rows.append(("total", str(total), *map(str, sec["verdicts"].values())))
    logged = sec["incident_lines"]["audit"]
    if sec["counts_from"] == "tally":
        column = "audits"
        lead = _tallied_lead(sec, total, logged)
    else:
        column = "lines"
        lead = (
            f"{plural(logged, 'audit line')} (no tally in the log: identical audits, which get"
            " no line, are not counted, so there are no shares):"
        )
    right = (False, *([True] * (len(verdicts) + 1)))
    legend = "; ".join(f"{m}: {MODE_MEANING[m]}" for m in modes if m in MODE_MEANING)
    out: list[Block] = [Para(lead), Table(("mode", column, *verdicts), tuple(rows), right)]
    if legend:
        out.append(Para(f"Modes: {legend}."))
    return out


def _tallied_lead(sec: dict[str, Any], total: int, logged: int) -> str:
    """The audits the tallies counted, and how the incident lines read stand against them."""
    unstable = total - sec["verdicts"].get("identical", 0)
    lead = f"{plural(total, 'audit')}, counted by the tallies; {unstable} of them not identical"
    if logged == unstable:
        lead += ": each of those has its incident line here."
    elif logged < unstable:
        lead += (
            f": {logged} of their incident lines are here (the others are in files not read,"
            " or rotated away)."
        )
    else:
        lead += f", yet {logged} incident lines here are within the tallies' time (see the notes)."
    after = sec.get("lines_after_tallies", {}).get("audit", 0)
    if after:
        lead += f" {plural(after, 'audit line')} came after the newest tally: not counted here yet."
    return lead


def _rates(sec: dict[str, Any]) -> list[Block]:
    if sec["rates"] is None:
        return [Para("Shares: n/a (denominators unknown without tally lines).")]
    named = [
        (v if v != "logprob_drift" else "logprob_drift (same tokens)", p)
        for v, p in sec["rates"].items()
        if v != "incomparable"
    ]
    named.append(("TARr (raw-output agreement: same tokens)", sec["tar_r"]))
    if sec["tar_a"] is not None:
        named.append(("TARa (answer agreement)", sec["tar_a"]))
    incomparable = sec["rates"].get("incomparable")
    if incomparable is not None:
        named.append(("incomparable (of all audits)", incomparable))
    rows = tuple(
        (name, str(p["count"]), str(p["denominator"]), pct(p["rate"]), ci(p)) for name, p in named
    )
    out: list[Block] = [
        Para(
            f"Shares of the {sec['comparable']} comparable audits (all but incomparable), with"
            " their 95% Wilson intervals:"
        ),
        Table(("measure", "count", "of", "share", "95% CI"), rows, (False, True, True, True, True)),
    ]
    if sec["tar_a"] is None:
        out.append(Para(f"TARa (answer agreement): n/a ({sec.get('tar_a_note', 'no answers')})."))
    return out


def _positions(sec: dict[str, Any]) -> list[Block]:
    pos, delta = sec["positions"], sec["logprob_delta"]
    tie = pos["near_tie"]
    lines = pos.get("divergent_lines", pos["count"])
    out: list[Block] = []
    if lines:
        missing = lines - pos["count"]
        why = (
            f"; the other {missing} compare output hashes only (duplicate requests, or no"
            " tokens to compare)"
            if missing
            else ""
        )
        out.append(
            Para(
                f"First divergent token: known for {pos['count']} of the {lines} text or answer"
                f" divergence lines{why}. Token index: min {num(pos['min'])}, median"
                f" {num(pos['median'])}, p90 {num(pos['p90'])}, max {num(pos['max'])}."
            )
        )
    if pos["count"]:
        buckets = pos["histogram"]
        out.append(
            Table(
                ("token index", *(b["bucket"] for b in buckets)),
                (("divergences", *(str(b["count"]) for b in buckets)),),
                (False, *(True for _ in buckets)),
            )
        )
        if tie["with_margin"]:
            out.append(
                Para(
                    f"Near ties: {tie['count']} of the {tie['with_margin']} with a known margin"
                    f" ({pct(tie['share'])}) flipped where the primary's top two tokens were"
                    f" within {tie['threshold_nats']} nats."
                )
            )
    seen = delta["count"] + delta["null"]
    if seen:
        if delta["count"]:
            spread = (
                f"median {num(delta['p50'])}, p90 {num(delta['p90'])}, p99 {num(delta['p99'])},"
                f" max {num(delta['max'])} nats"
            )
        else:
            spread = "no values"
        nulls = f" ({delta['null']} without one: no logprobs, or infinite)" if delta["null"] else ""
        out.append(
            Para(
                f"Largest |logprob delta| over the common prefix, on {delta['count']} of the"
                f" {seen} comparable audit lines{nulls}: {spread}."
            )
        )
    return out


def _loops(sec: dict[str, Any]) -> list[Block]:
    loops = sec["loops"]
    where = "tallies" if loops["counts_from"] == "tally" else "loop lines"
    total = loops["total"]
    out: list[Block] = []
    if not total:
        out.append(Para(f"Loops: none (from the {where})."))
    else:
        out.append(
            Para(
                f"Loops: {total} detected (from the {where}), on client requests and on their"
                " retries:"
            )
        )
        rows = tuple(
            (ch, src, str(n))
            for ch, by_src in sorted(loops["by_channel_source"].items())
            for src, n in sorted(by_src.items())
        )
        out.append(Table(("channel", "source", "loops"), rows, (False, False, True)))
    acts = sec["policy_actions"]
    if acts is None:
        if total:
            out.append(Para("Retries and aborts: n/a (only tallies count them)."))
        return out
    by_action = acts["by_action"]
    retried = acts["retried"]
    if retried:
        outcomes = sorted(
            by_action.get("retry", {}).items(), key=lambda o: (o[0] != "recovered", o)
        )
        parts = " + ".join(f"{n} {words(outcome)}" for outcome, n in outcomes)
        rec = acts["recovery"]
        text = f"Retries: {retried} = {parts} ({pct(rec['rate'])} recovered, 95% CI {ci(rec)})."
    else:
        text = "Retries: none."
    aborts = sum(acts["aborts"].values())
    if aborts:
        why = ", ".join(f"{n} {words(k)}" for k, n in acts["aborts"].items())
        text += f" Aborted: {aborts} ({why})."
    if acts["observed"]:
        text += f" Observed only: {acts['observed']}."
    if retried or aborts or acts["observed"] or total:
        out.append(Para(text))
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
                ("strategy", "retried", "recovered", "share", "tokens per retry", "tokens kept"),
                by_strategy,
                (False, True, True, True, True, True),
            )
        )
    return out


def _causes(sec: dict[str, Any]) -> list[Block]:
    causes = sec.get("causes") or {}
    if not causes:
        return []
    rows = tuple((words(c), str(v["count"]), v["meaning"], v["action"]) for c, v in causes.items())
    out: list[Block] = [
        Para("Causes (triage's verdicts on the audit lines; what to do about each):"),
        Table(("cause", "count", "what it means", "what to do"), rows, (False, True, False, False)),
    ]
    missing = sec.get("unknown_missing") or {}
    if missing:
        listed = "; ".join(f"{what} ({n})" for what, n in missing.items())
        out.append(Para(f"Unknown: the evidence missing: {listed}."))
    return out


def section_blocks(title: str, sec: dict[str, Any]) -> list[Block]:
    return [
        Heading(title, 2),
        *_counts(sec),
        *_rates(sec),
        *_causes(sec),
        *_positions(sec),
        *_loops(sec),
    ]


def engine_blocks(engine: dict[str, Any] | None) -> list[Block]:
    """What the engine loaded: the recipes measured on, declared fields not met, restarts."""
    if not engine:
        return []
    recipes, mismatches = engine["recipes"], engine["mismatches"]
    restarts = engine["restarts"]
    if not recipes and not mismatches and not restarts["count"]:
        return []
    out: list[Block] = [Heading("Engine (what loaded)", 2)]
    if recipes:
        out.append(Para("Audits measured on recipe " + ", ".join(recipes) + "."))
    for m in mismatches:
        out.append(
            Para(
                f"{when(m['time'])} UTC: recipe {m['recipe'] or 'n/a'} does not meet"
                f" [upstream.expect] ({plural(len(m['fields']), 'field')}):"
            )
        )
        rows = tuple((f["field"], f["declared"], f["loaded"]) for f in m["fields"])
        out.append(Table(("field", "declared", "loaded"), rows, (False, False, False)))
    if engine["loaded"]:
        facts = tuple(
            (str(k), v if isinstance(v, str) else json.dumps(v))
            for k, v in engine["loaded"].items()
        )
        out.append(Para("Loaded at the last mismatch:"))
        out.append(Table(("fact", "value"), facts, (False, False)))
    if restarts["count"]:
        longest = restarts["longest_down_s"]
        down = "" if longest is None else f", the longest down {num(longest)} s"
        out.append(
            Para(
                f"Upstream restarted {plural(restarts['count'], 'time')} (the same identity"
                f" back, not a change), the last at {when(restarts['last'])} UTC{down}."
            )
        )
    return out


def _worst(items: list[dict[str, Any]], one_model: bool) -> list[Block]:
    head: tuple[str, ...] = ("#", "request id", "model", "mode", "verdict", "at token")
    head = (*head, "primary", "shadow", "margin", "delta", "cause", "time (UTC)")
    rows: tuple[tuple[str, ...], ...] = tuple(
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
            words(w.get("cause") or "untriaged"),
            when(w["time"]),
        )
        for i, w in enumerate(items, 1)
    )
    right: tuple[bool, ...] = (True, False, False, False, False, True, False, False, True, True)
    right = (*right, False, False)
    if one_model:  # the model is in the heading above
        keep = [i for i in range(len(head)) if i != 2]
        head = tuple(head[i] for i in keep)
        rows = tuple(tuple(r[i] for i in keep) for r in rows)
        right = tuple(right[i] for i in keep)
    if not rows:
        return [Para("None.")]
    return [
        Table(head, rows, right),
        Para(
            "margin: the primary's top-1 minus top-2 logprob at that token (nats; small: a near"
            " tie); delta: the largest |logprob delta| over the common prefix (nats)."
        ),
    ]


def _header(report: dict[str, Any]) -> list[Block]:
    lines = report["lines"]
    processes = len(report["processes"])
    kinds = [
        plural(lines["audit"], "audit line"),
        plural(lines["loop"], "loop line"),
        plural(lines["tally"], "tally", "tallies")
        + (f" (the counts of {plural(processes, 'detproxy process', 'detproxy processes')})"),
    ]
    if lines.get("upstream_change"):
        kinds.append(plural(lines["upstream_change"], "upstream change"))
    if lines.get("upstream_restart"):
        kinds.append(plural(lines["upstream_restart"], "upstream restart"))
    if lines.get("engine_mismatch"):
        kinds.append(plural(lines["engine_mismatch"], "engine mismatch", "engine mismatches"))
    if lines.get("cause"):
        kinds.append(plural(lines["cause"], "cause line"))
    ignored = [
        (lines["malformed"], "malformed"),
        (lines["unknown_kind"], "of an unknown kind"),
        (lines["duplicate"], "duplicate"),
    ]
    skipped = ", ".join(f"{n} {what}" for n, what in ignored if n)
    out: list[Block] = [
        Heading("detproxy report", 1),
        Para("Read: " + ", ".join(report["files"]) + "."),
        Para(
            f"{plural(lines['read'], 'line')}: "
            + ", ".join(kinds)
            + (f"; ignored: {skipped}." if skipped else ".")
        ),
    ]
    span = report["time_range"]
    if span is not None:
        first, last = when(span["first"]), when(span["last"])
        if first[:10] == last[:10]:
            last = last[11:]
        out.append(Para(f"From {first} to {last} UTC."))
    coverage = report.get("coverage")
    if coverage is not None:
        out.append(Para(_coverage(coverage)))
    if report["model_filter"] is not None:
        out.append(Para(f"Models matching: {report['model_filter']}"))
    return out


def _coverage(coverage: dict[str, Any]) -> str:
    """Which period the counts cover, and what came after it (a live log's newest lines)."""
    tallies = coverage["tallies"]
    if not tallies:
        return (
            "Counts: of incident lines only (no tally in these files: identical audits have no"
            " line, so there are no shares)."
        )
    if len(tallies) == 1:
        (only,) = tallies
        text = (
            f"Counts and shares are the tally's of {when(only['last'])} UTC (detproxy process"
            f" {only['process'][:8]}, started {when(only['started'])} UTC): every audit up to"
            " then, identical ones too, and the incident lines up to then."
        )
    else:
        text = (
            f"Counts and shares are the tallies' of {len(tallies)} detproxy processes, each up"
            f" to its newest tally (the latest at {when(coverage['until'])} UTC), and the"
            " incident lines up to then."
        )
    after = coverage["after_tallies"]
    if not coverage["tally_behind"]:
        return text + " No incident line read is newer."
    parts = [plural(after["audit"], "audit line"), plural(after["loop"], "loop line")]
    newest = coverage["newest_line"]
    return text + (
        f" {' and '.join(p for p in parts if not p.startswith('0 '))} came after (the newest at"
        f" {when(newest) if newest else 'n/a'} UTC): not in the counts or shares yet (the next"
        " tally counts them), only among the worst items."
    )


def blocks(report: dict[str, Any]) -> list[Block]:
    out = _header(report)
    models = report["models"]
    if not models:
        out.append(Para("No audits or loops in these files."))
    for model, sec in models.items():
        out += section_blocks(f"Model {model}", sec)
    if len(models) > 1:
        out += section_blocks(f"All models ({len(models)})", report["all_models"])
    by_upstream = report.get("causes_by_upstream") or []
    if by_upstream:
        out.append(Heading("Causes per upstream", 2))
        up_rows = tuple(
            (
                u["fingerprint"] or "unknown",
                u["recipe"] or "unknown",
                ", ".join(f"{words(c)} {n}" for c, n in u["causes"].items()),
            )
            for u in by_upstream
        )
        out.append(Table(("fingerprint", "recipe", "causes"), up_rows, (False, False, False)))
    out += engine_blocks(report.get("engine"))
    out.append(Heading("Shadow replays dropped", 2))
    dropped = report["shadows_dropped"]
    if dropped is None:
        out.append(Para("n/a (no tally lines)."))
    elif dropped:
        rows = tuple((r, str(n)) for r, n in dropped.items())
        out.append(
            Para(f"{sum(dropped.values())} dropped (not replayed, so not audited), by reason:")
        )
        out.append(Table(("reason", "dropped"), rows, (False, True)))
    else:
        out.append(Para("None."))
    worst = report["worst"]
    later = sum(1 for w in worst if not w.get("counted", True))
    after = f"; {later} after the newest tally" if later else ""
    out.append(Heading(f"Worst items ({len(worst)}, most serious first{after})", 2))
    out += _worst(worst, len(models) == 1)
    notes = [n for n in report["notes"] if not n.startswith(IGNORED_NOTE)]  # in the header
    if notes:
        out.append(Heading("Notes", 2))
        out += [Para(f"- {n}") for n in notes]
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
