"""The upstream client (proxy/http/h1.py) raises detproxy's own errors, one type for each fault:
a body cut short, a body gone silent."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from proxy.http.errors import UpstreamBodyError, UpstreamError, UpstreamTimeout
from proxy.http.h1 import H1Upstream
from proxy.http.upstream import READ_ERRORS, Upstream, read_error_kind
from tests.helpers.upstreams import ScriptedRequest, ScriptedServer

READ_TIMEOUT_S = 0.2
CUT_LENGTH = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial"
CUT_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"b\r\ndata: {}\n\n\r\n8\r\ndata: {"
)
SILENT = b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc"


def cut(raw: bytes) -> Callable[[ScriptedRequest, asyncio.StreamWriter], Awaitable[bool]]:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        await writer.drain()
        return False  # the server closes the connection

    return reply


def silent(raw: bytes) -> Callable[[ScriptedRequest, asyncio.StreamWriter], Awaitable[bool]]:
    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        await writer.drain()
        await asyncio.sleep(10 * READ_TIMEOUT_S)
        return False

    return reply


@pytest.fixture
async def connect() -> AsyncIterator[Callable[[Any], Awaitable[Upstream]]]:
    servers: list[asyncio.Server] = []
    clients: list[Upstream] = []

    async def start(reply: Any) -> Upstream:
        script = ScriptedServer(reply)
        script.server = await asyncio.start_server(script.handle, "127.0.0.1", 0)
        servers.append(script.server)
        client = H1Upstream(
            script.url,
            connect_timeout_s=2.0,
            read_timeout_s=READ_TIMEOUT_S,
            keepalive_timeout_s=4.0,
            max_connections=4,
        )
        clients.append(client)
        return client

    yield start
    for client in clients:
        await client.close()
    for server in servers:
        server.close()
        await server.wait_closed()


async def read_all(client: Upstream, how: str) -> bytes:
    resp = await client.send("GET", "/", {}, None)
    try:
        if how == "read":
            return await resp.read()
        return b"".join([data async for data in resp.chunks()])
    finally:
        resp.close()


@pytest.mark.parametrize("how", ["read", "chunks"])
@pytest.mark.parametrize("raw", [CUT_LENGTH, CUT_CHUNKED], ids=["length", "chunked"])
async def test_a_body_cut_short_is_an_upstream_body_error(
    connect: Any, how: str, raw: bytes
) -> None:
    client = await connect(cut(raw))
    with pytest.raises(UpstreamError) as err:
        await read_all(client, how)
    assert type(err.value) is UpstreamBodyError
    assert isinstance(err.value, READ_ERRORS) and read_error_kind(err.value) == "reset"


@pytest.mark.parametrize("how", ["read", "chunks"])
async def test_a_silent_body_is_an_upstream_timeout(connect: Any, how: str) -> None:
    client = await connect(silent(SILENT))
    with pytest.raises(UpstreamError) as err:
        await read_all(client, how)
    assert type(err.value) is UpstreamTimeout
    assert isinstance(err.value, READ_ERRORS) and read_error_kind(err.value) == "timeout"
    assert isinstance(err.value, TimeoutError)  # what `except TimeoutError` readers expect


def trickle(chunks: int, gap_s: float, then_silent_s: float = 0.0) -> Any:
    """A chunked body: ``chunks`` chunks ``gap_s`` apart, then (optionally) silence."""

    async def reply(req: ScriptedRequest, writer: asyncio.StreamWriter) -> bool:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(chunks):
            writer.write(b"1\r\nx\r\n")
            await writer.drain()
            await asyncio.sleep(gap_s)
        if then_silent_s:
            await asyncio.sleep(then_silent_s)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return False

    return reply


@pytest.mark.parametrize("how", ["read", "chunks"])
async def test_a_body_that_keeps_coming_outlasts_the_read_timeout(connect: Any, how: str) -> None:
    # 12 chunks 0.05 s apart: 0.6 s in all, three read timeouts, never 0.2 s of silence.
    client = await connect(trickle(12, READ_TIMEOUT_S / 4))
    assert await read_all(client, how) == b"x" * 12


@pytest.mark.parametrize("how", ["read", "chunks"])
async def test_silence_after_some_chunks_is_an_upstream_timeout(connect: Any, how: str) -> None:
    client = await connect(trickle(6, READ_TIMEOUT_S / 4, then_silent_s=10 * READ_TIMEOUT_S))
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(UpstreamTimeout):
        await read_all(client, how)
    # The last chunk came at 0.25 s: the timeout counts from it, not from the first chunk.
    assert 5 * READ_TIMEOUT_S / 4 + READ_TIMEOUT_S * 0.9 <= loop.time() - started < 1.5
