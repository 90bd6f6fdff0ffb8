"""What ``detproxy serve`` runs on its listeners, until SIGTERM or SIGINT, then drained.

Every listener is the lean front (``proxy.http.front``): on the main one the proxied requests
go straight to the ``Forwarder`` and ``/detproxy/...`` to the app's ``Admin``
(``proxy.http.admin``); with ``server.admin_port`` the admin endpoints are served on that
listener only (health stays on both, for probes), and it proxies nothing. How much of the
admin surface a listener serves without a token its bound address decides
(``proxy.http.admin.serves_all``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

from aiohttp import web

from proxy.app import ADMIN, INCIDENTS, RUNTIME
from proxy.config import ConfigError, ServerConfig
from proxy.http.front import FrontServer

log = logging.getLogger("detproxy")

# asyncio's default of 100 overflows when hundreds of clients connect at once (a wrk start, a
# client pool after a redeploy): dropped SYNs come back 1 s, 3 s later. The kernel caps it at
# net.core.somaxconn (4096 on current kernels).
LISTEN_BACKLOG = 4096


class StartError(Exception):
    """The app could not start (its configuration, a file it opens): one line saying why."""


@dataclass(slots=True)
class Drain:
    """What the shutdown of the main listener found: proxied requests in flight when it
    stopped accepting, those still running when the grace ran out (cancelled), and how long
    it waited."""

    in_flight: int = 0
    cut: int = 0
    seconds: float = 0.0


def bound_address(sock: socket.socket) -> str:
    """The address ``sock`` is bound to (what decides how much of the admin surface it
    serves: ``proxy.http.admin.serves_all``)."""
    return str(sock.getsockname()[0])


@asynccontextmanager
async def serving(
    app: web.Application,
    server: ServerConfig,
    main: socket.socket,
    admin: socket.socket | None = None,
    drain: Drain | None = None,
) -> AsyncIterator[FrontServer]:
    """The app started and served on ``main`` (and ``admin``); on exit, requests in progress
    get ``server.shutdown_grace_s`` to finish (what happened recorded in ``drain``), then the
    app's cleanup runs. Yields the main listener's front."""
    runner = web.AppRunner(app, access_log=None)  # the app's lifetime: no site of aiohttp's
    fronts: list[FrontServer] = []
    try:
        await runner.setup()  # the app's start: a failure here still cleans up what started
        routes = app[ADMIN]
        keepalive_s = server.keepalive_timeout_s
        forward, own = routes.main_listener(app[RUNTIME].forwarder.handle, bound_address(main))
        front = FrontServer(forward, own, keepalive_s=keepalive_s)
        fronts.append(front)
        await front.listen(main, LISTEN_BACKLOG)
        if admin is not None:
            side = FrontServer(
                *routes.admin_listener(bound_address(admin)), keepalive_s=keepalive_s
            )
            fronts.append(side)
            await side.listen(admin, LISTEN_BACKLOG)
        yield front
    finally:
        grace = server.shutdown_grace_s
        for front in fronts:
            front.stop_listening()
        if fronts:
            grace = await _wait_in_flight(app, grace, drain)
        await asyncio.gather(*(front.shutdown(grace) for front in fronts))
        await runner.cleanup()


async def _wait_in_flight(app: web.Application, grace_s: float, drain: Drain | None) -> float:
    """Until the proxied requests in flight are done or ``grace_s`` ran out; the grace left."""
    forwarder = app[RUNTIME].forwarder
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + grace_s
    in_flight = forwarder.inflight
    # Polled: the forwarder counts its requests, it does not signal the last one's end.
    while forwarder.inflight and loop.time() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.05)
    if drain is not None:
        drain.in_flight = in_flight
        drain.cut = forwarder.inflight
        drain.seconds = loop.time() - start
    return max(deadline - loop.time(), 0.0)


def describe_start_error(exc: BaseException) -> str:
    """One line for what stopped the app from starting."""
    if isinstance(exc, ConfigError):
        return " ".join(str(exc).split())  # its lines, one per field, on one line
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"cannot open {exc.filename}: {exc.strerror or exc}"
    return f"{type(exc).__name__}: {exc}"


async def serve_until_signalled(
    app: web.Application,
    server: ServerConfig,
    main: socket.socket,
    admin: socket.socket | None,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Serves until SIGTERM or SIGINT, then drains, saying so. A failure to start raises
    ``StartError``; ``on_listening`` runs once the listeners accept connections."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    received: list[signal.Signals] = []

    def signalled(sig: signal.Signals) -> None:
        received.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, signalled, sig)
    drain = Drain()
    started = False
    try:
        async with serving(app, server, main, admin, drain):
            started = True
            if on_listening is not None:
                on_listening()
            await stop.wait()
            name = received[0].name if received else "stop"
            log.info(
                "%s: stopped accepting connections; %d request(s) in flight get up to %gs",
                name,
                app[RUNTIME].forwarder.inflight,
                server.shutdown_grace_s,
                extra={"fields": {"event": "shutdown", "signal": name}},
            )
    except (ConfigError, OSError) as exc:
        if started:
            raise
        raise StartError(describe_start_error(exc)) from exc
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    incidents = app[INCIDENTS]
    log.info(
        "stopped: %d request(s) drained in %.1fs, %d cut at the end of the grace;"
        " %d incident line(s) written",
        drain.in_flight - drain.cut,
        drain.seconds,
        drain.cut,
        incidents.written,
        extra={
            "fields": {
                "event": "stopped",
                "drained": drain.in_flight - drain.cut,
                "cut": drain.cut,
                "drain_s": round(drain.seconds, 3),
                "incidents_written": incidents.written,
            }
        },
    )


def run(
    app: web.Application,
    server: ServerConfig,
    main: socket.socket,
    admin: socket.socket | None,
    loop: asyncio.AbstractEventLoop,
    on_listening: Callable[[], None] | None = None,
) -> None:
    """Serves on ``loop`` until a signal; then the loop's tasks and generators are closed.
    Raises ``StartError`` when the app cannot start."""
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(serve_until_signalled(app, server, main, admin, on_listening))
    finally:
        leftover = [t for t in asyncio.all_tasks(loop) if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            loop.run_until_complete(asyncio.gather(*leftover, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
