"""InspectorSet (proxy/relay/inspectors.py): every inspector sees every item through its one
method, watchers after the others; a watcher's first trigger is the answer; an inspector that
raises is dropped and reported, and the others go on."""

from __future__ import annotations

from typing import Any

from policies.base import Trigger
from proxy.relay.inspectors import Delta, InspectorSet, Item

TRIGGER = Trigger("proxy", "content", 0)


class Recorder:
    """An inspector that notes every call it gets (in a list it shares with others)."""

    def __init__(self, name: str, calls: list[tuple[Any, ...]], answer: Any = None) -> None:
        self.name = name
        self.calls = calls
        self.answer = answer

    def on_delta(self, item: Item) -> Trigger | None:
        self.calls.append((self.name, item))
        return self.answer

    def on_end(self, complete: bool) -> None:
        self.calls.append((self.name, "end", complete))


class Raising:
    def __init__(self, name: str, at: str = "on_delta") -> None:
        self.name = name
        self.at = at

    def on_delta(self, item: Item) -> None:
        if self.at == "on_delta":
            raise RuntimeError("inspector bug")

    def on_end(self, complete: bool) -> None:
        raise RuntimeError("inspector bug")


def test_watchers_are_asked_after_the_others_and_only_theirs_is_the_answer() -> None:
    calls: list[tuple[Any, ...]] = []
    other = Recorder("other", calls, answer=Trigger("ignored", "content", 0))
    watcher = Recorder("watch", calls, answer=TRIGGER)
    inspectors = InspectorSet([other], print, [watcher])
    delta = Delta(0, "content", "Hi")
    assert inspectors.on_delta(delta) == TRIGGER
    assert calls == [("other", delta), ("watch", delta)]
    # After the first trigger the relay asks the watchers no more: the others still see it.
    chunk: dict[str, Any] = {"choices": []}
    assert inspectors.on_delta(chunk, watch=False) is None
    assert calls[2:] == [("other", chunk)]
    inspectors.on_end(True)
    assert calls[3:] == [("watch", "end", True), ("other", "end", True)]


def test_the_first_watchers_trigger_wins() -> None:
    calls: list[tuple[Any, ...]] = []
    second = Trigger("engine", "content", 0)
    inspectors = InspectorSet(
        [],
        print,
        [Recorder("a", calls), Recorder("b", calls, TRIGGER), Recorder("c", calls, second)],
    )
    assert inspectors.on_delta(Delta(0, "content", "x")) == TRIGGER
    assert [c[0] for c in calls] == ["a", "b", "c"]  # each watcher sees every item


def test_one_that_raises_is_dropped_and_reported_and_the_others_go_on() -> None:
    calls: list[tuple[Any, ...]] = []
    dropped: list[str] = []
    inspectors = InspectorSet(
        [Raising("bad"), Recorder("good", calls)], dropped.append, [Raising("watch")]
    )
    assert inspectors
    for text in ("a", "b"):
        assert inspectors.on_delta(Delta(0, "content", text)) is None
    assert dropped == ["bad", "watch"]  # once each
    assert [c[1] for c in calls] == [Delta(0, "content", "a"), Delta(0, "content", "b")]
    inspectors.on_end(False)
    assert calls[-1] == ("good", "end", False)
    failing_end = InspectorSet([Raising("late", at="on_end")], dropped.append)
    failing_end.on_end(True)
    assert dropped[-1] == "late" and not failing_end


def test_a_set_with_none_is_false() -> None:
    assert not InspectorSet([], print)
    assert InspectorSet([], print, [Recorder("w", [])])


def test_deltas_compare_by_value() -> None:
    assert Delta(1, "reasoning", "x") == Delta(1, "reasoning", "x")
    assert Delta(1, "reasoning", "x") != Delta(1, "content", "x")
    assert len({Delta(0, "content", "a"), Delta(0, "content", "a")}) == 1
    assert repr(Delta(0, "content", "a")) == "Delta(0, 'content', 'a')"
