"""``detproxy serve``'s listening socket holds a burst of connections it has not accepted yet
(aiohttp's default backlog of 128 drops the rest of the SYNs: they come back 1 s, 3 s later)."""

from __future__ import annotations

import asyncio
import os
import select
import signal
import socket
import sys
import time
from pathlib import Path

from proxy.tools.emulator import EmulatorServer
from tests.helpers.processes import bare_env, free_port, wait_healthy

ROOT = Path(__file__).resolve().parents[1]
BURST = 600


def connected_within(port: int, n: int, wait_s: float) -> int:
    """Open ``n`` connections at once; how many the kernel completed within ``wait_s`` (less
    than the 1 s after which a dropped SYN is sent again)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", port))
            socks.append(s)
        poller = select.poll()
        for s in socks:
            poller.register(s, select.POLLOUT)
        done: set[int] = set()
        remaining = wait_s
        end = time.monotonic() + wait_s
        while remaining > 0 and len(done) < n:
            for fd, ev in poller.poll(remaining * 1000):
                if ev & select.POLLOUT:
                    done.add(fd)
                    poller.unregister(fd)
            remaining = end - time.monotonic()
        return len(done)
    finally:
        for s in socks:
            s.close()


async def test_a_burst_of_connections_waits_in_the_backlog() -> None:
    port = free_port()
    async with EmulatorServer() as emu:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "serve",
            "--upstream",
            emu.url,
            "--port",
            str(port),
            env={**bare_env(), "PYTHONPATH": str(ROOT)},
            cwd=ROOT,
            stderr=asyncio.subprocess.DEVNULL,
        )
        try:
            await wait_healthy(f"http://127.0.0.1:{port}/detproxy/health")
            os.kill(proc.pid, signal.SIGSTOP)  # accepts nothing: only the backlog holds them
            try:
                done = await asyncio.to_thread(connected_within, port, BURST, 0.8)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            assert done == BURST
        finally:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)
