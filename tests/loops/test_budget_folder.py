"""The recovery budget shared by a server's workers through their folder
(proxy/loops/budget_folder.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from policies.budget import RecoveryBudget
from proxy.loops.budget_folder import PREFIX, SUFFIX, FolderBudgetSync
from tests.helpers.waiting import eventually

MODEL = "m"


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def worker(
    directory: Path, pid: int, clock: Clock, floor: int = 100
) -> tuple[FolderBudgetSync, RecoveryBudget]:
    budget = RecoveryBudget(share=0.0, floor_tokens=floor, window_s=60)
    return FolderBudgetSync(directory, budget, 0.05, pid=pid, clock=clock), budget


def test_each_worker_decides_on_the_servers_totals(tmp_path: Path) -> None:
    clock = Clock()
    (a, a_budget), (b, b_budget) = worker(tmp_path, 1, clock), worker(tmp_path, 2, clock)
    a_budget.record_generated(MODEL, 500)
    assert a_budget.try_reserve(MODEL, 60)
    assert b_budget.use(MODEL).spent == 0  # before any sync, b does not know a's 60
    a.sync_once()
    b.sync_once()
    use = b_budget.use(MODEL)
    assert (use.generated, use.spent, use.allowed) == (500, 60, 100), use
    assert not b_budget.try_reserve(MODEL, 60), "60 + 60 is over the server's floor of 100"
    assert b_budget.try_reserve(MODEL, 40)
    b.sync_once()
    a.sync_once()
    assert a_budget.use(MODEL).spent == 100, "a holds its 60 and b's 40"
    assert a.workers == b.workers == 2


def test_a_worker_that_stopped_writing_is_left_out(tmp_path: Path) -> None:
    a_clock, b_clock = Clock(), Clock()
    (a, a_budget), (b, b_budget) = worker(tmp_path, 1, a_clock), worker(tmp_path, 2, b_clock)
    assert a_budget.try_reserve(MODEL, 80)
    a.sync_once()
    b.sync_once()
    assert b_budget.use(MODEL).spent == 80
    b_clock.now += b.stale_s + 1  # a has not written since
    b.sync_once()
    assert b_budget.use(MODEL).spent == 0, "a stale worker's totals still held"
    assert b.workers == 1


async def test_a_closed_worker_takes_its_file_and_junk_files_are_skipped(tmp_path: Path) -> None:
    clock = Clock()
    (a, a_budget), (b, b_budget) = worker(tmp_path, 1, clock), worker(tmp_path, 2, clock)
    (tmp_path / f"{PREFIX}99{SUFFIX}").write_bytes(b"{not json")
    (tmp_path / f"{PREFIX}98{SUFFIX}").write_bytes(b'{"written_at": "x"}')
    assert a_budget.try_reserve(MODEL, 30)
    a.sync_once()
    b.sync_once()
    assert b_budget.use(MODEL).spent == 30 and b.workers == 2, "junk counted or a missed"
    await a.close()
    assert not (tmp_path / f"{PREFIX}1{SUFFIX}").exists(), "a closed worker's file stayed"
    b.sync_once()
    assert b_budget.use(MODEL).spent == 0


async def test_a_missing_folder_leaves_each_worker_its_own_budget(tmp_path: Path) -> None:
    clock = Clock()
    sync, budget = worker(tmp_path / "gone", 1, clock)
    budget.set_others({MODEL: (0, 90)})  # what the others had spent, long ago
    task = asyncio.get_running_loop().create_task(sync.run())
    try:
        await eventually(lambda: sync.errors >= 2, what="two failed syncs")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await sync.close()
    assert budget.use(MODEL).spent == 0, "never synced: the others' totals are not held"
    assert budget.try_reserve(MODEL, 100), "the worker's own floor no longer serves"
    assert sync.status()["last_sync_age_s"] is None
