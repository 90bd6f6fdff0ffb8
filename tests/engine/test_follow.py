"""The engine log followed as a file: from its start, waited for, across rotation and
truncation, with bounded lines; its facts merged with the endpoints' and held against
[upstream.expect]."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path
from typing import Any

import pytest

from proxy.engine.facts import EngineFacts
from proxy.engine.follow import EngineLogFollower, EngineTruth, merge, moved
from proxy.events import EngineFactsRead, EventBus
from tests.helpers.waiting import eventually

FIXTURES = Path(__file__).parent / "fixtures"
REFERENCE = Path("/work/shared/reference/engine-logs")


def engine_log(name: str) -> Path:
    """One of the real vLLM 0.23.0 logs (T1 copies them into fixtures/)."""
    for folder in (FIXTURES, REFERENCE):
        if (folder / name).exists():
            return folder / name
    pytest.skip(f"{name} is in neither {FIXTURES} nor {REFERENCE}")


class Lines:
    """A reader that keeps every line fed (the follower's mechanics, apart from parsing)."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.read_lines = 0
        self.ignored_lines = 0

    def feed(self, line: str) -> bool:
        self.lines.append(line)
        self.read_lines += 1
        return True

    @property
    def facts(self) -> EngineFacts:
        return EngineFacts({"lines": len(self.lines)}, {}, (), (), (), False)


def follower(path: Path, **kw: Any) -> tuple[EngineLogFollower, Lines, EngineTruth]:
    truth = EngineTruth(EventBus(), {}, str(path))
    lines = Lines()
    return EngineLogFollower(str(path), truth, poll_s=0.01, reader=lines, **kw), lines, truth


async def running(f: EngineLogFollower) -> asyncio.Task[None]:
    return asyncio.create_task(f.run(), name="test-follow")


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert task.cancelled(), f"the follower ended on its own: {task}"


async def test_a_file_that_appears_late_is_read_from_its_start_line_by_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.engine.follow")
    path = tmp_path / "vllm.log"
    f, lines, _ = follower(path)
    task = await running(f)
    try:
        await eventually(lambda: "waiting for engine log" in caplog.text, what="the follower waits")
        with path.open("w") as out:
            out.write("one\ntw")
            out.flush()
            await eventually(lambda: lines.lines == ["one"], what="the first line read")
            out.write("o\nthree\n")
            out.flush()
            await eventually(lambda: lines.lines == ["one", "two", "three"], what="three lines")
    finally:
        await stop(task)
    assert caplog.text.count("waiting for engine log") == 1, caplog.text


async def test_rotation_by_rename_and_truncation_are_followed(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    path.write_text("a\nb\n")
    f, lines, _ = follower(path)
    task = await running(f)
    try:
        await eventually(lambda: lines.lines == ["a", "b"], what="the first file")
        with path.open("a") as out:  # written just before the rotation: still read
            out.write("c\n")
        os.rename(path, tmp_path / "vllm.log.1")
        path.write_text("d\n")
        await eventually(lambda: lines.lines == ["a", "b", "c", "d"], what="the rotated file")
        assert f.reopened == 1
        path.write_text("")  # truncated in place (copytruncate)
        await eventually(lambda: f.reopened == 2, what="the truncation seen")
        with path.open("a") as out:
            out.write("e\n")
        await eventually(lambda: lines.lines[-1:] == ["e"], what="the truncated file read")
    finally:
        await stop(task)
    assert lines.lines == ["a", "b", "c", "d", "e"], "each line once"


async def test_a_huge_line_is_cut_and_counted_and_memory_stays_bounded(tmp_path: Path) -> None:
    path = tmp_path / "vllm.log"
    f, lines, _ = follower(path, max_line=100, chunk=64)
    path.write_text("before\n" + "x" * 10_000 + "\nafter\n" + "y" * 500)
    task = await running(f)
    try:
        await eventually(lambda: "after" in lines.lines, what="the line after the huge one")
        await eventually(lambda: f.cut_lines == 2, what="the unfinished long line cut")
    finally:
        await stop(task)
    assert lines.lines == ["before", "x" * 100, "after", "y" * 100], [len(x) for x in lines.lines]
    assert f.state()["cut_lines"] == 2


async def test_an_unreadable_file_is_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "vllm.log"
    path.mkdir()  # open() fails with IsADirectoryError
    f, _, _ = follower(path)
    task = await running(f)
    try:
        await eventually(lambda: "cannot be read" in caplog.text, what="said")
        said_at = f.polls  # a few more polls, which must not say it again
        await eventually(lambda: f.polls >= said_at + 5, what="five more polls")
    finally:
        await stop(task)
    assert caplog.text.count("cannot be read") == 1, caplog.text


def facts(values: dict[str, Any], **kw: Any) -> EngineFacts:
    base: dict[str, Any] = {
        "sources": {k: "test" for k in values},
        "unknown_env": (),
        "deprecated": (),
        "fallbacks": (),
        "start_failed": False,
    }
    base.update(kw)
    return EngineFacts(values, **base)


def test_endpoints_win_except_for_what_only_the_log_tells() -> None:
    log_facts = facts(
        {"attention_backend": "FLASH_ATTN", "dtype": "float16"}, unknown_env=("VLLM_X",)
    )
    endpoint = facts({"attention_backend": None, "dtype": "bfloat16", "prefix_caching": True})
    both = merge(log_facts, endpoint)
    assert both.values == {
        "attention_backend": "FLASH_ATTN",
        "dtype": "bfloat16",
        "prefix_caching": True,
    }
    assert both.unknown_env == ("VLLM_X",)


def test_a_fact_learnt_later_is_not_a_move() -> None:
    assert moved({}, {"attention_backend": "FLASH_ATTN"}) == []
    assert moved({"dtype": None}, {"dtype": "bfloat16"}) == []
    assert moved({"dtype": "bfloat16", "cudagraphs": True}, {"dtype": "bfloat16"}) == []
    assert moved({"dtype": "torch.bfloat16"}, {"dtype": "bfloat16"}) == [], (
        "one value, two spellings"
    )
    assert moved({"speculative": True}, {"speculative": "eagle3"}) == []
    assert moved({"non_default_args": {"a": 1}}, {"non_default_args": {"a": 2}}) == []
    assert moved({"dtype": "bfloat16"}, {"dtype": "float16"}) == ["dtype"]


def test_a_mismatch_is_published_once_per_change() -> None:
    bus = EventBus()
    seen: list[EngineFactsRead] = []
    bus.subscribe(EngineFactsRead, seen.append)
    truth = EngineTruth(bus, {"attention_backend": "FLASHINFER"}, None)
    truth.log_read(facts({"attention_backend": "FLASH_ATTN"}))
    truth.endpoints_read(facts({}))  # nothing new: no event
    assert len(seen) == 1, seen
    assert [(m.field, m.expected, m.loaded) for m in seen[0].mismatches] == [
        ("attention_backend", "FLASHINFER", "FLASH_ATTN")
    ]
    status = truth.status()
    assert status["mismatches"] == [
        {"field": "attention_backend", "expected": "FLASHINFER", "loaded": "FLASH_ATTN"}
    ]
