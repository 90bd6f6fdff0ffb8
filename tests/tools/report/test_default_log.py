"""``detproxy report`` with no FILE: the incident log the configuration names, with its rotated
backups oldest first; ``--config FILE``; and one line when there is nothing to read."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.config import IncidentConfig
from proxy.observe.incidents import IncidentLog
from proxy.tools.report.cli import main, rotated
from tests.helpers.processes import EXE
from tests.tools.report.logs import audit, tally, write


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A state directory of its own, and no configuration from the environment."""
    for name in list(os.environ):
        if name.startswith("DETPROXY_"):
            monkeypatch.delenv(name)
    folder = tmp_path / "state"
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(folder))
    return folder


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    code = main([*argv, "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out: dict[str, Any] = orjson.loads(captured.out)
    return out


async def test_no_file_reads_the_default_log_and_its_rotated_backups_oldest_first(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Written and rotated by the incident log itself, so the names are the ones it gives.
    path = state / "incidents.jsonl"
    path.parent.mkdir(parents=True)
    log = IncidentLog(IncidentConfig(path=str(path), max_bytes=1500, backups=5))
    for i in range(8):
        log.write(audit(f"r{i}", "text_divergence", ts=100 + i, model="m", index=i))
    log.write(tally("p1", 200, {"m": {"full": {"identical": 12, "text_divergence": 8}}}))
    await log.close()
    backups = sorted(name for name in os.listdir(state) if name != "incidents.jsonl")
    assert len(backups) >= 2, f"the log did not rotate: {sorted(os.listdir(state))}"
    (state / "incidents.jsonl.old").write_text("not a backup\n")  # not a rotation's name

    report = run_json(capsys)
    numbers = [int(Path(f).name.rsplit(".", 1)[1]) for f in report["files"][:-1]]
    assert numbers == sorted(numbers, reverse=True), "backups not read oldest first"
    assert report["files"][-1] == str(path)
    assert len(report["files"]) == len(backups) + 1
    assert report["lines"]["audit"] == 8 and report["lines"]["malformed"] == 0
    assert report["models"]["m"]["verdicts"]["text_divergence"] == 8
    assert [w["request_id"] for w in report["worst"][:3]] == ["r0", "r1", "r2"]


def test_rotated_names_gz_backups_and_skips_other_files(tmp_path: Path) -> None:
    base = tmp_path / "inc.jsonl"
    for name in ("inc.jsonl", "inc.jsonl.1", "inc.jsonl.10.gz", "inc.jsonl.2", "inc.jsonl.x"):
        (tmp_path / name).write_text("")
    (tmp_path / "inc.jsonl.3").mkdir()
    assert rotated(str(base)) == [
        str(tmp_path / "inc.jsonl.10.gz"),
        str(tmp_path / "inc.jsonl.2"),
        str(tmp_path / "inc.jsonl.1"),
        str(base),
    ]
    assert rotated(str(tmp_path / "missing" / "inc.jsonl")) == []


def test_config_names_the_log(
    state: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "served").mkdir()
    served = write(
        tmp_path / "served" / "audit.jsonl", [tally("p1", 10, {"m": {"full": {"identical": 4}}})]
    )
    config = tmp_path / "detproxy.toml"
    config.write_text(f'[incidents]\npath = "{served}"\n')
    assert run_json(capsys, "--config", str(config))["files"] == [str(served)]
    # The served config named by the environment, as `detproxy serve` reads it.
    monkeypatch.setenv("DETPROXY_CONFIG", str(config))
    assert run_json(capsys)["files"] == [str(served)]
    # Files named on the command line win.
    other = write(tmp_path / "other.jsonl", [tally("p2", 10, {})])
    assert run_json(capsys, str(other), "--config", str(config))["files"] == [str(other)]


def test_no_log_is_one_line_saying_where_it_looked(
    state: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert str(state / "incidents.jsonl") in lines[0]
    assert "detproxy report FILE" in lines[0] and "--config FILE" in lines[0]


def test_a_config_that_keeps_incidents_in_memory_or_is_wrong(
    state: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    memory = tmp_path / "memory.toml"
    memory.write_text('[incidents]\npath = ""\n')
    assert main(["--config", str(memory)]) == 2
    err = capsys.readouterr().err
    assert "in memory only" in err and str(memory) in err and len(err.splitlines()) == 1

    missing_log = tmp_path / "elsewhere.toml"
    missing_log.write_text(f'[incidents]\npath = "{tmp_path / "nothing.jsonl"}"\n')
    assert main(["--config", str(missing_log)]) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "nothing.jsonl") in err and str(missing_log) in err

    assert main(["--config", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml" in capsys.readouterr().err


def test_the_command_reads_the_default_log(state: Path, tmp_path: Path) -> None:
    """Through the console script, as a user runs it after `detproxy serve`."""
    state.mkdir()
    write(
        state / "incidents.jsonl",
        [tally("p1", 10, {"m": {"full": {"identical": 9, "logprob_drift": 1}}})],
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETPROXY_")}
    env["DETPROXY_STATE_DIR"] = str(state)
    done = subprocess.run(
        [EXE, "report"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    assert f"Read: {state / 'incidents.jsonl'}." in done.stdout
    assert "10 audits, counted by the tallies" in done.stdout
    env["DETPROXY_STATE_DIR"] = str(tmp_path / "empty")
    done = subprocess.run(
        [EXE, "report"], capture_output=True, text=True, timeout=60, env=env, check=False
    )
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith("detproxy report: no incident log at "), done.stderr
