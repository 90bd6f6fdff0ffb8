"""The real engine of the integration tests: llama.cpp's llama-server with SmolLM2-135M, built
(tests/integration/build_llama_server.sh) or named by LLAMA_SERVER and SMOLLM2_GGUF."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.metrics import scrape
from tests.helpers.processes import free_port, stop, wait_http
from tests.helpers.waiting import Unmet, eventually_sync

TESTS = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Engine:
    url: str  # base URL of llama-server, e.g. http://127.0.0.1:PORT
    model: str


def engine_paths() -> tuple[str, str]:
    """(llama-server binary, GGUF): from LLAMA_SERVER and SMOLLM2_GGUF, else built."""
    server, gguf = os.environ.get("LLAMA_SERVER"), os.environ.get("SMOLLM2_GGUF")
    if server and gguf:
        return server, gguf
    out = subprocess.run(
        ["bash", str(TESTS / "integration" / "build_llama_server.sh")],
        check=True,
        capture_output=True,
        text=True,
        timeout=3600,
    ).stdout
    found = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    return found["LLAMA_SERVER"], found["SMOLLM2_GGUF"]


def reasoning_template() -> str:
    """QwQ's chat template from the vendored llama.cpp: it opens a <think> block."""
    server, _ = engine_paths()
    src = os.environ.get("LLAMA_SRC") or str(Path(server).parents[2] / "src/vendor/llama.cpp")
    return str(Path(src) / "models/templates/Qwen-QwQ-32B.jinja")


def engine_busy(engine: Engine) -> float:
    """The requests llama-server is processing now (``llamacpp:requests_processing``)."""
    for value in scrape(engine.url + "/metrics", "llamacpp:requests_processing").values():
        return value
    raise AssertionError("llama-server exported no llamacpp:requests_processing")


def wait_engine_idle(engine: Engine, timeout_s: float = 120.0) -> None:
    """Until llama-server processes nothing: a request its client left may still generate."""

    def idle() -> bool | Unmet:
        busy = engine_busy(engine)
        return busy == 0 or Unmet(busy)

    eventually_sync(idle, timeout_s=timeout_s, interval_s=0.1, what="llama-server idle")


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
