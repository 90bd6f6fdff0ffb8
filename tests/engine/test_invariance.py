"""Declared batch invariance, checked (proxy.engine.invariance): detproxy in front of the
emulator, whose batch effects (``batch_divergence_slope``) make answers given at once differ
from the one given alone; the check's verdict in /detproxy/status, the gauge and the incident."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client import CollectorRegistry

from proxy.engine.facts import CHECKED, EngineFacts
from proxy.engine.follow import EngineTruth
from proxy.engine.invariance import BATCH, BatchInvarianceCheck
from proxy.events import EngineFactsRead, EventBus
from proxy.testing import MockUpstream, Received, Reply
from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.waiting import Unmet, eventually

FAST = {
    "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0.05",
    "DETPROXY_AUDIT__QUIET_SETTLE_S": "0.01",
    "DETPROXY_AUDIT__QUIET_POLL_S": "0.005",
}
DECLARED = FAST | {"DETPROXY_UPSTREAM__EXPECT__BATCH_INVARIANT": "true"}


async def status(client: TestClient[Any, Any]) -> dict[str, Any]:
    body: dict[str, Any] = await (await client.get("/detproxy/status")).json()
    return body


async def check_ended(
    client: TestClient[Any, Any], *, checks: int = 1, timeout_s: float = 30.0
) -> dict[str, Any]:
    """The engine status once ``checks`` checks have ended."""

    async def ended() -> dict[str, Any] | Unmet:
        engine = (await status(client))["engine"]
        found = engine["checks"]["batch_invariant"]
        done = found["checks"] >= checks and found["state"] not in ("waiting", "running")
        return dict(engine) if done else Unmet(found)

    return await eventually(ended, timeout_s=timeout_s, what=f"{checks} invariance check(s)")


def gauge(registry: CollectorRegistry) -> float | None:
    return registry.get_sample_value(
        "detproxy_engine_expectation_mismatch", {"field": "batch_invariant"}
    )


async def mismatch_incidents(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = await (await client.get("/detproxy/incidents")).json()
    return [i for i in found if i["kind"] == "engine_mismatch"]


async def test_batch_effects_against_declared_invariance_are_a_mismatch_with_evidence(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    config = EmulatorConfig(batch_divergence_slope=1.0, token_latency_s=0.005, seed=3)
    async with EmulatorServer(config) as emu:
        client = await make_proxy(emu.url, env=DECLARED)
        engine = await check_ended(client)
        check = engine["checks"]["batch_invariant"]
        assert check["state"] == "failed", check
        assert engine["loaded"]["facts"]["batch_invariant"] is False
        assert engine["loaded"]["sources"]["batch_invariant"] == CHECKED
        (mismatch,) = engine["mismatches"]
        assert mismatch["field"] == "batch_invariant"
        assert (mismatch["expected"], mismatch["loaded"]) == (True, False)
        evidence = mismatch["evidence"]
        assert 1 <= evidence["differed"] <= BATCH
        assert evidence["batch"] == BATCH
        assert evidence["cold_method"] == "cache_salt"
        assert evidence["logprobs"] is True
        assert isinstance(evidence["first_divergence"]["index"], int)
        assert gauge(registry) == 1.0
        (incident,) = await eventually(
            lambda: mismatch_incidents(client), what="the engine_mismatch incident"
        )
        assert incident["mismatches"][0]["evidence"]["differed"] == evidence["differed"]
        # The emulator says what it did: batch effects, never at one request in flight.
        kinds = {r["kind"] for r in emu.injections()}
        assert "batch_drift" in kinds, kinds
        assert emu.stats()["requests"] == check["requests"]


async def test_a_batch_invariant_engine_declared_so_is_checked_and_met(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.005)) as emu:
        client = await make_proxy(emu.url, env=DECLARED)
        engine = await check_ended(client)
        check = engine["checks"]["batch_invariant"]
        assert check["state"] == "passed", check
        assert check["last"]["differed"] == 0
        assert engine["mismatches"] == []
        assert "batch_invariant" not in engine["unknown"]
        assert engine["loaded"]["facts"]["batch_invariant"] is True
        assert engine["loaded"]["sources"]["batch_invariant"] == CHECKED
        assert gauge(registry) == 0.0
        assert await mismatch_incidents(client) == []
        # One lone run and the batch, cold (each its own salt), bounded in tokens.
        assert check["requests"] == 1 + BATCH
        assert emu.stats()["requests"] == 1 + BATCH
        assert 0 < check["tokens"] <= (1 + BATCH) * 200


async def test_without_the_declaration_no_check_is_sent(make_proxy: Any) -> None:
    async with EmulatorServer(EmulatorConfig()) as emu:
        client = await make_proxy(emu.url, env=FAST)

        async def read() -> dict[str, Any] | Unmet:
            body = await status(client)
            return body if body["upstream_fingerprint"] is not None else Unmet(body)

        body = await eventually(read, what="the upstream's identity read")
        assert body["engine"]["checks"] == {}
        assert emu.stats()["requests"] == 0


async def test_a_recipe_change_runs_the_check_again(
    make_proxy: Any, registry: CollectorRegistry
) -> None:
    stable = EmulatorConfig(token_latency_s=0.005)
    async with EmulatorServer(stable) as first:
        port = first.port
        client = await make_proxy(first.url, env=DECLARED)
        before = await check_ended(client)
        assert before["checks"]["batch_invariant"]["state"] == "passed"
    # Redeployed on the same port: another version, with batch effects.
    batched = EmulatorConfig(
        version="0.24.0", batch_divergence_slope=1.0, token_latency_s=0.005, seed=3
    )
    async with EmulatorServer(batched, port=port):
        after = await check_ended(client, checks=2)
        check = after["checks"]["batch_invariant"]
        assert check["state"] == "failed", check
        assert check["last"]["upstream"] != before["checks"]["batch_invariant"]["last"]["upstream"]
        assert [m["field"] for m in after["mismatches"]] == ["batch_invariant"]
        assert gauge(registry) == 1.0


# -- the verdicts a black-box upstream can give ---------------------------------------------------


class Scripted:
    """An OpenAI chat upstream that answers each request with the next scripted token."""

    def __init__(self, answers: list[str]) -> None:
        self.answers = answers
        self.sent = 0

    def chat(self, request: Received) -> Reply:
        token = self.answers[min(self.sent, len(self.answers) - 1)]
        self.sent += 1
        entry = {"token": token, "logprob": -0.5, "bytes": list(token.encode())}
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": token},
            "logprobs": {"content": [entry | {"top_logprobs": [entry]}]},
            "finish_reason": "stop",
        }
        return Reply.json(
            {"id": "x", "object": "chat.completion", "model": "scripted", "choices": [choice]}
        )


@pytest.mark.parametrize(
    ("answers", "state", "fact"),
    [
        (["a", "a", "a", "a", "a"], "passed", True),
        (["a", "a", "b", "a", "a", "a"], "failed", False),  # lone, 4 batched (one differs), lone
        (["a", "b", "a", "a", "a", "b"], "intrinsic", None),  # the second lone run differs
    ],
)
async def test_the_verdict_of_a_black_box_upstream(
    answers: list[str], state: str, fact: bool | None
) -> None:
    from proxy.config import AttributionConfig, AuditConfig

    scripted = Scripted(answers)
    models = Reply.json({"object": "list", "data": [{"id": "scripted"}]})
    upstream = MockUpstream(routes={"/v1/models": models, "/v1/chat/completions": scripted.chat})
    bus = EventBus()
    seen: list[EngineFactsRead] = []
    bus.subscribe(EngineFactsRead, seen.append)
    truth = EngineTruth(bus, {"batch_invariant": True}, None)
    truth.endpoints_read(EngineFacts())

    class Idle:
        inflight = 0
        started = 0

    audit = AuditConfig(cache_salt=True, quiet_settle_s=0.0, quiet_poll_s=0.005)
    check = BatchInvarianceCheck(
        truth, upstream, Idle(), audit, AttributionConfig(), follows_identity=False
    )
    check.subscribe(bus)
    check.start()
    try:

        def ended() -> str | None:
            return check.state if check.state not in ("waiting", "running") else None

        assert await eventually(ended, what="the check") == state
    finally:
        await check.close()
        await upstream.close()
    assert truth.facts.values.get("batch_invariant") is fact
    if state == "failed":
        (mismatch,) = truth.mismatches
        assert mismatch.evidence is not None
        assert mismatch.evidence["differed"] == 1
        assert mismatch.evidence["first_divergence"]["lone_token"] == "a"
        assert mismatch.evidence["first_divergence"]["batched_token"] == "b"
    else:
        assert truth.mismatches == ()
