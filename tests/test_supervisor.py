"""The supervisor over stand-in workers (shell commands): restarts with a growing delay
for a worker that keeps dying at start, and a worker that ignores SIGTERM killed after its
grace."""

from __future__ import annotations

import logging
import re
import threading

import pytest

from proxy.workers import Supervisor


def run_for(supervisor: Supervisor, seconds: float) -> int:
    timer = threading.Timer(seconds, supervisor.stop)  # what SIGTERM does
    timer.start()
    try:
        return supervisor.run()
    finally:
        timer.cancel()


def test_a_worker_that_dies_at_start_is_restarted_later_each_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    crash = ["/bin/sh", "-c", "exit 3"]
    caplog.set_level(logging.INFO, "detproxy.workers")
    assert run_for(Supervisor(crash, 1, grace_s=1.0, poll_s=0.01), 2.5) == 0
    exits = re.findall(
        r"exited with code 3; restarting it in ([\d.]+)s \(restart (\d+)\)", caplog.text
    )
    assert len(exits) >= 3
    assert [float(d) for d, _ in exits[:3]] == [0.2, 0.4, 0.8]  # doubling, not a busy loop
    assert [int(n) for _, n in exits] == list(range(1, len(exits) + 1))


def test_a_worker_that_ignores_sigterm_is_killed_after_its_grace(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # SIGTERM ignored, and still ignored after exec: one process, no orphan to leave behind.
    stubborn = ["/bin/sh", "-c", "trap '' TERM; exec sleep 60"]
    caplog.set_level(logging.INFO, "detproxy.workers")
    supervisor = Supervisor(stubborn, 2, grace_s=0.2, poll_s=0.01, exit_margin_s=0.1)
    assert run_for(supervisor, 1.0) == 0
    assert caplog.text.count("did not stop within its grace; killed") == 2
    assert list(supervisor.live()) == []
