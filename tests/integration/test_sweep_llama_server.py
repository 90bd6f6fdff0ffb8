"""``detproxy sweep`` against the real llama.cpp engine (two slots): a short, bounded sweep."""

from __future__ import annotations

import orjson
import pytest

from proxy.tools.sweep.cli import main
from tests.helpers.llama_server import Engine

pytestmark = pytest.mark.integration


def test_sweep_measures_llama_server(engine: Engine, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--upstream", engine.url, "--model", engine.model, "--concurrency", "1,2"]
    argv += ["--duration", "2", "--repeats", "2", "--max-tokens", "32", "--json"]
    # a busy machine gives wide spreads: this test is about the plumbing, not stability
    code = main([*argv, "--spread-warn", "1000"])
    report = orjson.loads(capsys.readouterr().out)
    assert code == 0, report["warnings"]
    assert [lv["concurrency"] for lv in report["levels"]] == [1, 2]
    for level in report["levels"]:
        # on two shared cores a request can outlast a 2 s window: it is cut, its tokens count
        assert level["errors"] == 0
        assert level["requests"] + level["cut"] > 0
        assert len(level["runs"]) == 2
        assert level["tokens_per_s"]["mean"] > 0
        assert level["tokens_per_s"]["spread"] is not None
        assert level["ttft_s"]["p50"] > 0 and level["itl_s"]["p50"] > 0
    fp = report["fingerprint"]
    assert fp["before"]["kind"] == "llama.cpp" and fp["after"]["kind"] == "llama.cpp"
    assert fp["changed"] is False and fp["before"] == fp["after"]
    assert report["elapsed_s"] >= 2 * 2 * 2  # every window (2 levels x 2 repeats) ran 2 s
