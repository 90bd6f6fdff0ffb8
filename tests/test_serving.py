"""``detproxy serve``'s life as an operator reads it in its log: what it runs with once it
listens, one line per request with ``--access-log``, and on SIGTERM the requests drained."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.processes import EXE, free_port, wait_healthy
from tests.helpers.waiting import eventually

CHAT = {
    "model": "emulator-model",
    "temperature": 0,
    "max_tokens": 24,
    "stream": True,
    "messages": [{"role": "user", "content": "a secret prompt"}],
}


async def wait_in_flight(base: str, http: aiohttp.ClientSession, timeout_s: float = 20) -> None:
    async def inflight() -> int:
        async with http.get(base + "/detproxy/status") as resp:
            return int((await resp.json())["inflight"])

    await eventually(inflight, timeout_s=timeout_s, what="the request shown in flight")


async def test_json_lines_from_start_to_a_drained_sigterm(tmp_path: Path) -> None:
    port = free_port()
    emulator = EmulatorServer(EmulatorConfig(token_latency_s=0.05))
    async with emulator as emu:
        proc = await asyncio.create_subprocess_exec(
            EXE, "serve", "--upstream", emu.url, "--port", str(port),
            "--log-format", "json", "--access-log",
            env={"PATH": "", "DETPROXY_STATE_DIR": str(tmp_path), "DETPROXY_WORKERS": "1"},
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base + "/detproxy/health")
            async with aiohttp.ClientSession() as http:
                headers = {"X-Request-Id": "drain-me-1"}
                async with http.post(
                    base + "/v1/chat/completions", json=CHAT, headers=headers
                ) as resp:
                    await wait_in_flight(base, http)
                    proc.send_signal(signal.SIGTERM)
                    body = await resp.read()
                assert resp.status == 200 and body.endswith(b"data: [DONE]\n\n"), body[-200:]
            _, err = await asyncio.wait_for(proc.communicate(), 60)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 0, err.decode()[-2000:]
    text = err.decode()
    assert "a secret prompt" not in text
    lines = [orjson.loads(line) for line in text.splitlines()]  # every line is one JSON object
    events: dict[str, Any] = {}
    for line in lines:
        assert {"ts", "level", "logger", "msg"} <= line.keys(), line
        events.setdefault(line.get("event", ""), line)
    order = [line.get("event") for line in lines]
    assert order.index("listening") < order.index("config") < order.index("shutdown")
    assert events["listening"]["port"] == port
    access = events["request"]
    assert access["logger"] == "detproxy.access" and access["request_id"] == "drain-me-1"
    assert (access["status"], access["stream"], access["outcome"]) == (200, True, "ok")
    assert events["shutdown"]["signal"] == "SIGTERM"
    stopped = events["stopped"]
    assert (stopped["drained"], stopped["cut"]) == (1, 0), stopped


async def test_the_flat_log_level_variable_turns_on_per_request_lines(tmp_path: Path) -> None:
    port = free_port()
    async with EmulatorServer() as emu:
        proc = await asyncio.create_subprocess_exec(
            EXE, "serve", "--upstream", emu.url, "--port", str(port),
            env={"PATH": "", "DETPROXY_STATE_DIR": str(tmp_path), "DETPROXY_LOG_LEVEL": "DEBUG",
                 "DETPROXY_WORKERS": "1"},
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base + "/detproxy/health")
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    base + "/v1/chat/completions",
                    json={**CHAT, "stream": False},
                    headers={"X-Request-Id": "dbg-7"},
                ) as resp,
            ):
                assert resp.status == 200
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    text = err.decode()
    assert "DEBUG detproxy.events: chat emulator-model 200 whole deterministic" in text, text
    assert "dbg-7" in text and "a secret prompt" not in text
