"""``detproxy sweep`` against the real llama.cpp engine (two slots): a short, bounded sweep."""

from __future__ import annotations

import orjson
import pytest

from proxy.sweep.cli import main
from tests.integration.conftest import Engine

pytestmark = pytest.mark.integration


def test_sweep_measures_llama_server(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--upstream", engine.url, "--model", engine.model, "--concurrency", "1,2"]
    argv += ["--duration", "2", "--repeats", "2", "--max-tokens", "32", "--json"]
    # the exit status may be 1 on a busy machine (a wide spread); the report says why
    code = main([*argv, "--spread-warn", "1000"])
    report = orjson.loads(capsys.readouterr().out)
    assert code == 0, report["warnings"]
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["errors"] == 0
        assert level["requests"] > 0
        assert len(level["runs"]) == 2
        assert all(run["tokens_per_s"] > 0 for run in level["runs"])
        assert level["tokens_per_s"]["spread"] is not None
        assert 0 < level["ttft_s"]["p50"] < 2
        assert 0 < level["itl_s"]["p50"] < 1
    fp = report["fingerprint"]
    assert fp["before"]["kind"] == "llama.cpp" and fp["after"]["kind"] == "llama.cpp"
    assert fp["changed"] is False and fp["before"] == fp["after"]
    assert report["elapsed_s"] < 30
