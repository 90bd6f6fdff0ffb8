"""What a request's attempts are given (proxy/loops/context.py): plain settings and the seams
they act through, nothing reached through."""

from __future__ import annotations

import ast
from pathlib import Path

from policies.base import CONTINUE, Decision, PolicyContext, Retry, Trigger
from policies.budget import BudgetUse
from proxy.attempts import AttemptEnd, Attempts
from proxy.config import LadderConfig, LoopConfig, ReasoningMarkersConfig
from proxy.events import LoopDetected, PolicyActed, RecoveryBudgetUsed, RecoveryTokens
from proxy.loops.context import BudgetGauge, RecoveryContext, loop_settings
from proxy.loops.next_attempt import Generated
from proxy.loops.watch import LoopWatch

ROOT = Path(__file__).resolve().parents[2]
MODEL = "m"
LOOP = Trigger("proxy", "content", 0, 4, 8, 10)


class Told:
    """A ``Publisher``: what the attempts told, in order."""

    def __init__(self) -> None:
        self.events: list[object] = []

    def publish(self, event: object) -> None:
        self.events.append(event)


class RetryOnce:
    """A ``Policies``: a retry on the client's own attempt's loop, else nothing."""

    reads_clean_answers = False

    def __init__(self) -> None:
        self.asked: list[PolicyContext] = []

    def decide(self, ctx: PolicyContext) -> Decision:
        self.asked.append(ctx)
        return Retry("loop", {"seed": 1}, 50) if ctx.attempt == 1 else CONTINUE


class Ledger:
    """A ``Spending``: what the attempts spent."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []

    def record_generated(self, model: str, tokens: int) -> None:
        self.calls.append(("generated", tokens, 0))

    def settle(self, model: str, reserved: int, actual: int) -> None:
        self.calls.append(("settle", reserved, actual))

    def use(self, model: str) -> BudgetUse:
        return BudgetUse(spent=7, allowed=1000, generated=0)


def test_attempts_act_only_through_the_seams_they_are_given() -> None:
    told, policies, ledger = Told(), RetryOnce(), Ledger()
    settings = loop_settings(LoopConfig(policy="retry", max_attempts=2))
    context = RecoveryContext(settings, policies, told, ledger, BudgetGauge(lambda: 5.0))
    attempts = Attempts(context, "rid", MODEL, "chat", False, 200, {"model": MODEL})
    assert isinstance(attempts.started(), LoopWatch), "the settings' watch was not used"
    decision = attempts.ended(AttemptEnd(40, decide=True, trigger=LOOP))
    assert isinstance(decision, Retry), decision
    assert [c.max_attempts for c in policies.asked] == [2], "the cap is not the settings'"
    attempts.retried(decision, Generated(None))
    attempts.ended(AttemptEnd(30, decide=True))
    assert ledger.calls == [("generated", 40, 0), ("settle", 50, 30)], ledger.calls
    # The loop, the budget's use; then the retry's outcome, what it cost, the budget again.
    assert [type(e) for e in told.events] == [
        LoopDetected,
        RecoveryBudgetUsed,
        PolicyActed,
        RecoveryTokens,
        RecoveryBudgetUsed,
    ], told.events
    assert told.events[2] == PolicyActed("rid", MODEL, "retry", "recovered", 2, "restart")
    assert told.events[3] == RecoveryTokens(MODEL, "restart", 30, 0, "rid", 2)
    assert told.events[-1] == RecoveryBudgetUsed(MODEL, 7, 1000)


def test_the_gauge_is_due_at_once_when_moved_else_once_a_second() -> None:
    now = [10.0]
    gauge = BudgetGauge(lambda: now[0])
    assert gauge.due(MODEL, False)
    assert not gauge.due(MODEL, False), "due twice in one second"
    assert gauge.due(MODEL, True), "a moved account was not due at once"
    now[0] = 11.0
    assert gauge.due(MODEL, False)


def test_the_settings_are_the_configurations_values() -> None:
    markers = [ReasoningMarkersConfig(models="qwen*", start="<a>", end="</a>")]
    settings = loop_settings(
        LoopConfig(max_attempts=4, stream_mode="continue", reasoning_markers=markers)
    )
    assert settings.max_attempts == 4 and settings.one_path and settings.keep
    assert settings.markers("qwen-7b") == ("<a>", "</a>")
    assert settings.markers("other") == ("<think>", "</think>")
    restart = loop_settings(LoopConfig(stream_mode="restart"))
    assert not restart.one_path and not restart.keep, "nothing continues, yet text is kept"
    ladder = LadderConfig(attempts=[{"strategy": "continue"}])
    assert loop_settings(LoopConfig(stream_mode="restart", ladders=[ladder])).keep
    assert loop_settings(LoopConfig(enabled=False)).watch("chat") is None


def imported(path: str) -> set[str]:
    tree = ast.parse((ROOT / path).read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_import_cycle_between_the_attempts_and_recovery() -> None:
    for path in (
        "proxy/loops/recovery.py",
        "proxy/loops/context.py",
        "proxy/loops/next_attempt.py",
    ):
        assert "proxy.attempts" not in imported(path), f"{path} imports proxy.attempts"
