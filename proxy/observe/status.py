"""Live figures for ``/detproxy/status`` and for the tally lines of the incident log.

A subscriber that counts audits per model, mode and verdict, loops per model, channel and
source, policy actions per model, action and outcome, and dropped shadows. The incident log
only holds what went wrong; these counts are the denominators a report needs.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

from proxy.events import (
    AuditCompleted,
    CauseAttributed,
    EventBus,
    LoopDetected,
    PolicyActed,
    RecoveryTokens,
    ShadowDropped,
)

MAX_KEYS = 4096  # labels come from clients (model names): keep the tally bounded
# Requests in flight are counted exactly up to this; more is counted as this ("64+").
INFLIGHT_CAP = 64


def _nest(counter: Counter[tuple[str, ...]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, count in counter.items():
        node = out
        for part in key[:-1]:
            node = node.setdefault(part, {})
        node[key[-1]] = count
    return out


class AuditTally:
    def __init__(self) -> None:
        self.process = uuid.uuid4().hex
        self.started = time.time()
        self.audits: Counter[tuple[str, ...]] = Counter()  # (model, mode, verdict)
        self.loops: Counter[tuple[str, ...]] = Counter()  # (model, channel, source)
        self.actions: Counter[tuple[str, ...]] = Counter()  # (model, action, outcome)
        self.recoveries: Counter[tuple[str, ...]] = Counter()  # (model, strategy, outcome)
        self.recovery_tokens: Counter[tuple[str, ...]] = Counter()  # (model, strategy, kind)
        # (model, in flight at the primary, verdict): the batch-effects curve's denominators
        self.by_inflight: Counter[tuple[str, ...]] = Counter()
        self.dropped: Counter[str] = Counter()
        self.causes: Counter[tuple[str, ...]] = Counter()  # (model, cause)

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(AuditCompleted, self._audited)
        bus.subscribe(ShadowDropped, self._dropped)
        bus.subscribe(LoopDetected, self._loop)
        bus.subscribe(PolicyActed, self._acted)
        bus.subscribe(RecoveryTokens, self._recovery_tokens)
        bus.subscribe(CauseAttributed, self._cause)

    def _cause(self, ev: CauseAttributed) -> None:
        replaced = (ev.model, ev.revises or "")
        if ev.revises is not None and self.causes[replaced] > 0:
            self.causes[replaced] -= 1  # the incident's cause now, counted once
            if not self.causes[replaced]:
                del self.causes[replaced]
        self._add(self.causes, (ev.model, ev.cause))

    def causes_by_model(self) -> dict[str, Any]:
        """``/detproxy/status``'s ``causes``: {model: {cause: count}}."""
        return _nest(self.causes)

    @staticmethod
    def _add(counter: Counter[tuple[str, ...]], key: tuple[str, ...]) -> None:
        if key in counter or len(counter) < MAX_KEYS:
            counter[key] += 1

    def _audited(self, ev: AuditCompleted) -> None:
        self._add(self.audits, (ev.model, ev.mode, ev.verdict.verdict))
        inflight = str(min(max(ev.inflight_primary, 0), INFLIGHT_CAP))
        self._add(self.by_inflight, (ev.model, inflight, ev.verdict.verdict))

    def _loop(self, ev: LoopDetected) -> None:
        self._add(self.loops, (ev.model, ev.trigger.channel, ev.trigger.source))

    def _acted(self, ev: PolicyActed) -> None:
        self._add(self.actions, (ev.model, ev.action, ev.outcome))
        if ev.action == "retry":
            self._add(self.recoveries, (ev.model, ev.strategy, ev.outcome))

    def _recovery_tokens(self, ev: RecoveryTokens) -> None:
        for kind, n in (("generated", ev.generated), ("kept", ev.kept)):
            key = (ev.model, ev.strategy, kind)
            if key in self.recovery_tokens or len(self.recovery_tokens) < MAX_KEYS:
                self.recovery_tokens[key] += n

    def _dropped(self, ev: ShadowDropped) -> None:
        self.dropped[ev.reason] += 1

    def snapshot(self) -> dict[str, Any]:
        verdicts: Counter[str] = Counter()
        modes: Counter[str] = Counter()
        for (_, mode, verdict), n in self.audits.items():
            verdicts[verdict] += n
            modes[mode] += n
        comparable = sum(n for v, n in verdicts.items() if v != "incomparable")
        unstable = sum(n for v, n in verdicts.items() if v not in ("identical", "incomparable"))
        return {
            "audits": sum(verdicts.values()),
            "verdicts": dict(verdicts),
            "modes": dict(modes),
            "nondeterminism_rate": unstable / comparable if comparable else None,
            "shadows_dropped": dict(self.dropped),
            "loops": sum(self.loops.values()),
        }

    def summary(self) -> dict[str, Any]:
        """A ``kind: tally`` line: cumulative counts of this process since it started."""
        return {
            "kind": "tally",
            "process": self.process,
            "started": self.started,
            "ts": time.time(),
            "audits": _nest(self.audits),
            "loops": _nest(self.loops),
            "policy_actions": _nest(self.actions),
            "recoveries": _nest(self.recoveries),
            "recovery_tokens": _nest(self.recovery_tokens),
            "audits_by_inflight": _nest(self.by_inflight),
            "causes": _nest(self.causes),
            "shadows_dropped": dict(self.dropped),
        }
