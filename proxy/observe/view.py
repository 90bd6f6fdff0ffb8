"""The server as ``/detproxy/status``, ``/detproxy/incidents`` and the explorer show it: this
process's own figures, and under ``serve --workers N`` every other worker's added
(``proxy.observe.fleet`` publishes and reads them, ``proxy.observe.merge`` adds them up), so
whichever worker a request lands on, it answers for the whole server."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

from proxy.http.admin import AdminRequest, Reply, error_reply, json_reply
from proxy.observe.fleet import Fleet, Published
from proxy.observe.incidents import IncidentLog, QueryError, parse_query, select
from proxy.observe.merge import (
    WorkerStatus,
    counter_rows,
    merge_counters,
    merge_records,
    merge_status,
)
from proxy.observe.status import AuditTally
from proxy.observe.ui.history import LiveHistory
from proxy.observe.ui.timeline import Point

ALL = 10**9  # recent(ALL): the whole ring
COUNTERS = ("audits", "loops", "recoveries", "by_inflight")  # the tally's, as the explorer reads


class ServerView:
    """``fleet`` None: one process, its own figures only."""

    def __init__(
        self,
        incidents: IncidentLog,
        tally: AuditTally,
        history: LiveHistory,
        fleet: Fleet | None = None,
        live_pids: Callable[[], set[int] | None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.incidents = incidents
        self.tally = tally
        self.history = history
        self.fleet = fleet
        self._live_pids = live_pids  # the running workers' pids (None: not known)
        self._clock = clock

    # -- what this worker publishes -----------------------------------------------------------

    def published(self, index: int, status: Mapping[str, Any]) -> dict[str, Any]:
        """This worker's status file: its status (without the configuration, the same for
        all), its tally counters and its audits over time."""
        tally = self.tally
        return {
            "index": index,
            "status": {k: v for k, v in status.items() if k != "config"},
            "counters": {name: counter_rows(getattr(tally, name)) for name in COUNTERS},
            "points": [[p.ts, p.model, p.verdict, p.count] for p in self.history.points()],
        }

    # -- what every worker shows --------------------------------------------------------------

    def _others(self) -> list[Published]:
        return self.fleet.others() if self.fleet is not None else []

    def status(self, own: dict[str, Any]) -> dict[str, Any]:
        """``/detproxy/status``: ``own`` (this worker's), the others' added."""
        if self.fleet is None:
            return own
        live = self._live_pids() if self._live_pids is not None else None
        now = self._clock()
        peers = []
        for other in self._others():
            status = other.status.get("status")
            if not isinstance(status, dict) or not isinstance(status.get("worker"), dict):
                continue
            alive = live is None or other.pid in live
            age = now - other.written_at
            index = int(other.status.get("index", status["worker"].get("index", -1)))
            peers.append(WorkerStatus(index, other.pid, alive, max(age, 0.0), status))
        return merge_status(own, peers)

    def records(self) -> list[dict[str, Any]]:
        """Every worker's incident ring, newest first."""
        mine = self.incidents.recent(ALL)
        if self.fleet is None:
            return mine
        return merge_records([mine, *(o.records for o in self._others())])

    def counters(self) -> dict[str, Mapping[tuple[str, ...], int]]:
        """The tally's counters (``COUNTERS``), every worker's summed."""
        own: dict[str, Mapping[tuple[str, ...], int]] = {
            name: getattr(self.tally, name) for name in COUNTERS
        }
        if self.fleet is None:
            return own
        others = [o.status.get("counters") or {} for o in self._others()]
        return {
            name: merge_counters([counter_rows(own[name]), *(c.get(name, []) for c in others)])
            for name in COUNTERS
        }

    def points(self) -> list[Point]:
        """Audits over time, every worker's summed per bucket, model and verdict."""
        mine = self.history.points()
        if self.fleet is None:
            return mine
        summed: Counter[tuple[float, str, str]] = Counter()
        for p in mine:
            summed[(p.ts, p.model, p.verdict)] += p.count
        for other in self._others():
            for row in other.status.get("points") or []:
                summed[(float(row[0]), str(row[1]), str(row[2]))] += int(row[3])
        return [Point(ts, model, verdict, n) for (ts, model, verdict), n in sorted(summed.items())]

    async def incidents_handler(self, request: AdminRequest) -> Reply:
        """``/detproxy/incidents``: the newest matching incidents of every worker."""
        try:
            query = parse_query(request.query.items())
        except QueryError as exc:
            return error_reply(400, str(exc), param=exc.param)
        return json_reply(select(self.records(), query))
