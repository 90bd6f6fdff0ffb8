"""`detproxy demo`, run the way a newcomer runs it, and `detproxy report` on what it wrote."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from pathlib import Path

import orjson

from proxy.tools.demo import OUTCOMES, Sent, outcome_of, table
from tests.helpers.processes import EXE


def test_demo_detects_recovers_and_leaves_nothing_running(tmp_path: Path) -> None:
    done = subprocess.run(
        [EXE, "demo", "--requests", "20", "--dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    out = done.stdout
    # Plain text for people: no Python dicts, tuples or reprs, no 16-digit floats.
    for python in ("{'", "('", "Counter(", "None", "[("):
        assert python not in out, f"{python!r} in the demo's output:\n{out}"
    # Three significant digits (the report's num): a small margin reads 0.0764, not more.
    assert not re.search(r"\d\.0*[1-9]\d{3,}", out), out

    # The client outcomes add up to the requests sent.
    summary = re.search(r"^20 requests in [\d.]+ s: (.*)\.$", out, re.M)
    assert summary, out
    outcomes = {what: int(n) for n, what in re.findall(r"(\d+) ([a-z ]+)", summary[1])}
    assert set(outcomes) <= set(OUTCOMES) and sum(outcomes.values()) == 20, summary[0]

    # What detproxy reports matches what the emulator did (its loops end with probability 0.7
    # per retry, seeded): every looping attempt detected, every escape counted as recovered,
    # and each of the 4 looping client requests ends one way.
    truth = re.search(r"the model looped on (\d+) attempts; detproxy detected (\d+) ", out)
    assert truth, out
    looped, detected = int(truth[1]), int(truth[2])
    assert looped >= 4 and detected == looped
    on_requests = re.search(r"(\d+) on client requests and (\d+) on their retries", out)
    assert on_requests and (int(on_requests[1]), int(on_requests[2])) == (4, looped - 4)
    retries = re.search(r"Retries: (\d+) = (\d+) recovered(?: \+ (\d+) looped again)?\.", out)
    assert retries, out
    recovered, again = int(retries[2]), int(retries[3] or 0)
    assert int(retries[1]) == recovered + again and again == looped - 4
    assert outcomes.get("recovered from a loop", 0) == recovered > 0
    assert recovered + outcomes.get("left looping", 0) == 4
    assert outcomes.get("answered as is", 0) == 16

    audits = re.search(r"^Audits: (\d+) ", out, re.M)
    assert audits, out
    rows = dict(re.findall(r"^  (identical|logprob_drift|text_divergence)\s+(\d+)\s", out, re.M))
    assert rows.keys() == {"identical", "logprob_drift", "text_divergence"}
    assert int(rows["text_divergence"]) > 0
    assert "Everything the demo started has stopped." in out

    log = tmp_path / "incidents.jsonl"
    lines = [orjson.loads(x) for x in log.read_bytes().splitlines()]
    assert {x["kind"] for x in lines} >= {"audit", "loop", "tally"}
    assert f"detproxy report {log}" in out

    # The report on the demo's own incident log, as the demo tells a newcomer to run it.
    report = subprocess.run([EXE, "report", str(log)], capture_output=True, text=True, timeout=60)
    assert report.returncode == 0, report.stderr
    text = report.stdout
    assert "Model emulator-model" in text and "All models" not in text
    assert f"{audits[1]} audits, counted by the tallies" in text
    assert "TARa (answer agreement): n/a (no answer was extracted" in text
    assert not re.search(r"\d\.0*[1-9]\d{3,}", text), text  # three significant digits


def test_a_client_outcome_is_what_the_client_got() -> None:
    looped = Counter({"loop": 2, "loop_escape": 1})
    assert outcome_of(Sent("a", 200, False, None), Counter()) == "answered as is"
    assert outcome_of(Sent("a", 200, False, "true"), looped) == "recovered from a loop"
    assert outcome_of(Sent("a", 200, False, "false"), looped) == "left looping"
    assert outcome_of(Sent("a", 200, True, None), looped) == "recovered from a loop"
    assert outcome_of(Sent("a", 200, True, None), Counter({"loop": 3})) == "left looping"
    assert outcome_of(Sent("a", 502, True, None), looped) == "failed"


def test_table_aligns_numbers_right() -> None:
    text = table(("verdict", "audits", "share"), [("identical", 36, "62%"), ("x", 5, "-")])
    assert text.splitlines() == [
        "  verdict    audits  share",
        "  ---------  ------  -----",
        "  identical      36    62%",
        "  x               5      -",
    ]
