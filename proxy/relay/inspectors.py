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

A token streamed on its own (the usual read) is one template hit: ``InspectorSet.on_text``
holds its text and hands the texts of one choice and channel on in one ``on_run`` call, when
the watchers would look at them (a watcher with ``quiet_chars(index, channel)`` says how many
chars it takes from here without looking: the loop watch until its detector's next check) and
before anything else reaches the inspectors (a parsed chunk, a run, the end). So a trigger
still comes with the chunk whose text reaches the check, as when each text is handed on by
itself, and a token costs the relay a list append, not a call through every inspector.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

from policies.base import Trigger
from proxy.classify import RequestView

log = logging.getLogger(__name__)

# What a set with no watcher (or after the first trigger) takes quietly: texts are held for the
# other inspectors until something else reaches them.
_UNBOUNDED: Final = 1 << 62


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
    what the client is sent, as on the general path. Texts of single template hits are held
    (``on_text``, the module's docstring): every other call hands them on first."""

    __slots__ = (
        "_held",
        "_held_channel",
        "_held_index",
        "_held_watched",
        "_inspectors",
        "_on_failure",
        "_quiet",
        "_quiet_known",
        "_watchers",
        "runs",
    )

    def __init__(
        self, inspectors: Sequence[StreamInspector], on_failure: Callable[[str], None]
    ) -> None:
        # One pass, each attribute asked once: a response builds its set, and a lookup that
        # fails raises (and catches) an AttributeError inside getattr.
        self._inspectors: list[StreamInspector] = []
        self._watchers: list[StreamInspector] = []
        # Whether every inspector reads runs of texts: then template chunks need no parsing.
        self.runs = True
        for inspector in inspectors:
            if getattr(inspector, "triggers", False):
                self._watchers.append(inspector)
            else:
                self._inspectors.append(inspector)
            if self.runs and not callable(getattr(inspector, "on_run", None)):
                self.runs = False
        self._on_failure = on_failure
        # Whether every watcher says how long it stays quiet (else each text goes at once).
        self._quiet_known = _all_quiet(self._watchers)
        # Texts of template hits of one choice and channel, not yet handed on (``on_text``).
        self._held: list[str] = []
        self._held_index = -1
        self._held_channel = ""
        self._held_watched = False  # whether the watchers get them too
        self._quiet = -1  # the chars the watchers still take quietly, less those held

    def __bool__(self) -> bool:
        return bool(self._inspectors or self._watchers)

    @property
    def watching(self) -> bool:
        """Whether an inspector that triggers is on."""
        return bool(self._watchers)

    def on_text(self, index: int, channel: str, text: str, watch: bool) -> Trigger | None:
        """The text of one template hit of choice ``index`` in ``channel`` (the watchers get it
        only with ``watch``): held while the watchers take it quietly, else handed on with the
        texts held before it; the trigger of its chunk, if one comes."""
        if not self._inspectors and not self._watchers:
            return None  # none left to hand it to: nothing is held
        if (
            index != self._held_index
            or channel != self._held_channel
            or watch != self._held_watched
            or self._quiet < 0
        ):
            self._hand_on()
            self._held_index, self._held_channel, self._held_watched = index, channel, watch
            self._quiet = self._quiet_chars(index, channel) if watch else _UNBOUNDED
            if not self._inspectors and not self._watchers:
                return None  # the last one failed just now
        self._held.append(text)
        self._quiet -= len(text)
        if self._quiet >= 0:
            return None
        found = self._hand_on()
        # Every text before this one was taken quietly: a trigger is this chunk's.
        return None if found is None else found[0]

    def _quiet_chars(self, index: int, channel: str) -> int:
        if not self._watchers:
            return _UNBOUNDED
        if not self._quiet_known:
            return 0
        quiet = _UNBOUNDED
        for watcher in self._watchers:  # _drop rebinds the attribute, not this list
            try:
                quiet = min(quiet, watcher.quiet_chars(index, channel))  # type: ignore[attr-defined]
            except Exception:
                self._drop(watcher)
                return self._quiet_chars(index, channel)  # of those left
        return quiet

    def _hand_on(self) -> tuple[Trigger, int] | None:
        """The held texts to the inspectors (and the watchers, when they were held for them):
        a watcher's trigger, with its chunk's position among them."""
        held = self._held
        if not held:
            return None
        self._held = []
        self._quiet = -1  # what the watchers take quietly is asked again for the next text
        index, channel = self._held_index, self._held_channel
        self._run_others(index, channel, held)
        return self._run_watchers(index, channel, held) if self._held_watched else None

    def on_chunk(self, chunk: dict[str, Any], watch: bool = True) -> Trigger | None:
        """Every inspector sees the chunk (the watchers only with ``watch``); the first
        trigger a watcher answers with."""
        self._hand_on()
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
        self._hand_on()
        return self._run_watchers(index, channel, texts)

    def _run_watchers(
        self, index: int, channel: str, texts: Sequence[str]
    ) -> tuple[Trigger, int] | None:
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
        self._hand_on()
        self._run_others(index, channel, texts)

    def _run_others(self, index: int, channel: str, texts: Sequence[str]) -> None:
        for inspector in self._inspectors:
            try:
                inspector.on_run(index, channel, texts)  # type: ignore[attr-defined]
            except Exception:
                self._drop(inspector)

    def on_end(self, complete: bool) -> None:
        self._hand_on()
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
        self._quiet_known = _all_quiet(self._watchers)
        self._on_failure(inspector.name)


def _all_quiet(watchers: list[StreamInspector]) -> bool:
    return all(callable(getattr(w, "quiet_chars", None)) for w in watchers)
