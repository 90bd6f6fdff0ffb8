"""Turns on the engine: shadows within the server's slots, a triage experiment alone, in one
process and across processes sharing a folder."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.audit.turns import EngineTurns, LocalTurns, SharedTurns, engine_turns
from tests.helpers.waiting import eventually, eventually_sync

ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.005


def pair(kind: str, folder: Path, slots: int) -> tuple[EngineTurns, EngineTurns]:
    """Two views of one server's turns: one object in a process, or two workers' files."""
    if kind == "local":
        one = LocalTurns(slots)
        return one, one
    return SharedTurns(str(folder), slots), SharedTurns(str(folder), slots)


def refused(turns: EngineTurns) -> bool:
    """No shadow may start now (one that could is given back at once)."""
    turn = turns.try_shadow()
    if turn is not None:
        turn.release()
    return turn is None


KINDS = pytest.mark.parametrize("kind", ["local", "shared"])


@KINDS
def test_shadows_take_at_most_the_servers_slots(kind: str, tmp_path: Path) -> None:
    a, b = pair(kind, tmp_path, slots=2)
    first, second = a.try_shadow(), b.try_shadow()
    assert first is not None and second is not None
    assert a.try_shadow() is None and b.try_shadow() is None, "a third shadow got a slot of 2"
    first.release()
    first.release()  # twice: harmless, frees nothing more
    third = b.try_shadow()
    assert third is not None and a.try_shadow() is None
    second.release()
    third.release()


@KINDS
async def test_an_experiment_waits_for_the_shadows_and_holds_new_ones_back(
    kind: str, tmp_path: Path
) -> None:
    a, b = pair(kind, tmp_path, slots=2)
    shadow = a.try_shadow()
    assert shadow is not None
    waiting = asyncio.create_task(b.experiment(POLL_S))
    await eventually(lambda: refused(a), what="new shadows held behind it")
    await asyncio.sleep(0.05)  # what is under test: it keeps waiting while a shadow is sent
    assert not waiting.done(), "the experiment started beside a shadow on the wire"
    shadow.release()
    experiment = await asyncio.wait_for(waiting, timeout=10)
    assert refused(a) and refused(b), "a shadow beside the experiment"
    experiment.release()
    again = await eventually(a.try_shadow, what="shadows go on after the experiment")
    again.release()


@KINDS
async def test_experiments_run_one_at_a_time(kind: str, tmp_path: Path) -> None:
    a, b = pair(kind, tmp_path, slots=1)
    first = await asyncio.wait_for(a.experiment(POLL_S), timeout=10)
    second = asyncio.create_task(b.experiment(POLL_S))
    await asyncio.sleep(0.05)  # what is under test: the second waits while the first runs
    assert not second.done(), "two experiments held the engine at once"
    first.release()
    (await asyncio.wait_for(second, timeout=10)).release()


async def test_a_cancelled_wait_gives_its_place_back(tmp_path: Path) -> None:
    for a, b in (pair("local", tmp_path, 1), pair("shared", tmp_path, 1)):
        shadow = a.try_shadow()
        assert shadow is not None
        waiting = asyncio.create_task(b.experiment(POLL_S))
        await eventually(lambda a=a: refused(a), what="the experiment waiting")
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        shadow.release()
        again = a.try_shadow()
        assert again is not None, "a cancelled experiment still held shadows back"
        again.release()


HOLDER = """
import asyncio, sys, time
from proxy.audit.turns import SharedTurns

async def main() -> None:
    await SharedTurns(sys.argv[1], 1).experiment(0.005)
    open(sys.argv[1] + "/held", "w").close()
    time.sleep(60)  # killed meanwhile

asyncio.run(main())
"""


def test_a_worker_that_dies_holding_the_engine_releases_it(tmp_path: Path) -> None:
    folder = tmp_path / "turns"
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], cwd=ROOT, env={"PYTHONPATH": str(ROOT)}
    )
    try:
        eventually_sync(lambda: (folder / "held").exists(), timeout_s=30, what="child holding")
        turns = SharedTurns(str(folder), 1)
        assert turns.try_shadow() is None, "a shadow while another worker's experiment ran"
        child.kill()
        child.wait(timeout=30)
        shadow = eventually_sync(turns.try_shadow, timeout_s=10, what="the dead worker's turn")
        shadow.release()
    finally:
        child.kill()
        child.wait(timeout=30)


def test_several_processes_share_a_folder_one_keeps_it_in_memory(tmp_path: Path) -> None:
    assert isinstance(engine_turns(4, 1, str(tmp_path)), LocalTurns)
    assert isinstance(engine_turns(4, 3, None), LocalTurns)
    shared = engine_turns(4, 3, str(tmp_path))
    assert isinstance(shared, SharedTurns) and (tmp_path / "turns").is_dir()
