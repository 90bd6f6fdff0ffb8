"""``detproxy sweep`` records what the upstream loaded beside each run (SPEC 1.15): from the
engine's endpoints as the fingerprint reads them, and from its log with --engine-log."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from proxy.tools.sweep.cli import amain
from proxy.tools.sweep.recipe import LogTail, describe_recipe

ROOT = Path(__file__).resolve().parents[3]
STOCK_LOG = ROOT / "tests" / "engine" / "fixtures" / "vllm-0.23.0-h200-stock.log"
ARGS = (
    "--model",
    "emulator-model",
    "--concurrency",
    "1,2",
    "--duration",
    "0.2",
    "--spread-warn",
    "10",
)


async def sweep(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, Any]:
    code = await amain([*argv, "--json"])
    out = capsys.readouterr().out
    return code, orjson.loads(out) if out else None


async def test_each_run_carries_the_recipe_read_from_the_endpoints(
    capsys: pytest.CaptureFixture[str],
) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        code, report = await sweep(capsys, "--upstream", emu.url, *ARGS, "--repeats", "2")
        text_code = await amain(["--upstream", emu.url, *ARGS, "--repeats", "1"])
        text = capsys.readouterr().out
    assert code == 0, f"sweep failed: {report and report['warnings']}"
    recipe = report["recipe"]
    before = recipe["before"]
    assert before is not None, "nothing read of what the emulator loaded"
    # the emulator's vllm:cache_config_info says prefix caching is on
    assert before["facts"]["prefix_caching"] is True and before["facts"]["engine"] == "vllm"
    assert recipe["after"] == before and recipe["moved"] == []
    assert recipe["read_from"] == "the engine's endpoints"
    runs = [run for level in report["levels"] for run in level["runs"]]
    assert len(runs) == 4 and {run["recipe"] for run in runs} == {before["digest"]}
    assert text_code == 0
    assert f"before: {before['digest']}: engine=vllm" in text, "no recipe line in the table"
    assert "prefix_caching=on" in text


async def test_the_engine_log_tells_what_the_endpoints_do_not(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    log = tmp_path / "engine.log"
    log.write_bytes(STOCK_LOG.read_bytes())
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        code, report = await sweep(
            capsys, "--upstream", emu.url, *ARGS, "--repeats", "1", "--engine-log", str(log)
        )
    assert code == 0
    facts = report["recipe"]["before"]["facts"]
    assert facts["attention_backend"] == "FLASH_ATTN" and facts["version"] == "0.23.0"
    assert facts["cudagraphs"] is False and facts["enforce_eager"] is True
    assert str(log) in report["recipe"]["read_from"]
    assert report["config"]["engine_log"] == str(log)


async def test_an_unreadable_engine_log_exits_2_in_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    missing = tmp_path / "nope.log"
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        code = await amain(["--upstream", emu.url, *ARGS, "--engine-log", str(missing)])
    err = capsys.readouterr().err.strip()
    assert code == 2, f"exit {code} for a missing engine log"
    assert err.startswith(f"detproxy sweep: cannot read the engine log {missing}")
    assert "\n" not in err


def test_the_log_is_read_as_it_grows_a_partial_line_waits(tmp_path: Path) -> None:
    log = tmp_path / "e.log"
    lines = STOCK_LOG.read_text().splitlines(keepends=True)
    log.write_text("".join(lines[:5]))
    tail = LogTail(str(log))
    tail.read()
    first = tail.reader.read_lines
    with log.open("a") as fh:
        fh.write("".join(lines[5:]) + "INFO half a li")
    tail.read()
    tail.close()
    assert first > 0 and tail.reader.read_lines == len(lines), "lines lost or read twice"
    assert tail.reader.facts.values.get("attention_backend") == "FLASH_ATTN"


def test_describe_recipe() -> None:
    assert describe_recipe(None).startswith("unknown")
    line = describe_recipe(
        {
            "digest": "abc",
            "facts": {"cudagraphs": False, "non_default_args": {"port": 1}},
            "unknown_env": ["VLLM_X"],
            "fallbacks": [],
            "start_failed": False,
        }
    )
    assert line == "abc: cudagraphs=off; ignored unknown env: VLLM_X"
