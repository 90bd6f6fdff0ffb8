"""A duplicate request's divergence triaged: the earlier answer is known by its digests only,
the replays are grouped with it by theirs, and the cause is read from the audit's two sides,
the primary and the earlier answer."""

from __future__ import annotations

import time
from typing import Any

from proxy.attribution.case import Diverged, Earlier, TriageCase
from proxy.attribution.decide import decide
from proxy.attribution.evidence import Evidence
from proxy.attribution.experiments import Observed, build_evidence, observed_of_audit, replay_limit
from proxy.audit.auditor import Auditor
from proxy.audit.outcome import ChoiceOutcome, Outcome, TokenLogprob, outcome_from_response
from proxy.audit.store import MemoryDuplicateStore, digest_choice
from proxy.classify import classify
from proxy.config import load_settings
from proxy.events import EventBus
from tests.helpers.answers import chat_body


def text(value: str) -> ChoiceOutcome:
    return ChoiceOutcome(0, value, "", None, "stop")


def with_logprobs(value: str, logprob: float = -0.1) -> ChoiceOutcome:
    toks = tuple(TokenLogprob(ch, logprob, ((ch, logprob),)) for ch in value)
    return ChoiceOutcome(0, value, "", toks, "stop")


def duplicate(
    primary: ChoiceOutcome,
    earlier: Earlier,
    *,
    verdict: str = "text_divergence",
    inflight: int = 8,
    cold_salt: bool = False,
    body: dict[str, Any] | None = None,
) -> TriageCase:
    now = time.time()
    return TriageCase(
        request_id="r",
        model="m",
        endpoint="chat",
        raw_path="/v1/chat/completions",
        body=body or {"model": "m", "temperature": 0},
        headers={},
        mode="duplicate",
        target="same",
        primary=Outcome((primary,)),
        shadow=Outcome(()),
        primary_inflight=inflight,
        primary_inflight_end=inflight,
        shadow_inflight=0,
        shadow_cold=False,
        shadow_alone=None,
        primary_at=now,
        shadow_at=now,
        estimated_tokens=10,
        diverged=(Diverged(0, verdict, now),),
        primary_cold_salt=cold_salt,
        earlier=earlier,
    )


def replay(name: str, choice: ChoiceOutcome, cache: str = "cold") -> Observed:
    return Observed(name, "same", cache, True, 1, None, Outcome((choice,)))


def replays(choice: ChoiceOutcome, cold: int = 2, warm: int = 2) -> list[Observed]:
    out = [replay(f"cold-{i + 1}", choice) for i in range(cold)]
    return out + [replay(f"warm-{i + 1}", choice, "warm") for i in range(warm)]


def evidence_of(
    case: TriageCase, runs: list[Observed], identities: tuple[str | None, str | None] = (None, None)
) -> Evidence:
    audit = observed_of_audit(case, *identities)
    return build_evidence(audit + runs, case.diverged[0], False, "cache_salt", None, ())


def test_replays_alone_agreeing_with_the_earlier_answer_name_the_crowded_primary_batch() -> None:
    earlier = Earlier((digest_choice(text("a")),))  # a shared store: nothing of how it ran
    case = duplicate(text("b"), earlier, cold_salt=True)  # cold: the client's new salt
    ev = evidence_of(case, replays(text("a"), warm=0))
    by_name = {r.name: r for r in ev.runs}
    assert by_name["earlier"].group == by_name["cold-1"].group == by_name["cold-2"].group
    assert by_name["primary"].group != by_name["earlier"].group
    assert by_name["earlier"].cache == "unknown" and by_name["earlier"].alone is None
    assert by_name["primary"].cache == "cold" and by_name["primary"].alone is False
    assert ev.parted[0].position is None  # a digest says they differ, not where
    found = decide(ev)
    assert found.cause == "batch", found
    assert "primary with 8 in flight" in found.reason


def test_a_primary_of_unknown_cache_state_needs_cold_and_warm_runs_alone() -> None:
    earlier = Earlier((digest_choice(text("a")),))
    case = duplicate(text("b"), earlier)
    assert decide(evidence_of(case, replays(text("a"), warm=0))).cause == "unknown"
    assert decide(evidence_of(case, replays(text("a")))).cause == "batch"


def test_replays_agreeing_with_the_primary_leave_an_earlier_of_unknown_conditions_unknown() -> None:
    earlier = Earlier((digest_choice(text("a")),))
    case = duplicate(text("b"), earlier, inflight=1)
    ev = evidence_of(case, replays(text("b")))
    by_name = {r.name: r for r in ev.runs}
    assert by_name["primary"].group == by_name["cold-1"].group != by_name["earlier"].group
    found = decide(ev)
    assert found.cause == "unknown", found
    assert any("not with the earlier" in m for m in found.missing), found.missing


def test_an_earlier_answer_the_store_saw_crowded_is_named_batch() -> None:
    earlier = Earlier((digest_choice(text("a")),), inflight=6, cache="cold")
    case = duplicate(text("b"), earlier, inflight=1)
    found = decide(evidence_of(case, replays(text("b"), warm=0)))
    assert found.cause == "batch", found
    assert "earlier with 6 in flight" in found.reason


def test_the_upstream_changed_since_the_earlier_answer_is_a_recipe_change() -> None:
    earlier = Earlier((digest_choice(text("a")),), inflight=1, cache="cold", at=time.time())
    case = duplicate(text("b"), earlier, inflight=1)
    found = decide(evidence_of(case, [], identities=("v2", "v1")))
    assert found.cause == "recipe_change", found
    assert "earlier (v1)" in found.reason


def test_a_logprob_drift_groups_by_the_logprob_digest_too() -> None:
    earlier = Earlier((digest_choice(with_logprobs("abc", -0.1)),))
    case = duplicate(with_logprobs("abc", -0.2), earlier, verdict="logprob_drift", cold_salt=True)
    ev = evidence_of(case, replays(with_logprobs("abc", -0.1), warm=0))
    by_name = {r.name: r for r in ev.runs}
    assert by_name["earlier"].group == by_name["cold-1"].group != by_name["primary"].group
    assert ev.level == "logprobs"
    assert decide(ev).cause == "batch"
    # At the text level the same tokens agree whatever their logprobs.
    text_case = duplicate(with_logprobs("abc", -0.2), earlier, cold_salt=True)
    assert len({r.group for r in evidence_of(text_case, []).runs}) == 1


def test_a_duplicates_replays_run_whole() -> None:
    long = with_logprobs("x" * 100)
    case = duplicate(long, Earlier((digest_choice(text("y")),)), body={"max_tokens": 100})
    assert replay_limit(case, 16) is None


def test_the_in_memory_store_keeps_how_the_earlier_answer_ran_and_the_auditor_offers_it() -> None:
    settings = load_settings(env={}, flags={"upstream": "http://127.0.0.1:8000"})
    offered: list[TriageCase] = []
    crowd = iter([5, 5, 1, 1])  # in flight as each of the two started and ended
    auditor = Auditor(
        settings,
        EventBus(),
        None,
        MemoryDuplicateStore(60, 100),
        lambda: next(crowd),
        triage=offered.append,
    )
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    for answer in ("first", "second"):
        ticket = auditor.plan(classify("chat", body), body, "r", "/v1/chat/completions", None)
        assert ticket is not None
        auditor.primary_done(
            ticket, outcome_from_response("chat", chat_body([], [(answer, -0.5, [])]))
        )
    assert len(offered) == 1
    case = offered[0]
    assert case.mode == "duplicate" and case.diverged[0].verdict == "text_divergence"
    assert case.earlier is not None and case.earlier.inflight == 5
    assert case.earlier.at is not None and case.earlier.cache == "unknown"
    assert case.earlier.digests[0] != digest_choice(case.primary.choices[0])
    assert case.primary_inflight == 1 and "stream" not in case.body


def test_with_passive_checks_only_the_primaries_tokens_grow_triages_budget() -> None:
    """No shadow scheduler counts them: the auditor hands them to triage, so its budget is
    not the allowance alone for the life of the process."""
    settings = load_settings(env={}, flags={"upstream": "http://127.0.0.1:8000"})
    counted: list[int] = []
    auditor = Auditor(
        settings,
        EventBus(),
        None,
        MemoryDuplicateStore(60, 100),
        lambda: 1,
        count_primary_tokens=counted.append,
    )
    body = {"model": "m", "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
    ticket = auditor.plan(classify("chat", body), body, "r", "/v1/chat/completions", None)
    assert ticket is not None
    answer = chat_body([], [("hello", -0.5, [])])
    answer["usage"] = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    auditor.primary_done(ticket, outcome_from_response("chat", answer))
    assert counted == [10]
