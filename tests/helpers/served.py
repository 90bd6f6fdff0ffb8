"""detproxy in the test's own process: its app served on a socket as ``detproxy serve`` serves
it (for aiohttp's ``TestClient``), and the tasks the loop holds besides aiohttp's."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from aiohttp import web
from aiohttp.test_utils import BaseTestServer
from aiohttp.web_runner import BaseRunner
from yarl import URL

from proxy.config import Settings
from proxy.serving import serving


class ServedApp(BaseTestServer):
    """A detproxy app served as ``detproxy serve`` serves it (``proxy.serving``: the lean front),
    for aiohttp's ``TestClient``."""

    def __init__(self, app: web.Application, settings: Settings) -> None:
        super().__init__()
        self.app = app
        self._settings = settings
        self._serving: contextlib.AbstractAsyncContextManager[object] | None = None

    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        raise TypeError("ServedApp serves through proxy.serving")

    @property
    def started(self) -> bool:
        return self._serving is not None

    async def start_server(self, loop: asyncio.AbstractEventLoop | None = None, **_: Any) -> None:
        if self._serving is not None:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "http"
        self._serving = serving(self.app, self._settings.server, sock)
        await self._serving.__aenter__()
        self._root = URL(f"http://127.0.0.1:{self.port}")

    async def close(self) -> None:
        if self._serving is not None and not self._closed:
            self._closed = True
            await self._serving.__aexit__(None, None, None)
            self._root = None


def own_tasks() -> int:
    """Tasks in this loop other than aiohttp's per-connection handlers: idle keep-alive
    connections keep theirs until the keep-alive timeout (pooled, not leaked)."""
    return sum(
        1
        for t in asyncio.all_tasks()
        if getattr(t.get_coro(), "__qualname__", "") != "RequestHandler.start"
    )
