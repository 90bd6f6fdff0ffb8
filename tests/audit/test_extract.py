"""Answer extractors: JSON paths (plain, fenced, embedded), regex groups, spec validation."""

from __future__ import annotations

import pytest

from proxy.audit.extract import JsonPathExtractor, RegexExtractor, build_extractor

DOC = '{"answer": {"date": "2024-03-01", "amount": 12.5}, "items": [{"amount": 3}, {"b": [1, 2]}]}'


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("$.answer.date", '"2024-03-01"'),
        ("$.answer.amount", "12.5"),
        ("$.items[0].amount", "3"),
        ("$.items[1].b[-1]", "2"),
        ("$['answer'][\"date\"]", '"2024-03-01"'),
        ("$.answer", '{"amount":12.5,"date":"2024-03-01"}'),
        ("$.missing", None),
        ("$.items[5]", None),
        ("$.answer[0]", None),
        ("$.items.amount", None),
    ],
)
def test_json_paths(path: str, expected: str | None) -> None:
    assert JsonPathExtractor(path).extract(DOC) == expected


def test_json_sorted_keys_make_equal_answers_equal() -> None:
    ex = JsonPathExtractor("$")
    assert ex.extract('{"b": 1, "a": [2, {"d": 1, "c": 0}]}') == ex.extract(
        '  {"a":[2,{"c":0,"d":1}],"b":1}\n'
    )
    assert ex.extract("null") == "null"
    assert (
        ex.extract('{"n": 123456789012345678901234567890}')
        == '{"n":123456789012345678901234567890}'
    )


def test_json_fences_and_embedded_spans() -> None:
    ex = JsonPathExtractor("$.total")
    assert ex.extract('```json\n{"total": 42}\n```') == "42"
    assert ex.extract('Here you go:\n```\n{"total": 7}\n```\nThanks') == "7"
    assert ex.extract('The result is {"total": 9} as requested.') == "9"
    assert ex.extract('Like {"total": 0}. Answer:\n```json\n{"total": 42}\n```') == "42"
    assert ex.extract('See [1] and {"x": {"total": 0}} then {"total": 5}') == "5"
    assert ex.extract("no json at all") is None
    assert ex.extract('{"total": ') is None
    assert JsonPathExtractor("$[1]").extract("values: [4, 5, 6]") == "5"


def test_regex_groups() -> None:
    assert RegexExtractor(r"Answer:\s*(\S+)").extract("blah Answer:  42 \n") == "42"
    assert (
        RegexExtractor(r"\d{4}-\d\d-\d\d").extract("on 2024-03-01 and 2025-01-01") == "2024-03-01"
    )
    assert RegexExtractor(r"(?P<y>\d{4})-(?P<m>\d\d)", group="m").extract("2024-03") == "03"
    assert RegexExtractor(r"(a)|(b)", group=1).extract("b") is None
    assert RegexExtractor(r"(x)(y)", group=2).extract("xy") == "y"
    assert RegexExtractor(r"(x)", group=0).extract(" x ") == "x"
    assert RegexExtractor(r"zzz").extract("abc") is None


def test_bad_regex_groups_raise() -> None:
    with pytest.raises(ValueError, match="no group named"):
        RegexExtractor(r"(?P<a>x)", group="b")
    with pytest.raises(ValueError, match="group"):
        RegexExtractor(r"(x)", group=2)
    with pytest.raises(ValueError, match="does not compile"):
        RegexExtractor(r"(unclosed")


def test_build_extractor() -> None:
    ex = build_extractor("json:$.answer.date")
    assert isinstance(ex, JsonPathExtractor)
    assert ex.extract(DOC) == '"2024-03-01"'
    rx = build_extractor(r"regex:total: (\d+)")
    assert isinstance(rx, RegexExtractor)
    assert rx.extract("total: 17") == "17"
    assert build_extractor("regex:a:b").extract("xa:by") == "a:b"  # colons in the pattern


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("", "expected 'json:"),
        ("json", "expected 'json:"),
        ("xpath://a", "expected 'json:"),
        ("json:", "JSON path is empty"),
        ("json:answer.date", "must start with '\\$'"),
        ("json:$.a..b", "unexpected"),
        ("json:$.a[x]", "unexpected"),
        ("regex:", "regex is empty"),
        ("regex:(a", "does not compile"),
    ],
)
def test_bad_specs(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_extractor(spec)
