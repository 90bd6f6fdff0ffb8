"""``build_app(settings)``: routes, the one ClientSession, and what lives as long as the app."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from aiohttp import web
from prometheus_client import CollectorRegistry

from policies.base import PolicyChain
from proxy import __version__
from proxy.config import Settings
from proxy.errors import error_response
from proxy.events import EventBus
from proxy.forward import Forwarder
from proxy.inspect.base import InspectorFactory
from proxy.metrics import Metrics
from proxy.upstream import AiohttpUpstream, Upstream, make_session

SETTINGS = web.AppKey("settings", Settings)
BUS = web.AppKey("bus", EventBus)
METRICS = web.AppKey("metrics", Metrics)
FORWARDER = web.AppKey("forwarder", Forwarder)
STARTED_AT = web.AppKey("started_at", float)

ADMIN_PREFIX = "/detproxy/"


def build_app(
    settings: Settings,
    *,
    registry: CollectorRegistry | None = None,
    upstream: Upstream | None = None,
    inspector_factories: Sequence[InspectorFactory] = (),
    policies: PolicyChain | None = None,
) -> web.Application:
    app = web.Application(client_max_size=settings.server.max_body_bytes)
    bus = EventBus()
    metrics = Metrics(registry if registry is not None else CollectorRegistry())
    metrics.subscribe(bus)
    chain = policies or PolicyChain()
    metrics.watch_failures(
        {"subscriber": lambda: dict(bus.failures), "policy": lambda: dict(chain.failures)}
    )
    app[SETTINGS] = settings
    app[BUS] = bus
    app[METRICS] = metrics
    app[STARTED_AT] = time.time()

    async def upstream_ctx(app: web.Application) -> AsyncIterator[None]:
        session = None
        target = upstream
        if target is None:
            session = make_session(settings.upstream)
            target = AiohttpUpstream(session, settings.upstream.url)
        app[FORWARDER] = Forwarder(settings, target, bus, inspector_factories, chain)
        yield
        if session is not None:
            await session.close()

    app.cleanup_ctx.append(upstream_ctx)
    app.router.add_get("/detproxy/health", _health)
    app.router.add_get("/detproxy/metrics", metrics.handle)
    app.router.add_get("/detproxy/status", _status)
    app.router.add_route("*", "/{tail:.*}", _dispatch)
    return app


async def _dispatch(request: web.Request) -> web.StreamResponse:
    if request.path.startswith(ADMIN_PREFIX):
        return error_response(404, f"no detproxy endpoint at {request.path}")
    return await request.app[FORWARDER].handle(request)


async def _health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def _status(request: web.Request) -> web.Response:
    app = request.app
    settings = app[SETTINGS]
    return web.json_response(
        {
            "version": __version__,
            "upstream": settings.upstream.url,
            "uptime_s": round(time.time() - app[STARTED_AT], 3),
            "inflight": app[FORWARDER].inflight,
            "config": settings.model_dump(mode="json"),
        }
    )
