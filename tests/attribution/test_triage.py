"""Triage's budgets, quiet waits, failures and shutdown, with a scripted upstream: what does not
fit is dropped and counted, and its incident still gets a cause naming what was missing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import orjson
import pytest

from proxy.attribution.account import SharedAccount
from proxy.attribution.case import Diverged, TriageCase
from proxy.attribution.experiments import run_experiments
from proxy.attribution.shared import SharedExperiments
from proxy.attribution.triage import CASES_PER_EXPERIMENT, Triage
from proxy.audit.outcome import ChoiceOutcome, Outcome, TokenLogprob
from proxy.audit.shadow import wait_quiet
from proxy.audit.turns import SharedTurns
from proxy.config import AttributionConfig, AuditConfig
from proxy.engine.load import EngineCounts
from proxy.events import CauseAttributed, EventBus, TriageDropped
from proxy.http.upstream import Upstream
from tests.helpers.waiting import eventually


class Load:
    def __init__(self, inflight: int = 0) -> None:
        self.inflight = inflight
        self.started = 0


class Answer:
    def __init__(self, body: bytes) -> None:
        self.status = 200
        self._body = body

    async def read(self) -> bytes:
        return self._body

    def close(self) -> None:
        pass


class Scripted:
    """An upstream that answers each replay with the text ``texts(n)`` (n: replays so far),
    and, where ``usage`` is given, its (prompt, completion) token counts."""

    def __init__(self, texts: Callable[[int], str], usage: tuple[int, int] | None = None) -> None:
        self.texts = texts
        self.usage = usage
        self.bodies: list[dict[str, Any]] = []

    async def send(self, method: str, raw_path: str, headers: Any, body: bytes) -> Answer:
        self.bodies.append(orjson.loads(body))
        text = self.texts(len(self.bodies))
        answer: dict[str, Any] = {
            "choices": [{"index": 0, "message": {"content": text}, "finish_reason": "stop"}]
        }
        if self.usage is not None:
            prompt, completion = self.usage
            answer["usage"] = {"prompt_tokens": prompt, "completion_tokens": completion}
        return Answer(orjson.dumps(answer))

    async def close(self) -> None:
        pass


def outcome(text: str) -> Outcome:
    return Outcome((ChoiceOutcome(0, text, "", None, "stop"),))


def case(i: int = 0, primary: str = "a", shadow: str = "b") -> TriageCase:
    now = time.time()
    return TriageCase(
        request_id=f"r{i}",
        model="m",
        endpoint="chat",
        raw_path="/v1/chat/completions",
        body={"model": "m", "messages": [{"role": "user", "content": f"q{i}"}], "temperature": 0},
        headers={},
        mode="full",
        target="same",
        primary=outcome(primary),
        shadow=outcome(shadow),
        primary_inflight=1,
        primary_inflight_end=1,
        shadow_inflight=0,
        shadow_cold=True,
        shadow_alone=True,
        primary_at=now,
        shadow_at=now,
        estimated_tokens=10,
        diverged=(Diverged(0, "text_divergence", now),),
    )


def triage(
    upstream: Scripted, load: Load | None = None, **config: Any
) -> tuple[Triage, list[object]]:
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(CauseAttributed, seen.append)
    bus.subscribe(TriageDropped, seen.append)
    settings = {"cold_method": "cache_salt", "max_per_minute": 6000.0, **config}
    audit = AuditConfig(quiet_settle_s=0, quiet_poll_s=0.005)
    t = Triage(AttributionConfig(**settings), audit, bus, cast(Upstream, upstream), load or Load())
    return t, seen


def causes(seen: list[object]) -> list[CauseAttributed]:
    return [e for e in seen if isinstance(e, CauseAttributed)]


def drops(seen: list[object]) -> list[str]:
    return [e.reason for e in seen if isinstance(e, TriageDropped)]


async def test_cold_replays_each_get_a_fresh_salt_and_warm_ones_one_of_their_own() -> None:
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream, cold_replays=3, warm_replays=2)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    salts = [b.get("cache_salt") for b in upstream.bodies]
    assert len(salts) == 6, upstream.bodies  # 3 cold, the prime, 2 warm
    assert len(set(salts[:3])) == 3 and None not in salts[:3]
    # The prime and the warm replays share one salt of their own, none of the cold ones': they
    # read what the prime wrote alone, never the primary's tenant.
    assert len(set(salts[3:])) == 1 and salts[3] is not None and salts[3] not in salts[:3]
    evidence = causes(seen)[0].evidence
    assert [r["name"] for r in evidence["runs"]] == [
        "primary",
        "shadow",
        "cold-1",
        "cold-2",
        "cold-3",
        "prime",
        "warm-1",
        "warm-2",
    ]


async def test_cold_replays_stop_once_they_disagree() -> None:
    upstream = Scripted(lambda n: "x" if n == 2 else "b")
    t, seen = triage(upstream, cold_replays=4)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    assert len(upstream.bodies) == 2
    found = causes(seen)[0]
    assert found.cause == "intrinsic"
    assert found.evidence["parted"] and found.evidence["groups"] == 3


async def test_a_burst_over_the_rate_waits_paced_instead_of_being_refused() -> None:
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream, max_per_minute=600.0, cold_replays=2, warm_replays=0)
    for i in range(4):  # four prompts at once: one experiment now, then one every 0.1 s
        t.offer(case(i))
    assert drops(seen) == [] and causes(seen) == [] and t.queued == 4
    t.start()
    await eventually(lambda: len(causes(seen)) == 4, timeout_s=20, what="four causes")
    await t.close()
    assert drops(seen) == []
    for found in causes(seen):  # each decided with its own experiment's replays
        assert [r["name"] for r in found.evidence["runs"]][2:] == ["cold-1", "cold-2"], found
    assert len(upstream.bodies) == 8


async def test_past_its_wait_a_case_ends_unknown_naming_the_budget() -> None:
    t, seen = triage(Scripted(lambda n: "b"), max_per_minute=0.001, max_wait_s=0.05)
    t.start()
    t.offer(case(1))  # the bucket's one token
    t.offer(case(2))  # waits for the next, a thousand minutes away: past its wait
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="two causes")
    await t.close()
    assert drops(seen) == ["rate_limit"]
    dropped = next(c for c in causes(seen) if c.request_id == "r2")
    assert dropped.cause == "unknown"
    assert (
        dropped.evidence["missing"][0] == "triage budget: rate_limit (triaged again when it frees)"
    )


async def test_status_says_what_the_next_experiment_waits_for() -> None:
    t, seen = triage(
        Scripted(lambda n: "b"), Load(inflight=3), max_per_minute=0.001, quiet_deadline_s=0.3
    )
    assert t.status()["waiting_for"] == {}
    t.start()
    t.offer(case(1))  # the bucket's one token; then a quiet moment, which never comes
    await eventually(
        lambda: t.status()["waiting_for"] == {"quiet": 1}, interval_s=0.005, what="quiet"
    )
    t.offer(case(2))
    await eventually(lambda: drops(seen) == ["quiet_deadline"], what="a drop")
    await eventually(
        lambda: t.status()["waiting_for"] == {"rate_limit": 1}, interval_s=0.005, what="rate"
    )
    await t.close()
    assert t.status()["waiting_for"] == {}


async def test_with_both_sides_known_cold_no_warm_replay_runs() -> None:
    """A client's new cache_salt and the shadow's own: the cache was no switch between the
    two sides, so the warm replays (3 of 7 runs) would tell nothing. An incident of the same
    request whose primary's cache state is not known gets an experiment with them."""
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream)
    cold = replace(case(1), primary_cold_salt=True, primary_inflight=4)
    t.start()
    t.offer(cold)
    await eventually(lambda: len(causes(seen)) == 1, what="the cold case's cause")
    assert causes(seen)[0].cause == "batch", causes(seen)[0].evidence
    assert len(upstream.bodies) == 4 and all("cache_salt" in b for b in upstream.bodies)
    t.offer(replace(cold, request_id="r1-again", primary_cold_salt=False))
    await eventually(lambda: len(causes(seen)) == 2, what="the unknown-state case's cause")
    await t.close()
    assert causes(seen)[1].cause == "batch", causes(seen)[1].evidence
    runs = [r["name"] for r in causes(seen)[1].evidence["runs"]]
    assert "warm-1" in runs and len(upstream.bodies) == 4 + 7, runs


async def test_the_token_budget_holds_an_experiment_until_its_wait_ends() -> None:
    upstream = Scripted(lambda n: "b", usage=(4, 6))  # 10 tokens a run, as estimated
    t, seen = triage(upstream, token_allowance=100, max_token_share=0.0, max_wait_s=0.05)
    t.start()
    t.offer(case(1))  # 10 tokens x 7 runs fits 100; the next does not
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="one cause")
    t.offer(case(2))
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="two causes")
    await t.close()
    assert drops(seen) == ["token_budget"]
    assert len(upstream.bodies) == 7


async def test_over_the_token_budget_incidents_say_so_at_once_not_after_the_wait() -> None:
    """On real vLLM (2026-12-07) a burst's last experiment waited for the token budget with
    its 7 incidents causeless for minutes (max_wait_s is 600 s by default)."""
    upstream = Scripted(lambda n: "b", usage=(4, 6))
    t, seen = triage(upstream, token_allowance=100, max_token_share=0.0, max_wait_s=600.0)
    t.start()
    t.offer(case(1))  # 10 tokens x 7 runs fits 100; the next does not
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="one cause")
    t.offer(case(2))
    await eventually(
        lambda: len(causes(seen)) == 2, timeout_s=10, interval_s=0.005, what="its unknown now"
    )
    assert causes(seen)[1].cause == "unknown" and "token_budget" in str(causes(seen)[1].evidence)
    assert drops(seen) == ["token_budget"] and t.status()["again_incidents"] == 1
    await t.close()
    assert len(upstream.bodies) == 7


async def test_more_requests_waiting_than_the_queue_holds_are_dropped() -> None:
    t, seen = triage(Scripted(lambda n: "b"), queue_size=1)
    t.offer(case(1))
    t.offer(case(2))
    assert drops(seen) == ["queue_full"]
    assert causes(seen)[0].evidence["missing"][0] == (
        "triage budget: queue_full (triaged again when it frees)"
    )
    await t.close()
    assert drops(seen) == ["queue_full", "shutdown"]


async def test_one_experiment_explains_every_incident_of_the_same_request() -> None:
    """A burst from one prompt, each request with its own cache_salt: one experiment's
    replays decide all of them, and a later incident reads the replays it left."""
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream, cold_replays=2, warm_replays=2)
    salted = [replace(case(0), request_id=f"s{i}", body={**case(0).body, "cache_salt": f"t{i}"})
              for i in range(5)]  # fmt: skip
    for c in salted[:4]:
        t.offer(c)
    assert t.queued == 1 and t.status()["waiting_incidents"] == 4
    t.start()
    await eventually(lambda: len(causes(seen)) == 4, interval_s=0.005, what="four causes")
    assert len(upstream.bodies) == 5  # 2 cold, the prime, 2 warm: once
    t.offer(salted[4])  # later: decided at once from the finished experiment's replays
    assert len(causes(seen)) == 5 and len(upstream.bodies) == 5
    await t.close()
    assert {c.request_id for c in causes(seen)} == {f"s{i}" for i in range(5)}
    for found in causes(seen):
        names = [r["name"] for r in found.evidence["runs"]]
        assert names == ["primary", "shadow", "cold-1", "cold-2", "prime", "warm-1", "warm-2"]
    assert t.status()["triaged"] == 1 and t.status()["explained"] == 5


async def test_replays_cut_short_do_not_explain_an_incident_that_parted_later() -> None:
    text = "a" * 500
    early = long_case("b" + text[1:], text)  # parted at token 0: replays of 17 tokens
    late = replace(long_case(text[:300] + "b" + text[301:], text), request_id="late")
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream, cold_replays=2, warm_replays=0)
    t.start()
    t.offer(early)
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="one cause")
    t.offer(late)  # parted at token 300: the 17-token replays cannot say
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="two causes")
    await t.close()
    assert [b["max_tokens"] for b in upstream.bodies] == [17, 17, 317, 317]


async def test_no_quiet_moment_gives_up_after_its_deadline() -> None:
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream, Load(inflight=3), quiet_deadline_s=0.05)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    assert upstream.bodies == []  # nothing was sent beside the client requests
    assert drops(seen) == ["quiet_deadline"]
    assert causes(seen)[0].cause == "unknown"
    assert "no quiet moment: quiet_deadline" in causes(seen)[0].evidence["missing"]


async def test_a_failing_triage_is_counted_and_the_next_one_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = 0

    async def flaky(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("boom")
        return await run_experiments(*args)

    monkeypatch.setattr("proxy.attribution.triage.run_experiments", flaky)
    t, seen = triage(Scripted(lambda n: "b"))
    t.start()
    t.offer(case(1))
    t.offer(case(2))
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="two causes")
    await t.close()
    assert drops(seen) == ["error"]
    first, second = causes(seen)
    assert first.evidence["missing"][0] == "triage failed: RuntimeError"
    assert second.evidence["runs"][2]["name"] == "cold-1"


async def test_shutdown_cancels_the_running_triage() -> None:
    t, _ = triage(Scripted(lambda n: "b"), Load(inflight=3), quiet_deadline_s=600)
    t.start()
    t.offer(case())
    await eventually(lambda: t.running, interval_s=0.005, what="the triage started")
    await asyncio.wait_for(t.close(), 5)
    assert not [task for task in asyncio.all_tasks() if task.get_name().startswith("triage:")]


class Crowded(Scripted):
    """A scripted upstream beside which a client request starts during every replay."""

    def __init__(self, texts: Callable[[int], str], load: Load) -> None:
        super().__init__(texts)
        self.load = load

    async def send(self, method: str, raw_path: str, headers: Any, body: bytes) -> Answer:
        self.load.started += 1
        return await super().send(method, raw_path, headers, body)


def count_waits(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The quiet waits triage makes (each call's settle_s)."""
    calls: list[float] = []

    async def counted(*args: Any, **kwargs: Any) -> bool:
        calls.append(kwargs["settle_s"])
        return await wait_quiet(*args, **kwargs)

    monkeypatch.setattr("proxy.attribution.triage.wait_quiet", counted)
    return calls


async def test_replays_after_one_that_ran_alone_do_not_wait_for_the_settle_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = count_waits(monkeypatch)
    upstream = Scripted(lambda n: "b")
    t, seen = triage(upstream)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    assert len(upstream.bodies) == 7, upstream.bodies  # 4 cold, the prime, 2 warm
    assert len(waits) == 1, f"{len(waits)} quiet waits for replays that all ran alone"
    assert all(r["alone"] for r in causes(seen)[0].evidence["runs"][2:])


async def test_a_client_request_beside_a_replay_makes_the_next_one_wait_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = count_waits(monkeypatch)
    load = Load()
    upstream = Crowded(lambda n: "b", load)
    t, seen = triage(upstream, load)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    assert len(upstream.bodies) == 7
    assert len(waits) == 7, f"{len(waits)} quiet waits for 7 replays each beside a request"
    assert not any(r["alone"] for r in causes(seen)[0].evidence["runs"][2:])


async def test_with_the_upstreams_running_count_read_every_replay_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    waits = count_waits(monkeypatch)
    reads = 0

    async def running() -> int:
        nonlocal reads
        reads += 1
        return 0

    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(CauseAttributed, seen.append)
    audit = AuditConfig(quiet_settle_s=0, quiet_poll_s=0.005, quiet_max_upstream_running=0)
    config = AttributionConfig(cold_method="cache_salt", max_per_minute=6000.0)
    upstream = Scripted(lambda n: "b")
    t = Triage(config, audit, bus, cast(Upstream, upstream), Load(), upstream_running=running)
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await t.close()
    assert len(waits) == 7 and reads >= 7, (len(waits), reads)


def long_case(primary: str, shadow: str) -> TriageCase:
    """A divergence with logprobs (one token a character), 100 prompt tokens, 500 generated."""

    def choice(text: str) -> ChoiceOutcome:
        tokens = tuple(TokenLogprob(ch, -0.1, ((ch, -0.1),)) for ch in text)
        return ChoiceOutcome(0, text, "", tokens, "length")

    c = case()
    fields = {f: getattr(c, f) for f in TriageCase.__dataclass_fields__}
    fields |= {
        "body": {"model": "m", "messages": [], "temperature": 0, "max_tokens": 500},
        "primary": Outcome((choice(primary),), prompt_tokens=100, completion_tokens=500),
        "shadow": Outcome((choice(shadow),), prompt_tokens=100, completion_tokens=500),
        "estimated_tokens": 600,
    }
    return TriageCase(**fields)


async def test_the_token_budget_counts_replays_cut_short_at_their_limit() -> None:
    text = "a" * 500
    diverged = long_case("b" + text[1:], text)  # parted at token 0: replays of 17 tokens
    cut, seen = triage(
        Scripted(lambda n: "b", usage=(100, 17)), token_allowance=1000, max_token_share=0.0
    )
    cut.start()
    cut.offer(diverged)  # 7 runs of 100 + 17 tokens: 819
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a cause")
    await cut.close()
    assert drops(seen) == [] and cut.tokens == 7 * 117, (drops(seen), cut.tokens)
    whole, seen_whole = triage(
        Scripted(lambda n: "b"),
        token_allowance=1000,
        max_token_share=0.0,
        replay_margin_tokens=100000,
        max_wait_s=0.05,
    )
    whole.start()
    whole.offer(diverged)  # 7 runs of 600 tokens: never fits
    await eventually(lambda: len(causes(seen_whole)) == 1, interval_s=0.005, what="a cause")
    await whole.close()
    assert drops(seen_whole) == ["token_budget"]


async def test_an_experiment_full_of_incidents_keeps_them_and_refuses_the_next() -> None:
    t, seen = triage(Scripted(lambda n: "b"))
    same = case(0)
    for i in range(CASES_PER_EXPERIMENT + 1):
        t.offer(replace(same, request_id=f"d{i}"))
    assert drops(seen) == ["queue_full"]
    assert t.status()["waiting_incidents"] == CASES_PER_EXPERIMENT and t.queued == 1
    await t.close()


class Slow(Scripted):
    """Answers after ``delay_s``: long enough for the engine's count to be read meanwhile."""

    def __init__(self, texts: Callable[[int], str], delay_s: float) -> None:
        super().__init__(texts)
        self.delay_s = delay_s

    async def send(self, method: str, raw_path: str, headers: Any, body: bytes) -> Answer:
        await asyncio.sleep(self.delay_s)
        return await super().send(method, raw_path, headers, body)


async def alone_of_replays(
    upstream: Any,
    running: Callable[[], Awaitable[int | None]],
    counts: Callable[[], Awaitable[EngineCounts | None]] | None = None,
    sees_all: bool = False,
) -> list[bool | None]:
    """A case triaged with two cold replays and no warm one, the engine's counts read through
    ``running`` (while a replay runs) and ``counts`` (either side): each replay's ``alone``."""
    bus = EventBus()
    seen: list[object] = []
    bus.subscribe(CauseAttributed, seen.append)
    config = AttributionConfig(cold_method="cache_salt", cold_replays=2, warm_replays=0)
    audit = AuditConfig(quiet_settle_s=0, quiet_poll_s=0.005)
    t = Triage(
        config,
        audit,
        bus,
        cast(Upstream, upstream),
        Load(),
        engine_running=running,
        engine_counts=counts,
        sees_all=sees_all,
    )
    t.start()
    t.offer(case())
    await eventually(lambda: len(causes(seen)) == 1, what="a cause")
    await t.close()
    return [r["alone"] for r in causes(seen)[0].evidence["runs"][2:]]


@pytest.mark.parametrize(
    ("engine_count", "sees_all", "alone"),
    [
        (3, True, False),  # company detproxy did not see: another client, another worker
        (1, False, True),  # the engine says the replay ran alone, whatever detproxy sees
        (None, True, True),  # no reading: one worker's own counts stand
        (None, False, None),  # no reading, several workers: not known
    ],
)
async def test_a_replay_is_alone_only_where_the_engines_running_count_agrees(
    engine_count: int | None, sees_all: bool, alone: bool | None
) -> None:
    reads = 0

    async def running() -> int | None:
        nonlocal reads
        reads += 1
        return engine_count

    replays = await alone_of_replays(Slow(lambda n: "b", delay_s=0.2), running, sees_all=sees_all)
    assert replays == [alone, alone], replays
    assert reads == 2


async def test_without_shadows_the_primaries_counted_here_are_the_budgets_base() -> None:
    t, _ = triage(Scripted(lambda n: "b"), token_allowance=100, max_token_share=0.5)
    assert t.token_budget == 100
    t.count_primary_tokens(1000)
    assert t.token_budget == 100 + 0.5 * 1000
    await t.close()


async def test_the_budget_keeps_what_the_replays_cost_not_what_was_reserved() -> None:
    """An experiment reserves its worst case (every run to the replay limit) and, once done,
    the budget keeps what the engine said the replays cost: a second experiment that the
    reservations alone would not let in fits."""
    text = "a" * 500
    upstream = Scripted(lambda n: "b", usage=(100, 3))  # answers stop 3 tokens in
    t, seen = triage(upstream, token_allowance=1000, max_token_share=0.0, max_wait_s=0.05)
    t.start()
    t.offer(long_case("b" + text[1:], text))  # reserves 7 x 117 = 819 of 1000
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a first cause")
    assert t.tokens == 7 * 103, f"the budget kept {t.tokens}, not the 721 the replays cost"
    second = long_case("b" + text[1:], text)
    second = replace(second, request_id="r-second", body=dict(second.body, seed=2))
    t.offer(second)  # 721 + 819 > 1000 reserved; 721 + 721 spent: still over, waits
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="a second cause")
    await t.close()
    assert drops(seen) == ["token_budget"], "1442 tokens fit no 1000-token budget"
    refund, seen_refund = triage(
        Scripted(lambda n: "b", usage=(100, 3)),
        token_allowance=1600,
        max_token_share=0.0,
        max_wait_s=0.05,
    )
    refund.start()
    refund.offer(long_case("b" + text[1:], text))
    await eventually(lambda: len(causes(seen_refund)) == 1, interval_s=0.005, what="a cause")
    refund.offer(second)  # 721 spent + 819 reserved = 1540 <= 1600: only the true-up lets it in
    await eventually(lambda: len(causes(seen_refund)) == 2, interval_s=0.005, what="2 causes")
    await refund.close()
    assert drops(seen_refund) == [] and refund.tokens == 2 * 7 * 103, refund.tokens


async def test_two_workers_run_one_experiment_for_the_server(tmp_path: Path) -> None:
    """serve's workers: the same request's incidents on two workers get one experiment, whose
    replays explain both (the second worker waits for the first's, or reads them)."""
    upstream = Scripted(lambda n: "b")
    folder = str(tmp_path)
    workers = []
    for _ in range(2):
        bus = EventBus()
        seen: list[object] = []
        bus.subscribe(CauseAttributed, seen.append)
        bus.subscribe(TriageDropped, seen.append)
        config = AttributionConfig(cold_method="cache_salt", max_per_minute=6000.0)
        audit = AuditConfig(quiet_settle_s=0, quiet_poll_s=0.005)
        t = Triage(
            config,
            audit,
            bus,
            cast(Upstream, upstream),
            Load(),
            turns=SharedTurns(f"{folder}/turns", 1),
            account=SharedAccount(config, f"{folder}/ledger.json"),
            shared=SharedExperiments(f"{folder}/experiments", config.reuse_s),
        )
        t.start()
        workers.append((t, seen))
    (one, seen_one), (two, seen_two) = workers
    one.offer(case(1))
    two.offer(replace(case(1), request_id="r1-on-the-other-worker"))
    await eventually(
        lambda: len(causes(seen_one)) == 1 and len(causes(seen_two)) == 1,
        interval_s=0.005,
        what="a cause on each worker",
    )
    three = case(1)
    two.offer(replace(three, request_id="r1-later"))  # read back at once, no replay
    await eventually(lambda: len(causes(seen_two)) == 2, interval_s=0.005, what="reused")
    await one.close()
    await two.close()
    # one experiment: 4 cold, the prime, 2 warm
    assert len(upstream.bodies) == 7, f"{len(upstream.bodies)} replays: two experiments ran"
    assert drops(seen_one) == drops(seen_two) == []
    assert {c.cause for c in causes(seen_one) + causes(seen_two)} == {causes(seen_one)[0].cause}


async def test_unknown_for_the_budget_is_triaged_again_when_it_frees() -> None:
    """An incident whose experiment did not fit the budget within max_wait_s ends unknown,
    naming it; once the budget frees (the primaries' tokens grow), the experiment runs and its
    cause replaces the unknown (``revises``)."""
    # serial cold replays that differ from each other: intrinsic, from two runs (20 tokens)
    upstream = Scripted(lambda n: "bc"[n % 2], usage=(4, 6))
    t, seen = triage(
        upstream, token_allowance=80, max_token_share=0.1, max_wait_s=0.05, max_per_minute=6e5
    )
    t.start()
    t.offer(case(1))  # reserves 70 (7 runs), keeps the 20 its two runs cost
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a first cause")
    per_experiment = len(upstream.bodies)
    t.offer(case(2))  # 20 + 70 reserved > 80
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="its unknown")
    first, unknown = causes(seen)
    assert unknown.cause == "unknown" and unknown.revises is None
    assert "triaged again when it frees" in str(unknown.evidence), unknown.evidence
    assert drops(seen) == ["token_budget"] and t.status()["again_incidents"] == 1
    t.count_primary_tokens(400)  # 80 + 0.1 x 400 = 120 allowed: 20 + 70 fits now
    await eventually(lambda: len(causes(seen)) == 3, interval_s=0.005, what="triaged again")
    await t.close()
    again = causes(seen)[2]
    assert again.request_id == unknown.request_id and again.revises == "unknown"
    assert first.cause == again.cause == "intrinsic", (again.cause, again.evidence)
    assert again.evidence["revises"] == "unknown" and t.status()["again_incidents"] == 0
    assert drops(seen) == ["token_budget"], "given up once, not again"
    assert len(upstream.bodies) == 2 * per_experiment, "two experiments in all"


async def test_an_experiment_still_over_the_budget_is_not_given_up_twice() -> None:
    upstream = Scripted(lambda n: "b", usage=(4, 6))
    t, seen = triage(
        upstream, token_allowance=100, max_token_share=0.0, max_wait_s=0.05, max_per_minute=6e5
    )
    t.start()
    t.offer(case(1))
    await eventually(lambda: len(causes(seen)) == 1, interval_s=0.005, what="a first cause")
    t.offer(case(2))
    await eventually(lambda: len(causes(seen)) == 2, interval_s=0.005, what="its unknown")
    t.offer(case(3))  # a third request: also over, also kept
    await eventually(lambda: len(causes(seen)) == 3, interval_s=0.005, what="the third's")
    await eventually(lambda: t.status()["again_incidents"] == 2, interval_s=0.005, what="both kept")
    await t.close()
    assert [c.cause for c in causes(seen)[1:]] == ["unknown", "unknown"]
    assert drops(seen) == ["token_budget", "token_budget"] and len(upstream.bodies) == 7


async def test_a_running_count_of_zero_while_the_replay_runs_is_no_reading() -> None:
    """vLLM's gauges lag an engine step: read while the replay runs, the engine may still say 0
    (every replay on an H100, 2026-12-07). The replay itself was running, so that is a count
    from before it: the counts either side decide, and here they say it ran alone."""
    left = [(0, 10), (0, 11)] * 2
    mid_reads = 0

    async def running() -> int | None:
        nonlocal mid_reads
        mid_reads += 1
        return 0

    async def counts() -> EngineCounts | None:
        return EngineCounts(*left.pop(0))

    replays = await alone_of_replays(Slow(lambda n: "b", delay_s=0.2), running, counts)
    assert replays == [True, True], replays
    assert mid_reads == 2, f"{mid_reads} reads while the replays ran, not one each"
    assert left == [], f"{len(left)} reads left: one before and one after each replay"


@pytest.mark.parametrize(
    ("reads", "alone"),
    [
        ([(0, 10), (0, 11)] * 2, True),  # nothing running either side, one request finished
        ([(0, 10), (0, 12)] * 2, None),  # another finished in between: it may have overlapped
        ([(1, 10), (0, 11)] * 2, None),  # one was running as the replay was sent
        ([(0, 10), (1, 11)] * 2, None),  # one was running as it ended
        ([None] * 2, None),  # no counts before a replay: none read after it
    ],
)
async def test_a_short_replay_is_alone_by_the_engines_counts_either_side(
    reads: list[tuple[int, int] | None], alone: bool | None
) -> None:
    """Several workers: a replay that ends before the engine's running count could be read
    (vLLM's /metrics is slow) is alone when nothing ran just before it and just after it, and
    the engine finished exactly one request (the replay) in between."""
    left = list(reads)

    async def running() -> int | None:
        return None  # read after the short replay ended: nothing of its company

    async def counts() -> EngineCounts | None:
        read = left.pop(0)
        return None if read is None else EngineCounts(*read)

    replays = await alone_of_replays(Scripted(lambda n: "b"), running, counts)
    assert replays == [alone, alone], replays
    assert left == [], f"{len(left)} reads left: one before and one after each replay"
