"""The event log on triage: each cause said with what it means, intrinsic as a warning, unknown
with what was missing; dropped triages said, repeats held back."""

from __future__ import annotations

import logging

from proxy.events import CauseAttributed, TriageDropped
from tests.observe.test_log import Lines, event_log, lines  # noqa: F401 (the fixture)


def cause(name: str, rid: str = "r1", **evidence: object) -> CauseAttributed:
    return CauseAttributed(
        request_id=rid,
        model="m",
        mode="full",
        choice=0,
        verdict="text_divergence",
        cause=name,
        evidence={"reason": "why", "missing": [], **evidence},
        timestamp=1.0,
        audit_ts=0.5,
    )


def test_causes_are_said_with_what_they_mean(lines: Lines) -> None:  # noqa: F811
    bus, _ = event_log()
    bus.publish(cause("intrinsic"))
    bus.publish(cause("batch"))
    bus.publish(cause("unknown", missing=["no way to run cold on this engine"]))
    (warning,) = lines.at(logging.WARNING)
    assert warning.startswith("cause of model m's text_divergence (full), request r1: intrinsic")
    assert "a bug to report" in warning
    batch, unknown = lines.at(logging.INFO)
    assert "batch composition" in batch
    assert unknown.endswith("missing: no way to run cold on this engine"), unknown


def test_dropped_triages_are_said_once_per_repeat_window(lines: Lines) -> None:  # noqa: F811
    bus, _ = event_log()
    for _ in range(3):
        bus.publish(TriageDropped("m", "rate_limit"))
    assert lines.at(logging.INFO) == [
        "triage of a divergent audit dropped: attribution.max_per_minute left no start within"
        " attribution.max_wait_s"
    ]
