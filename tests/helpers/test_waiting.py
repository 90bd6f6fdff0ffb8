"""The pollers of tests/helpers/waiting.py: the value that ends the wait, and a failure that
says what."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.helpers.waiting import Unmet, eventually, eventually_sync, settle


async def test_eventually_returns_the_first_truthy_value_of_a_sync_check() -> None:
    calls: list[int] = []

    def check() -> int:
        calls.append(1)
        return len(calls) if len(calls) >= 3 else 0

    assert await eventually(check, interval_s=0.001, what="three calls") == 3
    assert len(calls) == 3


async def test_eventually_awaits_an_async_check() -> None:
    calls: list[int] = []

    async def check() -> dict[str, int] | None:
        calls.append(1)
        return {"calls": len(calls)} if len(calls) >= 2 else None

    assert await eventually(check, interval_s=0.001, what="two calls") == {"calls": 2}


async def test_eventually_fails_past_its_deadline_saying_what_and_the_last_value() -> None:
    started = time.monotonic()
    with pytest.raises(AssertionError) as err:
        await eventually(lambda: [], timeout_s=0.1, interval_s=0.01, what="a non-empty list")
    assert time.monotonic() - started >= 0.1  # the whole deadline, not a count of tries
    first = str(err.value).splitlines()[0]
    assert first == "a non-empty list: not within 0.1 s (last: [])"


async def test_eventually_shows_what_an_unmet_check_saw_truncated() -> None:
    seen = {"queued": 2, "text": "x" * 2000 + "\nmore"}
    with pytest.raises(AssertionError) as err:
        await eventually(lambda: Unmet(seen), timeout_s=0.05, what="an empty queue")
    message = str(err.value)
    assert message.startswith("an empty queue: not within 0.05 s (last: {'queued': 2, 'text': 'x")
    assert "\n" not in message and len(message) < 600 and message.endswith("...)")


async def test_eventually_lets_an_error_of_the_check_through() -> None:
    def check() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(ConnectionError):
        await eventually(check, what="never reached")


def test_eventually_sync_returns_the_value_and_fails_with_the_message() -> None:
    calls: list[int] = []

    def check() -> str:
        calls.append(1)
        return "ready" if len(calls) >= 3 else ""

    assert eventually_sync(check, interval_s=0.001, what="ready") == "ready"
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"^the engine idle: not within 0.1 s \(last: 2\)"):
        eventually_sync(lambda: Unmet(2), timeout_s=0.1, what="the engine idle")
    assert time.monotonic() - started >= 0.1


class StatusClient:
    """Answers /detproxy/status with the next of ``statuses`` (the last one again at the end)."""

    def __init__(self, *statuses: dict[str, Any]) -> None:
        self.statuses = list(statuses)

    async def get(self, path: str, headers: dict[str, str] | None = None) -> StatusClient:
        assert path == "/detproxy/status"
        return self

    async def json(self) -> dict[str, Any]:
        return self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]


def status(queued: int, running: int, audits: int, dropped: int = 0) -> dict[str, Any]:
    shadow = {"queued": queued, "running": running}
    return {"shadow": shadow, "audit": {"audits": audits, "shadows_dropped": {"rate": dropped}}}


async def test_settle_waits_for_an_idle_queue_and_the_audits_a_dropped_shadow_ending_one() -> None:
    client = StatusClient(status(1, 0, 0), status(0, 1, 1), status(0, 0, 1), status(0, 0, 1, 1))
    assert await settle(client, audits=2, timeout_s=5) == status(0, 0, 1, 1)
    assert await settle(StatusClient(status(0, 0, 0))) == status(0, 0, 0)
    with pytest.raises(AssertionError, match=r"^shadows settled and 3 audits ended: not within"):
        await settle(StatusClient(status(0, 0, 2)), audits=3, timeout_s=0.05)
