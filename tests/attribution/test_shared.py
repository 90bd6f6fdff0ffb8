"""Experiments shared by a server's workers: their replays written and read back whole, one
worker's claim at a time, and only while fresh."""

from __future__ import annotations

import time
from pathlib import Path

from proxy.attribution.experiments import Observed, Plan
from proxy.attribution.shared import SharedExperiments, SharedResult, decode, encode
from proxy.audit.logprobs import TokenLogprob
from proxy.audit.outcome import ChoiceOutcome, Outcome

KEY = ("full", "0123abcd", "fp-1")


def result(at: float | None = None) -> SharedResult:
    tokens = (
        TokenLogprob("Hi", -0.25, (("Hi", -0.25), ("Hey", -1.5))),
        TokenLogprob("!", None, ()),
    )
    answered = Outcome(
        (ChoiceOutcome(0, "Hi!", "thinking", tokens, "stop", 2),),
        None,
        12,
        2,
        8,
    )
    replays = (
        Observed("cold-1", "same", "cold", True, 0, "fp-1", answered),
        Observed("warm-1", "same", "warm", None, None, None, None, "HTTP 500"),
        Observed("ref-1", "reference", "unknown", False, 3, None, Outcome((), "broke", None, None)),
    )
    plan = Plan(4, 2, 3, "cache_salt", True, 27)
    return SharedResult(replays, ("a missing thing",), plan, at or time.time(), "req-1")


def test_replays_come_back_whole() -> None:
    original = result()
    assert decode(encode(original)) == original


def test_one_worker_claims_a_key_at_a_time(tmp_path: Path) -> None:
    one, two = SharedExperiments(str(tmp_path), 600), SharedExperiments(str(tmp_path), 600)
    claim = one.claim(KEY)
    assert claim is not None
    assert two.claim(KEY) is None, "two workers ran one experiment"
    other = two.claim(("full", "another request", "fp-1"))
    assert other is not None, "a claim held back another request's experiment"
    other.release()
    claim.release()
    again = two.claim(KEY)
    assert again is not None
    again.release()


def test_any_worker_reads_the_replays_while_fresh(tmp_path: Path) -> None:
    one, two = SharedExperiments(str(tmp_path), 600), SharedExperiments(str(tmp_path), 600)
    assert two.finished(KEY) is None
    one.publish(KEY, result())
    assert two.finished(KEY) == one.finished(KEY) is not None
    one.publish(KEY, result(at=time.time() - 601))
    assert two.finished(KEY) is None, "replays older than reuse_s explained an incident"


def test_a_broken_file_is_no_result(tmp_path: Path) -> None:
    shared = SharedExperiments(str(tmp_path), 600)
    shared.publish(KEY, result())
    for path in tmp_path.glob("*.json"):
        path.write_bytes(b'{"replays": [')
    assert shared.finished(KEY) is None
    assert not list(tmp_path.glob("*.tmp")), "a temporary file was left behind"
