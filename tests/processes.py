"""detproxy as a user starts it: the console script in a child process, on a free port."""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp

EXE = str(Path(sys.executable).with_name("detproxy"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def wait_healthy(url: str, attempts: int = 200) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(attempts):
            try:
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise TimeoutError(f"{url} did not answer 200")


@asynccontextmanager
async def detproxy_serve(
    upstream: str, *flags: str, env: dict[str, str] | None = None, port: int | None = None
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """Yield (base URL, process); terminate it on exit unless the test already stopped it."""
    port = port or free_port()
    proc = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        *flags,
        env={"PATH": "", **(env or {})},
        stderr=asyncio.subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(base + "/detproxy/health")
        yield base, proc
    finally:
        if proc.returncode is None:
            proc.terminate()
            await asyncio.wait_for(proc.wait(), 30)


def own_tasks() -> int:
    """Tasks in this loop other than aiohttp's per-connection handlers: idle keep-alive
    connections keep theirs until the keep-alive timeout (pooled, not leaked)."""
    return sum(
        1
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") != "RequestHandler.start"
    )
