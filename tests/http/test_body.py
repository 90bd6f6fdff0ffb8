"""A client's body as the stages take it: JSON by its Content-Type, an object, or a clear 400."""

from __future__ import annotations

import pytest

from proxy.http.body import BadRequest, ensure_json_content_type, parse_object


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/json; charset=latin-1", False),
        ("application/jsonl", False),
        ("text/plain", False),
        (None, False),
    ],
)
def test_content_type(content_type: str | None, ok: bool) -> None:
    if ok:
        ensure_json_content_type(content_type)
    else:
        with pytest.raises(BadRequest) as exc:
            ensure_json_content_type(content_type)
        assert exc.value.status == 400


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (b"{", "not valid JSON"),
        (b"\xff{}", "not valid UTF-8"),
        (b"[1]", "must be a JSON object"),
    ],
)
def test_a_body_that_is_not_a_json_object_is_a_400_that_says_why(body: bytes, says: str) -> None:
    with pytest.raises(BadRequest) as exc:
        parse_object(body)
    assert exc.value.status == 400 and says in exc.value.message, exc.value.message
    assert parse_object(b'{"a": 1}') == {"a": 1}
