"""Replays cut short after the point that matters: the limit they run with, and how runs of
different lengths compare (over the window only, a cut run agreeing with a longer one that is
the same over its tokens), down to the cause decided."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from proxy.attribution.case import Diverged, TriageCase
from proxy.attribution.decide import decide
from proxy.attribution.experiments import (
    Observed,
    Plan,
    agree,
    build_evidence,
    compare_runs,
    limited_body,
    observed_of_audit,
    replay_limit,
    run_experiments,
)
from proxy.audit.outcome import ChoiceOutcome, Outcome, TokenLogprob

MARGIN = 16


def tokens(text: str, drift_at: int | None = None) -> tuple[TokenLogprob, ...]:
    """One token per character; from ``drift_at`` on, every logprob moved by 0.5 nats."""
    out = []
    for i, ch in enumerate(text):
        value = -0.1 - (0.5 if drift_at is not None and i >= drift_at else 0.0)
        out.append(TokenLogprob(ch, value, ((ch, value), ("~", -3.0))))
    return tuple(out)


def choice(text: str, finish: str = "length", drift_at: int | None = None) -> ChoiceOutcome:
    return ChoiceOutcome(0, text, "", tokens(text, drift_at), finish)


def text_choice(text: str, finish: str = "length") -> ChoiceOutcome:
    return ChoiceOutcome(0, text, "", None, finish)


BASE = "abcdefghijklmnopqrstuvwxyz" * 4  # 104 tokens


def at(position: int, text: str = BASE, sub: str = "#") -> str:
    """``text`` with its token at ``position`` changed."""
    return text[:position] + sub + text[position + 1 :]


def case(
    primary: ChoiceOutcome,
    shadow: ChoiceOutcome,
    *,
    verdict: str = "text_divergence",
    mode: str = "full",
    body: Mapping[str, Any] | None = None,
    primary_inflight: int = 8,
) -> TriageCase:
    now = time.time()
    return TriageCase(
        request_id="r",
        model="m",
        endpoint="chat",
        raw_path="/v1/chat/completions",
        body=dict(body) if body is not None else {"model": "m", "max_tokens": 104},
        headers={},
        mode=mode,
        target="same",
        primary=Outcome((primary,)),
        shadow=Outcome((shadow,)),
        primary_inflight=primary_inflight,
        primary_inflight_end=primary_inflight,
        shadow_inflight=0,
        shadow_cold=True,
        shadow_alone=True,
        primary_at=now,
        shadow_at=now,
        estimated_tokens=120,
        diverged=(Diverged(0, verdict, now),),
    )


# -- the limit ---------------------------------------------------------------------------------


def test_the_limit_is_the_first_divergent_token_plus_the_margin() -> None:
    c = case(choice(at(5)), choice(BASE))
    assert replay_limit(c, MARGIN) == 5 + 1 + MARGIN
    assert replay_limit(c, 1) == 7, "margin 1: the divergent token and one after"


def test_the_limit_never_rises_above_the_requests_own() -> None:
    primary, shadow = choice(at(5)), choice(BASE)
    assert replay_limit(case(primary, shadow, body={"max_tokens": 22}), MARGIN) is None
    assert replay_limit(case(primary, shadow, body={"max_tokens": 23}), MARGIN) == 22
    both = {"max_tokens": 1000, "max_completion_tokens": 20}
    assert replay_limit(case(primary, shadow, body=both), MARGIN) is None
    assert replay_limit(case(primary, shadow, body={}), MARGIN) == 22, "no limit: cut anyway"


def test_the_limit_is_set_on_the_field_the_request_uses() -> None:
    assert limited_body({"max_tokens": 512, "x": 1}, 22) == {"max_tokens": 22, "x": 1}
    assert limited_body({"max_completion_tokens": 512}, 22) == {"max_completion_tokens": 22}
    assert limited_body({"max_tokens": 512, "max_completion_tokens": 512}, 22) == {
        "max_tokens": 22,
        "max_completion_tokens": 22,
    }
    assert limited_body({"max_tokens": None}, 22) == {"max_tokens": 22}
    assert limited_body({}, 22) == {"max_tokens": 22}
    assert limited_body({"max_tokens": 512}, None) == {"max_tokens": 512}


def test_no_cut_where_the_position_does_not_say_where_to_stop() -> None:
    primary, shadow = choice(at(5)), choice(BASE)
    assert replay_limit(case(primary, shadow, verdict="answer_divergence"), MARGIN) is None
    prefill = case(choice("#"), choice("a"), mode="prefill", body={"max_tokens": 1})
    assert replay_limit(prefill, MARGIN) is None
    words = case(text_choice(at(5)), text_choice(BASE))  # no logprobs: a character index
    assert replay_limit(words, MARGIN) is None
    assert replay_limit(case(primary, shadow, body={"max_tokens": "512"}), MARGIN) is None


def test_no_cut_where_the_logprobs_leave_out_tokens_the_usage_counts() -> None:
    """An engine that lists only the answer's tokens (not the reasoning's): token 5 of the
    list is token 105 of the generation; a cut at 22 would end before it."""
    primary, shadow = choice(at(5)), choice(BASE)
    listed = case(primary, shadow, body={"max_tokens": 512})
    assert replay_limit(listed, MARGIN) == 22
    hidden = TriageCase(
        **{
            **{f: getattr(listed, f) for f in TriageCase.__dataclass_fields__},
            "primary": Outcome((primary,), completion_tokens=204),
            "shadow": Outcome((shadow,), completion_tokens=204),
        }
    )
    assert replay_limit(hidden, MARGIN) is None
    counted = TriageCase(
        **{
            **{f: getattr(listed, f) for f in TriageCase.__dataclass_fields__},
            "primary": Outcome((primary,), completion_tokens=105),  # an unlisted end token
            "shadow": Outcome((shadow,), completion_tokens=104),
        }
    )
    assert replay_limit(counted, MARGIN) == 22


def test_the_limit_covers_the_latest_of_several_diverged_choices() -> None:
    now = time.time()
    c = case(choice(at(5)), choice(BASE))
    late = ChoiceOutcome(1, at(30), "", tokens(at(30)), "length")
    other = ChoiceOutcome(1, BASE, "", tokens(BASE), "length")
    two = TriageCase(
        **{
            **{f: getattr(c, f) for f in TriageCase.__dataclass_fields__},
            "primary": Outcome((c.primary.choices[0], late)),
            "shadow": Outcome((c.shadow.choices[0], other)),
            "diverged": (Diverged(0, "text_divergence", now), Diverged(1, "logprob_drift", now)),
        }
    )
    assert replay_limit(two, MARGIN) == 30 + 1 + MARGIN


def test_a_logprob_drift_is_cut_after_its_first_drifting_token() -> None:
    c = case(choice(BASE, drift_at=9), choice(BASE), verdict="logprob_drift")
    assert replay_limit(c, MARGIN) == 9 + 1 + MARGIN


# -- comparison over the window ----------------------------------------------------------------


def test_a_cut_run_agrees_with_a_longer_one_that_is_the_same_over_its_tokens() -> None:
    full, cut = choice(BASE, "stop"), choice(BASE[:22])
    assert compare_runs(full, cut, False, None).verdict == "text_divergence", (
        "whole outputs: the cut one reads as ending early (the bug the window fixes)"
    )
    assert compare_runs(full, cut, False, 22).verdict == "identical"
    assert compare_runs(cut, full, False, 22).verdict == "identical"
    assert agree(full, cut, "logprobs", False, 22)
    later = choice(at(40), "stop")  # differs past the window: not seen
    assert agree(later, cut, "logprobs", False, 22)


def test_where_a_cut_run_parts_from_a_longer_one_is_reported_as_before() -> None:
    full, cut = choice(BASE, "stop"), choice(at(12)[:22])
    found = compare_runs(full, cut, False, 22)
    assert found.verdict == "text_divergence", found
    assert found.divergence is not None and found.divergence.index == 12
    drift = compare_runs(choice(BASE, drift_at=15), cut_drift := choice(BASE[:22]), False, 22)
    assert drift.verdict == "logprob_drift" and drift.divergence is not None
    assert drift.divergence.index == 15
    assert agree(choice(BASE, drift_at=15), cut_drift, "text", False, 22)
    assert not agree(choice(BASE, drift_at=15), cut_drift, "logprobs", False, 22)


def test_a_run_that_stopped_inside_the_window_still_differs_from_one_that_went_on() -> None:
    stopped = choice(BASE[:12], "stop")  # the end of sequence at 12: a real difference
    cut = choice(BASE[:22])
    found = compare_runs(stopped, cut, False, 22)
    assert found.verdict == "text_divergence", found
    assert found.divergence is not None and found.divergence.index == 12
    assert not agree(stopped, choice(BASE, "stop"), "text", False, 22)
    assert agree(stopped, choice(BASE[:12], "stop"), "logprobs", False, 22)


def test_a_run_cut_by_the_engines_own_limit_is_compared_over_its_tokens() -> None:
    # A request with no limit on an engine whose default is shorter than the window.
    assert agree(choice(BASE[:16]), choice(BASE[:22]), "logprobs", False, 22)
    assert not agree(choice(at(3)[:16]), choice(BASE[:22]), "text", False, 22)


def test_without_logprobs_on_a_side_a_cut_text_agrees_with_its_continuation() -> None:
    full = text_choice(BASE, "stop")
    assert agree(full, text_choice(BASE[:22]), "text", False, 22)
    assert agree(choice(BASE, "stop"), text_choice(BASE[:22]), "text", False, 22)
    assert not agree(full, text_choice(at(3)[:22]), "text", False, 22)
    assert not agree(full, text_choice(BASE[:22], "stop"), "text", False, 22)
    thinking = ChoiceOutcome(0, "answer", "reasoning long", None, "stop")
    assert agree(thinking, ChoiceOutcome(0, "", "reasoning", None, "length"), "text", False, 22)
    assert not agree(thinking, ChoiceOutcome(0, "", "reasoned", None, "length"), "text", False, 9)


def test_prefill_compares_the_first_token_whatever_the_window() -> None:
    assert compare_runs(choice("ab"), choice("ac"), True, 1).verdict == "identical"


# -- the experiments and the cause -------------------------------------------------------------


class Replies:
    """A runner answering replay ``n`` (from 1) with ``answers[n - 1]``, cut as an engine
    would cut it at the body's max_tokens; the bodies it was sent."""

    def __init__(self, answers: list[ChoiceOutcome]) -> None:
        self.answers = answers
        self.bodies: list[dict[str, Any]] = []

    async def run(self, name: str, target: str, cache: str, body: Mapping[str, Any]) -> Observed:
        self.bodies.append(dict(body))
        answer = self.answers[min(len(self.bodies), len(self.answers)) - 1]
        limit = body.get("max_tokens")
        assert answer.tokens is not None
        if isinstance(limit, int) and len(answer.tokens) > limit:
            answer = choice(answer.content[:limit])
        return Observed(name, target, cache, True, 0, None, Outcome((answer,)))


async def attribute(c: TriageCase, replies: Replies, limit: int | None) -> tuple[str, Any]:
    plan = Plan(4, 2, 0, "cache_salt", False, limit)
    replays, missing = await run_experiments(c, plan, replies)
    runs = [
        Observed("primary", "same", "unknown", False, 8, None, c.primary),
        Observed("shadow", "same", "cold", True, 0, None, c.shadow),
        *replays,
    ]
    evidence = build_evidence(runs, c.diverged[0], False, "cache_salt", None, missing, limit=limit)
    return decide(evidence).cause, evidence


async def test_replays_carry_the_cut_limit_and_the_evidence_names_it() -> None:
    c = case(choice(at(5), "stop"), choice(BASE, "stop"), body={"max_tokens": 104})
    limit = replay_limit(c, MARGIN)
    replies = Replies([choice(BASE, "stop")])
    cause, evidence = await attribute(c, replies, limit)
    assert [b["max_tokens"] for b in replies.bodies] == [22] * 7, replies.bodies
    assert cause == "batch", evidence
    assert (evidence.replay_max_tokens, evidence.compared_tokens) == (22, 22)
    whole, _ = await attribute(c, Replies([choice(BASE, "stop")]), None)
    assert whole == "batch"


async def test_intrinsic_variation_past_the_audits_divergence_but_inside_the_margin_is_seen() -> (
    None
):
    """The crowded primary parted from the shadow at 5; the replays, alone, part from each
    other at 15: inside the window (22), so they do not agree, as they would not at full
    length: intrinsic, the kernel race that pages, not batch."""
    c = case(choice(at(5), "stop"), choice(BASE, "stop"))
    limit = replay_limit(c, MARGIN)
    replies = Replies([choice(BASE, "stop"), choice(at(15), "stop")])
    cause, evidence = await attribute(c, replies, limit)
    assert cause == "intrinsic", evidence
    assert len(replies.bodies) == 2, "the cold replays stop once they disagree"
    assert len({r.group for r in evidence.runs}) == 3, evidence


async def test_variation_that_begins_past_the_window_is_not_seen_and_the_window_is_named() -> None:
    """The replays part from each other only at 40, past the window (22). Cut, they are the same
    over the window and the divergence the audit saw (the crowded primary at 5) reads as batch;
    whole, they would have shown intrinsic variation. This is the one verdict the cut changes:
    the cause is the one of the divergence in the window, and the evidence says the runs were
    compared over 22 tokens, so the later variation is not claimed to be absent."""
    c = case(choice(at(5), "stop"), choice(BASE, "stop"))
    limit = replay_limit(c, MARGIN)
    answers = [choice(BASE, "stop"), choice(at(40), "stop")]
    cut, evidence = await attribute(c, Replies(answers), limit)
    whole, _ = await attribute(c, Replies(answers), None)
    assert (cut, whole) == ("batch", "intrinsic")
    assert evidence.compared_tokens == 22


async def test_a_replay_that_stops_early_inside_the_window_is_not_read_as_agreeing() -> None:
    c = case(choice(at(5), "stop"), choice(BASE, "stop"))
    limit = replay_limit(c, MARGIN)
    replies = Replies([choice(BASE, "stop"), choice(BASE[:14], "stop")])
    cause, evidence = await attribute(c, replies, limit)
    assert cause == "intrinsic", evidence


# -- the primary's cache state -------------------------------------------------------------------


def test_the_primary_runs_warm_or_cold_where_the_engine_reported_its_cached_tokens() -> None:
    def primary_cache(cached: int | None) -> str:
        c = case(choice(at(5)), choice(BASE))
        c = TriageCase(
            **{f: getattr(c, f) for f in TriageCase.__dataclass_fields__ if f != "primary"},
            primary=Outcome(c.primary.choices, None, 30, 104, cached),
        )
        return observed_of_audit(c, "fp", "fp")[0].cache

    assert primary_cache(None) == "unknown", "not reported: not known"
    assert primary_cache(0) == "cold"
    assert primary_cache(16) == "warm"


def test_the_primary_runs_cold_where_the_clients_salt_was_new() -> None:
    c = case(choice(at(5)), choice(BASE))
    assert observed_of_audit(c, "fp", "fp")[0].cache == "unknown"
    new_salt = replace(c, primary_cold_salt=True)
    assert observed_of_audit(new_salt, "fp", "fp")[0].cache == "cold"
    # The engine's own count wins: a new salt, yet cached tokens (a shared-prefix tenant).
    counted = replace(new_salt, primary=Outcome(c.primary.choices, None, 30, 104, 16))
    assert observed_of_audit(counted, "fp", "fp")[0].cache == "warm"
