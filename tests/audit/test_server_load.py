"""The server's client traffic summed over its workers (``serve --workers N``): each worker
writes its own counts, every worker reads them all, a dead worker's count is not company."""

from __future__ import annotations

import asyncio
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.audit.server_load import SharedLoad, shared_load
from proxy.config import load_settings
from proxy.testing import MockUpstream, Reply
from proxy.workers import MULTIPROC_ENV, WORKER, WorkerIdentity
from tests.helpers.served import ServedApp
from tests.helpers.upstreams import MOCK_URL
from tests.helpers.waiting import Unmet, eventually


def test_each_worker_reads_every_workers_counts(tmp_path: Path) -> None:
    path = str(tmp_path / "load.bin")
    one, two = SharedLoad(path, 0, 3), SharedLoad(path, 1, 3)
    try:
        one.publish(2, 5)
        two.publish(1, 7)
        assert (one.inflight, one.started) == (3, 12), "worker one does not see worker two's"
        assert (two.inflight, two.started) == (3, 12)
        assert two.inflight_now() == 3
        two.publish(0, 7)
        assert one.inflight == 2
    finally:
        one.close()
        two.close()


def test_a_dead_workers_requests_are_no_company(tmp_path: Path) -> None:
    path = tmp_path / "load.bin"
    live = SharedLoad(str(path), 0, 2)
    try:
        gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, check=True, text=True)  # fmt: skip
        dead_pid = int(gone.stdout)
        with path.open("r+b") as f:  # worker 1 died with 4 requests in flight
            f.seek(struct.calcsize("<qqq"))
            f.write(struct.pack("<qqq", dead_pid, 4, 9))
        assert live.inflight == 0, "a dead worker's in-flight requests were counted"
        assert live.started == 9  # what it started still tells a shadow nothing new came
    finally:
        live.close()


def test_a_restarted_worker_starts_from_nothing_in_flight(tmp_path: Path) -> None:
    path = str(tmp_path / "load.bin")
    before = SharedLoad(path, 1, 2)
    before.publish(3, 3)
    before.close()
    after, other = SharedLoad(path, 1, 2), SharedLoad(path, 0, 2)
    try:
        assert other.inflight == 0, "the restarted worker's slot kept its predecessor's count"
    finally:
        after.close()
        other.close()


def test_a_request_finishing_after_close_writes_without_error(tmp_path: Path) -> None:
    load = SharedLoad(str(tmp_path / "load.bin"), 0, 2)
    load.publish(1, 1)
    load.close()
    load.publish(0, 1)  # the app stopped while this request was on its way out
    assert load.inflight == 0
    load.close()  # twice is harmless


def test_a_worker_index_outside_the_slots_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="worker index 2 is not below the 2 slots"):
        SharedLoad(str(tmp_path / "load.bin"), 2, 2)


def test_one_process_counts_its_own(tmp_path: Path) -> None:
    assert shared_load(1, str(tmp_path), 0) is None
    assert shared_load(2, None, 0) is None
    assert shared_load(2, str(tmp_path), None) is None
    both = shared_load(2, str(tmp_path), 1)
    assert both is not None
    both.close()


async def test_a_workers_requests_in_flight_are_in_the_servers_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, aiohttp_client: Any
) -> None:
    """Worker 0 of two, as ``serve --workers 2`` starts it: a request it answers is in the
    count worker 1 reads while it runs, and gone from it after."""
    monkeypatch.setenv(MULTIPROC_ENV, str(tmp_path))
    release = asyncio.Event()
    mock = MockUpstream(routes={})

    async def slow(_: Any) -> Reply:
        await release.wait()
        return Reply.json({"choices": []})

    mock.on("/v1/chat/completions", slow)
    settings = load_settings(
        env={"DETPROXY_WORKERS": "2"},
        flags={"upstream": MOCK_URL},
    )
    app = build_app(settings, registry=CollectorRegistry(), upstream=mock)
    app[WORKER] = WorkerIdentity(0, 2)
    other = SharedLoad(os.path.join(tmp_path, "load.bin"), 1, 2)
    try:
        async with mock:
            client = await aiohttp_client(ServedApp(app, settings))
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            sending = asyncio.create_task(client.post("/v1/chat/completions", json=body))

            def one_in_flight() -> int | Unmet:
                return other.inflight if other.inflight == 1 else Unmet(other.inflight)

            await eventually(one_in_flight, timeout_s=10, what="worker 0's request in the count")
            release.set()
            resp = await sending
            assert resp.status == 200
            await resp.read()

            def none_in_flight() -> bool | Unmet:
                return True if other.inflight == 0 else Unmet(other.inflight)

            await eventually(none_in_flight, timeout_s=10, what="worker 0's request gone")
    finally:
        other.close()
