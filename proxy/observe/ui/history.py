"""What the live page needs that neither the ring nor the tally keeps: audits by time (the
identical ones too, so rates over time have denominators), the upstream's fingerprint
readings and what the engine says it loaded (the ``engine`` object of ``/detproxy/status``,
from the same ``EngineFactsRead``). A bus subscriber; bounded in buckets, keys and readings."""

from __future__ import annotations

from collections import Counter, deque
from typing import Any

from proxy.events import (
    AuditCompleted,
    EngineFactsRead,
    EventBus,
    UpstreamFingerprinted,
    UpstreamRestarted,
    UpstreamUnreachable,
)
from proxy.observe.status import MAX_KEYS
from proxy.observe.ui.timeline import Observation, Point
from proxy.tools.report.summary import iso

BUCKET_S = 10.0
MAX_BUCKETS = 6 * 360  # six hours
MAX_READINGS = 512


class LiveHistory:
    def __init__(
        self,
        bucket_s: float = BUCKET_S,
        max_buckets: int = MAX_BUCKETS,
        max_readings: int = MAX_READINGS,
    ) -> None:
        self._bucket_s = bucket_s
        self._max_buckets = max_buckets
        self._buckets: dict[int, Counter[tuple[str, str]]] = {}  # bucket -> (model, verdict)
        # Of each run of one fingerprint, its first and its latest reading.
        self._readings: deque[Observation] = deque(maxlen=max_readings)
        self._down: UpstreamUnreachable | None = None  # the outage going on, if any
        self._restarts = 0
        self._restarted_at: float | None = None
        self._engine: dict[str, Any] | None = None  # as /detproxy/status's ``engine``

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(AuditCompleted, self._audited)
        bus.subscribe(UpstreamFingerprinted, self._fingerprinted)
        bus.subscribe(UpstreamUnreachable, self._unreachable)
        bus.subscribe(UpstreamRestarted, self._restarted)
        bus.subscribe(EngineFactsRead, self._engine_read)

    def _engine_read(self, ev: EngineFactsRead) -> None:
        facts = ev.facts
        self._engine = {
            "loaded": facts.as_dict(),
            "recipe": facts.digest(),
            "mismatches": [
                {"field": m.field, "expected": m.expected, "loaded": m.loaded}
                for m in ev.mismatches
            ],
            "unknown": list(ev.unknown_fields),
        }

    def engine(self) -> dict[str, Any] | None:
        """What the engine loaded as last read (None: nothing read yet)."""
        return self._engine

    def _unreachable(self, ev: UpstreamUnreachable) -> None:
        self._down = ev

    def _restarted(self, ev: UpstreamRestarted) -> None:
        self._restarts += 1
        self._restarted_at = ev.fingerprint.read_at

    def _audited(self, ev: AuditCompleted) -> None:
        bucket = int(ev.timestamp // self._bucket_s)
        counts = self._buckets.get(bucket)
        if counts is None:
            counts = self._buckets[bucket] = Counter()
            while len(self._buckets) > self._max_buckets:
                del self._buckets[min(self._buckets)]
        key = (ev.model, ev.verdict.verdict)
        if key in counts or len(counts) < MAX_KEYS:
            counts[key] += 1

    def _fingerprinted(self, ev: UpstreamFingerprinted) -> None:
        self._down = None
        fp = ev.fingerprint
        reading = Observation(fp.read_at, fp.fingerprint, fp.kind, fp.version)
        readings = self._readings
        same_run = len(readings) >= 2 and readings[-1].fingerprint == fp.fingerprint
        if same_run and readings[-2].fingerprint == fp.fingerprint:
            readings[-1] = reading  # the run's latest reading replaces the previous latest
        else:
            readings.append(reading)

    def points(self) -> list[Point]:
        half = self._bucket_s / 2
        return [
            Point(bucket * self._bucket_s + half, model, verdict, n)
            for bucket, counts in sorted(self._buckets.items())
            for (model, verdict), n in counts.items()
        ]

    def readings(self) -> list[Observation]:
        return list(self._readings)

    def upstream_notes(self) -> list[str]:
        """The upstream's state in words, where it is worth a line: down (or not up yet),
        and the restarts seen (the same identity back: not a change)."""
        notes = []
        down = self._down
        if down is not None:
            what = "down" if down.was_up else "not up yet"
            notes.append(f"The upstream is {what} since {iso(down.since)}: {down.reason}")
        if self._restarts and self._restarted_at is not None:
            notes.append(
                f"The upstream restarted {self._restarts} time(s), the last at"
                f" {iso(self._restarted_at)}: the same identity each time, not a change"
            )
        return notes
