"""The recovery budget shared by a server's workers, through their shared folder.

Under ``--workers N`` every worker decides on its own ``RecoveryBudget`` (nothing shared on the
request path) and, once per ``interval_s``, writes its own window totals to
``recovery-budget-<pid>.json`` in the workers' folder and reads the others', which it adds
(``RecoveryBudget.set_others``), as ``proxy.loops.budget_sync`` does through Redis across
replicas. So the server holds one floor and one share, as one process did, instead of each
worker holding a 1/N part of the floor: split, the default 32768-token floor left a worker of 16
less than one 4096-token retry (H100, 2026-12-07: 14 of 48 requests at 4096 tokens ended
``repetition`` after one attempt, as a refused retry ends them). A worker's file older than
``stale_s`` is left out (a worker that stopped); its own file goes with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

import orjson

from policies.budget import RecoveryBudget

log = logging.getLogger(__name__)

PREFIX = "recovery-budget-"
SUFFIX = ".json"


class FolderBudgetSync:
    def __init__(
        self,
        directory: Path,
        budget: RecoveryBudget,
        interval_s: float = 1.0,
        *,
        pid: int | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._directory = directory
        self._budget = budget
        self._interval = interval_s
        self._clock = clock
        self.pid = os.getpid() if pid is None else pid
        self._path = directory / f"{PREFIX}{self.pid}{SUFFIX}"
        self.stale_s = max(5 * interval_s, 10.0)
        self.workers = 1  # workers seen at the last sync, this one included
        self.errors = 0
        self.last_sync: float | None = None

    def sync_once(self) -> None:
        """Write this worker's totals, read the others' (fresh ones only) into the budget."""
        now = self._clock()
        own = {m: list(t) for m, t in self._budget.local_totals().items()}
        tmp = self._path.with_name(self._path.name + ".tmp")
        tmp.write_bytes(orjson.dumps({"pid": self.pid, "written_at": now, "totals": own}))
        tmp.replace(self._path)  # readers see the last version or this one
        others: dict[str, tuple[int, int]] = {}
        seen = 1
        for path in self._directory.glob(f"{PREFIX}*{SUFFIX}"):
            if path == self._path:
                continue
            try:
                doc = orjson.loads(path.read_bytes())
                if now - float(doc["written_at"]) > self.stale_s:
                    continue
                totals = doc["totals"]
                for model, (generated, spent) in totals.items():
                    had = others.get(model, (0, 0))
                    others[model] = (had[0] + int(generated), had[1] + int(spent))
            except (OSError, ValueError, KeyError, TypeError):
                continue  # gone, half written by an older writer, or not ours: skipped
            seen += 1
        self._budget.set_others(others)
        self.workers = seen
        self.last_sync = now

    async def run(self) -> None:
        """Sync every interval until cancelled."""
        while True:
            try:
                self.sync_once()
            except Exception as exc:  # a sync that fails costs the sharing, never the worker
                self.errors += 1
                log.warning("recovery budget: the workers' folder is unavailable: %r", exc)
                if self.last_sync is None or self._clock() - self.last_sync > self.stale_s:
                    self._budget.set_others({})  # the others' totals are too old to hold
                    self.workers = 1
            await asyncio.sleep(self._interval)

    def status(self) -> dict[str, object]:
        age = None if self.last_sync is None else round(self._clock() - self.last_sync, 3)
        return {
            "store": "workers",
            "workers": self.workers,
            "errors": self.errors,
            "last_sync_age_s": age,
        }

    async def close(self) -> None:
        with contextlib.suppress(OSError):  # the folder went first: nothing left to hold
            self._path.unlink(missing_ok=True)
