"""The sweep's figures on an injected clock: exact rates, TTFT, ITL, cuts and window bounds.

The upstream streams on virtual time (``tests.tools.sweep.virtual``): the first token after 1/64 s,
then one every 1/128 s, 8 tokens a request (9/128 s). In a 0.24 s window one stream completes
3 requests (27/128 s) and gets 2 tokens of the 4th (at 29/128 and 30/128 s; the next, 31/128 s,
is past the deadline): 26 tokens, 26 / 0.24 tok/s, whatever the machine's speed.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import orjson
import pytest

from proxy.tools.sweep import cli
from proxy.tools.sweep.load import Target, Window, run_window
from proxy.tools.sweep.run import run_sweep
from proxy.tools.sweep.stats import level_summary
from tests.tools.sweep.virtual import Upstream, clock, run_virtual

TARGET = Target(base_url="http://upstream.invalid", model="m", max_tokens=8)
DURATION = 0.24
PER_STREAM = 26  # tokens one stream gets in one window
TTFT = 1 / 64
GAP = 1 / 128


def window(concurrency: int, upstream: Upstream | None = None) -> tuple[Window, float]:
    """One window; and how long it ran on the clock."""

    async def go() -> tuple[Window, float]:
        w = Window(concurrency, 1, DURATION)
        done = await run_window((upstream or Upstream()).mock(), TARGET, w, clock=clock)
        return done, clock() - w.start

    result: tuple[Window, float] = run_virtual(go)
    return result


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_window_counts_tokens_until_its_deadline_and_cuts_the_rest(concurrency: int) -> None:
    w, ran = window(concurrency)
    assert ran == pytest.approx(DURATION, abs=1e-9)  # it ends at its deadline, not later
    assert w.tokens() == PER_STREAM * concurrency
    records = sorted(w.records, key=lambda r: r.sent)
    assert len(records) == 4 * concurrency
    done = [r for r in records if r.done]
    cut = [r for r in records if not r.done]
    assert len(done) == 3 * concurrency and len(cut) == concurrency
    assert all(r.tokens == 8 and r.usage_tokens == 8 for r in done)
    assert all(r.tokens == 2 and r.error is None for r in cut)  # 2 tokens before the deadline
    assert sorted({r.sent - w.start for r in records}) == pytest.approx(
        [0, 9 / 128, 18 / 128, 27 / 128]
    )
    assert all(r.ttft == pytest.approx(TTFT, abs=1e-12) for r in records)
    assert all(g == pytest.approx(GAP, abs=1e-12) for r in records for g in r.gaps)
    assert sum(len(r.gaps) for r in records) == (3 * 7 + 1) * concurrency


def test_level_figures_are_exact_and_scale_with_concurrency() -> None:
    one = level_summary(1, [window(1)[0]], 0.1)
    four = level_summary(4, [window(4)[0]], 0.1)
    assert one["tokens_per_s"]["mean"] == round(PER_STREAM / DURATION, 3)
    assert four["tokens_per_s"]["mean"] == round(4 * PER_STREAM / DURATION, 3)
    for level, c in ((one, 1), (four, 4)):
        assert level["ttft_s"] == {"p50": round(TTFT, 6), "p95": round(TTFT, 6)}
        assert level["itl_s"] == {"p50": round(GAP, 6), "p95": round(GAP, 6)}
        assert (level["requests"], level["cut"], level["errors"]) == (3 * c, c, 0)


def test_a_slower_upstream_gives_exactly_the_slower_rate() -> None:
    # ten times slower: the first token at 10/64 s, the second 10/128 s later, then the deadline
    w, _ = window(1, Upstream(slow_factor=10, slow_from_version_read=0))
    fast = w.tokens()
    slow_upstream = Upstream(slow_factor=10, slow_from_version_read=1, version_reads=1)
    w, _ = window(1, slow_upstream)
    assert (fast, w.tokens()) == (PER_STREAM, 2)
    assert [r.ttft for r in w.records] == [pytest.approx(10 * TTFT, abs=1e-12)]


def _sweep(upstream: Upstream, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> Any:
    """``detproxy sweep --json`` against ``upstream`` on the virtual clock."""
    mock = upstream.mock()
    monkeypatch.setattr(cli, "run_sweep", partial(run_sweep, clock=clock, upstream=mock))
    code = run_virtual(lambda: cli.amain([*argv, "--json"]))
    return code


def test_sweep_report_on_the_clock(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    upstream = Upstream()
    argv = ["--upstream", "http://upstream.invalid/v1/", "--model", "m", "--max-tokens", "8"]
    argv += ["--concurrency", "4,1", "--duration", str(DURATION), "--repeats", "2"]
    code = _sweep(upstream, argv, monkeypatch)
    report = orjson.loads(capsys.readouterr().out)
    assert code == 0 and report["ok"] and report["warnings"] == []
    one, four = report["levels"]
    assert (one["concurrency"], four["concurrency"]) == (1, 4)
    assert one["tokens_per_s"]["mean"] == round(PER_STREAM / DURATION, 3)
    assert four["tokens_per_s"]["mean"] == round(4 * PER_STREAM / DURATION, 3)
    for level, c in ((one, 1), (four, 4)):
        assert level["tokens_per_s"]["spread"] == 0.0 and level["spread_warning"] is False
        assert [run["tokens"] for run in level["runs"]] == [PER_STREAM * c] * 2
        assert (level["requests"], level["cut"]) == (2 * 3 * c, 2 * c)
        assert level["ttft_s"]["p95"] == round(TTFT, 6)
        assert level["itl_s"]["p95"] == round(GAP, 6)
    # the preflight (9/128 s), then 2 repeats x 2 levels x 0.24 s: nothing overruns
    assert report["elapsed_s"] == round(9 / 128 + 4 * DURATION, 3)
    assert upstream.requests == 1 + 2 * 4 * (1 + 4)  # preflight + 4 requests per stream


def test_a_wide_spread_across_repeats_exits_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # fast in repeat 1, ten times slower in repeat 2 (from the /version read after run 1)
    upstream = Upstream(slow_factor=10, slow_from_version_read=2)
    argv = ["--upstream", "http://upstream.invalid", "--model", "m", "--max-tokens", "8"]
    argv += ["--concurrency", "1", "--duration", str(DURATION), "--repeats", "2"]
    code = _sweep(upstream, argv, monkeypatch)
    report = orjson.loads(capsys.readouterr().out)
    assert code == 1 and report["exit_code"] == 1
    [level] = report["levels"]
    first, second = (run["tokens_per_s"] for run in level["runs"])
    assert (first, second) == (round(PER_STREAM / DURATION, 3), round(2 / DURATION, 3))
    rate = level["tokens_per_s"]
    assert rate["spread"] == round((first - second) / ((first + second) / 2), 4)
    assert level["spread_warning"] is True
    assert [w["kind"] for w in report["warnings"]] == ["wide_spread"]
