"""The incident log's file, written by its own task: nothing writes to disk on the data path.

``put()`` only queues a line already serialized, so an incident published from anywhere (a
socket callback's loop decision, an audit's verdict) costs no file I/O there. The writer task
(``start()``, named ``incidents:writer``) takes what is queued in batches and writes each batch
in a worker thread, rotating the file by size on the way (``path``, ``path.1`` ... ``path.N``):
the event loop never waits on the disk either.

The queue is bounded (``incidents.queue_lines``): a line that finds it full is dropped and
counted (``dropped``: the status shows it, and the metrics as an isolated failure), never waited
for. ``close()`` stops the task after the batch in hand, writes what is still queued and syncs
the file: a graceful stop loses no line.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
from typing import IO

from proxy.tasks import TaskOwner

log = logging.getLogger(__name__)


class IncidentFile:
    def __init__(self, path: str, max_bytes: int, backups: int, queue_lines: int) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self._backups = backups
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(maxsize=queue_lines)
        self._tasks = TaskOwner("incidents")
        self._writing: asyncio.Future[None] | None = None  # the batch in a thread now
        self._in_hand = 0  # its lines
        self._file: IO[bytes] | None = None
        self._lock: int | None = None  # the folder's fd: flock'd around each batch
        self._size = 0
        self._closed = False
        self._warned = False  # a run of dropped lines is logged once
        # Counted by the writer (its thread), read by the status.
        self.written = 0  # lines
        self.writes = 0  # batches
        self.dropped = 0  # lines that found the queue full

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def put(self, line: bytes) -> None:
        """Queue one line (with its newline); never blocks, never touches the file."""
        if self._closed:
            return
        try:
            self._queue.put_nowait(line)
        except asyncio.QueueFull:
            self.dropped += 1
            if not self._warned:
                self._warned = True
                log.warning(
                    "incident log %s: %d lines queued, the disk is not keeping up; lines are "
                    "dropped and counted (status: incidents.dropped) until it does",
                    self._path,
                    self._queue.maxsize,
                )

    def start(self) -> None:
        """The writer task, on the running loop."""
        self._tasks.spawn(self._run(), name="writer")

    async def _run(self) -> None:
        while True:
            batch = [await self._queue.get()]
            while not self._queue.empty():
                batch.append(self._queue.get_nowait())
            self._warned = False
            self._in_hand = len(batch)
            self._writing = asyncio.get_running_loop().run_in_executor(None, self._write, batch)
            # Cancelled meanwhile (close), the write still ends: close() waits for it.
            await asyncio.shield(self._writing)
            self._written_in_hand()

    def _written_in_hand(self) -> None:
        self._writing = None
        for _ in range(self._in_hand):
            self._queue.task_done()
        self._in_hand = 0

    async def drained(self) -> None:
        """Until every line queued so far is written (the writer must be running)."""
        await self._queue.join()

    async def close(self) -> None:
        """Stop the writer after the batch in hand, write what is queued, sync and close."""
        self._closed = True
        await self._tasks.close()
        if self._writing is not None:
            await self._writing
            self._written_in_hand()
        rest = []
        while not self._queue.empty():
            rest.append(self._queue.get_nowait())
        await asyncio.to_thread(self._finish, rest)
        for _ in rest:
            self._queue.task_done()

    def _finish(self, lines: list[bytes]) -> None:
        if lines:
            self._write(lines)
        if self._file is not None:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError:
                log.exception("cannot sync incident log %s", self._path)
            self._file.close()
            self._file = None
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def _write(self, lines: list[bytes]) -> None:
        """One batch (in the writer's thread): one write per file, rotating between them.
        Every process writing this file (serve's workers) takes the folder's lock around its
        batch: the size is the file's, not this process's lines, and a rotation is one
        process's, never two renaming each other's files."""
        try:
            if self._file is None:
                self._open()  # at the first line (or after a rotation that could not reopen)
            assert self._lock is not None
            fcntl.flock(self._lock, fcntl.LOCK_EX)
            try:
                self._follow()
                chunk: list[bytes] = []
                size = self._size
                for line in lines:
                    if size and size + len(line) > self._max_bytes:
                        self._emit(chunk)
                        chunk = []
                        self._rotate()
                        size = self._size
                    chunk.append(line)
                    size += len(line)
                self._emit(chunk)
            finally:
                fcntl.flock(self._lock, fcntl.LOCK_UN)
        except Exception:  # the writer goes on with the next batch
            log.exception("cannot write incident log %s", self._path)
        self.writes += 1

    def _emit(self, chunk: list[bytes]) -> None:
        if not chunk:
            return
        assert self._file is not None
        data = b"".join(chunk)
        self._file.write(data)
        self._file.flush()  # written means on its way to disk
        self._size += len(data)
        self.written += len(chunk)

    def _open(self) -> None:
        if self._lock is None:  # the file's folder: locked, it leaves no file of its own
            self._lock = os.open(os.path.dirname(os.path.abspath(self._path)), os.O_RDONLY)
        self._file = open(self._path, "ab")  # noqa: SIM115 (lives as long as the app)
        self._size = self._file.tell()

    def _follow(self) -> None:
        """Reopen the path where another process (a worker beside this one) rotated it: this
        process's file is a backup now, or gone."""
        assert self._file is not None
        try:
            now = os.stat(self._path)
        except FileNotFoundError:
            now = None
        held = os.fstat(self._file.fileno())
        if now is None or (now.st_dev, now.st_ino) != (held.st_dev, held.st_ino):
            self._file.close()
            self._file = None
            self._open()
        else:
            self._size = held.st_size  # the other processes' lines count too

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        self._file = None  # until reopened: a failed rotation leaves no closed file to write to
        path, backups = self._path, self._backups
        if backups == 0:
            os.truncate(path, 0)
        else:
            for i in range(backups - 1, 0, -1):
                if os.path.exists(f"{path}.{i}"):
                    os.replace(f"{path}.{i}", f"{path}.{i + 1}")
            os.replace(path, f"{path}.1")
        self._open()
