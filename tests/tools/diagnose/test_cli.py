"""`detproxy diagnose` against the emulator, one injected cause at a time."""

from __future__ import annotations

import io
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.tools.diagnose.cli import parse_args, run
from tests.helpers.processes import EXE, free_port
from tests.tools.diagnose.conftest import StartEmulator

FAST = ("--model", "emulator-model", "--runs", "4", "--max-tokens", "16", "--concurrency", "1,4")
# Every emulator here steps at 1 ms a token, so fillers are in flight beside the probed request.
LATENCY = {"token_latency_s": 0.001}


async def diagnose(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = await run(parse_args([*FAST, *argv]), out, err)
    return code, out.getvalue(), err.getvalue()


async def diagnose_json(*argv: str) -> tuple[int, dict[str, Any]]:
    code, out, _ = await diagnose("--json", "--quiet", *argv)
    return code, orjson.loads(out)


def statuses(report: dict[str, Any]) -> dict[str, str]:
    return {c["cause"]: c["status"] for c in report["checks"]}


async def test_stable_emulator_exits_0_and_claims_no_cause(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY)
    code, report = await diagnose_json("--upstream", url)
    assert (code, report["stable"], report["causes"]) == (0, True, []), report["causes"]
    assert statuses(report) == {
        "intrinsic": "not_found",
        "batch": "not_found",
        "prefix_cache": "not_found",
        "speculative": "not_tested",
        "recipe_change": "not_found",
        "unknown": "not_found",
    }
    assert report["engine"]["kind"] == "vllm" and report["prompts"] == 4


@pytest.mark.parametrize(
    ("fields", "cause"),
    [
        ({"flip_probability": 0.5}, "intrinsic"),
        ({"batch_divergence_slope": 0.5}, "batch"),
        ({"warm_cache_divergence": 1.0}, "prefix_cache"),
    ],
)
async def test_each_injected_cause_is_found_alone(
    emulator: StartEmulator, fields: dict[str, Any], cause: str
) -> None:
    url = await emulator(**LATENCY, **fields)
    code, report = await diagnose_json("--upstream", url)
    found = [c["cause"] for c in report["causes"]]
    assert (code, found) == (1, [cause]), f"injected {cause}, found {found}"
    (verdict,) = report["causes"]
    assert verdict["status"] == "found" and verdict["prompts_affected"] >= 1
    assert verdict["distinct_outputs"] >= 2 and verdict["first_divergent_position"] is not None
    assert verdict["margins"] and all(m > 0 for m in verdict["margins"])
    assert verdict["evidence"] and verdict["recommendation"]


async def test_intrinsic_leaves_the_other_switches_undecided(emulator: StartEmulator) -> None:
    """Serial replays that already differ cannot be the baseline of batch or cache."""
    url = await emulator(**LATENCY, flip_probability=0.5)
    _, report = await diagnose_json("--upstream", url)
    checks = statuses(report)
    assert (checks["batch"], checks["prefix_cache"]) == ("unknown", "unknown"), checks
    prefill = next(c for c in report["checks"] if c["cause"] == "intrinsic")["prefill"]
    assert max(p["distinct_vectors"] for p in prefill) >= 2


async def test_batch_names_the_levels_it_appeared_at(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY, batch_divergence_slope=0.5)
    _, report = await diagnose_json("--upstream", url)
    (verdict,) = report["causes"]
    assert (verdict["levels"], verdict["divergent_levels"]) == ([4], [4])


async def test_prefix_cache_off_is_no_cause(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY, warm_cache_divergence=1.0, enable_prefix_caching=False)
    code, report = await diagnose_json("--upstream", url)
    assert (code, report["causes"]) == (0, []), report["causes"]


async def test_speculative_against_the_plain_reference(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY, speculative=True, speculative_divergence=1.0)
    plain = await emulator(**LATENCY)
    code, report = await diagnose_json("--upstream", url, "--reference", plain)
    found = [c["cause"] for c in report["causes"]]
    assert (code, found) == (1, ["speculative"]), found
    assert report["causes"][0]["prompts_affected"] == 4


async def test_speculative_output_equivalent_is_no_cause(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY, speculative=True)
    plain = await emulator(**LATENCY)
    code, report = await diagnose_json("--upstream", url, "--reference", plain)
    assert (code, report["causes"], statuses(report)["speculative"]) == (0, [], "not_found")


async def test_text_output_prints_numbers_and_what_to_do(emulator: StartEmulator) -> None:
    url = await emulator(**LATENCY, warm_cache_divergence=1.0)
    code, out, err = await diagnose("--upstream", url)
    assert code == 1
    line = next(x for x in out.splitlines() if x.startswith("prefix_cache"))
    assert "FOUND" in line and "first divergent token" in line and "margins" in line, line
    assert "what to do: a prefix-cache hit" in out and "cache_salt" in out
    assert out.rstrip().endswith("UNSTABLE: prefix_cache")
    assert "diagnose: warm replays" in err and "diagnose: serial replays" in err, err


async def test_prompts_file_lines_and_jsonl(emulator: StartEmulator, tmp_path: Path) -> None:
    url = await emulator(**LATENCY)
    prompts = tmp_path / "p.txt"
    prompts.write_text('plain line\n\n{"prompt": "from json"}\n"a json string"\n')
    code, report = await diagnose_json("--upstream", url, "--prompts", str(prompts))
    assert (code, report["prompts"]) == (0, 3)


def cli(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [EXE, "diagnose", *argv], capture_output=True, text=True, timeout=60, check=False
    )


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (("--upstream", "http://127.0.0.1:1"), "--model"),
        (("--model", "m", "--upstream", "http://x", "--concurrency", "a"), "--concurrency"),
        (("--model", "m", "--upstream", "http://x", "--runs", "1"), "--runs"),
        # An openai SDK base URL: serve's hint, not ".../v1/v1/... answered 404".
        (("--model", "m", "--upstream", "http://127.0.0.1:1/v1"), "ends in /v1"),
    ],
)
def test_usage_errors_exit_2(argv: tuple[str, ...], says: str) -> None:
    done = cli(*argv)
    assert done.returncode == 2 and says in done.stderr, done.stderr
    assert done.stdout == ""


def test_unreachable_upstream_exits_2_in_one_line() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = cli("--upstream", url, "--model", "m")
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(
        "detproxy diagnose: cannot reach"
    )


def test_missing_prompts_file_exits_2_in_one_line(tmp_path: Path) -> None:
    done = cli(
        "--upstream", "http://127.0.0.1:1", "--model", "m", "--prompts", str(tmp_path / "no")
    )
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "cannot read" in done.stderr


async def test_the_report_says_what_the_engine_loaded(emulator: StartEmulator) -> None:
    url = await emulator(enable_prefix_caching=False, **LATENCY)
    code, out, err = await diagnose("--upstream", url, "--json")
    report = orjson.loads(out)
    assert code == 0, report["causes"]
    recipe = report["recipe"]
    assert recipe is not None and recipe["digest"], f"no recipe in the report: {report.keys()}"
    assert recipe["facts"]["prefix_caching"] is False, recipe
    assert "what loaded:" in err and "prefix_caching=off" in err, err
