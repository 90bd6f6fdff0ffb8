"""A loop incident says what was done about it (action, strategy, attempts, outcome, the
retry's tokens): one line per loop, written once its outcome is known, when its request ends
without one, or when detproxy stops; never lost, never written twice."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from policies.base import Trigger
from proxy.config import IncidentConfig
from proxy.events import EventBus, LoopDetected, PolicyActed, RecoveryTokens, RequestFinished
from proxy.observe.incidents import IncidentLog
from proxy.tools.emulator import EmulatorServer
from tests.helpers.emulator import knobs
from tests.helpers.waiting import eventually

LOOP = Trigger("proxy", "content", 0, 4, 8, 10, "unit")


def detected(rid: str, attempt: int, action: str) -> LoopDetected:
    return LoopDetected(rid, "m", "chat", True, attempt, LOOP, time.time(), action)


def finished(rid: str) -> RequestFinished:
    return RequestFinished("chat", "m", True, True, 200, "ok", 0.1, 0.01, rid)


class Logged:
    """An incident log on a file, and its lines."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "incidents.jsonl"
        self.log = IncidentLog(IncidentConfig(path=str(self.path)), process="p1")
        self.bus = EventBus()
        self.log.subscribe(self.bus)

    async def lines(self) -> list[dict[str, Any]]:
        """The file once the writer has written every line handed to it so far."""
        await asyncio.wait_for(self.log.drained(), timeout=10)
        return [orjson.loads(x) for x in self.path.read_bytes().splitlines()]


@pytest.fixture
async def logged(tmp_path: Path) -> AsyncIterator[Logged]:
    found = Logged(tmp_path)
    found.log.start()
    yield found
    await found.log.close()


def outcome_of(record: dict[str, Any]) -> tuple[Any, ...]:
    keys = ("attempt", "action", "strategy", "outcome", "attempts", "retry_tokens", "kept_tokens")
    return tuple(record[k] for k in keys)


async def test_a_retried_loop_is_written_once_with_its_outcome_and_the_retrys_tokens(
    logged: Logged,
) -> None:
    logged.bus.publish(detected("r1", 1, "retry"))
    (shown,) = logged.log.recent(5)
    assert (shown["action"], shown["outcome"]) == ("retry", None), "not in the ring at once"
    assert await logged.lines() == [], "written before its outcome was known"
    logged.bus.publish(PolicyActed("r1", "m", "retry", "recovered", 2, "continue"))
    logged.bus.publish(RecoveryTokens("m", "continue", 50, 12, "r1", 2))
    (line,) = await logged.lines()
    assert outcome_of(line) == (1, "retry", "continue", "recovered", 2, 50, 12)
    assert line["process"] == "p1"
    assert outcome_of(logged.log.recent(5)[0]) == outcome_of(line), "the ring lags the file"
    logged.bus.publish(finished("r1"))
    await logged.log.close()
    assert len(await logged.lines()) == 1, "the loop was written twice"


async def test_a_loop_that_loops_again_and_is_aborted_is_two_lines_one_per_attempt(
    logged: Logged,
) -> None:
    bus = logged.bus
    bus.publish(detected("r1", 1, "retry"))
    # The retry loops too (a stream: decided while it runs), then its tokens are counted.
    bus.publish(PolicyActed("r1", "m", "retry", "looped_again", 2, "restart"))
    bus.publish(detected("r1", 2, "abort"))
    bus.publish(PolicyActed("r1", "m", "abort", "attempts_exhausted", 2))
    bus.publish(RecoveryTokens("m", "restart", 300, 0, "r1", 2))
    await logged.log.close()
    assert [outcome_of(x) for x in await logged.lines()] == [
        (2, "abort", None, "attempts_exhausted", 2, None, None),
        (1, "retry", "restart", "looped_again", 2, 300, 0),
    ]


async def test_an_observed_loop_is_written_at_once(logged: Logged) -> None:
    logged.bus.publish(detected("r1", 1, "observe"))
    logged.bus.publish(PolicyActed("r1", "m", "observe", "observe", 1))
    (line,) = await logged.lines()  # before the request ends
    assert outcome_of(line) == (1, "observe", None, "observe", 1, None, None)


async def test_a_request_that_ends_before_its_retrys_outcome_writes_its_loop_unfinished(
    logged: Logged,
) -> None:
    logged.bus.publish(detected("r1", 1, "retry"))
    logged.bus.publish(finished("other"))
    assert await logged.lines() == []
    logged.bus.publish(finished("r1"))  # the client left during the retry
    (line,) = await logged.lines()
    assert (line["action"], line["outcome"]) == ("retry", "unfinished")


async def test_a_refused_retry_is_written_at_once(logged: Logged) -> None:
    logged.bus.publish(detected("r1", 1, "retry"))
    logged.bus.publish(PolicyActed("r1", "m", "retry", "error", 2, "restart"))
    (line,) = await logged.lines()
    assert outcome_of(line) == (1, "retry", "restart", "error", 2, None, None)


async def test_shutdown_writes_the_loops_still_waiting(logged: Logged) -> None:
    for i in range(3):
        logged.bus.publish(detected(f"r{i}", 1, "retry"))
    await logged.log.close()
    assert [(x["request_id"], x["outcome"]) for x in await logged.lines()] == [
        (f"r{i}", "unfinished") for i in range(3)
    ]


async def test_a_recovered_loop_says_so_in_the_ring_and_in_its_one_line(
    make_proxy: Any, tmp_path: Path
) -> None:
    path = tmp_path / "incidents.jsonl"
    async with EmulatorServer() as emu:
        client = await make_proxy(
            emu.url,
            env={
                "DETPROXY_INCIDENTS__PATH": str(path),
                "DETPROXY_LOOPS__POLICY": "retry",
                "DETPROXY_AUDIT__SAMPLE_RATE": "0",
            },
        )
        body = {
            "model": "emulator-model",
            "temperature": 0,
            "max_tokens": 200,
            "messages": [{"role": "user", "content": "loop, then recover"}],
        }
        loop = knobs(loop_channel="content", loop_after_tokens=3, loop_escape_probability=1.0)
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Request-Id": "looped", **loop}
        )
        assert resp.status == 200 and resp.headers["X-Detproxy-Recovered"] == "true"

        async def settled() -> dict[str, Any] | None:
            found = await (await client.get("/detproxy/incidents?kind=loop")).json()
            return found[0] if found and found[0]["outcome"] is not None else None

        record = await eventually(settled, timeout_s=10, what="the loop's outcome")
        assert (record["request_id"], record["attempt"]) == ("looped", 1)
        assert (record["action"], record["outcome"], record["attempts"]) == (
            "retry",
            "recovered",
            2,
        )
        assert record["strategy"] and record["retry_tokens"] > 0
        await client.close()
    lines = [orjson.loads(x) for x in path.read_bytes().splitlines()]
    (line,) = [x for x in lines if x["kind"] == "loop"]
    assert outcome_of(line) == outcome_of(record)
