"""`detproxy demo`, run the way a newcomer runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

EXE = str(Path(sys.executable).with_name("detproxy"))


def test_demo_detects_recovers_and_leaves_nothing_running(tmp_path: Path) -> None:
    done = subprocess.run(
        [EXE, "demo", "--requests", "20", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "Loops detected: 4" in out and 'outcome="recovered"} 4.0' in out
    assert "text_divergence" in out and "Everything the demo started has stopped." in out
    lines = [orjson.loads(x) for x in (tmp_path / "incidents.jsonl").read_bytes().splitlines()]
    kinds = {x["kind"] for x in lines}
    assert kinds == {"audit", "loop", "tally"}
    assert str(tmp_path / "incidents.jsonl") in out
