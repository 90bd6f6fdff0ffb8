"""SIGTERM: stop accepting, let in-flight requests finish within the grace period, flush the
incident log, exit."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import aiohttp
import orjson

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.processes import detproxy_serve


async def test_sigterm_drains_in_flight_streams_and_flushes(tmp_path: Path) -> None:
    incidents = tmp_path / "incidents.jsonl"
    config = tmp_path / "detproxy.toml"
    config.write_text(f'[incidents]\npath = "{incidents}"\n[server]\nshutdown_grace_s = 20\n')
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": 100,
        "stream": True,
        "messages": [{"role": "user", "content": "drain me"}],
    }
    async with (
        EmulatorServer(EmulatorConfig(token_latency_s=0.01)) as emu,
        detproxy_serve(emu.url, "--config", str(config)) as (base, proc),
        aiohttp.ClientSession() as http,
    ):
        resp = await http.post(base + "/v1/chat/completions", json=body)
        first = await resp.content.readuntil(b"\n\n")  # the stream is under way
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        rest = await resp.content.read()  # ~1 s of tokens still to come
        drained = time.monotonic() - t0
        assert (first + rest).endswith(b"data: [DONE]\n\n")
        assert drained > 0.3  # it really was still streaming when SIGTERM came
        try:  # no new connection once draining started (more than 0.3 s ago)
            async with (
                aiohttp.ClientSession() as fresh,
                fresh.get(base + "/detproxy/health") as late,
            ):
                refused = late.status >= 500
        except aiohttp.ClientError:
            refused = True
        assert refused
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    lines = [orjson.loads(x) for x in incidents.read_bytes().splitlines()]
    assert lines and lines[-1]["kind"] == "tally"  # flushed at shutdown
