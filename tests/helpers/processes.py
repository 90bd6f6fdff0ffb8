"""Ports and processes: free ports, and detproxy and redis-server started as a user starts them
(the console script in a child process), waited for until they answer and stopped."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from tests.helpers.waiting import Unmet, eventually, eventually_sync

EXE = str(Path(sys.executable).with_name("detproxy"))  # the console script a user runs
ONE_WORKER_ENV = "DETPROXY_WORKERS"


def bare_env(**extra: str) -> dict[str, str]:
    """A child process's environment with nothing of the caller's but the session's state
    dir (tests/conftest.py): without it the child would keep incidents in the real home.
    One worker unless the test asks for more (``--workers N`` overrides it; the default, one
    per core, is tested in tests/test_workers.py with ``workers=None``)."""
    env = {"PATH": "", "DETPROXY_STATE_DIR": os.environ["DETPROXY_STATE_DIR"], **extra}
    if env.get(ONE_WORKER_ENV) == "":
        del env[ONE_WORKER_ENV]  # bare_env(DETPROXY_WORKERS=""): the default, one per core
    else:
        env.setdefault(ONE_WORKER_ENV, "1")
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


NEEDS_REDIS = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="redis-server (Debian package) is not installed"
)


@contextlib.contextmanager
def redis_server(folder: Path) -> Iterator[str]:
    """A real redis-server on 127.0.0.1 (no persistence), its URL while the block runs."""
    port = free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--dir", str(folder)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip

    def listening() -> bool:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        except OSError:
            return False
        return True

    try:
        eventually_sync(listening, timeout_s=10, interval_s=0.05, what="redis-server listening")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def wait_healthy(url: str, timeout_s: float = 15.0) -> None:
    async with aiohttp.ClientSession() as http:

        async def answered() -> int | Unmet:
            try:
                async with http.get(url) as resp:
                    return resp.status if resp.status == 200 else Unmet(resp.status)
            except aiohttp.ClientError as err:
                return Unmet(err)

        await eventually(answered, timeout_s=timeout_s, interval_s=0.05, what=f"{url} answers 200")


@asynccontextmanager
async def detproxy_serve(
    upstream: str, *flags: str, env: dict[str, str] | None = None, port: int | None = None
) -> AsyncIterator[tuple[str, asyncio.subprocess.Process]]:
    """detproxy as a user starts it, the console script in a child process on a free port.
    Yield (base URL, process); terminate it on exit unless the test already stopped it."""
    port = port or free_port()
    proc = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--upstream",
        upstream,
        "--port",
        str(port),
        *flags,
        env={**bare_env(), **(env or {})},
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


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    """Block until ``url`` answers 200; fail at once if ``proc`` exits first."""

    def answered() -> int | Unmet:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                return int(resp.status) if resp.status == 200 else Unmet(resp.status)
        except OSError as err:
            return Unmet(err)

    eventually_sync(answered, timeout_s=timeout, interval_s=0.2, what=f"{url} answers 200")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def run_detproxy(logdir: Path, upstream: str, config: str = "") -> Iterator[str]:
    """detproxy in front of ``upstream``, started the way a user starts it, with this TOML
    config; its log in ``logdir``. One worker (``DETPROXY_WORKERS`` in the environment asks
    for more)."""
    port = free_port()
    cfg = logdir / f"detproxy-{port}.toml"
    cfg.write_text(config)
    log = open(logdir / f"detproxy-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            EXE,
            "serve",
            "--upstream",
            upstream,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--config",
            str(cfg),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        # one worker, as bare_env gives (the default, one per core, has its own tests)
        env={**os.environ, ONE_WORKER_ENV: os.environ.get(ONE_WORKER_ENV) or "1"},
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/detproxy/health", proc, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()
