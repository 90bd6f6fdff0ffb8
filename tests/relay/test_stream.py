"""The relay's paths (raw; inspected, with templates or every event parsed: the reference)
give the same client bytes, counts, inspected deltas, triggers and decisions, whatever the split
of the upstream reads."""

from __future__ import annotations

import gc
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Abort, Retry, Trigger
from proxy.audit.outcome import StreamAccumulator
from proxy.http.sse import FIRST_CUT_MIN, first_cut
from proxy.loops.detector import DetectorConfig
from proxy.loops.watch import LoopWatch
from proxy.relay.inspectors import Delta, Item
from proxy.relay.stream import StreamRelay
from tests.helpers.relay_run import ExplodingInspector, IterationWrites, RelayRun, relay
from tests.helpers.sse import chat_event, sse_blocks, sse_event

UNIT = " and then the model says the same thing again."
ID = "chatcmpl-1"


def answer(
    reasoning: list[str], content: list[str], key: str = "reasoning", usage: bool = True
) -> bytes:
    events = [chat_event({"role": "assistant", "content": ""})]
    keys = ("reasoning", "reasoning_content") if key == "both" else (key,)
    events += [chat_event(dict.fromkeys(keys, text)) for text in reasoning]
    events += [chat_event({"content": text}) for text in content]
    events.append(chat_event({"content": ""}, "stop"))
    if usage:
        events.append(sse_event({"id": ID, "choices": [], "usage": {"completion_tokens": 9}}))
    return b"".join([*events, b"data: [DONE]\n\n"])


def words(n: int) -> list[str]:
    return [f" word{i % 13}{'!' if i % 7 == 0 else ''}" for i in range(n)]


CLEAN = answer(words(20), words(30))
CONTENT_LOOP = answer(words(10), words(10) + [UNIT] * 15 + words(5))
REASONING_LOOP = answer(words(5) + [UNIT[:9], UNIT[9:]] * 12, words(5))


def split(stream: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted(c for c in cuts if c <= len(stream))
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


def summary(run: RelayRun, events: bool = True) -> tuple[Any, ...]:
    """What must agree between paths; ``events`` counts whole reads, so a decision that stops
    mid-read makes it depend on the split: compare it between runs of the same reads."""
    r = run.result
    return (
        run.client.body,
        r.complete,
        r.trigger,
        r.decision,
        r.events if events else None,
        r.first_id,
        r.token_events,
        r.completion_tokens,
        run.stopped,
        run.decided,
    )


# --- raw path ---------------------------------------------------------------------------------


def test_nothing_inspects_takes_the_raw_path_with_the_same_result() -> None:
    reads = split(CLEAN, [50, 51, 400, 2000])
    raw = relay(reads)
    assert raw.relay.raw
    assert summary(raw) == summary(relay(reads, general=True))
    r = raw.result
    assert r.complete and r.events == 54 and r.first_id == ID
    assert r.token_events == 50 and r.completion_tokens == 9
    assert r.first_token_s is not None and r.last_token_s is not None
    assert len(raw.client.writes) <= len(reads)  # one write per read at most


@pytest.mark.parametrize("general", [False, True])
def test_a_break_mid_event_ends_with_an_inband_error(general: bool) -> None:
    events = CLEAN.split(b"\n\n")
    cut = len(b"\n\n".join(events[:3])) + 2 + 20  # inside the fourth event
    run = relay([CLEAN[:cut]], fail=True, general=general)
    head = b"\n\n".join(events[:3]) + b"\n\n"
    assert run.client.body.startswith(head)
    error = run.client.body[len(head) :]
    assert error.startswith(b'data: {"error"') and error.endswith(b"data: [DONE]\n\n")
    assert not run.result.complete and run.failed == ["reset"]


def test_a_break_after_an_oversized_event_starts_with_a_blank_line() -> None:
    big = chat_event({"content": "x" * 3000})
    first = CLEAN.split(b"\n\n")[0] + b"\n\n"
    for general in (False, True):
        run = relay([first, big[:2000]], fail=True, max_event_bytes=1000, general=general)
        assert run.client.body.startswith(first + big[:2000] + b"\n\ndata: {")


# --- the inspected paths agree with the general one -----------------------------------------


BOTH_LOOP = answer(words(5) + [UNIT[:9], UNIT[9:]] * 12, words(5), "both")
STREAMS = [
    CLEAN,
    CONTENT_LOOP,
    REASONING_LOOP,
    BOTH_LOOP,
    answer(words(5), words(8), "reasoning_content"),
]
DECISIONS = [None, Retry("loop", {}), Abort("loop")]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(STREAMS),
    st.lists(st.integers(0, 12000), max_size=12),
    st.sampled_from(DECISIONS),
    st.booleans(),
    st.sampled_from([1 << 20, 600]),
)
def test_any_split_gives_what_the_general_path_gives(
    stream: bytes, cuts: list[int], decision: Any, hold: bool, hold_max: int
) -> None:
    kw = {"loops": True, "decision": decision, "hold": hold, "hold_max_bytes": hold_max}
    reads = split(stream, cuts)
    fast = relay(reads, **kw)
    assert summary(fast) == summary(relay(reads, general=True, **kw))
    assert summary(fast, False) == summary(relay([stream], general=True, **kw), False)


def test_loops_are_found_on_the_fast_path_and_stop_at_the_same_event() -> None:
    cases = ((CONTENT_LOOP, "content"), (REASONING_LOOP, "reasoning"), (BOTH_LOOP, "reasoning"))
    for stream, channel in cases:
        for decision in DECISIONS[1:]:
            fast = relay([stream], loops=True, decision=decision)
            general = relay([stream], loops=True, decision=decision, general=True)
            assert fast.result.trigger is not None
            assert fast.result.trigger.channel == channel
            assert fast.relay.extractor.hits > 10
            assert summary(fast) == summary(general)
            assert len(fast.client.body) < len(stream)


def test_a_trigger_the_policies_let_go_on_relays_the_stream_whole_whatever_the_split() -> None:
    # The read stops at the trigger's event; the decision comes in the relay's task, and the
    # event and the rest of its read then go out as they came, once.
    for stream in (CONTENT_LOOP, REASONING_LOOP, BOTH_LOOP):
        at = len(stream) // 2
        for reads in ([stream], split(stream, [at, at + 7]), events_of(stream)):
            for general in (False, True):
                run = relay(reads, loops=True, general=general)
                assert run.client.body == stream, (len(reads), general)
                assert len(run.decided) == 1, "the trigger was not answered once"
                assert run.result.complete and run.result.decision is None


def test_hold_reasoning_on_the_fast_path() -> None:
    for stream in (CLEAN, REASONING_LOOP):
        for decision in DECISIONS:
            reads = split(stream, list(range(0, len(stream), 97)))
            fast = relay(reads, loops=True, decision=decision, hold=True)
            general = relay(reads, loops=True, decision=decision, hold=True, general=True)
            assert summary(fast) == summary(general)
    # A retried looping attempt never showed its reasoning.
    run = relay([REASONING_LOOP], loops=True, decision=Retry("loop", {}), hold=True)
    assert b"word" not in run.client.body.replace(b'"role"', b"")


def test_a_literal_the_template_cannot_read_falls_back_and_stops_inspection() -> None:
    good = chat_event({"content": "fine"})
    broken = good.replace(b'"fine"', b'"bad\x01"')  # a raw control character: not JSON
    stream = chat_event({"role": "assistant", "content": ""}) + good * 3 + broken + good * 3
    for reads in ([stream], split(stream, [len(stream) - len(good) * 4])):
        run = relay(reads, loops=True)
        assert run.client.body == stream
        assert run.stopped == ["malformed_json"]
        assert run.result.token_events == 3
        assert summary(run) == summary(relay(reads, loops=True, general=True))


def test_other_framings_take_the_general_path_within_one_stream() -> None:
    stream = CONTENT_LOOP
    at = stream.index(UNIT.encode()) - 200
    mixed = stream[:at] + b": keep-alive\n\n" + stream[at:]
    for decision in DECISIONS:
        reads = split(mixed, [at - 50, at + 300])
        fast = relay(reads, loops=True, decision=decision)
        assert summary(fast) == summary(relay(reads, loops=True, decision=decision, general=True))


def test_restarted_attempt_keeps_the_first_id() -> None:
    stream = answer(words(3), words(3)).replace(ID.encode(), b"chatcmpl-2")
    run = relay([stream], loops=True, id_override=ID)
    assert b"chatcmpl-2" not in run.client.body
    assert summary(run) == summary(relay([stream], loops=True, id_override=ID, general=True))
    same = relay([CLEAN], loops=True, id_override=ID)
    assert same.client.body == CLEAN
    assert same.relay.extractor.hits > 10


class Collect:
    name = "collect"

    def __init__(self) -> None:
        self.chunks: list[Item] = []
        self.ended: list[bool] = []

    def on_delta(self, item: Item) -> None:
        self.chunks.append(item)

    def on_end(self, complete: bool) -> None:
        self.ended.append(complete)


def test_inspectors_see_every_chunk_and_one_that_raises_is_dropped() -> None:
    collect = Collect()
    run = relay(split(CLEAN, [300, 301]), loops=True, inspectors=[ExplodingInspector(), collect])
    assert run.client.body == CLEAN
    assert len(collect.chunks) == 53  # every data event but [DONE]
    assert run.stopped == ["explode"]
    assert run.relay.extractor.hits > 40
    assert collect.ended == [True]
    # The token chunks as deltas, the others parsed (the role, the finish, the usage).
    deltas = [c for c in collect.chunks if isinstance(c, Delta)]
    assert [(d.channel, d.text) for d in deltas] == [
        *(("reasoning", w) for w in words(20)),
        *(("content", w) for w in words(30)),
    ]
    assert all(isinstance(c, dict) for c in collect.chunks if c not in deltas)


def test_malformed_events_switch_inspection_off_and_bytes_flow() -> None:
    for bad in (b"data: {not json\n\n", b"garbage\n\n"):
        stream = CONTENT_LOOP.replace(b"\n\n", b"\n\n" + bad, 3)
        for reads in ([stream], split(stream, list(range(0, len(stream), 50)))):
            run = relay(reads, loops=True, decision=Abort("loop"))
            assert run.client.body == stream
            assert run.result.trigger is None and run.result.complete
            assert len(run.stopped) == 1


def with_logprobs(stream: bytes) -> bytes:
    """Each chunk of ``stream`` with logprobs on its choices, as an injected request gets."""
    out = []
    for block in sse_blocks(stream):
        data = block[len(b"data: ") :]
        if data != b"[DONE]":
            chunk = orjson.loads(data)
            for choice in chunk["choices"]:
                choice["logprobs"] = {"content": [{"token": "t", "logprob": -0.5}]}
            block = b"data: " + orjson.dumps(chunk)
        out.append(block + b"\n\n")
    return b"".join(out)


REWRITES = [
    ({"strip_logprobs": True}, b'"logprobs":{'),
    ({"id_override": "chatcmpl-first"}, b'"id":"chatcmpl-1"'),
    ({"reasoning_as_content": True}, b'"reasoning":'),
]


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from(REWRITES),
    st.sampled_from([b"data: {not json\n\n", b'data: "a string"\n\n', b"garbage\n\n"]),
    st.integers(1, 40),
    st.lists(st.integers(0, 12000), max_size=8),
    st.booleans(),
)
def test_what_the_client_needs_rewritten_still_is_after_inspection_stops(
    rewrite: tuple[dict[str, Any], bytes], bad: bytes, at: int, cuts: list[int], general: bool
) -> None:
    # Logprobs detproxy injected must not reach a client that did not ask for them, nor a
    # restarted attempt's id, nor reasoning after a closed one: a malformed event stops the
    # loop watch, not these.
    plan, absent = rewrite
    stream = with_logprobs(answer(words(20), words(30)))
    stream = stream.replace(b"\n\n", b"\n\n" + bad, at).replace(bad, b"", at - 1)
    run = relay(split(stream, cuts), loops=True, general=general, **plan)
    assert run.result.complete and len(run.stopped) == 1
    assert absent not in run.client.body
    body_events = sse_blocks(run.client.body)
    assert len(body_events) == len(sse_blocks(stream))
    assert bad in run.client.body  # the malformed event itself goes out as it came


def events_of(stream: bytes) -> list[bytes]:
    return [block + b"\n\n" for block in sse_blocks(stream)]


def test_one_event_per_read_is_handled_whole_like_the_general_path() -> None:
    for stream in STREAMS:
        reads = events_of(stream)
        for decision in DECISIONS:
            for hold in (False, True):
                kw = {"loops": True, "decision": decision, "hold": hold}
                fast = relay(reads, **kw)
                assert summary(fast) == summary(relay(reads, general=True, **kw))
                assert fast.relay.extractor.hits > 5
    good = chat_event({"content": "fine"})
    reads = [
        chat_event({"role": "assistant", "content": ""}),
        good,
        good,
        good.replace(b"fine", b"\t"),
    ]
    run = relay(reads, loops=True)
    assert run.client.body == b"".join(reads) and run.stopped == ["malformed_json"]


def test_template_runs_that_only_parse_together_are_not_trusted() -> None:
    good = chat_event({"content": "fine"})
    # Each alone is not a chunk of the template's shape; their literals would read together
    # as two strings, ["a\",", ""], if they were decoded as one run without further checks.
    first = good.replace(b'"fine"', b'"a\\"')
    second = good.replace(b'"fine"', b'",""')
    stream = chat_event({"role": "assistant", "content": ""}) + good * 2 + first + second + good
    for reads in ([stream], events_of(stream)):
        run = relay(reads, loops=True)
        assert summary(run) == summary(relay(reads, loops=True, general=True))
        assert run.client.body == stream and run.stopped == ["malformed_json"]


# --- an audited stream on the template path ---------------------------------------------------


def two_choices(n: int) -> bytes:
    """Two choices (n=2) streamed interleaved, token by token, then their finish."""

    def event(index: int, delta: dict[str, Any], finish: str | None = None) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish}
        return sse_event({"id": ID, "object": "chat.completion.chunk", "choices": [choice]})

    events = [event(i, {"role": "assistant", "content": ""}) for i in (0, 1)]
    for k, text in enumerate(words(n)):
        events.append(event(k % 2, {"content": text}))
    events += [event(i, {"content": ""}, "stop") for i in (0, 1)]
    return b"".join([*events, b"data: [DONE]\n\n"])


AUDITED = [*STREAMS, two_choices(40)]


@settings(max_examples=120, deadline=None)
@given(
    st.sampled_from(AUDITED),
    st.lists(st.integers(0, 12000), max_size=12),
    st.sampled_from(DECISIONS),
)
def test_an_audited_stream_accumulates_on_the_template_path_what_the_general_path_does(
    stream: bytes, cuts: list[int], decision: Any
) -> None:
    reads = split(stream, cuts)
    fast_acc, general_acc = StreamAccumulator("chat"), StreamAccumulator("chat")
    kw = {"loops": True, "decision": decision}
    fast = relay(reads, inspectors=[fast_acc], **kw)
    general = relay(reads, inspectors=[general_acc], general=True, **kw)
    assert summary(fast) == summary(general)
    assert fast_acc.outcome() == general_acc.outcome()


def test_the_audit_accumulator_keeps_the_template_path() -> None:
    for stream in (CLEAN, two_choices(40)):
        reads = events_of(stream)
        acc = StreamAccumulator("chat")
        fast = relay(reads, inspectors=[acc])
        assert fast.relay.extractor.hits > 15
        outcome = acc.outcome()
        assert outcome.error is None and all(c.content for c in outcome.choices)


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from([*AUDITED, answer(words(4), words(6), "both", usage=False)]),
    st.lists(st.integers(0, 12000), max_size=12),
    st.sampled_from(DECISIONS),
    st.sampled_from([{}, {"hold": True}, {"hold_back_chars": 40}, {"id_override": "x"}]),
)
def test_inspectors_see_the_same_items_whether_templates_read_them_or_not(
    stream: bytes, cuts: list[int], decision: Any, plan: dict[str, Any]
) -> None:
    reads = split(stream, cuts)
    fast_seen, general_seen = Collect(), Collect()
    kw = {"loops": True, "decision": decision, **plan}
    fast = relay(reads, inspectors=[fast_seen], **kw)
    general = relay(reads, inspectors=[general_seen], general=True, **kw)
    assert summary(fast) == summary(general)
    assert fast.relay.unshown == general.relay.unshown
    assert fast_seen.chunks == general_seen.chunks
    assert fast_seen.ended == general_seen.ended


class BrokenWatch:
    """A loop watch with a bug: it raises on the first event it is given. (Not a subclass of
    ``LoopWatch``: the compiled build's classes take no interpreted subclasses.)"""

    name = "loop_watch"  # as LoopWatch's

    def on_delta(self, item: Item) -> Any:
        raise RuntimeError("watch bug")

    def on_end(self, complete: bool) -> None:
        pass


@pytest.mark.parametrize("general", [False, True])
def test_a_loop_watch_that_raises_is_dropped_and_the_stream_goes_on(general: bool) -> None:
    # The watch is an inspector like the others: isolated, reported, the bytes keep flowing.
    collect = Collect()
    watch = BrokenWatch()
    run = relay([CONTENT_LOOP], decision=Retry("loop"), watch=watch, inspectors=[collect],
                general=general)  # fmt: skip
    assert run.client.body == CONTENT_LOOP  # the loop it would have caught goes through
    assert run.result.complete and run.result.trigger is None and run.result.decision is None
    assert run.stopped == ["loop_watch"]
    assert len(collect.chunks) == len(sse_blocks(CONTENT_LOOP)) - 1  # all but [DONE]


def test_a_trigger_no_policy_decides_on_is_recorded_and_the_stream_goes_on() -> None:
    # The watch with no policy to ask (no on_trigger): the trigger is kept, nothing stops.
    watch = LoopWatch("chat", DetectorConfig())
    observed = relay([CONTENT_LOOP], watch=watch)
    stopped = relay([CONTENT_LOOP], loops=True, decision=Retry("loop"))
    assert observed.result.trigger == stopped.result.trigger is not None
    assert observed.result.decision is None and observed.client.body == CONTENT_LOOP
    assert stopped.result.decision == Retry("loop")
    assert CONTENT_LOOP.startswith(stopped.client.body) and stopped.client.body != CONTENT_LOOP


@pytest.mark.parametrize("kind", ["raw", "simple", "general"])
def test_a_relay_is_freed_by_reference_counting_when_its_stream_ends(kind: str) -> None:
    """No reference cycle: a stream's objects go when it ends, not in a pass of the cyclic
    collector, which pauses the event loop while it walks them (issue 16)."""

    def relays() -> int:  # counted among the collector's objects (no weak reference to a
        # compiled class: tests run on the mypyc build too)
        return sum(1 for o in gc.get_objects() if type(o) is StreamRelay)

    gc.disable()
    try:
        before = relays()
        run = relay([CLEAN], loops=kind != "raw", general=kind == "general")
        assert run.result.complete and run.relay.raw == (kind == "raw")
        assert relays() == before + 1
        del run
        assert relays() == before
    finally:
        gc.enable()


# --- a stream read up to its first event before the relay -----------------------------------


FIRST_READ = [
    *STREAMS[:2],
    b": ping\n\n" + CLEAN,  # a comment before the first event
    CLEAN.replace(b"\n\n", b"\r\n\r\n"),  # the general decoder's framing
    CLEAN[:-2],  # a last event without its blank line: the handed decoder holds it
]
PLANS: list[dict[str, Any]] = [
    {},  # the raw path
    {"loops": True},
    {"loops": True, "hold": True},
    {"loops": True, "general": True},
    {"loops": True, "id_override": "chatcmpl-first"},
]


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(FIRST_READ),
    st.lists(st.integers(0, 12000), max_size=8),
    st.sampled_from(DECISIONS),
    st.sampled_from(PLANS),
    st.sampled_from([1 << 20, 200]),
    st.booleans(),
)
def test_events_cut_before_the_relay_are_not_decoded_again(
    stream: bytes, cuts: list[int], decision: Any, plan: dict[str, Any], bound: int, fail: bool
) -> None:
    """A stream read up to its first event (an altered request's, by the fallback) is decoded
    once: the relay goes on with the events cut and the decoder that cut them, and relays what
    it relays of the bytes alone, whatever the split, a trigger or an event over the bound
    among those first events, or a stream that breaks."""
    reads = split(stream, cuts)
    kw = {"decision": decision, "max_event_bytes": bound, "fail": fail, **plan}
    handed = relay(reads, first=True, **kw)
    assert handed.decoded is not None, "first_event handed no decoded events on"
    assert handed.relay.decoder is handed.decoded.decoder, "a second decoder read the stream"
    # A decision counts the events of the reads before it: the first events are one read.
    assert summary(handed, decision is None) == summary(relay(reads, **kw), decision is None)


def test_a_trigger_among_the_first_events_is_decided_before_reading_on() -> None:
    # CRLF-framed: a first read with no LF blank line is not cut (first_cut), so first_event
    # decodes every event of it, the loop's among them.
    stream = CONTENT_LOOP.replace(b"\n\n", b"\r\n\r\n")
    assert first_cut(stream) == 0
    for decision in DECISIONS:
        handed = relay([stream], first=True, loops=True, decision=decision)
        assert handed.decoded is not None and len(handed.decoded.datas) > 20
        assert summary(handed) == summary(relay([stream], loops=True, decision=decision))
        assert handed.result.trigger is not None


# --- a long first read: its first events go out before the rest is inspected ----------------


class TriggerAt:
    """A watcher that answers its ``n``th event with a trigger."""

    name = "loop_watch"

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen = 0

    def on_delta(self, item: Item) -> Trigger | None:
        self.seen += 1
        return Trigger("proxy", "content", 0) if self.seen == self.n else None

    def on_end(self, complete: bool) -> None:
        pass


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("first", [False, True])
def test_a_long_first_read_goes_out_as_its_two_parts_would(
    plan: dict[str, Any], first: bool
) -> None:
    """An upstream with the whole answer ready sends it in one read: the events up to the cut
    (first_cut) are written before the rest is read, and the client gets what the two parts
    read one after the other give, write for write (``first``: as an altered request's
    stream, read up to its first event before the relay)."""
    cut = first_cut(CLEAN)
    assert 0 < cut < 1024 and CLEAN[cut - 2 : cut] == b"\n\n"
    run = relay([CLEAN], first=first, **plan)
    two = relay([CLEAN[:cut], CLEAN[cut:]], first=first, **plan)
    assert run.client.writes == two.client.writes
    assert summary(run) == summary(two)
    if not plan:  # the raw path: each part as it came
        assert run.client.writes == [CLEAN[:cut], CLEAN[cut:]]
    if first:
        assert run.decoded is not None and run.decoded.src == CLEAN[:cut]


@pytest.mark.parametrize("first", [False, True])
def test_the_first_events_of_a_long_read_go_out_before_the_rest_is_relayed(first: bool) -> None:
    """Written at the end of a loop iteration of their own, as the front writes: the client's
    first token does not wait for the rest of the read to be inspected."""
    cut = first_cut(CLEAN)
    run = relay([CLEAN], first=first, loops=True, iterations=True)
    assert isinstance(run.client, IterationWrites)
    assert run.client.flushes == [CLEAN[:cut], CLEAN[cut:]]


def test_a_short_first_read_goes_out_in_one_write() -> None:
    read = CLEAN[: CLEAN.rfind(b"\n\n", 0, FIRST_CUT_MIN) + 2]  # whole events, not too many
    assert len(read) > first_cut(CLEAN)
    for plan in PLANS:
        if not plan.get("hold"):  # held reasoning goes out at the end, a write of its own
            assert len(relay([read], **plan).client.writes) == 1, plan


@pytest.mark.parametrize("decision", DECISIONS)
@pytest.mark.parametrize("first", [False, True])
def test_a_trigger_before_the_cut_of_a_long_read_is_decided_before_its_rest(
    decision: Any, first: bool
) -> None:
    cut = first_cut(CLEAN)
    kw = {"first": first, "loops": True, "decision": decision}
    run = relay([CLEAN], watch=TriggerAt(3), **kw)
    two = relay([CLEAN[:cut], CLEAN[cut:]], watch=TriggerAt(3), **kw)
    assert run.result.trigger == Trigger("proxy", "content", 0)
    assert len(run.decided) == 1, "the trigger was not answered once"
    assert summary(run) == summary(two)
    if decision is None:  # let go on: the whole stream, the rest of the read after the decision
        assert run.client.body == CLEAN and run.result.complete
    else:
        assert len(run.client.body) < cut
