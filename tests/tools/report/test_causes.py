"""``detproxy report``: triage's causes per model with what to do (SPEC 1.14), and what the
engine loaded (SPEC 1.15: engine_mismatch and upstream_restart lines, the recipe audited on)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.tools.report.causes import ACTION, CAUSES, MEANING, cause_order, missing_evidence
from proxy.tools.report.cli import main
from tests.tools.report.logs import audit, write


def cause_line(
    of: dict[str, Any], cause: str, evidence: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The follow-up line triage appends for an audit incident already written."""
    return {
        "kind": "cause",
        "ts": of["ts"] + 30,
        "audit_ts": of["ts"],
        "request_id": of["request_id"],
        "model": of["model"],
        "mode": of["mode"],
        "choice": of["choice"],
        "verdict": of["verdict"],
        "cause": cause,
        "cause_evidence": evidence or {},
        "upstream_fingerprint": "fp1",
    }


def run(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    assert main(list(args)) == 0, "detproxy report failed"
    return capsys.readouterr().out


def test_every_cause_has_a_meaning_and_an_action() -> None:
    for cause in CAUSES:
        assert MEANING[cause] and ACTION[cause], f"{cause} has no words"
    assert [c for c in sorted(["unknown", "untriaged", "batch", "intrinsic"], key=cause_order)] == [
        "intrinsic",
        "batch",
        "unknown",
        "untriaged",
    ]
    assert missing_evidence({"missing": ["a quiet time", "a reference"]}) == (
        "a quiet time, a reference"
    )
    assert missing_evidence({"missing": []}) is None
    assert missing_evidence("junk") is None


@pytest.fixture
def caused(tmp_path: Path) -> Path:
    a1 = audit("r1", "text_divergence", ts=100.0, index=3)
    a2 = audit("r2", "logprob_drift", ts=101.0, delta=0.3)
    a3 = audit("r3", "logprob_drift", ts=102.0, delta=0.2)
    a4 = audit("r4", "text_divergence", ts=103.0, index=9)  # never triaged
    a5 = audit("r5", "answer_divergence", ts=104.0, index=1, model="llama-3")
    a5["cause"], a5["cause_evidence"] = "intrinsic", {"distinct": 3}  # inline: the ring's form
    a1["upstream"] = {"fingerprint": "fp1", "recipe": "r" * 16}
    return write(
        tmp_path / "incidents.jsonl",
        [
            a1,
            a2,
            a3,
            a4,
            a5,
            cause_line(a1, "intrinsic"),
            cause_line(a2, "prefix_cache"),
            cause_line(a3, "unknown", {"missing": ["no quiet time within 60 s"]}),
        ],
    )


def test_causes_per_model_from_follow_up_and_inline(
    caused: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = orjson.loads(run(capsys, "--json", str(caused)))
    assert report["lines"]["cause"] == 3 and report["lines"]["unknown_kind"] == 0
    qwen = report["models"]["qwen3-8b"]
    assert {c: v["count"] for c, v in qwen["causes"].items()} == {
        "intrinsic": 1,
        "prefix_cache": 1,
        "unknown": 1,
        "untriaged": 1,
    }
    assert list(qwen["causes"]) == ["intrinsic", "prefix_cache", "unknown", "untriaged"]
    assert qwen["causes"]["prefix_cache"]["action"] == ACTION["prefix_cache"]
    assert qwen["unknown_missing"] == {"no quiet time within 60 s": 1}
    assert report["models"]["llama-3"]["causes"]["intrinsic"]["count"] == 1
    assert report["all_models"]["causes"]["intrinsic"]["count"] == 2
    by_request = {w["request_id"]: w["cause"] for w in report["worst"]}
    assert by_request == {
        "r1": "intrinsic",
        "r2": "prefix_cache",
        "r3": "unknown",
        "r4": None,
        "r5": "intrinsic",
    }
    assert report["engine"]["recipes"] == ["r" * 16]
    assert report["causes_by_upstream"] == [
        {
            "fingerprint": None,
            "recipe": None,
            "causes": {"intrinsic": 1, "prefix_cache": 1, "unknown": 1},
        },
        {"fingerprint": "fp1", "recipe": "r" * 16, "causes": {"intrinsic": 1}},
    ]


def test_causes_table_in_text_and_markdown(
    caused: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = run(capsys, str(caused))
    assert "what to do" in text, "no causes table in the text report"
    flat = " ".join(text.split())  # paragraphs and cells are wrapped
    assert "cache_salt per tenant" in flat and "kernel" in flat
    assert "the evidence missing: no quiet time within 60 s (1)" in flat
    assert "untriaged" in text
    assert "Causes per upstream" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("fp1"))
    assert "r" * 16 in row and "intrinsic 1" in row, f"per-upstream row wrong: {row!r}"
    markdown = run(capsys, "--markdown", str(caused))
    assert "| prefix cache | 1 |" in markdown, "no prefix cache row in the markdown table"


def test_a_log_without_causes_has_no_causes_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "i.jsonl", [audit("r1", "incomparable", ts=1.0)])
    report = orjson.loads(run(capsys, "--json", str(path)))
    assert report["models"]["qwen3-8b"]["causes"] == {}
    assert "what to do" not in run(capsys, str(path))


def test_a_cause_whose_incident_rotated_away_is_counted_but_merged_nowhere(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = audit("r9", "text_divergence", ts=5.0, index=1)
    path = write(tmp_path / "i.jsonl", [cause_line(gone, "batch")])
    report = orjson.loads(run(capsys, "--json", str(path)))
    assert report["lines"]["cause"] == 1 and report["models"] == {}


MISMATCH = {
    "kind": "engine_mismatch",
    "ts": 200.0,
    "mismatches": [
        {"field": "attention_backend", "expected": "FLASHINFER", "loaded": "FLASH_ATTN"},
        {"field": "unknown_env", "expected": [], "loaded": ["VLLM_ATTENTION_BACKEND"]},
    ],
    "loaded": {
        "facts": {"engine": "vllm", "version": "0.23.0", "attention_backend": "FLASH_ATTN"},
        "sources": {},
        "unknown_env": ["VLLM_ATTENTION_BACKEND"],
        "deprecated": [],
        "fallbacks": [],
        "start_failed": False,
    },
    "recipe": "0123456789abcdef",
    "upstream": {"fingerprint": "fp1", "kind": "vllm", "version": "0.23.0", "models": []},
}
RESTART = {
    "kind": "upstream_restart",
    "ts": 300.0,
    "down_s": 4.5,
    "evidence": "process_start_time_seconds moved",
    "upstream": {"fingerprint": "fp1"},
}


def test_engine_mismatch_and_restart_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "i.jsonl", [MISMATCH, RESTART, {**RESTART, "ts": 310.0}])
    report = orjson.loads(run(capsys, "--json", str(path)))
    assert report["lines"]["engine_mismatch"] == 1 and report["lines"]["upstream_restart"] == 2
    assert report["lines"]["unknown_kind"] == 0
    engine = report["engine"]
    assert engine["mismatches"][0]["recipe"] == "0123456789abcdef"
    assert engine["mismatches"][0]["fields"] == [
        {"field": "attention_backend", "declared": "FLASHINFER", "loaded": "FLASH_ATTN"},
        {"field": "unknown_env", "declared": "[]", "loaded": '["VLLM_ATTENTION_BACKEND"]'},
    ]
    assert engine["loaded"]["attention_backend"] == "FLASH_ATTN"
    assert engine["restarts"] == {
        "count": 2,
        "last": "1970-01-01T00:05:10.000Z",
        "longest_down_s": 4.5,
    }
    text = run(capsys, str(path))
    assert "Engine (what loaded)" in text, "no engine section in the text report"
    flat = " ".join(text.split())  # paragraphs are wrapped
    assert "1 engine mismatch" in flat and "2 upstream restarts" in flat
    row = next(line for line in text.splitlines() if line.strip().startswith("attention_backend"))
    assert "FLASHINFER" in row and "FLASH_ATTN" in row, f"mismatch row wrong: {row!r}"
    assert "restarted 2 times" in flat and "the longest down 4.5 s" in flat
