from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.loops.detector import DetectorConfig
from proxy.loops.watch import LoopWatch
from proxy.relay.extract import Extractor
from proxy.relay.inspectors import Delta

UNIT = " and then the model says the same thing again."


def delta(index: int = 0, finish: str | None = None, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": fields, "finish_reason": finish}]}


def test_content_loop_per_choice() -> None:
    watch = LoopWatch("chat", DetectorConfig())
    trigger = None
    for _ in range(40):
        watch.on_delta(delta(0, content="ordinary text that varies " + str(_)))
        trigger = trigger or watch.on_delta(delta(1, content=UNIT))
    assert trigger is not None
    assert (trigger.source, trigger.channel, trigger.choice, trigger.period) == (
        "proxy",
        "content",
        1,
        len(UNIT),
    )


def test_duplicated_reasoning_fields_count_once() -> None:
    # vLLM 0.11.1-0.15 sends the same text as reasoning and reasoning_content.
    watch = LoopWatch("chat", DetectorConfig())
    fed = 0
    trigger = None
    while trigger is None and fed < 5000:
        trigger = watch.on_delta(delta(reasoning=UNIT, reasoning_content=UNIT))
        fed += len(UNIT)
    assert trigger is not None and trigger.channel == "reasoning"
    assert trigger.start_offset is not None and trigger.start_offset < len(UNIT)
    assert fed <= DetectorConfig().required_chars(len(UNIT)) + 2 * len(UNIT) + 32  # type: ignore[operator]


def test_engine_repetition_and_runaway() -> None:
    watch = LoopWatch("chat", DetectorConfig())
    watch.on_delta(delta(content="hello"))
    trigger = watch.on_delta(delta(finish="repetition"))
    assert trigger is not None and (trigger.source, trigger.channel) == ("engine", "content")
    watch = LoopWatch("chat", DetectorConfig())
    watch.on_delta(delta(reasoning_content="thinking and thinking"))
    trigger = watch.on_delta(delta(finish="length"))
    assert trigger is not None and (trigger.source, trigger.channel) == ("runaway", "reasoning")
    watch = LoopWatch("chat", DetectorConfig(), runaway=False)
    watch.on_delta(delta(reasoning="thinking"))
    assert watch.on_delta(delta(finish="length")) is None


def test_whole_answers_and_completions() -> None:
    answer = {
        "choices": [
            {"index": 0, "finish_reason": "length", "message": {"content": "intro. " + UNIT * 20}}
        ]
    }
    trigger = LoopWatch("chat", DetectorConfig()).on_answer(answer)
    assert trigger is not None and trigger.period == len(UNIT)
    completion = {"choices": [{"index": 0, "text": "x" * 3 + UNIT * 20, "finish_reason": "length"}]}
    assert LoopWatch("completions", DetectorConfig()).on_answer(completion) is not None
    normal = {
        "choices": [
            {
                "index": 0,
                "finish_reason": "stop",
                "message": {"content": "\n".join(f"{i}. item {i}" for i in range(300))},
            }
        ]
    }
    assert LoopWatch("chat", DetectorConfig()).on_answer(normal) is None
    assert LoopWatch("chat", DetectorConfig()).on_answer({"choices": "junk"}) is None


def test_a_whole_answer_with_a_malformed_index_is_watched_as_choice_0() -> None:
    # As the streamed path reads it: a policy is told of choice 0, never of the string.
    for index in ("0", None, 1.5):
        answer = {
            "choices": [
                {"index": index, "finish_reason": "length", "message": {"content": UNIT * 20}}
            ]
        }
        trigger = LoopWatch("chat", DetectorConfig()).on_answer(answer)
        assert trigger is not None and trigger.choice == 0


# --- the fast path and runs: the same triggers as the general walk, chunk by chunk -----------

PIECES = [UNIT, UNIT[:7], UNIT[7:], " other words", "", "x" * 40, "- ", "\n"]


def chunk_strategy() -> st.SearchStrategy[dict[str, Any]]:
    text = st.sampled_from(PIECES)
    delta = st.fixed_dictionaries(
        {},
        optional={
            "content": st.one_of(text, st.none(), st.just(5)),
            "reasoning": st.one_of(text, st.none()),
            "reasoning_content": text,
            "role": st.just("assistant"),
        },
    )
    choice = st.fixed_dictionaries(
        {"delta": st.one_of(delta, st.none(), st.just("junk"))},
        optional={
            "index": st.sampled_from([0, 0, 0, 1, True, "0", None]),
            "finish_reason": st.sampled_from([None, "stop", "length", "repetition"]),
            "stop_reason": st.sampled_from([None, "repetition_detected"]),
        },
    )
    return st.fixed_dictionaries(
        {"choices": st.one_of(st.lists(choice, min_size=1, max_size=1), st.lists(choice))}
    )


def as_answer(chunk: dict[str, Any]) -> dict[str, Any]:
    """A streamed chunk as a whole answer's shape: each choice's ``delta`` as its ``message``
    (the chunks drawn here have no ``message`` of their own)."""
    choices = [
        {("message" if key == "delta" else key): value for key, value in choice.items()}
        for choice in chunk["choices"]
    ]
    return {**chunk, "choices": choices}


@settings(max_examples=200, deadline=None)
@given(st.lists(chunk_strategy(), max_size=120), st.booleans())
def test_fast_path_triggers_like_the_general_walk(chunks: list[Any], chat: bool) -> None:
    """A streamed chunk's fast path (a single choice already watched, read inline) triggers as
    the general walk of every choice does: ``on_answer`` walks the same chunk in a whole
    answer's shape."""
    endpoint = "chat" if chat else "completions"
    fast, general = LoopWatch(endpoint, DetectorConfig()), LoopWatch(endpoint, DetectorConfig())
    for chunk in chunks:
        assert fast.on_delta(chunk) == general.on_answer(as_answer(chunk))


@settings(max_examples=200, deadline=None)
@given(st.lists(chunk_strategy(), max_size=120), st.booleans())
def test_a_delta_triggers_as_the_chunk_it_was_read_from(chunks: list[Any], chat: bool) -> None:
    """What the relay hands on as a ``Delta`` (a chunk carrying one text and nothing else)
    gives the trigger the chunk itself gives."""
    endpoint = "chat" if chat else "completions"
    extractor = Extractor(chat, templates=False)
    as_deltas, as_chunks = (
        LoopWatch(endpoint, DetectorConfig()),
        LoopWatch(endpoint, DetectorConfig()),
    )
    for chunk in chunks:
        item = extractor.delta_of(chunk)
        assert as_deltas.on_delta(item or chunk) == as_chunks.on_delta(chunk)
    assert as_deltas.kept() == as_chunks.kept()


@st.composite
def split_text(draw: st.DrawFn) -> list[str]:
    """A text that may loop (noise, then a unit repeated), cut into deltas anywhere."""
    unit = draw(st.sampled_from([UNIT, "- ", "ab" * 20 + "!", "the same line\n"]))
    noise = draw(st.text(alphabet="abc \n", max_size=300))
    text = noise + unit * draw(st.integers(0, 80)) + draw(st.text(alphabet="xyz", max_size=50))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=60)))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


@settings(max_examples=300, deadline=None)
@given(split_text(), st.sampled_from(["content", "reasoning"]))
def test_a_delta_fires_where_its_chunk_does(texts: list[str], channel: str) -> None:
    as_chunks = LoopWatch("chat", DetectorConfig(), keep=True)
    as_deltas = LoopWatch("chat", DetectorConfig(), keep=True)
    for text in texts:
        expected = as_chunks.on_delta(delta(0, **{channel: text}))
        assert as_deltas.on_delta(Delta(0, channel, text)) == expected
        if expected is not None:
            break
    assert as_deltas.shown(0, channel) == as_chunks.shown(0, channel)
    finish = delta(0, finish="length")  # what a later finish chunk sees: the same channels seen
    assert as_deltas.on_delta(finish) == as_chunks.on_delta(finish)


def test_a_loop_fires_at_the_delta_that_reaches_the_check() -> None:
    texts = ["intro. "] + [UNIT] * 12
    watch = LoopWatch("chat", DetectorConfig())
    fired = [i for i, t in enumerate(texts) if watch.on_delta(Delta(0, "content", t)) is not None]
    assert len(fired) == 1 and fired[0] < len(texts) - 1
