"""InspectorSet (proxy/relay/inspectors.py): the texts of single template hits are held until
a watcher would look at them, and handed on, in order, before anything else reaches the
inspectors; a trigger still comes with the chunk that reaches the detector's check."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from policies.base import Trigger
from proxy.loops.detector import DetectorConfig
from proxy.loops.watch import LoopWatch
from proxy.relay.inspectors import InspectorSet

UNIT = " and then the model says the same thing again."


def delta(index: int = 0, **fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": index, "delta": fields, "finish_reason": None}]}


class Recorder:
    """An inspector that notes every call it gets."""

    name = "recorder"

    def __init__(self, calls: list[tuple[Any, ...]]) -> None:
        self.calls = calls

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        self.calls.append(("chunk",))

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> None:
        self.calls.append(("run", index, channel, list(texts)))

    def on_end(self, complete: bool) -> None:
        self.calls.append(("end", complete))


class RecordingWatch:
    """The loop watch, noting the runs it is handed (around it: the compiled build's classes
    cannot be subclassed by interpreted ones)."""

    name = "loop_watch"
    triggers = True

    def __init__(self, runs: list[list[str]]) -> None:
        self.watch = LoopWatch("chat", DetectorConfig())
        self.runs = runs

    def on_chunk(self, chunk: dict[str, Any]) -> Trigger | None:
        return self.watch.on_chunk(chunk)

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> tuple[Trigger, int] | None:
        self.runs.append(list(texts))
        return self.watch.on_run(index, channel, texts)

    def on_end(self, complete: bool) -> None:
        self.watch.on_end(complete)

    def quiet_chars(self, index: int, channel: str) -> int:
        return self.watch.quiet_chars(index, channel)


class BrokenQuiet(RecordingWatch):
    def quiet_chars(self, index: int, channel: str) -> int:
        raise RuntimeError("boom")


class SilentWatcher:
    """A watcher that cannot say how long it stays quiet: it gets each text at once."""

    name = "silent"
    triggers = True

    def __init__(self, runs: list[list[str]]) -> None:
        self.runs = runs

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        return None

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> None:
        self.runs.append(list(texts))

    def on_end(self, complete: bool) -> None:
        pass


def test_texts_are_held_until_the_watch_would_look_and_then_handed_on_in_one_call() -> None:
    calls: list[tuple[Any, ...]] = []
    runs: list[list[str]] = []
    watch = RecordingWatch(runs)
    watch.on_chunk(delta(content="Hi"))  # the choice's detector exists: it can say
    inspectors = InspectorSet([watch, Recorder(calls)], lambda name: None)
    quiet = watch.quiet_chars(0, "content")
    assert quiet == DetectorConfig().check_every_chars - len("Hi") - 1
    texts = ["abcd"] * (quiet // 4)  # all within what the watch takes quietly
    for text in texts:
        assert inspectors.on_text(0, "content", text, True) is None
    assert calls == [] and runs == []
    assert inspectors.on_text(0, "content", "the check", True) is None  # reaches it
    assert calls == [("run", 0, "content", [*texts, "the check"])]
    assert runs == [[*texts, "the check"]]


def test_held_texts_go_first_to_whatever_reaches_the_inspectors_next() -> None:
    for then in ("chunk", "run", "trigger_in_run", "end", "other channel", "no more watch"):
        calls: list[tuple[Any, ...]] = []
        inspectors = InspectorSet([LoopWatch("chat", DetectorConfig()), Recorder(calls)], print)
        inspectors.on_chunk(delta(content="Hi"))
        calls.clear()
        inspectors.on_text(0, "content", "a", True)
        inspectors.on_text(0, "content", "b", True)
        assert calls == [], then
        if then == "chunk":
            inspectors.on_chunk(delta(content="c"))
        elif then == "run":
            inspectors.on_run(0, "content", ["c"])
        elif then == "trigger_in_run":
            inspectors.trigger_in_run(0, "content", ["c"])
        elif then == "end":
            inspectors.on_end(True)
        elif then == "other channel":
            inspectors.on_text(0, "reasoning", "c", True)
        else:
            inspectors.on_text(0, "content", "c", False)
        assert calls[0] == ("run", 0, "content", ["a", "b"]), then
    # Without a watcher, texts are held until something else comes, however many.
    calls = []
    inspectors = InspectorSet([Recorder(calls)], print)
    for _ in range(1000):
        inspectors.on_text(0, "content", UNIT, True)
    assert calls == []
    inspectors.on_end(True)
    assert calls == [("run", 0, "content", [UNIT] * 1000), ("end", True)]


@settings(max_examples=200, deadline=None)
@given(
    st.text(alphabet="abc \n", max_size=200),
    st.integers(0, 60),
    st.lists(st.integers(1, 12), min_size=1, max_size=8),
    st.sampled_from(["content", "reasoning"]),
)
def test_a_trigger_comes_with_the_chunk_that_would_have_fired_it_alone(
    noise: str, copies: int, sizes: list[int], channel: str
) -> None:
    text = noise + UNIT * copies
    texts, at = [], 0
    while at < len(text):  # token-sized texts, in a repeating pattern of sizes
        size = sizes[len(texts) % len(sizes)]
        texts.append(text[at : at + size])
        at += size
    one_by_one = LoopWatch("chat", DetectorConfig())
    expected = next(
        (
            (i, trigger)
            for i, t in enumerate(texts)
            if (trigger := one_by_one.on_chunk(delta(**{channel: t}))) is not None
        ),
        None,
    )
    calls: list[tuple[Any, ...]] = []
    inspectors = InspectorSet([LoopWatch("chat", DetectorConfig()), Recorder(calls)], print)
    found = None
    for i, t in enumerate(texts):
        trigger = inspectors.on_text(0, channel, t, True)
        if trigger is not None:
            found = (i, trigger)
            break
    assert found == expected
    if found is not None:  # the others saw every text up to the triggering chunk's
        seen = [t for call in calls for t in call[3]]
        assert seen == texts[: found[0] + 1]


def test_a_watcher_that_cannot_say_gets_each_text_at_once() -> None:
    runs: list[list[str]] = []
    inspectors = InspectorSet([SilentWatcher(runs)], print)
    for text in ("a", "b", "c"):
        inspectors.on_text(0, "content", text, True)
    assert runs == [["a"], ["b"], ["c"]]


def test_a_watcher_whose_quiet_chars_raises_is_dropped_and_the_texts_go_on() -> None:
    dropped: list[str] = []
    calls: list[tuple[Any, ...]] = []
    broken = BrokenQuiet([])
    inspectors = InspectorSet([broken, Recorder(calls)], dropped.append)
    assert inspectors.on_text(0, "content", "a", True) is None
    assert dropped == ["loop_watch"] and not inspectors.watching
    inspectors.on_text(0, "content", "b", True)
    inspectors.on_end(True)
    assert calls == [("run", 0, "content", ["a", "b"]), ("end", True)]


def test_after_the_first_trigger_the_watchers_get_no_more_texts() -> None:
    runs: list[list[str]] = []
    watch = RecordingWatch(runs)
    inspectors = InspectorSet([watch], print)
    fired = None
    for i in range(200):
        if inspectors.on_text(0, "content", UNIT, True) is not None:
            fired = i
            break
    assert fired is not None
    fed = len(runs)
    for _ in range(100):
        assert inspectors.on_text(0, "content", UNIT, False) is None
    inspectors.on_end(True)
    assert len(runs) == fed


def test_a_set_with_no_inspector_left_holds_nothing() -> None:
    """Every inspector dropped (or none, on a stream relayed for its rewrites alone): texts are
    not kept for no one."""
    runs: list[list[str]] = []
    inspectors = InspectorSet([BrokenQuiet(runs)], print)
    for _ in range(3):
        assert inspectors.on_text(0, "content", UNIT, True) is None
    assert not inspectors.watching and not inspectors
    assert inspectors._held == []  # type: ignore[attr-defined]
    empty = InspectorSet([], print)
    empty.on_text(0, "content", UNIT, True)
    assert empty._held == []  # type: ignore[attr-defined]
