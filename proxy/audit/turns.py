"""Whose turn it is on the engine among detproxy's own background requests, across every
worker of a server.

A shadow takes one of ``slots`` (``audit.max_concurrent_shadows``, for the whole server); a
triage experiment takes the engine whole: it waits for the shadows on the wire to end, no
shadow starts until it is done, in any worker, and experiments run one at a time. So an
experiment's replays run alone however many shadows a burst queued (a queue of shadows sent one
after another would otherwise keep the engine busy past the triage's quiet deadline), and N
workers send no more shadows at once than one process would.

One process (``LocalTurns``): counts in memory. Several (``serve --workers N``,
``SharedTurns``): the same with ``flock`` on small files in the folder the workers share. It
prefers experiments: one that waits holds the ``intent`` lock, and a shadow starts only while it
can take that lock shared, so new shadows wait behind a waiting experiment instead of starving
it. A process that dies releases its locks with its file descriptors.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
from typing import Protocol


class Turn(Protocol):
    def release(self) -> None: ...


class EngineTurns(Protocol):
    def try_shadow(self) -> Turn | None:
        """A shadow's turn now, or None: an experiment holds or waits for the engine, or every
        slot is taken."""
        ...

    async def experiment(self, poll_s: float) -> Turn:
        """Wait for the engine whole: no shadow on the wire, none to start until released."""
        ...


class _Released:
    """A turn given back (``release`` twice is harmless)."""

    def __init__(self, turns: LocalTurns, shadow: bool) -> None:
        self._turns: LocalTurns | None = turns
        self._shadow = shadow

    def release(self) -> None:
        turns, self._turns = self._turns, None
        if turns is not None:
            turns.give_back(self._shadow)


class LocalTurns:
    """One process's turns, counted in memory."""

    def __init__(self, slots: int) -> None:
        self._slots = max(1, slots)
        self.shadows = 0  # on the wire
        self.experiments = 0  # waiting for the engine or holding it
        self._no_shadows = asyncio.Event()
        self._no_shadows.set()
        self._engine = asyncio.Lock()  # one experiment at a time

    def try_shadow(self) -> Turn | None:
        if self.experiments or self.shadows >= self._slots:
            return None
        self.shadows += 1
        self._no_shadows.clear()
        return _Released(self, shadow=True)

    async def experiment(self, poll_s: float) -> Turn:
        self.experiments += 1
        try:
            await self._engine.acquire()
        except BaseException:
            self.experiments -= 1
            raise
        try:
            await self._no_shadows.wait()
        except BaseException:
            self.give_back(shadow=False)
            raise
        return _Released(self, shadow=False)

    def give_back(self, shadow: bool) -> None:
        if not shadow:
            self.experiments -= 1
            self._engine.release()
            return
        self.shadows -= 1
        if not self.shadows:
            self._no_shadows.set()


def _try_lock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


async def _locked(fd: int, poll_s: float) -> None:
    """An exclusive lock on ``fd``, polled (flock has no wait an event loop can await)."""
    while True:
        if _try_lock(fd, fcntl.LOCK_EX):
            return
        await asyncio.sleep(poll_s)


class _Locks:
    """File locks held for a turn: closing their descriptors releases them."""

    def __init__(self, fds: list[int]) -> None:
        self._fds = fds

    def release(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


class SharedTurns:
    """The turns of every worker of a server, as ``flock``s on files in ``folder``."""

    def __init__(self, folder: str, slots: int) -> None:
        os.makedirs(folder, exist_ok=True)
        self._folder = folder
        self._slots = max(1, slots)

    def _open(self, name: str) -> int:
        return os.open(os.path.join(self._folder, name), os.O_RDWR | os.O_CREAT, 0o600)

    def try_shadow(self) -> Turn | None:
        intent = self._open("intent.lock")
        try:
            if not _try_lock(intent, fcntl.LOCK_SH):  # an experiment holds or wants the engine
                return None
            for i in range(self._slots):
                slot = self._open(f"slot-{i}.lock")
                if _try_lock(slot, fcntl.LOCK_EX):
                    return _Locks([slot])
                os.close(slot)
            return None
        finally:
            os.close(intent)  # its shared lock only guarded taking the slot

    async def experiment(self, poll_s: float) -> Turn:
        fds = [self._open("intent.lock")]
        try:
            await _locked(fds[0], poll_s)  # after another worker's experiment
            for i in range(self._slots):  # every slot: the shadows on the wire end first
                fds.append(self._open(f"slot-{i}.lock"))
                await _locked(fds[-1], poll_s)
        except BaseException:
            _Locks(fds).release()
            raise
        return _Locks(fds)


def engine_turns(slots: int, processes: int, shared_dir: str | None) -> EngineTurns:
    """The server's turns: in memory for one process, in ``shared_dir/turns`` (the folder
    every worker of one supervisor shares) for several."""
    if processes > 1 and shared_dir:
        return SharedTurns(os.path.join(shared_dir, "turns"), slots)
    return LocalTurns(slots)
