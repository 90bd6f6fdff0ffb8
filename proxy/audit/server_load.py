"""detproxy's own client traffic across every worker of a server: requests in flight and
requests started, summed over the workers.

One process counts its own (``Forwarder.inflight`` and ``started``). With ``serve --workers N``
each worker sees only the requests the kernel handed it, so whether a primary shared the
engine's batch with a request another worker answered was not known, and its cause stayed
``unknown`` ("whether the primary shared its batch is not known": real vLLM 0.23, a burst of
16 salted requests over 16 workers, 2026-12-07); a shadow's company likewise. Here
each worker writes its own two counts, and its pid, into its slot of a small file the workers
share, mapped in memory (one writer a slot: no lock); a reader sums the slots of the workers
still alive, so a worker that died mid-request leaves no phantom company behind.
"""

from __future__ import annotations

import mmap
import os
import struct

_SLOT = struct.Struct("<qqq")  # pid, in flight, started


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, another user's (a reused pid): taken as alive
        return True
    return True


class SharedLoad:
    """The server's client requests in flight and started, from ``slots`` workers' slots in
    ``path``; this worker writes slot ``index`` (``publish``)."""

    def __init__(self, path: str, index: int, slots: int) -> None:
        if not 0 <= index < slots:
            raise ValueError(f"worker index {index} is not below the {slots} slots")
        self._offset = index * _SLOT.size
        self._pid = os.getpid()
        size = slots * _SLOT.size
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < size:
                os.ftruncate(fd, size)  # zeros: no worker has written yet
            self._map: mmap.mmap | bytearray = mmap.mmap(fd, size)
        finally:
            os.close(fd)  # the mapping keeps the file
        self.publish(0, 0)  # a restarted worker's slot starts again from nothing in flight

    def publish(self, inflight: int, started: int) -> None:
        _SLOT.pack_into(self._map, self._offset, self._pid, inflight, started)

    def _totals(self) -> tuple[int, int]:
        inflight = started = 0
        own = self._pid
        for pid, n, s in _SLOT.iter_unpack(self._map):
            started += s
            if n > 0 and (pid == own or _alive(pid)):
                inflight += n
        return inflight, started

    @property
    def inflight(self) -> int:
        return self._totals()[0]

    @property
    def started(self) -> int:
        """Requests started by every worker so far (a restarted worker's count starts again:
        a reader compares two readings for a change, not for an order)."""
        return self._totals()[1]

    def inflight_now(self) -> int:
        """``inflight`` as a callable (the auditor's reading of a primary's company)."""
        return self._totals()[0]

    def close(self) -> None:
        """Unmap the file. A request still finishing as the app stops writes to a private
        buffer instead (no error on its way out); readers then see only this worker."""
        shared = self._map
        self._map = bytearray(len(shared))
        if isinstance(shared, mmap.mmap):
            shared.close()


def shared_load(processes: int, shared_dir: str | None, index: int | None) -> SharedLoad | None:
    """The workers' shared counts where there are several and they share a folder; None for
    one process (its own counts are the server's) or where there is no folder to share."""
    if processes <= 1 or not shared_dir or index is None:
        return None
    return SharedLoad(os.path.join(shared_dir, "load.bin"), index, processes)
