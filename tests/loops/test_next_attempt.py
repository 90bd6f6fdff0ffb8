"""The next attempt after a loop as a pure function (proxy/loops/next_attempt.py)."""

from __future__ import annotations

from typing import Any

from policies.base import Retry, Trigger
from proxy.loops.detector import DetectorConfig
from proxy.loops.next_attempt import (
    ORIGINAL,
    Asked,
    Generated,
    next_attempt,
    request_seed,
    seeded,
)

UNIT = " and then it repeats."
TEXT = "Once upon a time" + UNIT * 12
ONSET = Trigger("proxy", "content", 0, len(UNIT), 12, len("Once upon a time"))
PREFIX = "Once upon a time" + UNIT
RETRY = Retry("loop", {"presence_penalty": 1.5})


def body(**extra: Any) -> dict[str, Any]:
    return {
        "model": "m",
        "max_tokens": 500,
        "messages": [{"role": "user", "content": "hi"}],
        **extra,
    }


def test_the_seed_is_the_requests_whatever_its_delivery() -> None:
    assert request_seed(body()) == request_seed(body(stream=True, stream_options={"x": 1}))
    assert request_seed(body()) != request_seed(body(max_tokens=501))
    assert 0 <= request_seed(body()) < 2**31


def test_a_clients_own_seed_wins_then_the_ladders() -> None:
    assert seeded(body(seed=5), {"seed": 1, "temperature": 0.7}) == {"seed": 5, "temperature": 0.7}
    assert seeded(body(), {"seed": 1}) == {"seed": 1}
    assert seeded(body(), {}) == {"seed": request_seed(body())}


def test_streamed_or_not_the_retry_goes_on_from_the_onset_and_one_unit() -> None:
    whole = next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(TEXT))
    shown = TEXT[: len(PREFIX) + 3 * len(UNIT) + 4]  # the stream showed more repeats
    streamed = next_attempt(
        Asked("chat", body(stream=True)), ONSET, RETRY, Generated(TEXT, shown=shown)
    )
    assert whole.strategy == streamed.strategy == "continue"
    assert whole.continued is not None and streamed.continued is not None
    assert whole.continued.prefix == streamed.continued.prefix == PREFIX
    # the client holds the prefix and three repeats and a partial fourth: the fourth is
    # completed before the continuation, so its text is the prefix with whole units inserted
    assert streamed.continued.missing == UNIT[4:]
    assert shown + streamed.continued.missing == PREFIX + UNIT * 4
    assert {k: v for k, v in whole.body.items() if k != "stream"} == {
        k: v for k, v in streamed.body.items() if k != "stream"
    }
    assert whole.body["messages"][-1] == {"role": "assistant", "content": PREFIX}
    assert whole.body["seed"] == request_seed(body())
    assert whole.body["max_tokens"] == 500 - whole.kept_tokens


def test_a_stream_shown_whole_units_past_the_prefix_writes_nothing_before_going_on() -> None:
    shown = PREFIX + UNIT * 2
    nxt = next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(TEXT, shown=shown))
    assert nxt.continued is not None and nxt.continued.missing == ""


def test_a_partial_unit_is_completed_in_the_phase_of_a_prefix_cut_mid_unit() -> None:
    # a unit whose end is no word end: the prefix is cut back to one, inside the unit
    head, unit = "Ode:\n", "A love that is not just for the heart,"
    text = head + unit * 9
    trigger = Trigger("proxy", "content", 0, len(unit), 9, len(head))
    plain = next_attempt(Asked("chat", body()), trigger, RETRY, Generated(text))
    assert plain.continued is not None
    prefix = plain.continued.prefix
    assert prefix == head + "A love that is not just for the"  # cut back to a word end
    shown = head + unit * 6 + "A love"
    streamed = next_attempt(Asked("chat", body()), trigger, RETRY, Generated(text, shown=shown))
    assert streamed.continued is not None and streamed.continued.prefix == prefix
    # six whole units shown, then the seventh up to where the prefix ends in its unit
    assert shown + streamed.continued.missing == head + unit * 6 + prefix[len(head) :]


def test_text_shown_past_the_prefix_that_does_not_repeat_the_unit_gets_nothing_added() -> None:
    shown = PREFIX + UNIT * 2 + " and then it stops"  # not the loop's text: never completed
    nxt = next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(TEXT, shown=shown))
    assert nxt.continued is not None and nxt.continued.missing == ""


def test_what_the_stream_held_back_of_the_prefix_is_missing() -> None:
    held = PREFIX[:10]
    nxt = next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(TEXT, shown=held))
    assert nxt.continued is not None and nxt.continued.missing == PREFIX[10:]


def test_a_continued_streams_loop_is_cut_in_its_own_text() -> None:
    prior = "Earlier text."
    own = "x" + UNIT * 6
    trigger = Trigger("proxy", "content", 0, len(UNIT), 6, 1)
    nxt = next_attempt(
        Asked("chat", body()), trigger, RETRY, Generated(prior + own, offset=len(prior))
    )
    assert nxt.continued is not None and nxt.continued.prefix == prior + "x" + UNIT


def test_a_reasoning_loop_is_closed_at_its_onset() -> None:
    trigger = Trigger("proxy", "reasoning", 0, len(UNIT), 12, len("Once upon a time"))
    nxt = next_attempt(Asked("chat", body()), trigger, RETRY, Generated(TEXT))
    assert nxt.strategy == "close_reasoning" and nxt.continued is not None
    assert nxt.continued.message == f"<think>\n{PREFIX}\n</think>\n\n"


def test_it_restarts_where_going_on_cannot_keep_the_answer_whole() -> None:
    asked = Asked("chat", body(logprobs=True))
    assert next_attempt(asked, ONSET, RETRY, Generated(TEXT)).strategy == "restart"
    assert next_attempt(Asked("chat", body(n=2)), ONSET, RETRY, Generated(TEXT)).continued is None
    assert next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(None)).strategy == "restart"
    # stream_mode restart: the ladder's strategy (a restart unless it says continue).
    other = Asked("chat", body(), one_path=False)
    assert next_attempt(other, ONSET, RETRY, Generated(TEXT)).strategy == "restart"
    go_on = Retry("loop", {}, strategy="continue")
    assert next_attempt(other, ONSET, go_on, Generated(TEXT)).strategy == "continue"


def test_a_loop_the_engine_reported_goes_on_from_the_onset_the_detector_finds() -> None:
    engine = Trigger("engine", "content", 0)
    asked = Asked("chat", body(), detector=DetectorConfig())
    looped = "Once upon a time" + UNIT * 16  # long enough for the detector (256 chars)
    nxt = next_attempt(asked, engine, RETRY, Generated(looped))
    assert nxt.continued is not None and nxt.continued.prefix == PREFIX
    calm = "A calm answer that the engine stopped anyway."
    nxt = next_attempt(asked, engine, RETRY, Generated(calm))
    assert nxt.continued is not None and nxt.continued.prefix == calm  # no loop found: all of it


def test_what_goes_in_a_refused_retrys_place_is_decided_with_it() -> None:
    # A continuation: the client's own request (no overrides, its own seed or none) going on
    # from the same kept text, then the client's own request as it came.
    shown = TEXT[: len(PREFIX) + 2 * len(UNIT)]
    nxt = next_attempt(Asked("chat", body(stream=True)), ONSET, RETRY, Generated(TEXT, shown=shown))
    assert nxt.continued is not None
    own, original = nxt.fallbacks
    assert original == ORIGINAL and own.continued == nxt.continued
    assert own.body is not None and "presence_penalty" not in own.body and "seed" not in own.body
    assert own.body["messages"] == nxt.body["messages"], "the fallback goes on from other text"
    assert own.body["max_tokens"] == nxt.body["max_tokens"] == 500 - nxt.kept_tokens
    # A restart, or a closed reasoning (not what the client's own request would do): as it came.
    assert next_attempt(Asked("chat", body()), ONSET, RETRY, Generated(None)).fallbacks == (
        ORIGINAL,
    )
    trigger = Trigger("proxy", "reasoning", 0, len(UNIT), 12, len("Once upon a time"))
    closed = next_attempt(Asked("chat", body()), trigger, RETRY, Generated(TEXT))
    assert closed.strategy == "close_reasoning" and closed.fallbacks == (ORIGINAL,)
