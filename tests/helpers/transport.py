"""Transport callbacks made visible: which code runs inside an upstream's ``data_received``.

``mark_connections(monkeypatch, probe)`` wraps every protocol the running event loop connects
(``loop.create_connection``: detproxy's upstream pool, among others) in one that marks its
``data_received`` as running; code under test calls ``probe.note(what)`` (a policy, an event
subscriber, a writer) and ``probe.inside`` lists what ran inside such a callback.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from proxy.http.h1conn import Conn


@dataclass
class Probe:
    """Whether an upstream protocol's ``data_received`` is running, and what ran inside one."""

    depth: int = 0
    upstream_reads: int = 0
    calls: list[str] = field(default_factory=list)  # what was called, in order
    inside: list[str] = field(default_factory=list)  # those called inside a data callback

    def note(self, what: str) -> None:
        self.calls.append(what)
        if self.depth:
            self.inside.append(what)


class Marked(asyncio.Protocol):
    """A protocol that marks its inner one's ``data_received`` as running."""

    def __init__(self, inner: asyncio.Protocol, probe: Probe) -> None:
        self.inner, self.probe = inner, probe

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        probe = self.probe
        if isinstance(self.inner, Conn):
            probe.upstream_reads += 1
        probe.depth += 1
        try:
            self.inner.data_received(data)
        finally:
            probe.depth -= 1

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def mark_connections(monkeypatch: pytest.MonkeyPatch, probe: Probe) -> None:
    loop = asyncio.get_running_loop()
    connect = loop.create_connection

    async def create_connection(
        factory: Callable[[], asyncio.Protocol], *args: Any, **kwargs: Any
    ) -> tuple[asyncio.BaseTransport, asyncio.Protocol]:
        made: list[asyncio.Protocol] = []

        def marked() -> asyncio.Protocol:
            made.append(factory())
            return Marked(made[0], probe)

        transport, _ = await connect(marked, *args, **kwargs)
        return transport, made[0]

    monkeypatch.setattr(loop, "create_connection", create_connection)
