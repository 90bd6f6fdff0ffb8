"""The pieces of ``detproxy sweep``: SSE chunk counting, percentiles, rendering of gaps."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import Any

import orjson
import pytest

from proxy.tools.sweep.chart import to_html, to_svg
from proxy.tools.sweep.load import RequestRecord, Target, Window, record_event
from proxy.tools.sweep.render import to_markdown, to_text
from proxy.tools.sweep.run import normalise_base
from proxy.tools.sweep.stats import level_summary, percentile, warnings_for


def chunk(**delta: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}


def test_text_reasoning_and_completions_chunks_count_as_tokens() -> None:
    rec = RequestRecord(sent=0.0)
    record_event(rec, chunk(role="assistant", content=""), 0.1, 10.0)  # no text: not a token
    record_event(rec, chunk(reasoning="think"), 0.2, 10.0)
    record_event(rec, chunk(reasoning_content="more"), 0.25, 10.0)
    record_event(rec, chunk(content="answer"), 0.35, 10.0)
    record_event(rec, {"choices": [{"index": 0, "text": "t", "finish_reason": None}]}, 0.5, 10.0)
    record_event(rec, chunk(content="late"), 11.0, 10.0)  # after the deadline: not counted
    assert rec.chunk_tokens == 4 and rec.ttft == pytest.approx(0.2)
    assert rec.gaps == pytest.approx([0.05, 0.1, 0.15])
    record_event(rec, {"choices": [], "usage": {"completion_tokens": 9}}, 0.6, 10.0)
    assert rec.tokens == 4  # usage counts only for a request that completed in the window
    rec.done = True
    assert rec.tokens == 9


def test_in_band_error_is_recorded() -> None:
    rec = RequestRecord(sent=0.0)
    record_event(rec, {"error": {"message": "boom", "code": 500}}, 0.1, 10.0)
    assert rec.error == "in-band error: boom"


def test_request_body_merges_extra_and_rotates_prompts() -> None:
    target = Target("http://h", "m", 16, extra_body={"top_k": 1}, prompts=("a", "b"))
    first, second, third = (orjson.loads(target.body(i)) for i in range(3))
    assert first["messages"][0]["content"] == "a" and second["messages"][0]["content"] == "b"
    assert third["messages"] == first["messages"]
    assert first["top_k"] == 1 and first["max_tokens"] == 16 and first["temperature"] == 0
    completions = Target("http://h", "m", 16, endpoint="completions", prompts=("p",))
    assert orjson.loads(completions.body(0))["prompt"] == "p"
    assert completions.url == "http://h/v1/completions"


def test_percentile_interpolates() -> None:
    assert percentile([], 0.5) is None
    assert percentile([3.0], 0.95) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == pytest.approx(2.5)
    assert percentile(list(map(float, range(101))), 0.95) == pytest.approx(95.0)


def test_normalise_base() -> None:
    assert normalise_base("http://h:8000/v1/") == "http://h:8000"
    assert normalise_base("http://h:8000/") == "http://h:8000"


def report_with_empty_level() -> dict[str, Any]:
    empty = [Window(2, 1, 1.0), Window(2, 2, 1.0)]
    level = level_summary(2, empty, 0.1)
    fp = {"fingerprint": "ab", "kind": "unknown", "version": None, "models": []}
    fingerprint = {"before": fp, "after": fp, "changed": False, "changes": []}
    return {
        "upstream": "http://h",
        "model": "m",
        "elapsed_s": 2.0,
        "config": {"duration_s": 1.0, "repeats": 2, "max_tokens": 8},
        "fingerprint": fingerprint,
        "levels": [level],
        "warnings": warnings_for([level], fingerprint, 0.1),
    }


def test_a_level_without_tokens_renders() -> None:
    report = report_with_empty_level()
    level = report["levels"][0]
    assert level["tokens_per_s"] == {"mean": 0.0, "min": 0.0, "max": 0.0, "spread": None}
    assert level["ttft_s"] == {"p50": None, "p95": None}
    assert [w["kind"] for w in report["warnings"]] == ["no_tokens"]
    row = next(line for line in to_text(report).splitlines() if line.startswith("   2"))
    assert row.split()[:6] == ["2", "0.0", "0.0", "0.0", "-", "-"]
    assert "| 2 | 0.0 | 0.0 | 0.0 | - |" in to_markdown(report)
    ET.fromstring(to_svg(report))
    assert "<svg" in to_html(report)
