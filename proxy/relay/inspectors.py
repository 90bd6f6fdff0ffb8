"""The inspector seam on the streaming path.

An inspector sees each parsed SSE chunk (a dict, decoded once with orjson) of one response,
in order, synchronously: it must be O(len(chunk)) and never await. ``InspectorSet`` runs
them with isolation: an inspector that raises is switched off for the rest of the response
and reported, and the bytes keep flowing.
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


# Builds the inspectors for one response, or returns None when it has nothing to look at.
InspectorFactory = Callable[[RequestView], StreamInspector | None]


class InspectorSet:
    __slots__ = ("_inspectors", "_on_failure")

    def __init__(
        self, inspectors: Sequence[StreamInspector], on_failure: Callable[[str], None]
    ) -> None:
        self._inspectors = list(inspectors)
        self._on_failure = on_failure

    def __bool__(self) -> bool:
        return bool(self._inspectors)

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
