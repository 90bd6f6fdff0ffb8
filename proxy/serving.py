"""What ``detproxy serve`` runs on its listeners, until SIGTERM or SIGINT, then drained.

With ``server.http = "lean"`` (the default) the main listener is the lean front
(``proxy.http.front``): the proxied requests go straight to the ``Forwarder``, detproxy's own
endpoints to the aiohttp app on a private loopback listener. The admin listener
(``server.admin_port``), and with ``"aiohttp"`` the main one too, are aiohttp's.
"""

from __future__ import annotations

import asyncio
import signal
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from proxy.app import RUNTIME
from proxy.config import ServerConfig
from proxy.http.front import FrontServer
from proxy.http.h1 import H1Upstream

# asyncio's default of 100 overflows when hundreds of clients connect at once (a wrk start, a
# client pool after a redeploy): dropped SYNs come back 1 s, 3 s later. The kernel caps it at
# net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096
# The aiohttp app behind the front answers detproxy's own endpoints: small and local.
_ADMIN_TIMEOUT_S = 120.0


def _loopback_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    return sock


@asynccontextmanager
async def serving(
    app: web.Application,
    server: ServerConfig,
    main: socket.socket,
    admin: socket.socket | None = None,
) -> AsyncIterator[FrontServer | None]:
    """The app started and served on ``main`` (and ``admin``); on exit, requests in progress
    get ``server.shutdown_grace_s`` to finish, then the app's cleanup runs. Yields the front
    (None when aiohttp serves the main listener)."""
    runner = web.AppRunner(
        app,
        handler_cancellation=True,  # a client that leaves cancels its handler: upstream closes
        access_log=None,
        shutdown_timeout=server.shutdown_grace_s,
        keepalive_timeout=server.keepalive_timeout_s,
    )
    await runner.setup()
    front: FrontServer | None = None
    private: H1Upstream | None = None
    try:
        socks = [s for s in (admin,) if s is not None]
        if server.http == "aiohttp":
            socks.insert(0, main)
        else:
            back = _loopback_socket()
            socks.append(back)
            port = back.getsockname()[1]
            private = H1Upstream(
                f"http://127.0.0.1:{port}",
                connect_timeout_s=_ADMIN_TIMEOUT_S,
                read_timeout_s=_ADMIN_TIMEOUT_S,
                keepalive_timeout_s=30.0,
                max_connections=64,
            )
        for sock in socks:
            await web.SockSite(runner, sock, backlog=LISTEN_BACKLOG).start()
        if private is not None:
            front = FrontServer(
                app[RUNTIME].forwarder.handle, private, keepalive_s=server.keepalive_timeout_s
            )
            await front.listen(main, LISTEN_BACKLOG)
        yield front
    finally:
        if front is not None:
            await front.shutdown(server.shutdown_grace_s)
        if private is not None:
            await private.close()
        await runner.cleanup()


async def serve_until_signalled(
    app: web.Application, server: ServerConfig, main: socket.socket, admin: socket.socket | None
) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        async with serving(app, server, main, admin):
            await stop.wait()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(
    app: web.Application,
    server: ServerConfig,
    main: socket.socket,
    admin: socket.socket | None,
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Serves on ``loop`` until a signal; then the loop's tasks and generators are closed."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve_until_signalled(app, server, main, admin))
    finally:
        leftover = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
