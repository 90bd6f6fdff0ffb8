"""``detproxy report`` on a live log says first what it covers, and its figures add up: counts
and shares are the tallies' up to their time, the incident lines after it are named and kept
out of the figures, and the counts are what ``/detproxy/status`` said for the same period.
``--html OUT`` writes the file and says where in one line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.app import INCIDENTS, TALLY
from proxy.tools.emulator import EmulatorServer
from proxy.tools.report.cli import main
from tests.helpers.emulator import knobs
from tests.helpers.settings import NO_SHADOWS
from tests.helpers.waiting import eventually, settle
from tests.tools.report.logs import audit, loop, tally, write

T = 1_750_000_000.0  # the tally's time
COUNTS = {"m": {"full": {"identical": 42, "text_divergence": 8}}}


def mine(line: dict[str, Any], process: str = "p1") -> dict[str, Any]:
    return line | {"process": process}


@pytest.fixture
def live_log(tmp_path: Path) -> Path:
    """A process's tally at T, 8 divergences before it, 58 after, and a loop each side."""
    before = [
        mine(audit(f"b{i}", "text_divergence", ts=T - 50 + i, model="m", index=i)) for i in range(8)
    ]
    after = [
        mine(audit(f"a{i}", "text_divergence", ts=T + 1 + i, model="m", index=i)) for i in range(58)
    ]
    loops = [
        mine(loop("l1", ts=T - 5, model="m", channel="content", source="proxy")),
        mine(loop("l2", ts=T + 5, model="m", channel="content", source="proxy")),
    ]
    counted = tally("p1", T, COUNTS, loops={"m": {"content": {"proxy": 1}}})
    return write(tmp_path / "incidents.jsonl", [*before, loops[0], counted, *after, loops[1]])


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict[str, Any]:
    assert main([*argv, "--json"]) == 0
    out: dict[str, Any] = orjson.loads(capsys.readouterr().out)
    return out


def test_the_figures_cover_the_tallys_period_and_the_lines_after_it_are_named(
    live_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = run_json(capsys, str(live_log))
    coverage = report["coverage"]
    assert coverage["counts_from"] == "tally" and coverage["tally_behind"] is True
    assert coverage["until"] == "2025-06-15T15:06:40.000Z"
    assert coverage["after_tallies"] == {"audit": 58, "loop": 1}
    m = report["models"]["m"]
    assert m["audited"] == 50 and m["verdicts"]["text_divergence"] == 8
    # The lines the figures use are the ones the tally counted: they add up to its counts.
    assert m["incident_lines"] == {"audit": 8, "loop": 1}
    assert m["lines_after_tallies"] == {"audit": 58, "loop": 1}
    assert m["positions"]["divergent_lines"] == 8 and m["positions"]["count"] == 8
    assert m["causes"]["untriaged"]["count"] == 8
    assert not any("tallies count" in n for n in report["notes"])
    # The newest incidents are still among the worst items, marked.
    counted = {
        w["request_id"]: w["counted"]
        for w in run_json(capsys, str(live_log), "--top", "100")["worst"]
    }
    assert counted["b0"] is True and counted["a0"] is False and len(counted) == 66


def test_the_text_says_what_it_covers_in_its_first_lines(
    live_log: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([str(live_log)]) == 0
    text = capsys.readouterr().out
    head = " ".join(text.split("Model m", 1)[0].split())
    assert (
        "Counts and shares are the tally's of 2025-06-15 15:06:40 UTC (detproxy process p1," in head
    )
    assert (
        "58 audit lines and 1 loop line came after (the newest at 2025-06-15 15:07:38 UTC):"
        " not in the counts or shares yet" in head
    )
    model = " ".join(text.split("Model m", 1)[1].split())
    # No more "50 audits ... a line for each one that was not identical (58 here)".
    assert (
        "50 audits, counted by the tallies; 8 of them not identical: each of those has its"
        " incident line here. 58 audit lines came after the newest tally: not counted here yet."
        in model
    )
    assert "First divergent token: known for 8 of the 8 text or answer divergence lines" in model


def test_a_log_whose_tally_is_newest_says_every_line_is_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(
        tmp_path / "incidents.jsonl",
        [mine(audit("x", "text_divergence", ts=T - 1, model="m", index=1)), tally("p1", T, COUNTS)],
    )
    report = run_json(capsys, str(path))
    assert report["coverage"]["tally_behind"] is False
    assert report["coverage"]["after_tallies"] == {"audit": 0, "loop": 0}
    assert main([str(path)]) == 0
    assert "No incident line read is newer." in " ".join(capsys.readouterr().out.split())


def test_a_line_of_another_process_is_counted_by_that_process_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two workers on one log: a line after its own worker's newest tally is not counted,
    even when the other worker's tally is newer."""
    path = write(
        tmp_path / "incidents.jsonl",
        [
            tally("p1", T, COUNTS),
            mine(audit("late", "text_divergence", ts=T + 1, model="m", index=1), "p1"),
            mine(audit("in", "text_divergence", ts=T + 2, model="m", index=1), "p2"),
            tally("p2", T + 10, {"m": {"full": {"text_divergence": 1}}}),
            audit("old", "text_divergence", ts=T + 3, model="m", index=1),  # names no process
        ],
    )
    report = run_json(capsys, str(path), "--top", "10")
    assert {w["request_id"]: w["counted"] for w in report["worst"]} == {
        "late": False,
        "in": True,
        "old": True,  # an older detproxy's line: up to the newest tally of any process
    }


def test_html_writes_the_file_and_says_where_in_one_line(
    live_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.html"
    assert main(["--html", str(out), str(live_log)]) == 0
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        f"detproxy report: wrote {out} (opens offline in a browser)"
    ]
    page = out.read_text()
    assert "59 incident(s) came after the newest tally (2025-06-15T15:06:40.000Z)" in page
    # With --json, stdout is the JSON's; the line saying where goes to stderr.
    assert main(["--html", str(out), str(live_log), "--json"]) == 0
    captured = capsys.readouterr()
    assert orjson.loads(captured.out)["coverage"]["after_tallies"]["audit"] == 58
    assert captured.err.startswith("detproxy report: wrote ")


async def test_a_live_logs_counts_are_what_status_said_at_its_newest_tally(
    make_proxy: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "incidents.jsonl"
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 6,
        "messages": [{"role": "user", "content": "the same question"}],
    }
    flip = knobs(flip_probability=1, flip_position=2)
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env=NO_SHADOWS  # the passive duplicate check audits each repeat
            | {
                "DETPROXY_INCIDENTS__PATH": str(path),
                "DETPROXY_INCIDENTS__TALLY_INTERVAL_S": "3600",
            },
        )
        for headers in ({}, {}, flip, {}):
            assert (
                await client.post("/v1/chat/completions", json=body, headers=headers)
            ).status == 200
        status = (await settle(client, audits=3))["audit"]
        assert status["verdicts"].get("text_divergence", 0) >= 1, status
        app = client.server.app
        app[INCIDENTS].write(app[TALLY].summary())  # the periodic tally, now
        # One more divergence after it: in the log, not in the tally.
        assert (await client.post("/v1/chat/completions", json=body, headers=flip)).status == 200
        after = (await settle(client, audits=4))["audit"]
        assert after["audits"] == status["audits"] + 1

        def incident_lines() -> int | None:
            found = sum(b'"kind":"audit"' in x for x in path.read_bytes().splitlines())
            unstable = sum(n for v, n in after["verdicts"].items() if v != "identical")
            return found if found == unstable else None

        await eventually(incident_lines, timeout_s=10, what="every incident line written")
        report = run_json(capsys, str(path))  # the log as it is, detproxy still running
        await client.close()
    figures = report["all_models"]
    assert figures["audited"] == status["audits"]
    assert {v: n for v, n in figures["verdicts"].items() if n} == status["verdicts"]
    unstable = sum(n for v, n in status["verdicts"].items() if v != "identical")
    assert figures["incident_lines"]["audit"] == unstable
    assert report["coverage"]["after_tallies"]["audit"] == 1
