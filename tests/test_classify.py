from __future__ import annotations

from typing import Any

import pytest

from proxy.classify import classify


@pytest.mark.parametrize(
    ("body", "deterministic"),
    [
        ({"temperature": 0}, True),
        ({"temperature": 0.0}, True),
        ({"temperature": 5e-6}, True),
        ({"temperature": 0.7}, False),
        ({"temperature": 0.7, "top_k": 1}, True),
        ({}, False),  # no temperature: the model's generation config decides, not greedy
        ({"seed": 3, "temperature": 0.8}, False),
        ({"temperature": "0"}, False),  # wrong type: forwarded unaudited
        ({"temperature": True}, False),
        ({"top_k": "1"}, False),
    ],
)
def test_deterministic(body: dict[str, Any], deterministic: bool) -> None:
    assert classify("chat", body).deterministic is deterministic


def test_declared_default_and_seeded() -> None:
    assert classify("chat", {}, default_temperature=0.0).deterministic
    assert not classify("chat", {}, default_temperature=0.6).deterministic
    assert classify(
        "chat", {"seed": 1, "temperature": 0.8}, seeded_is_deterministic=True
    ).deterministic


def test_view_is_tolerant() -> None:
    view = classify("completions", {"model": 3, "stream": "yes", "temperature": 0})
    assert (view.model, view.stream, view.well_typed, view.deterministic) == (
        "",
        False,
        False,
        False,
    )
    view = classify("chat", {"model": "m", "stream": True, "temperature": 0})
    assert (view.model, view.stream, view.well_typed, view.deterministic) == ("m", True, True, True)
