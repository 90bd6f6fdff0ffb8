"""Who may see detproxy's own endpoints (``/detproxy/...``).

With ``server.admin_token`` set, every admin endpoint but health asks for
``Authorization: Bearer <token>`` (Prometheus sends it with ``authorization`` in its scrape
config). With ``server.admin_port`` set, the admin endpoints are served only on that listener
(health stays on both, for probes), and that listener serves nothing else.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from proxy.config import ServerConfig
from proxy.http.errors import error_response

ADMIN_PREFIX = "/detproxy/"
HEALTH = "/detproxy/health"


def _local_port(request: web.Request) -> int | None:
    transport = request.transport
    sockname = transport.get_extra_info("sockname") if transport is not None else None
    return sockname[1] if isinstance(sockname, tuple) and len(sockname) >= 2 else None


def admin_middlewares(config: ServerConfig) -> list[Middleware]:
    """The guard where there is something to guard; none otherwise (it would only cost every
    request a call)."""
    if config.admin_token is None and config.admin_port is None:
        return []
    return [admin_guard(config)]


def admin_guard(config: ServerConfig) -> Middleware:
    expected = (b"Bearer " + config.admin_token.encode()) if config.admin_token else None
    admin_port = config.admin_port

    @web.middleware
    async def guard(request: web.Request, handler: Handler) -> web.StreamResponse:
        path = request.path
        if path == HEALTH:
            return await handler(request)
        is_admin = path.startswith(ADMIN_PREFIX)
        if admin_port is not None:
            on_admin_listener = _local_port(request) == admin_port
            if is_admin != on_admin_listener:
                return error_response(404, f"nothing at {path} on this listener")
        if is_admin and expected is not None:
            given = request.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), expected):
                resp = error_response(401, "detproxy admin endpoints need a bearer token")
                resp.headers["WWW-Authenticate"] = 'Bearer realm="detproxy"'
                return resp
        return await handler(request)

    return guard
