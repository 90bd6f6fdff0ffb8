"""``detproxy report``: exact figures from hand-built incident logs, in all three formats."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.tools.report.cli import main
from tests.tools.report.logs import audit, loop, tally, write

Z = 1.959963984540054

QWEN_TALLY = {
    "qwen3-8b": {
        "full": {
            "identical": 80,
            "logprob_drift": 6,
            "text_divergence": 4,
            "answer_divergence": 2,
            "incomparable": 3,
        },
        "prefill": {"identical": 18, "text_divergence": 2},
    }
}
P2_TALLY = {
    "llama-3": {"full": {"identical": 40, "answer_divergence": 1}},
    "qwen3-8b": {"n_choices": {"identical": 5, "text_divergence": 1}},
}


def wilson_quadratic(k: int, n: int) -> tuple[float, float]:
    """The Wilson interval as the roots of its quadratic (a different route to the same values)."""
    p = k / n
    root = Z * math.sqrt(Z * Z + 4 * n * p * (1 - p))
    return (2 * n * p + Z * Z - root) / (2 * (n + Z * Z)), (2 * n * p + Z * Z + root) / (
        2 * (n + Z * Z)
    )


@pytest.fixture
def logs(tmp_path: Path) -> list[Path]:
    current = write(
        tmp_path / "incidents.jsonl",
        [
            tally(  # each process's newest tally: after every incident line below
                "p1",
                2000.0,
                QWEN_TALLY,
                loops={
                    "qwen3-8b": {"reasoning": {"proxy": 3, "runaway": 1}, "content": {"engine": 1}}
                },
                policy_actions={
                    "qwen3-8b": {
                        "retry": {"recovered": 3, "looped_again": 1},
                        "abort": {"budget_exhausted": 1},
                    }
                },
                shadows_dropped={"queue_full": 2, "rate": 1},
            ),
            tally("p2", 1950.0, P2_TALLY, shadows_dropped={"queue_full": 4}),
            audit("a1", "text_divergence", ts=1000, index=0, margin=0.02, delta=0.5),
            audit("a2", "text_divergence", ts=1001, index=2, margin=0.3, delta=1.25),
            audit("a3", "text_divergence", ts=1002, index=17, margin=0.05, delta=None),
            audit("a4", "answer_divergence", ts=1003, index=300, margin=0.7, delta=0.1),
            b"not json at all\n",
            b"[1, 2]\n",
            b"\n",
            b'{"kind": "mystery", "ts": 1}\n',
            b'{"kind": "audit", "ts": "yesterday"}\n',
            loop("l1", ts=1010, model="qwen3-8b", channel="reasoning", source="proxy"),
            b'{"kind": "audit", "ts": 1',  # cut short by a crash
        ],
    )
    rotated = write(
        tmp_path / "incidents.jsonl.1.gz",
        [
            tally("p1", 100.0, {"qwen3-8b": {"full": {"identical": 10}}}),  # older: ignored
            audit("a5", "logprob_drift", ts=1004, index=3, delta=0.002),
            audit("a6", "logprob_drift", ts=1005, index=1, delta=0.25),
            audit("a7", "incomparable", ts=1006),
            audit("a8", "answer_divergence", ts=1007, model="llama-3", index=5, delta=0.9),
            audit(
                "a9", "text_divergence", ts=1008, mode="prefill", index=2, margin=0.09, delta=3.0
            ),
            audit("a10", "logprob_drift", ts=1009, index=0, delta=None),
        ],
        compress=True,
    )
    return [current, rotated]


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    out: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return out


def test_counts_rates_and_lines(logs: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *map(str, logs))
    assert report["lines"] == {
        "read": 19,
        "audit": 10,
        "loop": 1,
        "tally": 3,
        "malformed": 4,
        "unknown_kind": 1,
        "duplicate": 0,
        "upstream_change": 0,
        "engine_mismatch": 0,
        "upstream_restart": 0,
        "cause": 0,
    }
    assert sum(v for k, v in report["lines"].items() if k != "read") == report["lines"]["read"]
    assert report["processes"] == ["p1", "p2"]
    assert report["denominators_known"] is True
    assert list(report["models"]) == ["llama-3", "qwen3-8b"]
    qwen = report["models"]["qwen3-8b"]
    assert qwen["audited"] == 121
    assert qwen["audited_by_mode"] == {"full": 95, "n_choices": 6, "prefill": 20}
    assert qwen["verdicts"] == {
        "identical": 103,
        "logprob_drift": 6,
        "text_divergence": 7,
        "answer_divergence": 2,
        "incomparable": 3,
    }
    assert qwen["comparable"] == 118
    tar_r = qwen["tar_r"]
    assert (tar_r["count"], tar_r["denominator"], tar_r["of"]) == (109, 118, "comparable")
    assert tar_r["rate"] == pytest.approx(109 / 118)
    low, high = wilson_quadratic(109, 118)
    assert tar_r["ci_low"] == pytest.approx(low, rel=1e-12)
    assert tar_r["ci_high"] == pytest.approx(high, rel=1e-12)
    assert qwen["tar_a"]["count"] == 116 and qwen["tar_a"]["denominator"] == 118
    incomparable = qwen["rates"]["incomparable"]
    assert (incomparable["count"], incomparable["denominator"]) == (3, 121)
    assert incomparable["of"] == "audited"
    assert qwen["rates"]["text_divergence"]["rate"] == pytest.approx(7 / 118)

    total = report["all_models"]
    assert total["audited"] == 162 and total["comparable"] == 159
    assert total["tar_r"]["count"] == 149 and total["tar_a"]["count"] == 156
    assert report["models"]["llama-3"]["tar_r"]["count"] == 40
    assert report["shadows_dropped"] == {"queue_full": 6, "rate": 1}
    assert "ignored 4 malformed line(s), 1 line(s) of an unknown kind" in report["notes"][0]


def test_positions_deltas_loops_actions(
    logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    report = run_json(capsys, *map(str, logs))
    qwen = report["models"]["qwen3-8b"]
    pos = qwen["positions"]
    assert (pos["count"], pos["min"], pos["median"], pos["max"]) == (5, 0, 2, 300)
    assert pos["p90"] == pytest.approx(17 + 0.6 * 283)  # of [0, 2, 2, 17, 300]
    assert [b["count"] for b in pos["histogram"]] == [1, 2, 0, 1, 0, 1]
    assert pos["near_tie"]["count"] == 3 and pos["near_tie"]["with_margin"] == 5
    assert pos["near_tie"]["share"] == pytest.approx(0.6)
    delta = qwen["logprob_delta"]
    assert delta["count"] == 6 and delta["null"] == 2
    assert delta["p50"] == pytest.approx(0.375) and delta["max"] == 3.0
    assert delta["p90"] == pytest.approx(2.125)
    assert report["all_models"]["positions"]["count"] == 6
    assert report["all_models"]["positions"]["median"] == pytest.approx(3.5)

    loops = qwen["loops"]
    assert loops["counts_from"] == "tally" and loops["total"] == 5
    assert loops["by_channel_source"] == {
        "content": {"engine": 1},
        "reasoning": {"proxy": 3, "runaway": 1},
    }
    acts = qwen["policy_actions"]
    assert (acts["retried"], acts["recovered"], acts["observed"]) == (4, 3, 0)
    assert acts["aborts"] == {"budget_exhausted": 1}
    assert acts["recovery"]["rate"] == 0.75


def test_worst_ordering(logs: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *map(str, logs))
    ids = [w["request_id"] for w in report["worst"]]
    assert ids == ["a8", "a4", "a1", "a9", "a2", "a3", "a10", "a6", "a5"]
    first = report["worst"][0]
    assert first["verdict"] == "answer_divergence" and first["model"] == "llama-3"
    assert (first["index"], first["primary_token"], first["shadow_token"]) == (5, "yes", "no")
    assert first["time"] == "1970-01-01T00:16:47.000Z"
    assert [w["request_id"] for w in run_json(capsys, *map(str, logs), "--top", "2")["worst"]] == [
        "a8",
        "a4",
    ]


def test_text_and_markdown_carry_the_figures(
    logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(p) for p in logs]) == 0
    text = capsys.readouterr().out
    low, high = wilson_quadratic(109, 118)
    # A share: count, denominator, rounded percentage, interval.
    qwen = text.split("Model qwen3-8b", 1)[1]
    tar_r = next(ln for ln in qwen.splitlines() if "TARr" in ln).split()
    assert tar_r[-4:] == [
        "109",
        "118",
        f"{100 * 109 / 118:.1f}%",
        f"{100 * low:.1f}-{100 * high:.1f}%",
    ]
    assert "TARa (answer agreement)" in text
    assert "121 audits, counted by the tallies" in text
    assert "Near ties: 3 of the 5 with a known margin (60.0%)" in text
    assert "queue_full" in text and "a8" in text
    # The line counts add up, and the ignored ones are said once.
    assert (
        "19 lines: 10 audit lines, 1 loop line, 3 tallies (the counts of 2 detproxy processes);"
        " ignored: 4 malformed, 1 of an unknown kind." in " ".join(text.split())
    )
    assert text.count("malformed") == 1
    assert "## " not in text and "0.00%" not in text
    assert main([*map(str, logs), "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "## Model qwen3-8b" in md and "## All models (2)" in md
    assert (
        f"| TARr (raw-output agreement: same tokens) | 109 | 118 | {100 * 109 / 118:.1f}% |" in md
    )
    assert "|---|---:|" in md


def test_one_model_has_no_all_models_section(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "incidents.jsonl",
        [tally("p1", 10, {"m": {"full": {"identical": 3, "logprob_drift": 1}}})],
    )
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "Model m" in text and "All models" not in text
    # One mode: no total row repeating it.
    assert not any(ln.split()[:1] == ["total"] for ln in text.splitlines())
    assert "4 audits, counted by the tallies" in text


def test_tar_a_is_not_claimed_without_an_answer_extractor(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    counts = {"m": {"full": {"identical": 8, "logprob_drift": 1, "text_divergence": 1}}}
    bare = write(
        tmp_path / "bare.jsonl",
        [
            tally("p1", 10, counts),
            audit("x1", "text_divergence", ts=5, model="m", index=1),
            audit("x2", "logprob_drift", ts=6, model="m", index=1),
        ],
    )
    report = run_json(capsys, str(bare))
    sec = report["models"]["m"]
    assert sec["tar_a"] is None and sec["answers_extracted"] == 0
    assert "no answer extractor configured" in sec["tar_a_note"]
    assert sec["tar_r"]["count"] == 9
    assert main([str(bare)]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "TARa (answer agreement): n/a (no answer was extracted: no answer extractor" in text
    assert "100.0%" not in text.split("TARa", 1)[1].split("\n", 1)[0]

    # With an extractor, the lines carry answers: TARa is measured.
    answered = audit("x1", "text_divergence", ts=5, model="m", index=1)
    answered |= {"primary_answer": '"2024-03-03"', "shadow_answer": '"2024-03-03"'}
    extracted = write(tmp_path / "extracted.jsonl", [tally("p1", 10, counts), answered])
    sec = run_json(capsys, str(extracted))["models"]["m"]
    assert sec["answers_extracted"] == 1 and "tar_a_note" not in sec
    assert (sec["tar_a"]["count"], sec["tar_a"]["denominator"]) == (10, 10)
    # An answer divergence is evidence of an extractor even when no line is left.
    diverged = {"m": {"full": {"identical": 9, "answer_divergence": 1}}}
    path = write(tmp_path / "diverged.jsonl", [tally("p1", 10, diverged)])
    sec = run_json(capsys, str(path))["models"]["m"]
    assert (sec["tar_a"]["count"], sec["tar_a"]["denominator"]) == (9, 10)


def test_output_is_deterministic(logs: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    for flags in ([], ["--json"], ["--markdown"]):
        assert main([*map(str, logs), *flags]) == 0
        first = capsys.readouterr().out
        assert main([*map(str, logs), *flags]) == 0
        assert capsys.readouterr().out == first


def test_same_file_twice_counts_incidents_once(
    logs: list[Path], capsys: pytest.CaptureFixture[str]
) -> None:
    report = run_json(capsys, str(logs[1]), str(logs[1]))
    assert report["lines"]["audit"] == 6 and report["lines"]["duplicate"] == 6
    assert report["lines"]["tally"] == 2  # the same tally twice is still one process
    assert report["all_models"]["audited"] == 10


def test_model_filter(logs: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    report = run_json(capsys, *map(str, logs), "--model", "qwen*")
    assert list(report["models"]) == ["qwen3-8b"]
    assert report["model_filter"] == "qwen*"
    assert report["all_models"]["audited"] == 121
    assert report["all_models"]["verdicts"] == report["models"]["qwen3-8b"]["verdicts"]
    assert "a8" not in [w["request_id"] for w in report["worst"]]
    assert run_json(capsys, *map(str, logs), "--model", "nothing*")["models"] == {}


def test_without_tallies(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(
        tmp_path / "incidents.jsonl",
        [
            audit("x1", "text_divergence", ts=5, index=4, margin=0.01, delta=0.3),
            audit("x2", "logprob_drift", ts=6, mode="duplicate", index=2, delta=0.01),
            loop("l1", ts=7, model="qwen3-8b", channel="reasoning", source="proxy"),
            loop("l2", ts=8, model="qwen3-8b", channel="reasoning", source="proxy"),
            loop("l3", ts=9, model="qwen3-8b", channel="content", source="engine"),
        ],
    )
    report = run_json(capsys, str(path))
    assert report["denominators_known"] is False
    qwen = report["models"]["qwen3-8b"]
    assert qwen["counts_from"] == "incidents" and qwen["audited"] is None
    assert qwen["audited_by_mode"] is None
    assert qwen["rates"] is None and qwen["tar_r"] is None and qwen["tar_a"] is None
    assert qwen["verdicts_by_mode"] == {
        "duplicate": {"logprob_drift": 1},
        "full": {"text_divergence": 1},
    }
    assert qwen["loops"] == {
        "counts_from": "incidents",
        "total": 3,
        "by_channel_source": {"content": {"engine": 1}, "reasoning": {"proxy": 2}},
    }
    assert qwen["policy_actions"] is None and report["shadows_dropped"] is None
    assert any("denominators unknown" in n for n in report["notes"])
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    assert "denominators unknown" in text and "Shares: n/a" in text
    assert "3 audit lines" not in text and "2 audit lines (no tally in the log" in text


def test_a_line_within_the_tallies_time_that_they_do_not_count_is_noted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "incidents.jsonl",
        [
            tally("p1", 10, {"m": {"full": {"identical": 3}}}),
            audit("x1", "text_divergence", ts=9, model="m", index=1),
        ],
    )
    report = run_json(capsys, str(path))
    assert any(
        "1 text_divergence incident line(s) up to the tallies' time but the tallies count 0" in n
        for n in report["notes"]
    )


def test_missing_or_unreadable_file(
    logs: list[Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No FILE reads the default log: none in an empty state dir.
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(tmp_path / "empty-state"))
    monkeypatch.delenv("DETPROXY_CONFIG", raising=False)
    assert main([str(logs[0]), str(tmp_path / "nope.jsonl")]) == 2
    captured = capsys.readouterr()
    assert "nope.jsonl" in captured.err and captured.out == ""
    assert main([str(tmp_path)]) == 2
    assert str(tmp_path) in capsys.readouterr().err
    (tmp_path / "broken.gz").write_bytes(b"\x1f\x8b" + b"\x00" * 20)
    assert main([str(tmp_path / "broken.gz")]) == 2
    assert main([]) == 2
    assert main([str(logs[0]), "--top", "-1"]) == 2
    assert main([str(logs[0]), "--json", "--markdown"]) == 2


def test_time_range_and_control_characters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "incidents.jsonl",
        [
            audit("r\x1b[2J", "text_divergence", ts=86400.5, model="m\x1b[31m", index=1),
            audit("far", "text_divergence", ts=1e300, model="m", index=2),
        ],
    )
    report = run_json(capsys, str(path))
    assert report["time_range"]["first"] == "1970-01-02T00:00:00.500Z"
    assert report["worst"][1]["time"] == "1e+300"
    for flags in ([], ["--markdown"]):
        assert main([str(path), *flags]) == 0
        out = capsys.readouterr().out
        assert "\x1b" not in out and "m\\x1b[31m" in out and "r\\x1b[2J" in out


def test_recovery_rate_and_cost_per_strategy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    recoveries = {
        "m": {
            "restart": {"recovered": 6, "looped_again": 2},
            "continue": {"recovered": 9, "looped_again": 1},
        }
    }
    tokens = {
        "m": {
            "restart": {"generated": 8000, "kept": 0},
            "continue": {"generated": 3000, "kept": 4500},
        }
    }
    line = tally("p1", 1000.0, {}, recoveries=recoveries, recovery_tokens=tokens)
    path = write(tmp_path / "inc.jsonl", [line])
    report = run_json(capsys, str(path))
    strategies = report["models"]["m"]["recovery_strategies"]
    assert strategies["restart"]["recovery"]["rate"] == 0.75
    assert strategies["restart"]["generated_per_retry"] == 1000
    assert strategies["continue"]["recovery"]["rate"] == 0.9
    assert strategies["continue"]["generated_per_retry"] == 300
    assert strategies["continue"]["kept_tokens"] == 4500
    assert main([str(path)]) == 0
    text = capsys.readouterr().out
    row = next(ln for ln in text.splitlines() if ln.strip().startswith("continue"))
    assert row.split() == ["continue", "10", "9", "90.0%", "300", "4500"]


def test_a_tally_without_recoveries_reads_as_none(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path / "old.jsonl", [tally("p1", 1000.0, {})])
    assert run_json(capsys, str(path))["lines"]["tally"] == 1


def test_help_says_what_it_reads_without_markup(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    assert "95% Wilson" in text and "%%" not in text
    assert "--config FILE" in text and "With no FILE" in text
