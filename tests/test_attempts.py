"""The attempt lifecycle (proxy/attempts.py): its transitions, the one attempt cap, and the
recovery budget's accounting across them."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from policies.base import Abort, Continue, Decision, PolicyChain, PolicyContext, Retry, Trigger
from policies.budget import RecoveryBudget
from policies.ladder import Ladder, LoopLadderPolicy
from proxy.attempts import AttemptEnd, Attempts, Generated, run_attempts
from proxy.config import LadderConfig, LoopConfig
from proxy.events import (
    EventBus,
    LoopDetected,
    PolicyActed,
    RecoveryBudgetUsed,
    RecoveryTokens,
)
from proxy.exchange import Exchange
from proxy.loops.next_attempt import NextAttempt, request_seed
from proxy.loops.recovery import Recovery
from proxy.loops.watch import LoopWatch
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import knobs
from tests.helpers.metrics import metric
from tests.helpers.sse import sse_chunks

MODEL = "m"
LOOP = Trigger("proxy", "content", 0, 4, 8, 10, "unit")
BASE = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 200}


class Seen:
    """The events the lifecycle published, by type."""

    def __init__(self, bus: EventBus) -> None:
        self.events: list[object] = []
        for kind in (LoopDetected, PolicyActed, RecoveryBudgetUsed, RecoveryTokens):
            bus.subscribe(kind, self.events.append)

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def actions(self) -> list[tuple[str, str, int]]:
        return [(e.action, e.outcome, e.attempt) for e in self.of(PolicyActed)]


class AlwaysRetry:
    """A policy that retries whatever the attempt, reserving ``tokens`` each time: only the
    lifecycle's cap stops it."""

    name = "always-retry"

    def __init__(self, budget: RecoveryBudget, tokens: int = 100) -> None:
        self.budget, self.tokens = budget, tokens
        self.seen: list[PolicyContext] = []

    def decide(self, ctx: PolicyContext) -> Decision:
        self.seen.append(ctx)
        assert self.budget.try_reserve(ctx.model, self.tokens)
        return Retry("again", {"seed": ctx.attempt}, reserved_tokens=self.tokens)


def lifecycle(
    policy: Any = None,
    max_attempts: int = 3,
    ladders: tuple[LadderConfig, ...] = (),
    enabled: bool = True,
    stream: bool = False,
) -> tuple[Attempts, RecoveryBudget, Seen]:
    """A request's attempts over a fresh app-wide recovery: the ladder of ``ladders`` (each
    step a restart), or ``policy(budget)`` in its place."""
    config = LoopConfig(
        policy="retry",
        enabled=enabled,
        stream_mode="restart",
        max_attempts=max_attempts,
        ladders=list(ladders),
    )
    budget = RecoveryBudget(1.0, floor_tokens=10_000, clock=lambda: 1000.0)
    if policy is None:
        steps = [
            Ladder(lad.models, lad.action, tuple(lad.attempts), lad.on_exhausted)
            for lad in config.ladder_list()
        ]
        policy = LoopLadderPolicy(steps, budget)
    else:
        policy = policy(budget)
    bus = EventBus()
    seen = Seen(bus)
    recovery = Recovery(config, PolicyChain([policy]), bus, budget=budget, clock=lambda: 1000.0)
    attempts = Attempts(recovery.context, "rid", MODEL, "chat", stream, 200, BASE)
    return attempts, budget, seen


SEEDS = (LadderConfig(attempts=[{"seed": n} for n in range(1, 10)]),)  # more steps than any cap


def test_started_watches_each_attempt_unless_loops_are_off_or_it_is_a_fallback() -> None:
    attempts, _, _ = lifecycle(stream=True)
    assert isinstance(attempts.started(), LoopWatch), "the client's own attempt is not watched"
    attempts.decided(LOOP)
    attempts.retried(Retry("loop"), Generated(None))
    assert isinstance(attempts.started(), LoopWatch), "a retry is not watched"
    attempts.refused(fallback=True)
    assert attempts.started() is None, "a fallback (the client's own request) was watched"
    off, _, _ = lifecycle(enabled=False)
    assert off.started() is None, "loops are off, yet an attempt was watched"


def test_a_loop_decided_to_retry_reserves_budget_for_the_next_attempt() -> None:
    attempts, budget, seen = lifecycle()
    decision = attempts.decided(LOOP)
    assert isinstance(decision, Retry), f"the ladder did not retry: {decision}"
    assert attempts.reserved == {2: 200}, "the reservation is not the next attempt's"
    assert budget.use(MODEL).spent == 200
    assert attempts.looped and attempts.pending_retry and attempts.trigger == LOOP
    assert [(e.attempt, e.action) for e in seen.of(LoopDetected)] == [(1, "retry")]
    assert seen.actions() == []  # a retry's outcome is known when its attempt ends


def test_the_client_attempt_records_what_it_generated_and_a_retry_settles_its_reservation() -> None:
    attempts, budget, seen = lifecycle()
    decision = attempts.ended(AttemptEnd(120, decide=True, trigger=LOOP))
    assert isinstance(decision, Retry)
    assert budget.use(MODEL).generated == 120, "the client's own attempt was not recorded"
    nxt = attempts.retried(decision, Generated("text"))
    body, continued = orjson.dumps(nxt.body), nxt.continued
    assert continued is None and attempts.strategy == "restart" and attempts.count == 2
    assert decision.overrides, "the default ladder's first step has no overrides"
    # The request again under the overrides, seeded from the request (no seed of its own).
    expected = {**BASE, **decision.overrides, "seed": request_seed(BASE)}
    assert orjson.loads(body) == expected, "not base + overrides + the request's seed"
    assert attempts.ended(AttemptEnd(50, decide=True)) == Continue()
    assert attempts.reserved == {}, "the retry's reservation is still held"
    assert budget.use(MODEL).spent == 50, "spent is not what the retry generated"
    assert budget.use(MODEL).generated == 120, "a retry's tokens counted as the client's"
    assert seen.of(RecoveryBudgetUsed)[-1] == RecoveryBudgetUsed(MODEL, 50, 10_000)
    # Named by request and attempt: the loop's incident line carries what its retry cost.
    assert seen.of(RecoveryTokens) == [RecoveryTokens(MODEL, "restart", 50, 0, "rid", 2)]
    assert seen.actions() == [("retry", "recovered", 2)]
    assert attempts.recovered


def test_a_continued_retry_keeps_the_prefix_and_accounts_its_tokens_as_kept() -> None:
    attempts, budget, seen = lifecycle()
    decision = attempts.ended(AttemptEnd(40, decide=True, trigger=LOOP))
    assert isinstance(decision, Retry)
    looping = "Once upon a time " + "ab, " * 20
    continue_ = Retry(decision.reason, {}, decision.reserved_tokens, strategy="continue")
    nxt = attempts.retried(continue_, Generated(looping))
    body, continued = orjson.dumps(nxt.body), nxt.continued
    assert continued is not None and looping.startswith(continued.prefix)
    assert attempts.strategy == "continue" and 0 < attempts.kept_tokens < 40
    sent = orjson.loads(body)
    assert sent["messages"][-1] == {"role": "assistant", "content": continued.message}
    assert sent["max_tokens"] == 200 - attempts.kept_tokens, "the kept tokens were not taken off"
    attempts.ended(AttemptEnd(25, decide=True))
    kept = attempts.kept_tokens
    assert seen.of(RecoveryTokens) == [RecoveryTokens(MODEL, "continue", 25, kept, "rid", 2)]
    assert budget.use(MODEL).spent == 25


def test_a_refused_retry_releases_its_reservation() -> None:
    attempts, budget, seen = lifecycle(stream=True)
    decision = attempts.decided(LOOP)
    assert isinstance(decision, Retry)
    attempts.ended(AttemptEnd(80, decision=decision))
    attempts.retried(decision, Generated(None))
    attempts.refused()
    assert budget.use(MODEL).spent == 0, "a retry never sent kept its reservation"
    assert attempts.reserved == {}
    assert seen.actions() == [("retry", "error", 2)]
    assert not attempts.fell_back and not attempts.recovered
    attempts.refused(fallback=True)
    assert attempts.fell_back
    assert seen.actions() == [("retry", "error", 2)], "one refusal was reported twice"


@pytest.mark.parametrize("cap", [1, 2, 4])
def test_the_cap_is_the_configured_max_attempts_whatever_the_policy(cap: int) -> None:
    attempts, budget, seen = lifecycle(AlwaysRetry, max_attempts=cap)
    decisions = []
    while True:
        decision = attempts.ended(AttemptEnd(10, decide=True, trigger=LOOP))
        decisions.append(decision)
        if not isinstance(decision, Retry):
            break
        attempts.retried(decision, Generated(None))
    assert attempts.count == cap, f"{attempts.count} attempts under a cap of {cap}"
    assert decisions[-1] == Abort("attempts_exhausted")
    assert ("abort", "attempts_exhausted", cap) in seen.actions()
    # Each loop says what was decided about it: the capped one was aborted, not retried.
    assert [e.action for e in seen.of(LoopDetected)] == ["retry"] * (cap - 1) + ["abort"]
    # Every retry sent spent what it generated; the one at the cap released what it reserved.
    assert budget.use(MODEL).spent == 10 * (cap - 1), "the capped retry's reservation leaked"
    assert attempts.reserved == {}


def test_the_ladder_gives_up_its_own_way_at_the_cap_it_is_told() -> None:
    """The ladder sees the cap (its on_exhausted: observe), and reserves nothing past it."""
    steps = tuple({"seed": n} for n in range(1, 10))
    ladder = LoopLadderPolicy([Ladder(attempts=steps, on_exhausted="observe")], RecoveryBudget())

    def the_ladder(budget: RecoveryBudget) -> LoopLadderPolicy:
        ladder.budget = budget
        return ladder

    attempts, budget, seen = lifecycle(the_ladder, max_attempts=2)
    assert isinstance(attempts.decided(LOOP), Retry)
    attempts.retried(Retry("loop", {"seed": 1}, 200), Generated(None))
    attempts.ended(AttemptEnd(30, decide=False))
    assert attempts.decided(LOOP) == Continue(), "the cap was not the ladder's to apply"
    assert ladder.exhausted == {"attempts_exhausted": 1}, "the ladder did not see the cap"
    assert budget.use(MODEL).spent == 30, "the ladder reserved a retry past the cap"
    assert seen.actions() == [("retry", "looped_again", 2), ("observe", "observe", 2)]
    assert [e.action for e in seen.of(LoopDetected)] == ["retry", "observe"]


def test_a_retry_a_policy_asks_for_on_a_clean_answer_at_the_cap_is_not_sent() -> None:
    attempts, budget, _ = lifecycle(AlwaysRetry, max_attempts=1)
    assert attempts.decided(None, 200, {"choices": []}) == Continue()
    assert budget.use(MODEL).spent == 0 and attempts.reserved == {}
    assert not attempts.looped


class Looping:
    """An answer whose every attempt loops (a whole answer's trigger, found once read)."""

    def __init__(self, attempts: Attempts) -> None:
        self.attempts = attempts
        self.exchange = Exchange(None, "chat", 0.0, 1)  # type: ignore[arg-type]
        self.sent: list[bytes] = []

    async def attempt(self) -> AttemptEnd | None:
        return AttemptEnd(10, decide=True, trigger=LOOP)

    def generated(self) -> Generated:
        return Generated(None)

    async def retry(self, nxt: NextAttempt, decision: Retry) -> bool:
        self.sent.append(orjson.dumps(nxt.body))
        return True


@pytest.mark.parametrize("cap", [1, 3, 5])
async def test_run_attempts_sends_exactly_the_cap(cap: int) -> None:
    attempts, _, _ = lifecycle(max_attempts=cap, ladders=SEEDS)
    answer = Looping(attempts)
    assert await run_attempts(answer) == Abort("attempts_exhausted")
    assert len(answer.sent) == cap - 1, f"{len(answer.sent) + 1} attempts under a cap of {cap}"
    assert [orjson.loads(b)["seed"] for b in answer.sent] == list(range(1, cap))


# -- through the proxy, against the emulator ------------------------------------------------

PERSISTS = knobs(loop_channel="content", loop_after_tokens=5)  # a seed never ends the loop
LADDER = '[{"models": "*", "attempts": [' + ",".join(f'{{"seed": {n}}}' for n in range(9)) + "]}]"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("cap", [1, 2, 4])
async def test_max_attempts_n_gives_exactly_n_attempts(
    make_proxy: Any,
    emulator: EmulatorServer,
    registry: CollectorRegistry,
    cap: int,
    stream: bool,
) -> None:
    env = {
        "DETPROXY_LOOPS__LADDERS": LADDER,
        "DETPROXY_LOOPS__MAX_ATTEMPTS": str(cap),
        "DETPROXY_AUDIT__PASSIVE_CHECKS": "false",
    }
    client = await make_proxy(emulator.url, env=env)
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 2000,
        "stream": stream,
        "messages": [{"role": "user", "content": "tell me a story"}],
    }
    resp = await client.post("/v1/chat/completions", json=body, headers=PERSISTS)
    payload = await resp.read()
    assert emulator.stats()["requests"] == cap, "the engine was not asked exactly cap times"
    if stream:
        infos = [c["detproxy"] for c in sse_chunks(payload) if "detproxy" in c]
        assert infos[-1]["attempts"] == cap and infos[-1]["recovered"] is False
    else:
        assert resp.headers["X-Detproxy-Attempts"] == str(cap)
    exhausted = metric(
        registry,
        "detproxy_policy_actions_total",
        model="emulator-model",
        action="abort",
        outcome="attempts_exhausted",
    )
    assert exhausted == 1
