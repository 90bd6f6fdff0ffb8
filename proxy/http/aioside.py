"""``ClientSide`` on aiohttp's server: a request aiohttp parsed, and the response it writes.

A whole response is handed back to aiohttp (the handler returns ``response``); a streamed one
is a ``StreamResponse`` prepared on ``start``. aiohttp writes only when awaited, so
``write_nowait`` holds the data for the next ``drain`` (or write, or end).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from aiohttp import web

from proxy.http.body import read_bounded
from proxy.http.headers import HeaderFields, as_mapping


class AiohttpSide:
    """One aiohttp request as a ``ClientSide``."""

    __slots__ = ("_queued", "_request", "response")

    def __init__(self, request: web.Request) -> None:
        self._request = request
        self.response: web.StreamResponse | None = None
        self._queued: list[bytes] = []

    @property
    def method(self) -> str:
        return self._request.method

    @property
    def path(self) -> str:
        return self._request.path

    @property
    def raw_path(self) -> str:
        return self._request.raw_path

    @property
    def headers(self) -> Mapping[str, str]:
        return self._request.headers

    def header(self, name: bytes) -> str | None:
        return self._request.headers.get(name.decode("latin-1"))

    @property
    def passed_fields(self) -> bytes | None:
        return None  # aiohttp keeps no field's bytes: the headers are filtered

    @property
    def has_body(self) -> bool:
        return self._request.body_exists

    async def read_body(self, limit: int) -> bytes:
        return await read_bounded(self._request, limit)

    def body_chunks(self) -> AsyncIterator[bytes]:
        return self._request.content.iter_chunked(64 * 1024)

    async def respond(self, status: int, headers: HeaderFields, body: bytes) -> None:
        self.response = web.Response(status=status, body=body, headers=as_mapping(headers))

    async def start(self, status: int, headers: HeaderFields) -> None:
        self.response = web.StreamResponse(status=status, headers=as_mapping(headers))
        await self.response.prepare(self._request)

    async def write(self, data: bytes) -> None:
        self._queued.append(data)
        await self.drain()

    def write_nowait(self, data: bytes) -> bool:
        self._queued.append(data)
        return False

    async def drain(self) -> None:
        assert self.response is not None
        queued = self._queued
        if queued:
            data = queued[0] if len(queued) == 1 else b"".join(queued)
            queued.clear()
            await self.response.write(data)

    async def end(self) -> None:
        assert self.response is not None
        await self.drain()
        await self.response.write_eof()
