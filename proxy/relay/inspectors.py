"""The inspector seam on the streaming path: what an inspector sees, and how a response's
inspectors are run.

An inspector sees each data event of one response, in order, synchronously (it must be
O(len(event)) and never await), through one method, ``on_delta``: a token chunk as a ``Delta``
(choice, channel, text: the chunk carries that text and nothing else an inspector reads), any
other chunk as the dict it parses to (the role, a finish, tool calls, logprobs, usage, an error:
its texts, if any, are in it). ``[DONE]`` and comments are not passed. ``InspectorSet`` runs
them with isolation: an inspector that raises is switched off for the rest of the response and
reported, and the bytes keep flowing.

Watchers (the loop watch, ``proxy.loops.watch.LoopWatch``) are named as such when the set is
built: their ``on_delta`` answers with a ``Trigger`` or None, and the relay hands a trigger to
the policies. The others' answers are not read. Watchers are asked after the others, so that
when a decision stops the stream every inspector has seen what the watchers saw.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from policies.base import Trigger
from proxy.classify import RequestView

log = logging.getLogger(__name__)


class Delta:
    """The text of one token chunk: choice ``index``'s ``channel`` ("content": chat's content,
    completions' text; or "reasoning"), ``text`` (it may be empty)."""

    __slots__ = ("channel", "index", "text")

    def __init__(self, index: int, channel: str, text: str) -> None:
        self.index = index
        self.channel = channel
        self.text = text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Delta) and (self.index, self.channel, self.text) == (
            other.index,
            other.channel,
            other.text,
        )

    def __hash__(self) -> int:
        return hash((self.index, self.channel, self.text))

    def __repr__(self) -> str:
        return f"Delta({self.index!r}, {self.channel!r}, {self.text!r})"


# What flows to an inspector: a token chunk's text, or any other chunk, parsed.
Item = Delta | dict[str, Any]


class StreamInspector(Protocol):
    name: str

    def on_delta(self, item: Item) -> Trigger | None:
        """One data event (see the module's docstring); a watcher may answer with a trigger,
        the others answer None."""

    def on_end(self, complete: bool) -> None:
        """The stream ended; ``complete`` is False when it broke or the client left."""


# Builds the inspectors for one response, or returns None when it has nothing to look at.
InspectorFactory = Callable[[RequestView], StreamInspector | None]


class InspectorSet:
    """A response's inspectors and watchers, each isolated."""

    __slots__ = ("_inspected", "_inspectors", "_on_failure", "_watched", "_watchers")

    def __init__(
        self,
        inspectors: Sequence[StreamInspector],
        on_failure: Callable[[str], None],
        watchers: Sequence[StreamInspector] = (),
    ) -> None:
        self._inspectors = list(inspectors)
        self._watchers = list(watchers)
        # Each one's on_delta bound once, called per event: a call through the protocol looks
        # the method up by name every time (callgrind: ~150 instructions an event each).
        self._inspected: list[Callable[[Item], object]] = [i.on_delta for i in self._inspectors]
        self._watched: list[Callable[[Item], Trigger | None]] = [w.on_delta for w in self._watchers]
        self._on_failure = on_failure

    def __bool__(self) -> bool:
        return bool(self._inspectors or self._watchers)

    def on_delta(self, item: Item, watch: bool = True) -> Trigger | None:
        """Every inspector sees the item (the watchers only with ``watch``); the first trigger
        a watcher answers with."""
        inspectors = self._inspectors
        for i, on_delta in enumerate(self._inspected):
            try:
                on_delta(item)
            except Exception:
                self._drop(inspectors[i])
        if not watch:
            return None
        first = None
        watchers = self._watchers
        for i, on_watched in enumerate(self._watched):
            try:
                found = on_watched(item)
            except Exception:
                self._drop(watchers[i])
                continue
            if first is None:
                first = found
        return first

    def on_end(self, complete: bool) -> None:
        for inspector in [*self._watchers, *self._inspectors]:
            try:
                inspector.on_end(complete)
            except Exception:
                self._drop(inspector)

    def _drop(self, inspector: StreamInspector) -> None:
        log.exception(
            "inspector %s failed; it is off for the rest of this response", inspector.name
        )
        self._inspectors = [i for i in self._inspectors if i is not inspector]
        self._watchers = [i for i in self._watchers if i is not inspector]
        self._inspected = [i.on_delta for i in self._inspectors]
        self._watched = [w.on_delta for w in self._watchers]
        self._on_failure(inspector.name)
