"""Writes coalesced per event-loop iteration: each connection's writes of one iteration go out
in one ``transport.write``, and all of them together at the iteration's end.

Why: on loopback (a sidecar, a benchmark) each write to a socket wakes the process reading it,
and waking a process that sleeps on another core costs more than the write itself (an
inter-processor interrupt; in a virtual machine, an exit to the hypervisor). A relay that writes
as it goes, between the reads and the inspection of other streams, wakes its peer once per
write: the peer wakes, reads one event, sleeps, and is woken by the next. Written back to back
at the end of the iteration, the later writes find the reader still awake. The delay is the
rest of the iteration (the other ready connections' reads). ``tests/bench/bench_paced.py``
measures the relay's CPU per event with it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

log = logging.getLogger(__name__)


class Coalesced(Protocol):
    """A connection whose queued writes ``flush`` writes now."""

    def flush(self) -> None: ...


class WriteCoalescer:
    """The connections with writes queued in this iteration of ``loop``, flushed at its end."""

    __slots__ = ("_loop", "_queued")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._queued: list[Coalesced] = []

    def queue(self, conn: Coalesced) -> None:
        """``conn`` has writes to flush; called once per iteration, with its first write."""
        if not self._queued:
            self._loop.call_soon(self._flush)
        self._queued.append(conn)

    def _flush(self) -> None:
        queued = self._queued
        self._queued = []
        for conn in queued:
            try:
                conn.flush()
            except Exception:  # one connection's fault is not the others'
                log.exception("writing to a connection failed")
