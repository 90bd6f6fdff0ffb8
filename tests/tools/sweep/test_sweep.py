"""``detproxy sweep`` against the in-process emulator and scripted upstreams (``MockUpstream``s,
given to the sweep as its client)."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.testing import MockUpstream
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from proxy.tools.sweep import cli
from proxy.tools.sweep.cli import amain, main
from proxy.tools.sweep.run import run_sweep
from tests.helpers.processes import free_port
from tests.helpers.upstreams import MOCK_URL, UpstreamScript, scripted_routes

SVG = "{http://www.w3.org/2000/svg}"


async def sweep_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = await amain([*argv, "--json"])
    return code, orjson.loads(capsys.readouterr().out)


def svg_texts(svg: str) -> list[str]:
    root = ET.fromstring(svg)
    assert root.tag == SVG + "svg"
    return [el.text or "" for el in root.iter(SVG + "text")]


def serve(monkeypatch: pytest.MonkeyPatch, script: UpstreamScript) -> str:
    """The sweep's upstream client is a ``MockUpstream`` answering ``script``: every request of
    the sweep goes to it, in process; the URL returned names it."""
    mock = MockUpstream(routes=scripted_routes(script))
    monkeypatch.setattr(cli, "run_sweep", partial(run_sweep, upstream=mock))
    return MOCK_URL


async def test_emulator_report_is_consistent(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chart = tmp_path / "sweep.svg"
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        code, report = await sweep_json(
            capsys,
            "--upstream", emu.url + "/v1/", "--model", "emulator-model",
            "--concurrency", "4,1", "--duration", "0.5", "--repeats", "2",
            "--spread-warn", "10", "--chart", str(chart),
        )  # fmt: skip
    assert code == 0 and report["exit_code"] == 0 and report["ok"]
    assert report["schema"] == "detproxy.sweep/1"
    assert report["upstream"] == emu.url
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 4]
    # Speed is not asserted here (a busy machine runs slower; speed belongs in benchmarks):
    # the exact figures, on an injected clock, are in test_sweep_clock.py. Here: a real
    # upstream over real sockets gives a report whose parts agree with each other.
    for level in report["levels"]:
        rate = level["tokens_per_s"]
        rates = [run["tokens_per_s"] for run in level["runs"]]
        assert [run["repeat"] for run in level["runs"]] == [1, 2]
        assert rate["min"] == min(rates) and rate["max"] == max(rates)
        assert rate["mean"] == pytest.approx(sum(rates) / 2, abs=1e-3)
        assert rate["spread"] == pytest.approx((rate["max"] - rate["min"]) / rate["mean"], abs=1e-3)
        assert level["spread_warning"] is False
        assert level["errors"] == 0 and level["requests"] > 0
        for run in level["runs"]:
            assert run["tokens"] > 0
            assert run["tokens_per_s"] == pytest.approx(run["tokens"] / 0.5)
        assert 0 < level["ttft_s"]["p50"] <= level["ttft_s"]["p95"]
        assert 0 < level["itl_s"]["p50"] <= level["itl_s"]["p95"]
    fp = report["fingerprint"]
    assert fp["before"] == fp["after"] and fp["changed"] is False and fp["changes"] == []
    assert fp["before"]["kind"] == "vllm" and fp["before"]["models"] == ["emulator-model"]
    assert report["warnings"] == []
    assert report["elapsed_s"] >= 2 * 2 * 0.5  # every window ran its whole duration
    texts = svg_texts(chart.read_text())
    assert {"1", "4", "output tokens/s (sustained)", "TTFT p50 (ms)"} <= set(texts)
    assert "concurrent requests" in texts


async def test_markdown_table_and_html_chart(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    chart = tmp_path / "sweep.html"
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        argv = ["--upstream", emu.url, "--model", "emulator-model", "--concurrency", "1,2"]
        argv += ["--duration", "0.3", "--repeats", "1", "--markdown", "--chart", str(chart)]
        code = await amain(argv)
    out = capsys.readouterr().out
    assert code == 0
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("| conc |"))
    assert lines[header + 1].startswith("|---:|")
    assert lines[header + 2].startswith("| 1 |") and lines[header + 3].startswith("| 2 |")
    assert "spread needs --repeats 2" in out
    html = chart.read_text()
    assert html.startswith("<!doctype html>") and "<table>" in html
    svg = html[html.index("<svg") : html.index("</svg>") + len("</svg>")]
    assert {"1", "2"} <= set(svg_texts(svg))


async def test_plain_table_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        argv = ["--upstream", emu.url, "--model", "emulator-model", "--concurrency", "2"]
        code = await amain([*argv, "--duration", "0.3", "--repeats", "1"])
    captured = capsys.readouterr()
    assert code == 0
    assert "conc  tok/s mean" in captured.out and "upstream after:  unchanged" in captured.out
    assert captured.err == ""  # no progress line when stderr is not a terminal


def test_refused_connection_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        ["--upstream", f"http://127.0.0.1:{free_port()}", "--model", "m", "--duration", "0.2"]
    )
    assert code == 2
    assert "failed" in capsys.readouterr().err


async def test_unknown_model_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    async with EmulatorServer(EmulatorConfig()) as emu:
        code = await amain(["--upstream", emu.url, "--model", "nope", "--duration", "0.2"])
    err = capsys.readouterr().err
    assert code == 2 and "HTTP 4" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["--model", "m"],
        ["--upstream", "http://x", "--model", "m", "--concurrency", "0,2"],
        ["--upstream", "http://x", "--model", "m", "--duration", "-1"],
        ["--upstream", "http://x", "--model", "m", "--extra-body", "[1]"],
        ["--upstream", "http://x", "--model", "m", "--json", "--markdown"],
        ["--upstream", "http://x", "--model", "m", "--prompts", "/nonexistent/prompts.txt"],
    ],
)
def test_usage_errors_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2


def test_help_documents_exit_codes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "exit status" in out and "fingerprint changed" in out and "--spread-warn" in out


async def test_fingerprint_change_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    script = UpstreamScript(change_version=True)
    url = serve(monkeypatch, script)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    chart = tmp_path / "c.svg"
    code, report = await sweep_json(
        capsys,
        "--upstream", url, "--model", "m", "--concurrency", "1,2", "--duration", "0.3",
        "--repeats", "1", "--max-tokens", "7", "--extra-body", '{"top_k": 1, "seed": 3}',
        "--prompts", str(prompts), "--chart", str(chart),
    )  # fmt: skip
    assert code == 1 and report["exit_code"] == 1 and not report["ok"]
    fp = report["fingerprint"]
    assert fp["changed"] is True
    assert fp["before"]["version"] == "0.1.0" and fp["after"]["version"] == "0.2.0"
    assert fp["before"]["fingerprint"] != fp["after"]["fingerprint"]
    [change] = fp["changes"]
    assert change["after_repeat"] == 1 and change["after_concurrency"] == 1
    assert [w["kind"] for w in report["warnings"]] == ["fingerprint_changed"]
    body = script.bodies[-1]
    assert body["model"] == "m" and body["temperature"] == 0 and body["stream"] is True
    assert body["max_tokens"] == 7 and body["top_k"] == 1 and body["seed"] == 3
    assert body["stream_options"] == {"include_usage": True}
    contents = {b["messages"][0]["content"] for b in script.bodies}
    assert contents == {"first prompt", "second prompt"}
    assert any("UPSTREAM CHANGED" in t for t in svg_texts(chart.read_text()))
    # the usage count is used for completed requests
    assert all(
        run["tokens"] % 20 == 0 or run["cut"] for lv in report["levels"] for run in lv["runs"]
    )


async def test_a_fresh_speculative_vllm_is_no_change_after_its_first_drafts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its spec-decode counters read 0 after the test request and rise during the sweep: the
    same upstream."""
    script = UpstreamScript(speculative=True)
    url = serve(monkeypatch, script)
    code, report = await sweep_json(
        capsys, "--upstream", url, "--model", "m", "--concurrency", "1", "--duration", "0.2",
        "--repeats", "1",
    )  # fmt: skip
    assert script.chat_calls > 2  # the counters did rise between the two readings
    fp = report["fingerprint"]
    assert fp["changed"] is False and fp["before"] == fp["after"]
    assert code == 0 and report["warnings"] == []


async def test_upstream_change_shows_in_the_table(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = serve(monkeypatch, UpstreamScript(change_version=True))
    argv = ["--upstream", url, "--model", "m", "--concurrency", "1", "--duration", "0.2"]
    code = await amain([*argv, "--repeats", "1"])
    out = capsys.readouterr().out
    assert code == 1
    assert "CHANGED DURING THE SWEEP" in out and "WARNING: the upstream changed" in out


async def test_failed_requests_are_counted(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    url = serve(monkeypatch, UpstreamScript(fail_every=2, tokens=5))
    code, report = await sweep_json(
        capsys,
        "--upstream", url, "--model", "m", "--concurrency", "1", "--duration", "0.5",
        "--repeats", "1",
    )  # fmt: skip
    assert code == 1
    [level] = report["levels"]
    assert level["errors"] >= 1 and level["requests"] >= 1
    assert level["runs"][0]["error_samples"][0].startswith("HTTP 500")
    assert [w["kind"] for w in report["warnings"]] == ["errors"]
