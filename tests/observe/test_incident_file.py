"""The incident log's file has its own writer: a published incident is queued, never written in
the publisher's call; the writer task writes every line in order, rotates, drops and counts
what a full queue cannot take, and a graceful stop writes what is queued."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import orjson
import pytest

from proxy.audit.compare import Verdict
from proxy.config import IncidentConfig
from proxy.events import AuditCompleted, EventBus
from proxy.observe.incident_file import IncidentFile
from proxy.observe.incidents import IncidentLog
from tests.helpers.waiting import eventually


def line(i: int) -> bytes:
    return orjson.dumps({"kind": "audit", "request_id": f"r{i}", "pad": "x" * 40}) + b"\n"


def ids(*paths: Path) -> list[str]:
    return [orjson.loads(x)["request_id"] for p in paths for x in p.read_bytes().splitlines()]


def sizes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in folder.iterdir()}


def audit(i: int) -> AuditCompleted:
    verdict = Verdict("text_divergence", None, None, None, "p", "s", 1, 1)
    return AuditCompleted(
        f"r{i}", "m", "chat", "full", 0, verdict, "k", 1, 0, 0.1, 0.1, "same", time.time()
    )


async def test_publishing_an_incident_writes_nothing_in_the_publishers_call(
    tmp_path: Path,
) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path)))
    bus = EventBus()
    log.subscribe(bus)
    log.start()
    bus.publish(audit(1))  # no await between this and the checks: the writer cannot have run
    assert [r["request_id"] for r in log.recent(5)] == ["r1"], "the ring is not updated at once"
    assert path.read_bytes() == b"", "the publisher's call wrote the file"
    assert log.file_status() == {"written": 0, "queued": 1, "dropped": 0}
    await eventually(lambda: log.written == 1, what="the writer task wrote the incident")
    assert ids(path) == ["r1"]
    await log.close()


async def test_the_writer_writes_every_line_in_order_across_batches(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    out = IncidentFile(str(path), max_bytes=10**9, backups=1, queue_lines=1000)
    out.start()
    for i in range(300):
        out.put(line(i))
        if i % 7 == 0:
            await asyncio.sleep(0)  # let the writer take a batch in hand meanwhile
    await eventually(lambda: out.written == 300, what="300 lines written")
    assert ids(path) == [f"r{i}" for i in range(300)]
    assert 1 < out.writes < 300, f"{out.writes} writes: the lines were not batched"
    assert (out.queued, out.dropped) == (0, 0)
    await out.close()


async def test_the_writer_rotates_keeping_the_order(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    out = IncidentFile(str(path), max_bytes=500, backups=2, queue_lines=1000)
    out.start()
    for i in range(40):
        out.put(line(i))
        if i % 5 == 0:
            await eventually(lambda n=i + 1: out.written == n, what=f"{i + 1} lines written")
    await out.close()
    assert sorted(sizes(tmp_path)) == ["inc.jsonl", "inc.jsonl.1", "inc.jsonl.2"]
    kept = ids(tmp_path / "inc.jsonl.2", tmp_path / "inc.jsonl.1", path)
    assert kept == [f"r{i}" for i in range(40 - len(kept), 40)]  # the oldest fell off, in order
    assert max(sizes(tmp_path).values()) <= 500, sizes(tmp_path)


async def test_a_graceful_stop_writes_what_is_queued(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    out = IncidentFile(str(path), max_bytes=10**9, backups=1, queue_lines=1000)
    out.start()
    for i in range(200):
        out.put(line(i))
    await asyncio.sleep(0)  # the writer takes the first lines in hand ...
    for i in range(200, 400):
        out.put(line(i))  # ... and these wait in the queue when the stop comes
    await out.close()
    assert ids(path) == [f"r{i}" for i in range(400)]
    assert out.written == 400
    out.put(line(400))  # after the stop: not queued, not written
    assert (out.queued, ids(path)[-1]) == (0, "r399")


async def test_a_full_queue_drops_and_counts_never_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "inc.jsonl"
    log = IncidentLog(IncidentConfig(path=str(path), queue_lines=3))
    bus = EventBus()
    log.subscribe(bus)
    with caplog.at_level(logging.WARNING, logger="proxy.observe.incident_file"):
        for i in range(5):  # the writer is not running: nothing empties the queue
            bus.publish(audit(i))
    assert log.file_status() == {"written": 0, "queued": 3, "dropped": 2}
    assert log.failures() == {"queue_full": 2}
    assert len(log.recent(10)) == 5, "the ring lost what the file's queue dropped"
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "dropped and counted" in warning.getMessage()
    log.start()
    await eventually(lambda: log.written == 3, what="the queued lines written")
    assert ids(path) == ["r0", "r1", "r2"]
    await log.close()


async def test_a_log_in_memory_only_has_no_writer(tmp_path: Path) -> None:
    log = IncidentLog(IncidentConfig(path=""))
    log.start()
    log.write({"kind": "tally"})
    assert log.file_status() == {"written": 0, "queued": 0, "dropped": 0}
    assert log.failures() == {}
    await log.close()
