"""Workers' files: each one's status and ring, written whole, read by the others."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from proxy.events import EventBus, ShadowDropped
from proxy.observe.fleet import EVERY_S, Fleet, stale_files
from tests.helpers.waiting import Unmet, eventually


def test_each_reads_the_others_and_not_itself(tmp_path: Path) -> None:
    a, b = Fleet(tmp_path, pid=11, clock=lambda: 5.0), Fleet(tmp_path, pid=12)
    a.publish({"index": 0, "status": {"n": 1}}, [{"ts": 1.0}])
    b.publish({"index": 1, "status": {"n": 2}}, None)  # no ring yet
    (seen,) = b.others()
    assert (seen.pid, seen.written_at, seen.status["status"], seen.records) == (
        11,
        5.0,
        {"n": 1},
        [{"ts": 1.0}],
    )
    (seen,) = a.others()
    assert seen.pid == 12 and seen.records == []
    a.publish({"index": 0, "status": {"n": 3}}, None)  # the ring unchanged: kept as it was
    (seen,) = b.others()
    assert seen.status["status"] == {"n": 3} and seen.records == [{"ts": 1.0}]
    assert sorted(p.name for p in stale_files(tmp_path)) == [
        "incidents-11.json",
        "status-11.json",
        "status-12.json",
    ]


def test_a_broken_or_foreign_file_is_skipped(tmp_path: Path) -> None:
    (tmp_path / "status-13.json").write_text("{half")
    (tmp_path / "status-x.json").write_text("{}")
    (tmp_path / "counter_13.db").write_bytes(b"\0")  # prometheus_client's: not ours
    assert Fleet(tmp_path, pid=1).others() == []


async def test_a_count_is_published_soon_not_a_second_later(tmp_path: Path) -> None:
    bus, mine = EventBus(), Fleet(tmp_path, pid=21)
    mine.subscribe(bus)
    count = {"n": 0}
    reader = Fleet(tmp_path, pid=22)

    def published() -> Any:
        (other,) = reader.others() or [None]
        if other is None or other.status["status"]["n"] != count["n"]:
            return Unmet(other)
        return other

    task = asyncio.create_task(
        mine.run(lambda: {"index": 0, "status": dict(count)}, lambda: [], lambda: 0)
    )
    try:
        await eventually(published, timeout_s=5, what="the first publication")
        count["n"] = 1
        bus.publish(ShadowDropped("m", "rate_limit"))
        await eventually(published, timeout_s=EVERY_S / 2, what="the count published at once")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
