"""The sidecar's first day against the real llama.cpp engine: detproxy started before its
engine, then the engine restarted on the same port: no upstream change, one restart."""

from __future__ import annotations

import contextlib
import json
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.llama_server import engine_paths
from tests.helpers.metrics import scrape
from tests.helpers.processes import free_port, run_detproxy, stop, wait_http
from tests.helpers.waiting import eventually_sync

pytestmark = pytest.mark.integration

COUNTS = ("detproxy_upstream_changes_total", "detproxy_upstream_restarts_total")


@contextlib.contextmanager
def llama_server(logdir: Path, port: int) -> Iterator[None]:
    """llama-server on ``port`` (a fixed one: a restart comes back where it was)."""
    server, gguf = engine_paths()
    with open(logdir / f"llama-server-{port}-{time.monotonic_ns()}.log", "wb") as log:
        proc = subprocess.Popen(
            [server, "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
             "-a", "smollm2", "--no-webui", "--metrics"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        try:
            wait_http(f"http://127.0.0.1:{port}/health", proc)
            yield
        finally:
            stop(proc)


def state_of(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/detproxy/status", timeout=5) as resp:
        state: dict[str, Any] = json.load(resp)["upstream_state"]
        return state


def test_started_before_llama_server_and_llama_server_restarted(tmp_path: Path) -> None:
    port = free_port()
    config = "[upstream]\nfingerprint_interval_s = 0.2\n"
    with run_detproxy(tmp_path, f"http://127.0.0.1:{port}", config) as url:
        eventually_sync(
            lambda: state_of(url)["state"] == "waiting", timeout_s=30, what="waiting for the engine"
        )
        with llama_server(tmp_path, port):
            eventually_sync(lambda: state_of(url)["state"] == "up", timeout_s=30, what="up")
            metrics = scrape(url + "/detproxy/metrics", "detproxy_upstream_")
            assert [metrics[name] for name in COUNTS] == [0, 0], metrics
            assert metrics["detproxy_upstream_up"] == 1
            with urllib.request.urlopen(url + "/detproxy/status", timeout=5) as resp:
                assert json.load(resp)["upstream_fingerprint"]["kind"] == "llama.cpp"
        eventually_sync(lambda: state_of(url)["state"] == "down", timeout_s=30, what="down")
        assert (
            scrape(url + "/detproxy/metrics", "detproxy_upstream_up")["detproxy_upstream_up"] == 0
        )
        with llama_server(tmp_path, port):
            eventually_sync(lambda: state_of(url)["restarts"] == 1, timeout_s=30, what="restarted")
            metrics = scrape(url + "/detproxy/metrics", "detproxy_upstream_")
            assert [metrics[name] for name in COUNTS] == [0, 1], metrics
            assert state_of(url)["state"] == "up"
    log = next(tmp_path.glob("detproxy-*.log")).read_text()
    assert "upstream changed" not in log, log
    assert log.count("restarted: the same identity (llama.cpp ") == 1, log
