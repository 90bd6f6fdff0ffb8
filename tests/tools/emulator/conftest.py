from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from proxy.tools.emulator import EmulatorConfig, EmulatorServer
from tests.helpers.emulator import EmulatorClient

MakeClient = Callable[..., Awaitable[tuple[EmulatorClient, EmulatorServer]]]


@pytest.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    """Start an EmulatorServer with the given config fields; return (client, server)."""
    servers: list[EmulatorServer] = []
    sessions: list[aiohttp.ClientSession] = []

    async def make(**fields: Any) -> tuple[EmulatorClient, EmulatorServer]:
        server = EmulatorServer(EmulatorConfig(**fields))
        url = await server.start()
        servers.append(server)
        session = aiohttp.ClientSession()
        sessions.append(session)
        return EmulatorClient(session, url), server

    yield make
    for session in sessions:
        await session.close()
    for server in servers:
        await server.stop()


@pytest.fixture
async def client(make_client: MakeClient) -> EmulatorClient:
    c, _ = await make_client()
    return c
