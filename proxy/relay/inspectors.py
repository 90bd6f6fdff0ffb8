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
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from proxy.classify import RequestView

log = logging.getLogger(__name__)


class StreamInspector(Protocol):
    name: str

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        """One parsed ``data:`` event (``[DONE]`` and comments are not passed)."""

    def on_end(self, complete: bool) -> None:
        """The stream ended; ``complete`` is False when it broke or the client left."""


class RunInspector(StreamInspector, Protocol):
    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> None:
        """Consecutive token chunks of choice ``index`` that carry only a text: ``channel`` is
        ``"content"`` (completions: the text) or ``"reasoning"``."""


# Builds the inspectors for one response, or returns None when it has nothing to look at.
InspectorFactory = Callable[[RequestView], StreamInspector | None]


class InspectorSet:
    __slots__ = ("_inspectors", "_on_failure", "runs")

    def __init__(
        self, inspectors: Sequence[StreamInspector], on_failure: Callable[[str], None]
    ) -> None:
        self._inspectors = list(inspectors)
        self._on_failure = on_failure
        # Whether every inspector reads runs of texts: then template chunks need no parsing.
        self.runs = all(callable(getattr(i, "on_run", None)) for i in self._inspectors)

    def __bool__(self) -> bool:
        return bool(self._inspectors)

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> None:
        for inspector in self._inspectors:
            try:
                inspector.on_run(index, channel, texts)  # type: ignore[attr-defined]
            except Exception:
                self._drop(inspector)

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        for inspector in self._inspectors:
            try:
                inspector.on_chunk(chunk)
            except Exception:
                self._drop(inspector)

    def on_end(self, complete: bool) -> None:
        for inspector in self._inspectors:
            try:
                inspector.on_end(complete)
            except Exception:
                self._drop(inspector)

    def _drop(self, inspector: StreamInspector) -> None:
        log.exception(
            "inspector %s failed; it is off for the rest of this response", inspector.name
        )
        self._inspectors = [i for i in self._inspectors if i is not inspector]
        self._on_failure(inspector.name)
