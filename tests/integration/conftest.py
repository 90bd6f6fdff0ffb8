"""Real parts: llama.cpp's llama-server (built from the llama-cpp-python sdist), SmolLM2-135M,
detproxy started by its own console script, and the official openai SDK as the client."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args!r} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not ready after {timeout}s")


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass(frozen=True)
class Engine:
    url: str  # base URL of llama-server, e.g. http://127.0.0.1:PORT
    model: str


def reasoning_template() -> str:
    """QwQ's chat template from the vendored llama.cpp: it opens a <think> block."""
    server, _ = engine_paths()
    src = os.environ.get("LLAMA_SRC") or str(Path(server).parents[2] / "src/vendor/llama.cpp")
    return str(Path(src) / "models/templates/Qwen-QwQ-32B.jinja")


def engine_paths() -> tuple[str, str]:
    server, gguf = os.environ.get("LLAMA_SERVER"), os.environ.get("SMOLLM2_GGUF")
    if server and gguf:
        return server, gguf
    out = subprocess.run(
        ["bash", str(HERE / "build_llama_server.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    ).stdout
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return found["LLAMA_SERVER"], found["SMOLLM2_GGUF"]


@contextlib.contextmanager
def run_engine(logdir: Path, *args: str) -> Iterator[Engine]:
    """llama-server on a free loopback port with these extra arguments."""
    server, gguf = engine_paths()
    port = free_port()
    log = open(logdir / f"llama-server-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            server,
            "-m",
            gguf,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "-t",
            "2",
            "-a",
            "smollm2",
            "--no-webui",
            "--metrics",
            *args,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", proc)
        yield Engine(url=f"http://127.0.0.1:{port}", model="smollm2")
    finally:
        stop(proc)
        log.close()


@contextlib.contextmanager
def run_detproxy(logdir: Path, upstream: str, config: str = "") -> Iterator[str]:
    """detproxy in front of ``upstream``, started the way a user starts it."""
    port = free_port()
    exe = Path(sys.executable).with_name("detproxy")
    cfg = logdir / f"detproxy-{port}.toml"
    cfg.write_text(config)
    log = open(logdir / f"detproxy-{port}.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            str(exe),
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
    )
    try:
        wait_http(f"http://127.0.0.1:{port}/detproxy/health", proc, timeout=30)
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(proc)
        log.close()


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # Two slots with per-slot KV (kv_unified off): batch-invariant, so the direct and the
    # proxied answer to one greedy request can be compared bit for bit.
    with run_engine(tmp_path_factory.mktemp("engine"), "-np", "2", "-c", "4096") as eng:
        yield eng


@pytest.fixture(scope="session")
def detproxy_url(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_detproxy(tmp_path_factory.mktemp("detproxy"), engine.url) as url:
        yield url
