"""Several processes (``serve --workers N``) appending to one incident log: every line kept,
whole, once, and each file rotated once at its size, not once per writer."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson

from proxy.observe.incident_file import IncidentFile
from proxy.tools.report.cli import rotated
from tests.helpers.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
LINE = {"kind": "audit", "pad": "x" * 80}


def lines_of(path: Path) -> list[dict[str, object]]:
    return [
        orjson.loads(x) for name in rotated(str(path)) for x in Path(name).read_bytes().splitlines()
    ]


def sizes_of(path: Path) -> dict[str, int]:
    return {Path(name).name: Path(name).stat().st_size for name in rotated(str(path))}


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


async def test_two_writers_take_turns_in_one_file_and_one_rotation(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    a, b = (IncidentFile(str(path), 1500, 50, 1000) for _ in range(2))
    a.start()
    b.start()
    for i in range(60):
        writer = a if i % 2 else b
        writer.put(orjson.dumps({**LINE, "n": i}) + b"\n")
        await writer.drained()  # in turns: the next line is the other writer's
    await a.close()
    await b.close()
    # In the order written, each once: a writer follows the other's rotation to the new file.
    assert [r["n"] for r in lines_of(path)] == list(range(60))
    sizes = sizes_of(path)
    assert all(size <= 1500 for size in sizes.values()), sizes
    # Full files: a rotation at the file's size, not at each writer's half of it.
    assert all(
        size > 1500 - 2 * len(orjson.dumps({**LINE, "n": 10}))
        for name, size in sizes.items()
        if name != "inc.jsonl"
    ), sizes
    assert names_in(tmp_path) == sorted(sizes)  # nothing else left


WRITER = """
import asyncio, os, sys, time
import orjson
from proxy.observe.incident_file import IncidentFile

async def main() -> None:
    log = IncidentFile(sys.argv[1], 4000, 5000, 100000)
    log.start()
    open(sys.argv[1] + ".ready-" + sys.argv[2], "w").close()
    go = sys.argv[1] + ".go"
    deadline = time.monotonic() + 30
    while not os.path.exists(go) and time.monotonic() < deadline:  # every writer at once
        time.sleep(0.001)
    for i in range(int(sys.argv[3])):
        line = {"kind": "audit", "writer": sys.argv[2], "n": i, "pad": "y" * 60}
        log.put(orjson.dumps(line) + b"\\n")
        if i % 20 == 0:
            await asyncio.sleep(0)  # the writer takes its batches meanwhile
    await log.close()

asyncio.run(main())
"""


def test_concurrent_processes_lose_no_line_to_a_rotation(tmp_path: Path) -> None:
    path = tmp_path / "inc.jsonl"
    count = 3000
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path), name, str(count)],
            cwd=ROOT,
            env={"PYTHONPATH": str(ROOT), "PATH": ""},
        )
        for name in "abc"
    ]
    eventually_sync(
        lambda: all((tmp_path / f"inc.jsonl.ready-{n}").exists() for n in "abc"),
        timeout_s=30,
        what="every writer ready",
    )
    (tmp_path / "inc.jsonl.go").touch()  # then all of them at once
    assert [p.wait(timeout=60) for p in procs] == [0, 0, 0]
    records = lines_of(path)
    for name in "abc":
        mine = [r["n"] for r in records if r["writer"] == name]
        assert mine == list(range(count)), (
            f"writer {name}: {len(mine)} lines, in order: {mine == sorted(mine)}"
        )
    assert all(Path(n).stat().st_size <= 4000 for n in rotated(str(path)))
