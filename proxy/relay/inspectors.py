"""The inspector seam on the streaming path.

An inspector sees each parsed SSE chunk (a dict, decoded once with orjson) of one response,
in order, synchronously: it must be O(len(chunk)) and never await. ``InspectorSet`` runs
them with isolation: an inspector that raises is switched off for the rest of the response
and reported, and the bytes keep flowing.

An inspector that also has ``on_run`` (``RunInspector``) lets the relay keep its template path
(``proxy.relay.template``): token chunks that match a learned template are not parsed, and it
gets their texts instead, a run of one choice and channel at a time, in stream order with the
chunks it is given parsed. Such a chunk carries nothing else (no finish reason, logprobs or
usage), so the texts are all it would have read from them.

An inspector that says ``triggers = True`` answers a chunk with a ``Trigger`` or None, and a
run with the trigger and the position in the run of the chunk it belongs to: the loop watch
(``proxy.loops.watch.LoopWatch``) does; the relay hands a trigger to the policies.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from policies.base import Trigger
from proxy.classify import RequestView

log = logging.getLogger(__name__)


class StreamInspector(Protocol):
    name: str

    def on_chunk(self, chunk: dict[str, Any]) -> Trigger | None:
        """One parsed ``data:`` event (``[DONE]`` and comments are not passed); an inspector
        that triggers may answer with a trigger, the others answer None."""

    def on_end(self, complete: bool) -> None:
        """The stream ended; ``complete`` is False when it broke or the client left."""


class RunInspector(StreamInspector, Protocol):
    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> tuple[Trigger, int] | None:
        """Consecutive token chunks of choice ``index`` that carry only a text: ``channel`` is
        ``"content"`` (completions: the text) or ``"reasoning"``. A trigger comes with the
        position in ``texts`` of the chunk it belongs to."""


# Builds the inspectors for one response, or returns None when it has nothing to look at.
InspectorFactory = Callable[[RequestView], StreamInspector | None]


class InspectorSet:
    """A response's inspectors, each isolated. Those that answer with triggers (``triggers =
    True``: the loop watch) are asked after the others for a chunk, and alone for a run: the
    relay finds where a run's trigger is, then hands the others the texts up to that chunk
    (``on_run``), and the rest only when the decision lets the stream go on, so that they see
    what the client is sent, as on the general path."""

    __slots__ = ("_inspectors", "_on_failure", "_watchers", "runs")

    def __init__(
        self, inspectors: Sequence[StreamInspector], on_failure: Callable[[str], None]
    ) -> None:
        self._inspectors = [i for i in inspectors if not getattr(i, "triggers", False)]
        self._watchers = [i for i in inspectors if getattr(i, "triggers", False)]
        self._on_failure = on_failure
        # Whether every inspector reads runs of texts: then template chunks need no parsing.
        self.runs = all(callable(getattr(i, "on_run", None)) for i in inspectors)

    def __bool__(self) -> bool:
        return bool(self._inspectors or self._watchers)

    @property
    def watching(self) -> bool:
        """Whether an inspector that triggers is on."""
        return bool(self._watchers)

    def on_chunk(self, chunk: dict[str, Any], watch: bool = True) -> Trigger | None:
        """Every inspector sees the chunk (the watchers only with ``watch``); the first
        trigger a watcher answers with."""
        for inspector in self._inspectors:
            try:
                inspector.on_chunk(chunk)
            except Exception:
                self._drop(inspector)
        if not watch:
            return None
        first = None
        for watcher in self._watchers:
            try:
                found = watcher.on_chunk(chunk)
            except Exception:
                self._drop(watcher)
                continue
            if first is None:
                first = found
        return first

    def trigger_in_run(
        self, index: int, channel: str, texts: Sequence[str]
    ) -> tuple[Trigger, int] | None:
        """A run to the watchers: the earliest trigger, with its chunk's position in it."""
        first = None
        for watcher in self._watchers:
            try:
                found = watcher.on_run(index, channel, texts)  # type: ignore[attr-defined]
            except Exception:
                self._drop(watcher)
                continue
            if found is not None and (first is None or found[1] < first[1]):
                first = found
        return first

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> None:
        """A run (or its part up to a trigger's chunk) to the inspectors that do not trigger."""
        for inspector in self._inspectors:
            try:
                inspector.on_run(index, channel, texts)  # type: ignore[attr-defined]
            except Exception:
                self._drop(inspector)

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
        self._on_failure(inspector.name)
