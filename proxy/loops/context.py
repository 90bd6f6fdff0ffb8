"""What a request's attempts are given of the app's loop recovery: ``RecoveryContext``.

``proxy.attempts.Attempts`` is the one owner of a request's recovery: it watches each attempt,
asks the policies, spends the recovery budget and says what it did. It reaches through nothing
for that; it is given, once per app, one ``RecoveryContext``: the loop settings as plain values
(``LoopSettings``: the cap, the detector, how a retry continues), and the three seams it acts
through, as Protocols: the policies that decide (``Policies``), where what happened is told
(``Publisher``), and the budget its retries spend (``Spending``, None when loops are off) with
the gauge that says when that budget's use is told again (``BudgetGauge``).
"""

from __future__ import annotations

import fnmatch
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from policies.base import Decision, PolicyContext
from policies.budget import BudgetUse
from proxy.config import LoopConfig, ReasoningMarkersConfig
from proxy.loops.detector import DetectorConfig
from proxy.loops.watch import LoopWatch

MAX_PUBLISHED = 1024  # models whose budget gauge is rate-limited (client-controlled names)


class Policies(Protocol):
    """The policies a loop (or an answer's end) is put to (``policies.base.PolicyChain``)."""

    @property
    def reads_clean_answers(self) -> bool:
        """Whether some policy reads an answer that ended without a trigger."""

    def decide(self, ctx: PolicyContext) -> Decision: ...


class Publisher(Protocol):
    """Where what a request's attempts did is told (``proxy.events.EventBus``)."""

    def publish(self, event: object) -> None: ...


class Spending(Protocol):
    """The recovery budget as a request's attempts spend it (``policies.budget.RecoveryBudget``:
    a retry reserves its share when a policy decides it)."""

    def record_generated(self, model: str, tokens: int) -> None: ...

    def settle(self, model: str, reserved: int, actual: int) -> None: ...

    def use(self, model: str) -> BudgetUse: ...


class BudgetGauge:
    """When ``RecoveryBudgetUsed`` for a model is due: at once when a recovery moved its
    account, else once a second per model (each request's tokens move "allowed" a little; not
    worth an update each)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._published: dict[str, int] = {}  # model -> second its gauge was last set

    def due(self, model: str, moved: bool) -> bool:
        now = int(self._clock())
        if not moved and self._published.get(model) == now:
            return False
        if len(self._published) < MAX_PUBLISHED or model in self._published:
            self._published[model] = now
        return True


@dataclass(frozen=True, slots=True)
class LoopSettings:
    """``[loops]`` as a request's attempts read it: plain values, read once per app."""

    enabled: bool
    max_attempts: int  # the one cap on a request's attempts
    detector: DetectorConfig  # the loop detector's thresholds (a retry's end is read with them)
    runaway: bool
    # Whether some ladder continues: then a stream's text is kept for its prefix.
    keep: bool
    # stream_mode "continue": a streamed retry goes on from exactly what the client was shown.
    one_path: bool
    reasoning_markers: tuple[ReasoningMarkersConfig, ...] = ()

    def watch(self, endpoint: str, empty_stop: bool = False) -> LoopWatch | None:
        """The loop watch of one attempt (``empty_stop``: a streamed retry's, where an answer
        that stops with nothing in it is a trigger too); None when loops are off."""
        if not self.enabled:
            return None
        return LoopWatch(
            endpoint, self.detector, runaway=self.runaway, keep=self.keep, empty_stop=empty_stop
        )

    def markers(self, model: str) -> tuple[str, str]:
        """The reasoning markers of ``model`` (``[[loops.reasoning_markers]]``)."""
        for markers in self.reasoning_markers:
            if fnmatch.fnmatchcase(model, markers.models):
                return markers.start, markers.end
        default = ReasoningMarkersConfig()
        return default.start, default.end


def loop_settings(config: LoopConfig) -> LoopSettings:
    """``config``'s values as ``LoopSettings``."""
    keep = config.stream_mode == "continue" or any(
        attempt.get("strategy") in ("continue", "close_reasoning")
        for ladder in config.ladder_list()
        for attempt in ladder.attempts
    )
    return LoopSettings(
        config.enabled,
        config.max_attempts,
        DetectorConfig(**config.detector),  # type: ignore[arg-type]
        config.runaway,
        keep,
        config.stream_mode == "continue",
        tuple(config.reasoning_markers),
    )


@dataclass(frozen=True, slots=True)
class RecoveryContext:
    """What every request's ``Attempts`` is given (one per app)."""

    settings: LoopSettings
    policies: Policies
    bus: Publisher
    budget: Spending | None  # None: loops are off
    gauge: BudgetGauge
