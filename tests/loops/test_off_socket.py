"""A loop's decision runs in the exchange's task, never inside an upstream transport callback.

The upstream's data callback (``data_received`` -> ``on_body`` -> the relay's read) only hands
bytes on and stops reading at a trigger; the policies, the recovery budget and the events they
publish run once the task resumes. Held here by wrapping every protocol the event loop connects
with one that marks its ``data_received`` as running, and a policy and event subscribers that
note whether they were called inside one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from policies.base import Decision, PolicyChain, PolicyContext
from policies.budget import RecoveryBudget
from policies.ladder import Ladder, LoopLadderPolicy
from proxy.app import BUS, INCIDENTS
from proxy.config import DEFAULT_ATTEMPTS
from proxy.events import LoopDetected, PolicyActed, RecoveryBudgetUsed, RecoveryTokens
from proxy.observe.incident_file import IncidentFile
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import knobs
from tests.helpers.sse import sse_chunks
from tests.helpers.transport import Probe, mark_connections
from tests.helpers.waiting import eventually

MODEL = "emulator-model"
# Paced: each token its own upstream read, handed on from the data callback.
LOOP = knobs(
    loop_channel="content",
    loop_after_tokens=5,
    loop_escape_probability=1.0,
    token_latency_s=0.002,
)
RETRY = {"DETPROXY_LOOPS__POLICY": "retry", "DETPROXY_AUDIT__PASSIVE_CHECKS": "false"}


@dataclass
class NotingPolicy:
    """The default loop ladder, noting each time it is asked (it reserves the budget)."""

    inner: LoopLadderPolicy
    probe: Probe
    name: str = "noting-ladder"
    triggers_only = True

    def decide(self, ctx: PolicyContext) -> Decision:
        self.probe.note("policy")
        return self.inner.decide(ctx)


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
@pytest.mark.parametrize("mode", ["continue", "restart"])
async def test_no_policy_budget_or_event_runs_inside_a_transport_callback(
    make_proxy: Any,
    emulator: EmulatorServer,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
    mode: str,
) -> None:
    probe = Probe()
    mark_connections(monkeypatch, probe)
    put = IncidentFile.put

    def noting_put(self: IncidentFile, line: bytes) -> None:
        probe.note("incident_queued")
        put(self, line)

    monkeypatch.setattr(IncidentFile, "put", noting_put)
    policy = NotingPolicy(
        LoopLadderPolicy([Ladder(attempts=DEFAULT_ATTEMPTS)], RecoveryBudget()), probe
    )
    env = RETRY | {"DETPROXY_LOOPS__STREAM_MODE": mode}
    client = await make_proxy(emulator.url, env=env, policies=PolicyChain([policy]))
    app = client.server.app
    bus, incidents = app[BUS], app[INCIDENTS]
    for event in (LoopDetected, PolicyActed, RecoveryTokens, RecoveryBudgetUsed):
        bus.subscribe(event, lambda ev: probe.note(type(ev).__name__))
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 200,
        "messages": [{"role": "user", "content": "tell me a story"}],
        "stream": stream,
    }
    resp = await client.post("/v1/chat/completions", json=body, headers=LOOP)
    assert resp.status == 200
    if stream:
        chunks = sse_chunks(await resp.read())
        assert chunks[-1]["detproxy"]["attempts"] == 2, chunks[-1]
    else:
        assert resp.headers["X-Detproxy-Attempts"] == "2"
        await resp.read()
    # The probe saw the upstream's reads, and the recovery ran: the test can fail.
    assert probe.upstream_reads > 0, "no upstream read went through the marked protocol"
    # Queued (``put``, noted) is all a publisher does: the writer task writes it, in a thread
    # (tests/observe/test_incident_file.py holds that ``put`` writes nothing).
    await eventually(lambda: incidents.written >= 1, what="the loop incident written to its file")
    for what in ("policy", "LoopDetected", "PolicyActed", "RecoveryTokens", "incident_queued"):
        assert what in probe.calls, f"{what} never ran: {probe.calls}"
    assert probe.inside == [], f"ran inside an upstream data callback: {probe.inside}"
