"""``detproxy serve`` as a process: the event loop it runs on, and what it says at start."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest

from proxy.tools.emulator import EmulatorServer
from tests.helpers import EXE, detproxy_serve, free_port

CHAT = {
    "model": "emulator-model",
    "temperature": 0,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hello"}],
}


@pytest.mark.parametrize(
    ("flags", "env", "loop"),
    [
        ((), {}, "uvloop"),  # auto, with uvloop installed
        (("--event-loop", "uvloop"), {}, "uvloop"),
        (("--event-loop", "asyncio"), {}, "asyncio"),
        ((), {"DETPROXY_SERVER__EVENT_LOOP": "asyncio"}, "asyncio"),
    ],
)
async def test_serve_runs_on_the_configured_loop(
    flags: tuple[str, ...], env: dict[str, str], loop: str
) -> None:
    async with (
        EmulatorServer() as emu,
        detproxy_serve(emu.url, *flags, env=env) as (base, _),
        aiohttp.ClientSession() as http,
    ):
        async with http.get(base + "/detproxy/status") as resp:
            assert (await resp.json())["event_loop"] == loop
        # And it proxies on that loop: whole, streamed, and passed through.
        async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and (await resp.json())["choices"]
        async with http.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 200


async def test_uvloop_asked_for_but_missing_stops_serve_at_start(tmp_path: Path) -> None:
    (tmp_path / "uvloop").mkdir()
    (tmp_path / "uvloop" / "__init__.py").write_text("raise ImportError('not here')\n")
    proc = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--event-loop",
        "uvloop",
        "--port",
        str(free_port()),
        env={"PATH": "", "PYTHONPATH": str(tmp_path)},
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert 'server.event_loop is "uvloop" but uvloop cannot be imported' in err.decode()
