"""Live audit figures for ``/detproxy/status``: a subscriber that tallies verdicts."""

from __future__ import annotations

from collections import Counter
from typing import Any

from proxy.events import AuditCompleted, EventBus, ShadowDropped


class AuditTally:
    def __init__(self) -> None:
        self.verdicts: Counter[str] = Counter()
        self.by_mode: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(AuditCompleted, self._audited)
        bus.subscribe(ShadowDropped, self._dropped)

    def _audited(self, ev: AuditCompleted) -> None:
        self.verdicts[ev.verdict.verdict] += 1
        self.by_mode[ev.mode] += 1

    def _dropped(self, ev: ShadowDropped) -> None:
        self.dropped[ev.reason] += 1

    def snapshot(self) -> dict[str, Any]:
        comparable = sum(n for v, n in self.verdicts.items() if v != "incomparable")
        unstable = sum(
            n for v, n in self.verdicts.items() if v not in ("identical", "incomparable")
        )
        return {
            "audits": sum(self.verdicts.values()),
            "verdicts": dict(self.verdicts),
            "modes": dict(self.by_mode),
            "nondeterminism_rate": unstable / comparable if comparable else None,
            "shadows_dropped": dict(self.dropped),
        }
