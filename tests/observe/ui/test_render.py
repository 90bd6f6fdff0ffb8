"""HTML of the pages: what untrusted text becomes, the bars drawn, the views without text."""

from __future__ import annotations

import re

from proxy.observe.ui.filters import IncidentFilter
from proxy.observe.ui.incident import detail_of
from proxy.observe.ui.overview import Inputs, build_overview
from proxy.observe.ui.page import Links
from proxy.observe.ui.render import incident_page, overview_page
from tests.observe.ui.records import audit, loop

EVIL = '<script>alert("x")</script><img src=x onerror=alert(1)>'


def scripts(page: str) -> list[str]:
    return re.findall(r"<script\b[^>]*>", page)


def test_untrusted_text_is_escaped_everywhere() -> None:
    record = audit(
        model=f"m{EVIL}",
        tokens=(EVIL, " dog"),
        primary_top=((EVIL, -0.5), (" dog", -1.0)),
        texts=(f"same {EVIL} primary", "same shadow"),
        prompt=EVIL,
    )
    record["request_id"] = EVIL
    detail = detail_of(record)
    assert detail is not None
    page = incident_page(detail, Links(), "NONCE", "live")
    assert scripts(page) == ['<script nonce="NONCE">']  # only the page's own
    assert "<img" not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    ov = build_overview(
        Inputs([record], None, None, None, None, (), (), None, EVIL), IncidentFilter()
    )
    listing = overview_page(ov, Links(), "NONCE")
    assert scripts(listing) == ['<script nonce="NONCE">'] and "<img" not in listing


def test_an_audit_page_draws_both_topk_and_marks_the_divergent_token() -> None:
    detail = detail_of(audit(texts=("The cat sat.", "The dog sat."), prompt="say it"))
    assert detail is not None
    page = incident_page(detail, Links(), "N", "live")
    assert len(re.findall(r'class="bar topk-bar', page)) == 4
    assert len(re.findall(r'class="bar topk-bar chosen"', page)) == 2
    assert (
        '<mark class="div"> cat</mark> sat.' in page
        and '<mark class="div"> dog</mark> sat.' in page
    )
    assert "0.02 nats <b>near tie</b>" in page
    assert "yes: client requests ran during the shadow" in page
    assert 'id="no-text"' not in page


def test_without_stored_text_the_page_shows_hashes_positions_and_numbers() -> None:
    detail = detail_of(audit(texts=None))
    assert detail is not None
    page = incident_page(detail, Links(), "N", "live")
    assert 'id="no-text"' in page and "<mark" not in page
    assert "a" * 32 in page and "b" * 32 in page
    assert len(re.findall(r'class="bar topk-bar', page)) == 4  # top-k is not text: still drawn


def test_a_loop_page_marks_each_shown_repeat_and_draws_them_all() -> None:
    detail = detail_of(loop(repeats=6))
    assert detail is not None
    page = incident_page(detail, Links(), "N", "live")
    assert page.count('<mark class="unit">') == 3 and "and 3 more repeats" in page
    assert len(re.findall(r'class="loop-unit', page)) == 6
    bare = incident_page(detail_of(loop(unit=None)), Links(), "N", "live")  # type: ignore[arg-type]
    assert '<mark class="unit">' not in bare and 'id="no-text"' in bare
    assert len(re.findall(r'class="loop-unit', bare)) == 6


def test_links_point_at_the_live_pages_or_at_anchors_in_a_file() -> None:
    ov = build_overview(
        Inputs([audit()], None, None, None, None, (), (), None, "x"), IncidentFilter()
    )
    row_id = ov.rows[0].id
    assert f'href="/detproxy/ui/incident/{row_id}"' in overview_page(ov, Links(), "N")
    assert f'href="#i-{row_id}"' in overview_page(ov, Links(base=None), "N")


def test_a_loop_page_says_what_was_done_and_how_it_came_out() -> None:
    record = loop(action="retry", strategy="continue", outcome="recovered", retry_tokens=120)
    detail = detail_of(record)
    assert detail is not None
    facts = dict(
        re.findall(
            r"<tr><th>([^<]*)</th><td>(.*?)</td></tr>", incident_page(detail, Links(), "N", "live")
        )
    )
    assert (facts["action"], facts["strategy"], facts["outcome"]) == (
        "retry",
        "continue",
        "recovered",
    )
    assert (facts["attempts of the request"], facts["tokens the retry generated"]) == ("2", "120")
    # A boolean as a person reads it, not Python's repr.
    assert facts["streamed"] == "yes" and "False" not in facts.values()
    pending = detail_of(loop(action="retry"))
    assert pending is not None
    assert "pending: the retry is running" in incident_page(pending, Links(), "N", "live")
    older = detail_of(loop())  # a line of a detproxy that did not say what it did
    assert older is not None
    assert "not recorded (an older detproxy)" in incident_page(older, Links(), "N", "live")


def test_the_list_tells_a_requests_attempts_apart() -> None:
    first = loop("r1", ts=100.0, action="retry", outcome="looped_again", strategy="restart")
    second = loop("r1", ts=101.0, attempt=2, action="abort", outcome="attempts_exhausted")
    ov = build_overview(
        Inputs([second, first], None, None, None, None, (), (), None, "x"), IncidentFilter()
    )
    page = overview_page(ov, Links(), "N")
    head = re.search(r'<table id="incidents"><thead><tr>(.*?)</tr>', page)
    assert head is not None and "<th>attempt</th>" in head[1]
    attempts = re.findall(r'<td class="n attempt">(\d*)</td>', page)
    assert attempts == ["2", "1"]
    assert "retry (restart): looped again" in page and "abort: attempts exhausted" in page


def test_the_overview_leads_with_the_summary_and_lists_incidents_after() -> None:
    records = [audit(f"r{i}", ts=1_700_000_000.0 + i) for i in range(120)]
    tally = {("m1", "full", "identical"): 900, ("m1", "full", "text_divergence"): 120}
    ov = build_overview(Inputs(records, tally, {}, {}, None, (), (), None, "x"), IncidentFilter())
    page = overview_page(ov, Links(), "N")
    summary, charts = page.index('<section class="model"'), page.index('<svg class="chart')
    listing = page.index('<h2 id="list">')
    assert summary < charts < listing, "the incident list comes before the summary"
    assert "Non-identical rate: 11.76%" in page[:listing]
    assert page.index('href="#list"') < summary  # a way down to the list, at the top
