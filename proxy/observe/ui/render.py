"""View models to HTML: the overview (per model charts and the incident list), one incident's
page (an audit, a loop, an upstream change) and an error page. Everything that came from a
client or an upstream is escaped (``esc``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import orjson

from proxy.attribution.case import TRIAGED
from proxy.observe.ui.incident import (
    AuditDetail,
    ChangeDetail,
    Detail,
    EngineMismatchDetail,
    IncidentRow,
    LoopDetail,
    RestartDetail,
    SideBySide,
)
from proxy.observe.ui.overview import EngineView, ModelView, Overview
from proxy.observe.ui.page import Links, document, esc
from proxy.observe.ui.svg import inflight_curve, loop_strip, pct, timeline, topk_bars
from proxy.tools.report.causes import ACTION, MEANING, UNTRIAGED, missing_evidence
from proxy.tools.report.summary import iso

SHOWN_REPEATS = 3  # a loop's unit is written out this many times, marked


def _time(ts: float | None) -> str:
    if ts is None:
        return '<span class="muted">no time</span>'
    stamp = iso(ts)
    return f'<time datetime="{esc(stamp)}" data-ts="{ts:.3f}">{esc(stamp)}</time>'


def _num(value: float | int | None, unit: str = "", digits: int = 4) -> str:
    if value is None:
        return '<span class="muted">n/a</span>'
    if isinstance(value, float) and math.isinf(value):
        return "-inf" if value < 0 else "inf"
    shown = str(value) if isinstance(value, int) else f"{value:.{digits}g}"
    return esc(shown + unit)


def _token(value: str | None) -> str:
    return "(end of output)" if value is None else esc(orjson.dumps(value).decode())


def badge(verdict: str) -> str:
    return f'<span class="badge b-{esc(verdict)}">{esc(verdict.replace("_", " "))}</span>'


def _facts(rows: Sequence[tuple[str, str]]) -> str:
    body = "".join(f"<tr><th>{esc(k)}</th><td>{v}</td></tr>" for k, v in rows)
    return f'<table class="facts">{body}</table>'


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], numeric: Sequence[bool]) -> str:
    ths = "".join(f"<th>{esc(h)}</th>" for h in head)
    trs = "".join(
        "<tr>"
        + "".join(
            f'<td class="n">{c}</td>' if n else f"<td>{c}</td>"
            for c, n in zip(r, numeric, strict=True)
        )
        + "</tr>"
        for r in rows
    )
    return f"<table><thead><tr>{ths}</tr></thead><tbody>{trs}</tbody></table>"


def cause_badge(cause: str) -> str:
    """An audit's cause as triage attributed it (``untriaged`` where it has not)."""
    shown = cause or UNTRIAGED
    title = esc(MEANING.get(shown, ""))
    return (
        f'<span class="badge cause c-{esc(shown)}" title="{title}">'
        f"{esc(shown.replace('_', ' '))}</span>"
    )


def _triageable(row: IncidentRow) -> bool:
    """An audit with a cause, or one that triage could take (not incomparable)."""
    return row.kind == "audit" and (bool(row.cause) or row.verdict in TRIAGED)


def causes_table(causes: Sequence[tuple[str, int]]) -> str:
    """Causes with their counts, what each means and what to do about it."""
    return _table(
        ("cause", "incidents", "what it means", "what to do"),
        [
            (cause_badge(c), str(n), esc(MEANING.get(c, "")), esc(ACTION.get(c, "")))
            for c, n in causes
        ],
        (False, True, False, False),
    )


# ---------------------------------------------------------------------------------- overview


def _model_section(view: ModelView, ov: Overview, links: Links) -> str:
    head = f'<h2>Model <span class="mname">{esc(view.model)}</span></h2>'
    audited = "unknown (no tally)" if view.audited is None else str(view.audited)
    counts = ", ".join(f"{esc(v)} {n}" for v, n in view.verdicts if n)
    summary = (
        f"<p>Audited: {esc(audited)}. Non-identical rate: {esc(pct(view.rate))}."
        f" Verdicts: {counts or 'none'}. Incidents recorded: {view.incidents}"
        f' (<a href="{esc(links.overview(ov.filter.query(model=view.model)))}">list</a>).</p>'
    )
    chart = '<p class="muted">No audits yet.</p>'
    if ov.start is not None and ov.end is not None:
        chart = timeline(view.columns, ov.spans, ov.start, ov.end, view.with_denominators)
    rate_note = (
        "bars: non-identical audits per interval (by verdict); line: their share of comparable"
        " audits; band: the upstream's fingerprint, a dashed line where it changed"
    )
    if not view.with_denominators:
        rate_note = "bars: incidents per interval (no rate: identical audits are not counted)"
    inflight = '<p class="muted">No audits with an in-flight count.</p>'
    if view.inflight:
        inflight = inflight_curve(view.inflight)
    loops = '<p class="muted">No loops.</p>'
    if view.loops:
        loops = _table(
            ("channel", "source", "loops"),
            [(esc(ch), esc(src), str(n)) for ch, src, n in view.loops],
            (False, False, True),
        )
    if view.strategies is None:
        strategies = '<p class="muted">Recoveries: unknown (no tally).</p>'
    elif not view.strategies:
        strategies = '<p class="muted">No recoveries tried.</p>'
    else:
        strategies = _table(
            ("strategy", "retried", "recovered", "looped again", "recovery rate"),
            [
                (
                    esc(s.strategy),
                    str(s.retried),
                    str(s.recovered),
                    str(s.looped_again),
                    esc(pct(s.rate)),
                )
                for s in view.strategies
            ],
            (False, True, True, True, True),
        )
    causes = ""
    if view.causes:
        causes = (
            "<h3>Causes</h3><p class=\"small muted\">triage's verdicts on this model's audit"
            f" incidents (untriaged: not reached yet)</p>{causes_table(view.causes)}"
        )
    return (
        f'<section class="model" data-model="{esc(view.model)}">{head}{summary}{causes}'
        f'<h3>Verdicts over time</h3><p class="small muted">{rate_note}</p>{chart}'
        '<div class="grid"><div><h3>Divergence by requests in flight</h3>'
        '<p class="small muted">a rate that grows with the load is a batch effect</p>'
        f"{inflight}</div><div><h3>Loops</h3>{loops}<h3>Recoveries per strategy</h3>"
        f"{strategies}</div></div></section>"
    )


def _select(name: str, options: Sequence[str], current: str | None) -> str:
    opts = ['<option value="">any</option>']
    for value in options:
        sel = " selected" if value == current else ""
        opts.append(f'<option value="{esc(value)}"{sel}>{esc(value)}</option>')
    return f'<label>{esc(name)}<select name="{esc(name)}">{"".join(opts)}</select></label>'


def _filters(ov: Overview, links: Links) -> str:
    f = ov.filter
    mode = "client" if links.in_file else "server"
    action = "" if links.in_file else f' action="{esc(links.overview())}" method="get"'
    return (
        f'<form id="filters" class="filters" data-mode="{mode}"{action}>'
        + _select("model", ov.options["model"], f.model)
        + _select("verdict", ov.options["verdict"], f.verdict)
        + _select("mode", ov.options["mode"], f.mode)
        + _select("fingerprint", ov.options["fingerprint"], f.fingerprint)
        + f'<label>limit<input name="limit" type="number" min="1" value="{f.limit}"></label>'
        + '<button type="submit">filter</button></form>'
    )


def _row(row: IncidentRow, links: Links) -> str:
    attrs = (
        f' data-id="{esc(row.id)}" data-model="{esc(row.model)}" data-verdict="{esc(row.verdict)}"'
        f' data-mode="{esc(row.mode)}" data-fingerprint="{esc(row.fingerprint)}"'
        f' data-request="{esc(row.request_id)}" data-cause="{esc(row.cause)}"'
    )
    href = esc(links.incident(row.id))
    cause = cause_badge(row.cause) if _triageable(row) else ""
    # A request's retry can loop too: its attempt tells the rows of one request apart.
    attempt = "" if row.attempt is None else str(row.attempt)
    return (
        f"<tr{attrs}><td>{_time(row.ts)}</td><td>{esc(row.model)}</td><td>{badge(row.verdict)}</td>"
        f'<td>{esc(row.mode)}</td><td>{cause}</td><td class="sum"><a class="incident-link"'
        f' href="{href}">{esc(row.summary)}</a></td><td class="small">{esc(row.request_id)}</td>'
        f'<td class="n attempt">{attempt}</td>'
        f'<td class="small">{esc(row.fingerprint[:8])}</td></tr>'
    )


LIST_COLUMNS = (
    "time (UTC)",
    "model",
    "verdict",
    "mode",
    "cause",
    "what",
    "request",
    "attempt",
    "upstream",
)


def incident_list(ov: Overview, links: Links) -> str:
    shown = f"{len(ov.rows)} shown of {ov.matching} matching ({ov.recorded} recorded)"
    head = "".join(f"<th>{h}</th>" for h in LIST_COLUMNS)
    rows = "".join(_row(r, links) for r in ov.rows)
    empty = "" if ov.rows else '<p class="muted" id="none">No incidents match.</p>'
    return (
        f'<h2 id="list">Incidents, newest first</h2>{_filters(ov, links)}'
        f'<p class="small muted" id="shown">{shown}</p>'
        f'<table id="incidents"><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>{empty}'
    )


def engine_section(engine: EngineView | None) -> str:
    """What the engine loaded (live, or at the last mismatch) and what it does not meet."""
    if engine is None:
        return ""
    parts = [
        '<section id="engine"><h2>Engine: what loaded</h2>'
        f'<p class="small muted">from {esc(engine.origin)}; recipe'
        f" <code>{esc(engine.recipe or 'unknown')}</code>; a fact not listed is unknown</p>"
    ]
    if engine.mismatches:
        parts.append(
            '<p class="note" id="engine-mismatch">The engine does not run what'
            " [upstream.expect] declares:</p>"
            + _table(
                ("field", "declared", "loaded"),
                [
                    (esc(f), f"<code>{esc(d)}</code>", f"<code>{esc(ld)}</code>")
                    for f, d, ld in engine.mismatches
                ],
                (False, False, False),
            )
        )
    if engine.loaded:
        parts.append(
            _table(
                ("fact", "loaded"),
                [(esc(k), f"<code>{esc(v)}</code>") for k, v in engine.loaded],
                (False, False),
            )
        )
    if engine.unknown_env:
        parts.append(
            f"<p>Ignored as unknown by the engine: <code>{esc(', '.join(engine.unknown_env))}"
            "</code></p>"
        )
    if engine.fallbacks:
        parts.append(f"<p>Fallbacks: {esc('; '.join(engine.fallbacks))}</p>")
    parts.append("</section>")
    return "".join(parts)


def fingerprint_causes(ov: Overview) -> str:
    if not ov.causes_by_fingerprint:
        return ""
    rows = [
        (f"<code>{esc(fp)}</code>", ", ".join(f"{cause_badge(c)} {n}" for c, n in causes))
        for fp, causes in ov.causes_by_fingerprint
    ]
    return (
        '<h2 id="causes-by-upstream">Causes per upstream fingerprint</h2>'
        '<p class="small muted">the triaged audit incidents measured on each upstream</p>'
        + _table(("fingerprint", "causes"), rows, (False, False))
    )


def overview_body(ov: Overview, links: Links) -> str:
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in ov.notes)
    models = "".join(_model_section(v, ov, links) for v in ov.models)
    if not ov.models:
        models = '<p class="muted">Nothing audited and no incidents yet.</p>'
    spans = ""
    if ov.spans:
        spans = "<h2>Upstream fingerprints</h2>" + _table(
            ("fingerprint", "kind", "version", "first seen", "last seen"),
            [
                (
                    f"<code>{esc(s.fingerprint)}</code>",
                    esc(s.kind or ""),
                    esc(s.version or ""),
                    _time(s.first),
                    _time(s.last),
                )
                for s in ov.spans
            ],
            (False, False, False, False, False),
        )
    # The summary first (per model: rates, causes, charts), then what the upstream ran, and
    # the incident list last: a long list must not push the figures out of sight.
    jump = (
        f'<p class="small" id="to-list"><a href="#list">the incidents: {ov.matching} matching,'
        " below</a></p>"
    )
    return (
        f'<div id="overview"><h1>Determinism audit</h1>{notes}{jump}{models}'
        f"{fingerprint_causes(ov)}{engine_section(ov.engine)}{spans}"
        f"{incident_list(ov, links)}</div>"
    )


def overview_page(ov: Overview, links: Links, nonce: str) -> str:
    return document("detproxy incidents", overview_body(ov, links), nonce, ov.source, links)


# ---------------------------------------------------------------------------------- incidents


def _sides(pair: SideBySide) -> str:
    hidden = ""
    if pair.common_hidden:
        hidden = (
            f'<span class="muted">… {pair.common_hidden} characters in common before this</span>'
        )

    def side(name: str, mark: str, rest: str, cut: int) -> str:
        more = f'<span class="muted"> … {cut} more characters</span>' if cut else ""
        return (
            f'<div class="side" data-side="{name}"><h3>{name}</h3><pre class="text">'
            f'<mark class="div">{esc(mark)}</mark>{esc(rest)}{more}</pre></div>'
        )

    return (
        f"<h2>Outputs from the first divergent character (offset {pair.offset})</h2>"
        f'<p class="small">common prefix, its end:</p>{hidden}<pre class="text common">'
        f"{esc(pair.common)}</pre>"
        '<div class="sides">'
        + side("primary", pair.primary_mark, pair.primary_rest, pair.primary_cut)
        + side("shadow", pair.shadow_mark, pair.shadow_rest, pair.shadow_cut)
        + "</div>"
    )


def _overlap(value: bool | None) -> str:
    if value is None:
        return '<span class="muted">unknown</span>'
    return "yes: client requests ran during the shadow" if value else "no: it ran alone"


def audit_body(d: AuditDetail) -> str:
    row, div = d.row, d.divergence
    facts = [
        ("verdict", badge(row.verdict) + (f" ({esc(d.reason)})" if d.reason else "")),
        ("model", esc(row.model)),
        ("mode / endpoint / choice", f"{esc(row.mode)} / {esc(d.endpoint)} / {_num(d.choice)}"),
        ("time (UTC)", _time(row.ts)),
        ("request id", esc(row.request_id)),
        ("first divergent token", _num(div.index if div else None)),
        ("primary token there", _token(div.primary_token) if div else _num(None)),
        ("shadow token there", _token(div.shadow_token) if div else _num(None)),
        (
            "primary top-1/top-2 margin",
            _num(div.margin if div else None, " nats")
            + (" <b>near tie</b>" if div and div.near_tie else ""),
        ),
        ("max |Δ logprob| over the common prefix", _num(d.max_delta, " nats")),
        ("Δ of the primary's token there", _num(div.token_shift if div else None, " nats")),
        ("tokens primary / shadow", f"{_num(d.primary_tokens)} / {_num(d.shadow_tokens)}"),
        (
            "in flight at primary / shadow",
            f"{_num(d.inflight_primary)} / {_num(d.inflight_shadow)}",
        ),
        (
            "latency primary / shadow",
            f"{_num(d.primary_latency_s, ' s')} / {_num(d.shadow_latency_s, ' s')}",
        ),
        ("shadow overlapped traffic", _overlap(d.overlapped)),
        ("shadow target", esc(d.target or "")),
        ("output hash primary", f"<code>{esc(d.primary_hash)}</code>"),
        ("output hash shadow", f"<code>{esc(d.shadow_hash)}</code>"),
        ("request key", f"<code>{esc(d.request_key or '')}</code>"),
        (
            "upstream",
            f"<code>{esc(row.fingerprint)}</code> {esc(d.upstream_kind or '')}"
            f" {esc(d.upstream_version or '')}",
        ),
        ("measured on recipe", f"<code>{esc(row.recipe or 'unknown')}</code>"),
    ]
    if _triageable(row):
        facts.append(("cause", _cause_cell(row.cause, d.cause_evidence)))
    if d.primary_answer is not None or d.shadow_answer is not None:
        facts.append(
            ("answers primary / shadow", f"{_token(d.primary_answer)} / {_token(d.shadow_answer)}")
        )
    parts = [f"<h1>{badge(row.verdict)} {esc(row.summary)}</h1>", _facts(facts)]
    if div is not None and (div.primary_top or div.shadow_top):
        parts.append(
            "<h2>Top-k at the divergence</h2>"
            f'<p class="small muted">bar length: probability; the emitted token is marked.'
            f" Margin (primary top-1 minus top-2): {_num(div.margin, ' nats')}.</p>"
            '<div class="grid">'
            f"<div><h3>primary</h3>{topk_bars(div.primary_top, 'primary')}</div>"
            f"<div><h3>shadow</h3>{topk_bars(div.shadow_top, 'shadow')}</div></div>"
        )
    if d.cause_evidence:
        evidence = orjson.dumps(d.cause_evidence, option=orjson.OPT_INDENT_2).decode()
        parts.append(
            '<details id="cause-evidence"><summary>cause evidence (triage\'s runs)</summary>'
            f'<pre class="text">{esc(evidence)}</pre></details>'
        )
    if d.side_by_side is not None:
        parts.append(_sides(d.side_by_side))
    elif not d.text_stored:
        parts.append(
            '<p class="note" id="no-text">Text not stored (incidents.store_text is off):'
            " hashes, positions and numbers only.</p>"
        )
    if d.prompt is not None:
        parts.append(
            '<details id="prompt"><summary>prompt</summary>'
            f'<pre class="text">{esc(d.prompt)}</pre></details>'
        )
    return "".join(parts)


def _cause_cell(cause: str, evidence: dict[str, Any] | None) -> str:
    shown = cause or UNTRIAGED
    cell = f"{cause_badge(cause)} {esc(ACTION.get(shown, ''))}"
    missing = missing_evidence(evidence) if shown == "unknown" else None
    if missing:
        cell += f" <b>Missing:</b> {esc(missing)}"
    return cell


def _yes_no(value: bool | None) -> str:
    if value is None:
        return '<span class="muted">unknown</span>'
    return "yes" if value else "no"


def _done(d: LoopDetail) -> list[tuple[str, str]]:
    """What the policy did about the loop and how it came out."""
    if d.action is None:
        return [("what was done", '<span class="muted">not recorded (an older detproxy)</span>')]
    outcome = '<span class="muted">pending: the retry is running</span>'
    if d.outcome is not None:
        outcome = esc(d.outcome.replace("_", " "))
    facts = [("action", esc(d.action))]
    if d.action == "retry":
        facts.append(("strategy", esc(d.strategy) if d.strategy else _num(None)))
    facts += [("outcome", outcome), ("attempts of the request", _num(d.attempts))]
    if d.action == "retry":
        facts.append(("tokens the retry generated", _num(d.retry_tokens)))
        if d.kept_tokens:
            facts.append(("tokens kept from the looping attempt", _num(d.kept_tokens)))
    return facts


def loop_body(d: LoopDetail) -> str:
    row = d.row
    covered = d.period * d.repeats if d.period is not None and d.repeats is not None else None
    facts = [
        ("kind", badge("loop")),
        ("model", esc(row.model)),
        ("time (UTC)", _time(row.ts)),
        ("request id", esc(row.request_id)),
        ("source / channel / choice", f"{esc(d.source)} / {esc(d.channel)} / {_num(d.choice)}"),
        ("attempt", _num(d.attempt)),
        *_done(d),
        ("endpoint", esc(d.endpoint)),
        ("streamed", _yes_no(d.stream)),
        ("unit length (period)", _num(d.period, " chars")),
        ("repeats", _num(d.repeats)),
        ("loop starts at", _num(d.start_offset, " chars")),
        ("characters covered", _num(covered)),
        ("upstream", f"<code>{esc(row.fingerprint)}</code>"),
        ("measured on recipe", f"<code>{esc(row.recipe or 'unknown')}</code>"),
    ]
    parts = [f"<h1>{badge('loop')} {esc(row.summary)}</h1>", _facts(facts)]
    if d.period is not None and d.repeats is not None and d.period > 0 and d.repeats > 0:
        parts.append("<h2>Where it loops</h2>" + loop_strip(d.start_offset, d.period, d.repeats))
    if d.unit is not None:
        truncated = d.period is not None and d.period > len(d.unit)
        unit = f'<mark class="unit">{esc(d.unit)}{"…" if truncated else ""}</mark>'
        shown = min(d.repeats or 1, SHOWN_REPEATS)
        more = (d.repeats or 1) - shown
        tail = f'<span class="muted"> … and {more} more repeats</span>' if more > 0 else ""
        parts.append(
            f'<h2>The repeated unit</h2><pre class="text loop-text">{unit * shown}{tail}</pre>'
        )
    else:
        parts.append(
            '<p class="note" id="no-text">Text not stored (incidents.store_text is off):'
            " period, repeats and offsets only.</p>"
        )
    return "".join(parts)


def _side_of(side: dict[str, Any]) -> str:
    models = side.get("models")
    named = ", ".join(str(m) for m in models) if isinstance(models, list) else ""
    return (
        f"<code>{esc(side.get('fingerprint', ''))}</code> {esc(side.get('kind', ''))}"
        f" {esc(side.get('version', ''))} {esc(named)}"
    )


def change_body(d: ChangeDetail) -> str:
    row = d.row
    facts = [
        ("kind", badge("upstream_change")),
        ("time (UTC)", _time(row.ts)),
        ("before", _side_of(d.before)),
        ("after", _side_of(d.after)),
    ]
    changed = '<p class="muted">No identity field recorded as changed.</p>'
    if d.changed_fields:
        changed = _table(
            ("identity field", "before", "after"),
            [
                (esc(k), f"<code>{esc(a)}</code>", f"<code>{esc(b)}</code>")
                for k, a, b in d.changed_fields
            ],
            (False, False, False),
        )
    head = f"<h1>{badge('upstream_change')} {esc(row.summary)}</h1>"
    return f"{head}{_facts(facts)}<h2>What changed</h2>{changed}"


def engine_mismatch_body(d: EngineMismatchDetail) -> str:
    row = d.row
    facts = [
        ("kind", badge("engine_mismatch")),
        ("time (UTC)", _time(row.ts)),
        ("recipe (what loaded)", f"<code>{esc(row.recipe or 'unknown')}</code>"),
        ("upstream", f"<code>{esc(row.fingerprint)}</code>"),
        ("failed start", "yes" if d.start_failed else "no"),
    ]
    if d.unknown_env:
        facts.append(
            ("unknown variables (ignored)", f"<code>{esc(', '.join(d.unknown_env))}</code>")
        )
    if d.deprecated:
        facts.append(("deprecated", esc("; ".join(d.deprecated))))
    if d.fallbacks:
        facts.append(("fallbacks", esc("; ".join(d.fallbacks))))
    mismatches = _table(
        ("field", "declared", "loaded"),
        [
            (esc(f), f"<code>{esc(dc)}</code>", f"<code>{esc(ld)}</code>")
            for f, dc, ld in d.mismatches
        ],
        (False, False, False),
    )
    loaded = '<p class="muted">Nothing read of what loaded.</p>'
    if d.loaded:
        loaded = _table(
            ("fact", "loaded", "read from"),
            [(esc(k), f"<code>{esc(v)}</code>", esc(d.sources.get(k, ""))) for k, v in d.loaded],
            (False, False, False),
        )
    return (
        f"<h1>{badge('engine_mismatch')} {esc(row.summary)}</h1>{_facts(facts)}"
        f"<h2>Declared in [upstream.expect], not met</h2>{mismatches}"
        f'<h2>What loaded</h2><p class="small muted">a fact not listed is unknown</p>{loaded}'
    )


def restart_body(d: RestartDetail) -> str:
    row = d.row
    facts = [
        ("kind", badge("upstream_restart")),
        ("time (UTC)", _time(row.ts)),
        ("down for", _num(d.down_s, " s")),
        ("evidence", esc(d.evidence) if d.evidence else _num(None)),
        ("upstream (same identity)", f"<code>{esc(row.fingerprint)}</code>"),
        ("recipe", f"<code>{esc(row.recipe or 'unknown')}</code>"),
    ]
    return (
        f"<h1>{badge('upstream_restart')} {esc(row.summary)}</h1>{_facts(facts)}"
        '<p class="small muted">The engine came back with the same identity: audits before and'
        " after it measure the same recipe.</p>"
    )


def detail_body(d: Detail) -> str:
    if isinstance(d, AuditDetail):
        return audit_body(d)
    if isinstance(d, LoopDetail):
        return loop_body(d)
    if isinstance(d, EngineMismatchDetail):
        return engine_mismatch_body(d)
    if isinstance(d, RestartDetail):
        return restart_body(d)
    return change_body(d)


def incident_page(d: Detail, links: Links, nonce: str, source: str) -> str:
    row = d.row
    back = links.overview({"model": row.model} if row.model else None)
    crumbs = (
        f'<p class="small"><a href="{esc(back)}">← incidents'
        f"{' of ' + esc(row.model) if row.model else ''}</a>"
        f" · incident <code>{esc(row.id)}</code></p>"
    )
    body = f'<article class="incident-page" id="i-{esc(row.id)}">{crumbs}{detail_body(d)}</article>'
    return document(f"detproxy incident {row.id}", body, nonce, source, links)


def error_page(status: int, message: str, links: Links, nonce: str) -> str:
    body = (
        f'<h1>{status}</h1><p class="note" id="error">{esc(message)}</p>'
        f'<p><a href="{esc(links.overview())}">back to the incidents</a></p>'
    )
    return document(f"detproxy: {status}", body, nonce, "", links)


def report_page(ov: Overview, details: Sequence[Detail], nonce: str, omitted: int) -> str:
    """One file: the overview and every incident's page as an anchor (``#i-<id>``)."""
    links = Links(base=None)
    note = ""
    if omitted:
        note = f'<p class="note">{omitted} older incident(s) left out of this file.</p>'
    pages = "".join(
        f'<article class="incident-page" id="i-{esc(d.row.id)}"><p class="small">'
        f'<a href="#">← all incidents</a> · incident <code>{esc(d.row.id)}</code></p>'
        f"{detail_body(d)}</article>"
        for d in details
    )
    return document(
        "detproxy incident report", overview_body(ov, links) + note + pages, nonce, ov.source, links
    )
