from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer

StartEmulator = Callable[..., Awaitable[str]]


@pytest.fixture
async def emulator() -> AsyncIterator[StartEmulator]:
    """Start an in-process emulator with these config fields; return its base URL."""
    servers: list[EmulatorServer] = []

    async def start(**fields: Any) -> str:
        server = EmulatorServer(EmulatorConfig(**fields))
        servers.append(server)
        return str(await server.start())

    yield start
    for server in servers:
        await server.stop()
