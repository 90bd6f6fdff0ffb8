"""What each worker of ``serve --workers N`` publishes for the others, and reads of theirs.

Every worker writes two files in its supervisor's folder (the one the Prometheus multiprocess
files are in, ``PROMETHEUS_MULTIPROC_DIR``, fresh per supervisor): ``status-<pid>.json``
(its status, tally counters and audits over time) and ``incidents-<pid>.json`` (its incident
ring). Each is written whole to a temporary name and renamed over the last one, so a reader
sees one version or the next, never half of one; by an owned task, soon after something was
counted (``MIN_GAP_S``), and at least every ``EVERY_S`` (what goes on now: requests in flight).
The incidents file is written only when the ring changed.

A worker answering ``/detproxy/status``, ``/detproxy/incidents`` or the explorer reads the
others' files (the incidents ones parsed again only when they changed) and adds its own live
figures (``proxy.observe.view``). A worker that exited leaves its files: what it counted still
counts, as its Prometheus counters do (the supervisor's ``supervisor.json`` says which pids
are running). Files are the worker's pid's, so a restarted worker writes new ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from proxy.events import (
    AuditCompleted,
    CauseAttributed,
    EventBus,
    LoopDetected,
    PolicyActed,
    RecoveryTokens,
    ShadowDropped,
)

log = logging.getLogger(__name__)

STATUS_PREFIX = "status-"
INCIDENTS_PREFIX = "incidents-"
SUFFIX = ".json"
EVERY_S = 1.0
MIN_GAP_S = 0.2  # after a write: counts that come together are written together
# What changes the figures the others show: a write is due soon after one.
COUNTED = (
    AuditCompleted,
    LoopDetected,
    PolicyActed,
    RecoveryTokens,
    ShadowDropped,
    CauseAttributed,
)


@dataclass(frozen=True, slots=True)
class Published:
    """Another worker's files as last read."""

    pid: int
    written_at: float
    status: Mapping[str, Any]  # {"index", "status", "counters", "points"}
    records: list[dict[str, Any]]  # its incident ring, newest first


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)  # readers see the last version or this one


def _pid_of(name: str, prefix: str) -> int | None:
    middle = name[len(prefix) : -len(SUFFIX)]
    return (
        int(middle)
        if name.startswith(prefix) and name.endswith(SUFFIX) and middle.isdigit()
        else None
    )


class Fleet:
    """This worker's files in ``directory``, and the other workers'."""

    def __init__(
        self, directory: Path, pid: int | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.directory = directory
        self.pid = os.getpid() if pid is None else pid
        self._clock = clock
        self._changed = asyncio.Event()
        # path -> (mtime_ns, size, parsed): a file is parsed again only when it changed.
        self._cache: dict[Path, tuple[int, int, Any]] = {}

    # -- publishing ---------------------------------------------------------------------------

    def subscribe(self, bus: EventBus) -> None:
        for kind in COUNTED:
            bus.subscribe(kind, self._counted)

    def _counted(self, ev: object) -> None:
        self._changed.set()

    def publish(self, status: Mapping[str, Any], records: list[dict[str, Any]] | None) -> None:
        """Write this worker's status (and its ring, unless None: unchanged)."""
        doc = {"pid": self.pid, "written_at": self._clock(), **status}
        _write(self.directory / f"{STATUS_PREFIX}{self.pid}{SUFFIX}", orjson.dumps(doc))
        if records is not None:
            ring = {"pid": self.pid, "records": records}
            _write(self.directory / f"{INCIDENTS_PREFIX}{self.pid}{SUFFIX}", orjson.dumps(ring))

    async def run(
        self,
        status: Callable[[], Mapping[str, Any]],
        records: Callable[[], list[dict[str, Any]]],
        ring_changes: Callable[[], int],
    ) -> None:
        """Publish until cancelled: soon after a count, and every ``EVERY_S``."""
        written = -1
        while True:
            self._changed.clear()
            changes = ring_changes()
            try:
                self.publish(status(), records() if changes != written else None)
                written = changes
            except OSError as exc:  # a full disk: the others show this worker's last figures
                log.warning("cannot publish this worker's status in %s: %s", self.directory, exc)
            await asyncio.sleep(MIN_GAP_S)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), EVERY_S)

    def publish_last(self, status: Mapping[str, Any], records: list[dict[str, Any]]) -> None:
        """At the worker's stop: its final figures, for the workers that go on."""
        try:
            self.publish(status, records)
        except OSError as exc:
            log.warning("cannot publish this worker's last status in %s: %s", self.directory, exc)

    # -- reading ------------------------------------------------------------------------------

    def _read(self, path: Path) -> Any:
        try:
            stat = path.stat()
            cached = self._cache.get(path)
            if cached is not None and cached[:2] == (stat.st_mtime_ns, stat.st_size):
                return cached[2]
            parsed = orjson.loads(path.read_bytes())
        except (OSError, orjson.JSONDecodeError):
            return None  # gone, or replaced between the stat and the read: as if absent
        self._cache[path] = (stat.st_mtime_ns, stat.st_size, parsed)
        return parsed

    def others(self) -> list[Published]:
        """The other workers' last published files (exited ones' included), by pid."""
        found: list[Published] = []
        try:
            names = sorted(os.listdir(self.directory))
        except OSError:
            return found
        for name in names:
            pid = _pid_of(name, STATUS_PREFIX)
            if pid is None or pid == self.pid:
                continue
            status = self._read(self.directory / name)
            if not isinstance(status, dict):
                continue
            ring = self._read(self.directory / f"{INCIDENTS_PREFIX}{pid}{SUFFIX}")
            records = ring.get("records", []) if isinstance(ring, dict) else []
            found.append(Published(pid, float(status.get("written_at", 0.0)), status, records))
        return found


def stale_files(directory: Path) -> list[Path]:
    """A previous run's files in ``directory`` (the supervisor removes them at its start)."""
    return [
        p
        for p in directory.iterdir()
        if p.name.startswith((STATUS_PREFIX, INCIDENTS_PREFIX))
        and (p.name.endswith(SUFFIX) or p.name.endswith(SUFFIX + ".tmp"))
    ]
