"""Writes coalesced per loop iteration (proxy/http/coalesce.py)."""

from __future__ import annotations

import asyncio

import pytest

from proxy.http.coalesce import WriteCoalescer


class Recorded:
    def __init__(self, log: list[str], name: str, fails: bool = False) -> None:
        self.log, self.name, self.fails = log, name, fails

    def flush(self) -> None:
        self.log.append(self.name)
        if self.fails:
            raise OSError("gone")


async def test_queued_connections_are_flushed_once_at_the_iteration_end() -> None:
    log: list[str] = []
    writes = WriteCoalescer(asyncio.get_running_loop())
    a, b = Recorded(log, "a"), Recorded(log, "b")
    writes.queue(a)
    writes.queue(b)
    assert log == []  # nothing written yet: the iteration goes on
    await asyncio.sleep(0)
    assert log == ["a", "b"]
    writes.queue(a)  # a later iteration schedules its own flush
    await asyncio.sleep(0)
    assert log == ["a", "b", "a"]


async def test_a_failing_flush_does_not_keep_the_others_from_theirs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log: list[str] = []
    writes = WriteCoalescer(asyncio.get_running_loop())
    writes.queue(Recorded(log, "a", fails=True))
    writes.queue(Recorded(log, "b"))
    await asyncio.sleep(0)
    assert log == ["a", "b"]
    assert "writing to a connection failed" in caplog.text
