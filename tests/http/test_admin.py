"""Who may see /detproxy/*: a bearer token, and a separate admin listener."""

from __future__ import annotations

from typing import Any

import aiohttp

from proxy.tools.emulator import EmulatorServer
from tests.helpers import detproxy_serve, free_port

TOKEN = "s3cret-admin-token-0123"


async def test_bearer_token_guards_admin_endpoints_but_not_health(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        for path in ("/detproxy/metrics", "/detproxy/status", "/detproxy/incidents"):
            resp = await client.get(path)
            assert resp.status == 401 and resp.headers["WWW-Authenticate"].startswith("Bearer")
            assert (await resp.json())["error"]["code"] == 401
            resp = await client.get(path, headers={"Authorization": "Bearer wrong-token-xxxxxx"})
            assert resp.status == 401
            resp = await client.get(path, headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status == 200
        assert (await client.get("/detproxy/health")).status == 200
        # The proxied API is the upstream's business, not the admin token's.
        assert (await client.get("/v1/models")).status == 200


async def test_a_short_token_is_a_config_error() -> None:
    from proxy.config import ConfigError, load_settings

    try:
        load_settings(env={"DETPROXY_SERVER__ADMIN_TOKEN": "short"})
    except ConfigError as exc:
        assert "server.admin_token" in str(exc)
    else:
        raise AssertionError("a 5-character admin token was accepted")


async def test_separate_admin_listener() -> None:
    admin = free_port()
    async with (
        EmulatorServer() as emu,
        detproxy_serve(emu.url, env={"DETPROXY_SERVER__ADMIN_PORT": str(admin)}) as (main, _),
        aiohttp.ClientSession() as http,
    ):
        side = f"http://127.0.0.1:{admin}"
        async with http.get(main + "/detproxy/metrics") as resp:
            assert resp.status == 404  # admin endpoints only on the admin listener
        async with http.get(side + "/detproxy/metrics") as resp:
            assert resp.status == 200 and "detproxy_requests" in await resp.text()
        async with http.get(side + "/v1/models") as resp:
            assert resp.status == 404  # and the admin listener proxies nothing
        async with http.get(main + "/v1/models") as resp:
            assert resp.status == 200
        async with http.get(side + "/detproxy/health") as resp:
            assert resp.status == 200


async def test_two_processes_on_one_machine() -> None:
    # Each binds only its own ports (aiohttp would add 8080 if given a host as well).
    async with (
        EmulatorServer() as emu,
        detproxy_serve(emu.url) as (one, _),
        detproxy_serve(emu.url) as (two, _),
        aiohttp.ClientSession() as http,
    ):
        for base in (one, two):
            async with http.get(base + "/v1/models") as resp:
                assert resp.status == 200


def test_the_guard_is_installed_only_where_there_is_something_to_guard() -> None:
    from proxy.config import ServerConfig
    from proxy.http.admin import admin_middlewares

    assert admin_middlewares(ServerConfig()) == []
    assert len(admin_middlewares(ServerConfig(admin_token=TOKEN))) == 1
    assert len(admin_middlewares(ServerConfig(admin_port=9090))) == 1
