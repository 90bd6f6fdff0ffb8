"""`detproxy demo`, run the way a newcomer runs it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import orjson

from tests.helpers import EXE


def test_demo_detects_recovers_and_leaves_nothing_running(tmp_path: Path) -> None:
    done = subprocess.run(
        [EXE, "demo", "--requests", "20", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # What detproxy reports matches what the emulator did (its loops end with probability 0.7
    # per retry, seeded): every looping attempt detected, every escape counted as recovered,
    # and each of the 4 looping client requests ends one way.
    truth = re.search(r"The model looped on (\d+) attempts .*; (\d+) retries escaped", out)
    assert truth, out
    looped, escaped = int(truth[1]), int(truth[2])
    assert looped >= 4 and f"Loops detected: {looped} " in out

    def action(outcome: str) -> float:
        found = re.search(rf'outcome="{outcome}"}} ([\d.]+)', out)
        return float(found[1]) if found else 0.0

    assert action("recovered") == escaped > 0
    assert action("looped_again") == looped - 4
    assert escaped + action("attempts_exhausted") + action("budget_exhausted") == 4
    assert "text_divergence" in out and "Everything the demo started has stopped." in out
    lines = [orjson.loads(x) for x in (tmp_path / "incidents.jsonl").read_bytes().splitlines()]
    kinds = {x["kind"] for x in lines}
    assert kinds == {"audit", "loop", "tally"}
    assert str(tmp_path / "incidents.jsonl") in out
