"""Polling: until something is so, by a deadline (never a count of tries: a busy machine is
slow). ``eventually()`` and ``eventually_sync()`` poll a check; ``Unmet`` is a check's "not yet"
that still shows what it saw; ``settle()`` and ``settle_sync()`` wait for a detproxy's shadows
and audits to end."""

from __future__ import annotations

import asyncio
import inspect
import time
import urllib.request
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, overload

import orjson

T = TypeVar("T")


@dataclass(frozen=True)
class Unmet:
    """A check's answer for "not yet" that still shows what it saw in the failure message."""

    seen: Any

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return repr(self.seen)


def _not_within(what: str, timeout_s: float, last: object) -> AssertionError:
    seen = repr(last).replace("\n", "\\n")
    if len(seen) > 500:
        seen = seen[:500] + "..."
    return AssertionError(f"{what}: not within {timeout_s} s (last: {seen})")


@overload
async def eventually(
    check: Callable[[], Awaitable[T | Unmet | None]],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str,
) -> T: ...


@overload
async def eventually(
    check: Callable[[], T | Unmet | None],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str,
) -> T: ...


async def eventually(
    check: Callable[[], Any],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str,
) -> Any:
    """``check()``'s first truthy value (``check`` may be async), polled every ``interval_s``;
    past ``timeout_s`` an AssertionError that says ``what`` was awaited and the last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise _not_within(what, timeout_s, value)
        await asyncio.sleep(interval_s)


def eventually_sync(
    check: Callable[[], T | Unmet | None],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.02,
    what: str,
) -> T:
    """``eventually()`` for code that blocks (processes polled with blocking HTTP)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value is not None and value and not isinstance(value, Unmet):  # (narrowed for mypy)
            return value
        if time.monotonic() >= deadline:
            raise _not_within(what, timeout_s, value)
        time.sleep(interval_s)


def _settled(status: dict[str, Any], audits: int) -> dict[str, Any] | Unmet:
    shadow, audit = status["shadow"], status["audit"]
    ended = audit["audits"] + sum(audit["shadows_dropped"].values())
    idle = shadow is None or shadow["queued"] == shadow["running"] == 0
    return status if idle and ended >= audits else Unmet({"shadow": shadow, "ended": ended})


def _settled_what(audits: int) -> str:
    return f"shadows settled and {audits} audits ended" if audits else "shadows settled"


async def settle(
    client: Any, audits: int = 0, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    """Until no shadow is queued or running and ``audits`` audits ended (a dropped shadow
    ended too), read from ``client``'s (a TestClient's) /detproxy/status; the status then."""

    async def status() -> dict[str, Any] | Unmet:
        resp = await client.get("/detproxy/status", headers=headers)
        return _settled(await resp.json(), audits)

    return await eventually(status, timeout_s=timeout_s, what=_settled_what(audits))


def settle_sync(base: str, audits: int = 0, *, timeout_s: float = 60.0) -> dict[str, Any]:
    """``settle()`` for a detproxy process at ``base`` (its URL), polled with blocking HTTP."""

    def status() -> dict[str, Any] | Unmet:
        with urllib.request.urlopen(base + "/detproxy/status", timeout=10) as resp:
            return _settled(orjson.loads(resp.read()), audits)

    what = _settled_what(audits)
    return eventually_sync(status, timeout_s=timeout_s, interval_s=0.5, what=what)
