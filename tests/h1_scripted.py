"""A scripted HTTP/1.1 server for the upstream client's tests: it records each request and
the connection it came on, and answers with whatever bytes a test's ``Reply`` writes."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

JSON = b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n{"a":1}'


@dataclass
class Request:
    conn: int  # which server-side connection it came on (0, 1, ...)
    head: bytes
    body: bytes

    @property
    def lines(self) -> list[bytes]:
        return self.head.split(b"\r\n")

    def header(self, name: bytes) -> bytes | None:
        for line in self.lines[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == name.lower():
                return value.strip()
        return None


# Gets the request and the writer; returns True to keep reading requests on the connection.
Reply = Callable[[Request, asyncio.StreamWriter], Awaitable[bool]]


@dataclass
class Scripted:
    reply: Reply
    requests: list[Request] = field(default_factory=list)
    connections: int = 0
    eofs: int = 0  # connections the client closed
    server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = self.connections
        self.connections += 1
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, ConnectionError):
                    self.eofs += 1
                    return
                req = Request(conn, head, b"")
                length = req.header(b"content-length")
                if length is not None:
                    req.body = await reader.readexactly(int(length))
                elif req.header(b"transfer-encoding") == b"chunked":
                    req.body = await _read_chunked(reader)
                self.requests.append(req)
                if not await self.reply(req, writer):
                    writer.close()
                    return
                await writer.drain()
        finally:
            writer.close()


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        data = await reader.readexactly(size + 2)
        if size == 0:
            return out
        out += data[:-2]


def answer(raw: bytes) -> Reply:
    async def reply(req: Request, writer: asyncio.StreamWriter) -> bool:
        writer.write(raw)
        return True

    return reply
