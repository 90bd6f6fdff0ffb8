"""Upstream faults at every stage of a response, streamed and not, while audits and loop
retries are in flight: the client gets the documented outcome, shadows never change a
primary, and no task or upstream connection is left behind."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
from prometheus_client import CollectorRegistry

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.metrics import metric
from tests.helpers.served import own_tasks
from tests.helpers.waiting import Unmet, eventually, settle

FAULTS = [
    "reset_mid_stream",
    "http_500",
    "http_503",
    "malformed_sse",
    "malformed_json",
    "inband_error",
]


@pytest.mark.parametrize("stream", [True, False])
async def test_faults_while_audits_and_retries_run(
    make_proxy: Any, registry: CollectorRegistry, stream: bool
) -> None:
    async with EmulatorServer(EmulatorConfig(token_latency_s=0.001)) as emu:
        client = await make_proxy(
            emu.url,
            env={
                "DETPROXY_AUDIT__SAMPLE_RATE": "1",
                "DETPROXY_LOOPS__POLICY": "retry",
                "DETPROXY_LOOPS__RECOVERY_TOKEN_FLOOR": "10000000",
            },
        )
        await client.get("/detproxy/health")
        before = own_tasks()
        body = {
            "model": "emulator-model",
            "temperature": 0,
            "max_tokens": 40,
            "stream": stream,
            "messages": [{"role": "user", "content": "faults"}],
        }

        async def call(knobs: dict[str, Any]) -> tuple[int, bytes]:
            headers = {"X-Emulator-Knobs": orjson.dumps(knobs).decode()} if knobs else {}
            resp = await client.post("/v1/chat/completions", json=body, headers=headers)
            return resp.status, await resp.read()

        # Background: clean audited requests and looping ones being retried, all the while.
        background = [call({}) for _ in range(6)] + [
            call({"loop_channel": "content", "loop_after_tokens": 3}) for _ in range(4)
        ]
        faulted = [call({"fault": f, "fault_after_tokens": 5}) for f in FAULTS]
        results = await asyncio.gather(*background, *faulted)
        await settle(client)

        def left_behind() -> tuple[int, int] | Unmet:
            now = (own_tasks(), emu.stats()["running"])  # tasks, upstream requests
            return now if now[0] <= before and now[1] == 0 else Unmet(now)

        # The handlers' last steps run after their answers: none may be left.
        await eventually(left_behind, what=f"no task (of {before}), no upstream request left")

    clean, loops, faults = results[:6], results[6:10], dict(zip(FAULTS, results[10:], strict=True))
    assert all(s == 200 for s, _ in clean + loops)
    if stream:
        assert all(raw.endswith(b"data: [DONE]\n\n") for _, raw in clean + loops)
        reset = faults["reset_mid_stream"][1]
        assert faults["reset_mid_stream"][0] == 200 and b'"code":502' in reset  # in-band error
        assert reset.endswith(b"data: [DONE]\n\n")
        for name in ("malformed_sse", "malformed_json", "inband_error"):
            assert faults[name][0] == 200 and faults[name][1].endswith(b"data: [DONE]\n\n")
    else:
        assert all(orjson.loads(raw)["choices"] for _, raw in clean)
        assert faults["reset_mid_stream"][0] == 502
        assert faults["inband_error"][0] == 500  # the upstream's own error, relayed
    assert faults["http_500"][0] == 500 and faults["http_503"][0] == 503  # relayed as they were
    assert (
        metric(
            registry, "detproxy_responses_total", endpoint="chat", code="500", outcome="proxy_error"
        )
        == 0
    )
