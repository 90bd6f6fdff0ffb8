"""Engine truth against the real llama.cpp engine: detproxy follows llama-server's own log file
and reads its /props; a declared expectation it does not meet raises the mismatch (status,
metric, incident), one it meets raises nothing."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llama_server import run_engine
from tests.helpers.metrics import scrape
from tests.helpers.processes import run_detproxy
from tests.helpers.waiting import eventually_sync

pytestmark = pytest.mark.integration


def get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return json.load(resp)


def config(engine_log: Path, expect: str) -> str:
    return (
        f'[upstream]\nfingerprint_interval_s = 0.5\nengine_log = "{engine_log}"\n'
        f"[upstream.expect]\n{expect}\n"
    )


def test_llama_server_log_and_props_held_against_expectations(tmp_path: Path) -> None:
    logs = tmp_path / "engine"
    logs.mkdir()
    with run_engine(logs, "-np", "1") as engine:
        (log_file,) = logs.glob("llama-server-*.log")
        # Not met: llama-server runs no draft model.
        with run_detproxy(tmp_path, engine.url, config(log_file, "speculative = true")) as url:

            def mismatched() -> Any:
                found = get(url + "/detproxy/status")["engine"]
                return found if found["mismatches"] else None

            engine_state = eventually_sync(
                mismatched, timeout_s=60, interval_s=0.1, what="the speculative mismatch shown"
            )
            assert [m["field"] for m in engine_state["mismatches"]] == ["speculative"]
            assert engine_state["engine_log"]["read_lines"] > 0, engine_state
            assert engine_state["loaded"], "llama-server's log and /props say what loaded"
            gauge = scrape(url + "/detproxy/metrics", "detproxy_engine_expectation_mismatch")
            assert list(gauge.values()) == [1.0], gauge
            kinds = [i["kind"] for i in get(url + "/detproxy/incidents")]
            assert kinds.count("engine_mismatch") == 1, kinds
        # Met: nothing raised.
        with run_detproxy(tmp_path, engine.url, config(log_file, "speculative = false")) as url:

            def read() -> Any:
                found = get(url + "/detproxy/status")["engine"]
                return found if "speculative" not in found["unknown"] and found["loaded"] else None

            engine_state = eventually_sync(
                read, timeout_s=60, interval_s=0.1, what="the recipe read"
            )
            assert engine_state["mismatches"] == [], engine_state
            gauge = scrape(url + "/detproxy/metrics", "detproxy_engine_expectation_mismatch")
            assert list(gauge.values()) == [0.0], gauge
            kinds = [i["kind"] for i in get(url + "/detproxy/incidents")]
            assert "engine_mismatch" not in kinds, kinds
