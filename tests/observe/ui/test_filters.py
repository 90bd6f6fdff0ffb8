"""The incident list's query parameters: what is accepted, what gets a 400 and why."""

from __future__ import annotations

import pytest

from proxy.observe.ui.filters import FilterError, IncidentFilter, parse_filter
from proxy.observe.ui.incident import row_of
from tests.observe.ui.records import audit, loop


def test_filters_parse_and_match() -> None:
    f = parse_filter([("model", "m1"), ("verdict", "text_divergence"), ("fingerprint", "0123")])
    rows = [row_of(audit()), row_of(audit(model="m2")), row_of(loop())]
    assert [r is not None and f.matches(r) for r in rows] == [True, False, False]
    assert parse_filter([("model", ""), ("limit", "")]) == IncidentFilter()
    loops = parse_filter([("verdict", "loop")])
    assert [r is not None and loops.matches(r) for r in rows] == [False, False, True]
    prefill = parse_filter([("mode", "prefill")])
    assert not any(r is not None and prefill.matches(r) for r in rows)
    assert parse_filter([("limit", "7")]).limit == 7


@pytest.mark.parametrize(
    ("pairs", "param", "says"),
    [
        ([("verdict", "bad")], "verdict", "verdict must be one of identical"),
        ([("mode", "FULL")], "mode", "mode must be one of full"),
        ([("fingerprint", "XYZ")], "fingerprint", "hex digits"),
        ([("limit", "0")], "limit", "from 1 to 10000"),
        ([("limit", "1e3")], "limit", "from 1 to 10000"),
        ([("limit", "9" * 5000)], "limit", "from 1 to 10000"),
        ([("modle", "m1")], "modle", "unknown query parameter 'modle'"),
        ([("model", "a"), ("model", "b")], "model", "more than once"),
        ([("model", "x" * 300)], "model", "at most 256"),
        ([("model", "a\nb")], "model", "printable"),
    ],
)
def test_bad_parameters_say_what_is_wrong(
    pairs: list[tuple[str, str]], param: str, says: str
) -> None:
    with pytest.raises(FilterError) as caught:
        parse_filter(pairs)
    assert caught.value.param == param
    assert says in str(caught.value)


def test_query_keeps_the_other_filters() -> None:
    f = IncidentFilter(model="m1", verdict="loop", limit=5)
    assert f.query(model="m2") == {"model": "m2", "verdict": "loop", "limit": "5"}
    assert f.query(verdict=None) == {"model": "m1", "limit": "5"}
