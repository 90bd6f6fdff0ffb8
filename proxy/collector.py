"""The cyclic garbage collector while detproxy serves (``server.gc_freeze``, ``gc_threshold``).

A full collection walks every tracked container, and after start-up there are some hundred
thousand of them (pydantic models, aiohttp's router, prometheus children, compiled patterns):
tens of milliseconds during which the event loop relays nothing. ``settle`` runs once, when the
server begins serving: it collects what start-up left as garbage, then freezes the rest into
the permanent generation that collections skip, and sets the thresholds. Requests still
allocate cycles now and then (exceptions and their tracebacks, futures), so collection stays
on; it only walks what serving allocated.
"""

from __future__ import annotations

import gc
from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.config import ServerConfig


def settle(freeze: bool, threshold: tuple[int, int, int]) -> None:
    gc.set_threshold(*threshold)
    if freeze:
        gc.collect()  # start-up's garbage is freed, not frozen
        gc.freeze()


def on_serving(config: ServerConfig) -> Callable[[web.Application], Awaitable[None]]:
    """An ``on_startup`` hook: appended after ``build_app``, it runs once the app's own
    start-up (clients, scheduler, subscribers) has allocated what it keeps."""

    async def settle_collector(app: web.Application) -> None:
        settle(config.gc_freeze, config.gc_threshold)

    return settle_collector
