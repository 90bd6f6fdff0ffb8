"""Who may see /detproxy/*: a bearer token, a browser's session cookie, a separate admin
listener, and, without a token, the address a listener is bound to."""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import socket
from collections.abc import AsyncIterator
from html import unescape
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from proxy.app import build_app
from proxy.config import load_settings
from proxy.http.admin import is_loopback
from proxy.serving import serving
from proxy.tools.emulator import EmulatorServer
from tests.helpers.processes import EXE, bare_env, detproxy_serve, free_port, wait_healthy

TOKEN = "s3cret-admin-token-0123"
AUTH_HEADER = {"Authorization": f"Bearer {TOKEN}"}


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


def test_an_empty_token_is_no_token_and_admin_host_needs_admin_port() -> None:
    """``DETPROXY_SERVER__ADMIN_TOKEN=`` (a compose file's ``${VAR:-}``, an empty Secret)
    leaves the token unset; ``server.admin_host`` alone would move nothing: refused."""
    from proxy.config import ConfigError

    assert load_settings(env={"DETPROXY_SERVER__ADMIN_TOKEN": ""}).server.admin_token is None
    with pytest.raises(ConfigError, match=r"server\.admin_host: .*admin_port"):
        load_settings(env={"DETPROXY_SERVER__ADMIN_HOST": "127.0.0.1"})
    server = load_settings(
        env={"DETPROXY_SERVER__ADMIN_HOST": "127.0.0.1", "DETPROXY_SERVER__ADMIN_PORT": "9090"},
        flags={"host": "0.0.0.0"},
    ).server
    assert (server.host, server.admin_address()) == ("0.0.0.0", "127.0.0.1")


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


# ---------------------------------------------------------------------------------------------
# A browser's login: the token for a session cookie


def _hidden(html: str, name: str) -> str:
    found = re.search(rf'<input type="hidden" name="{name}" value="([^"]*)">', html)
    assert found, f"no hidden field {name!r} in the page: {html[:300]}"
    return unescape(found.group(1))


def _set_cookies(resp: Any) -> dict[str, SimpleCookie]:
    out: dict[str, SimpleCookie] = {}
    for header in resp.headers.getall("Set-Cookie", []):
        jar: SimpleCookie = SimpleCookie()
        jar.load(header)
        for name in jar:
            out[name] = jar
    return out


async def _login_form(client: Any, next_path: str = "/detproxy/ui") -> tuple[str, str]:
    resp = await client.get("/detproxy/login", params={"next": next_path})
    html = await resp.text()
    assert resp.status == 200 and 'id="login"' in html, f"no login page: {resp.status} {html}"
    return _hidden(html, "csrf"), _hidden(html, "next")


async def _login(client: Any, token: str = TOKEN, **headers: str) -> Any:
    csrf, next_path = await _login_form(client)
    return await client.post(
        "/detproxy/login",
        data={"token": token, "csrf": csrf, "next": next_path},
        allow_redirects=False,
        headers=headers,
    )


async def test_a_browser_logs_in_uses_the_explorer_and_logs_out(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        # Without credentials, the explorer sends a browser to the login page, saying where
        # it was going.
        resp = await client.get("/detproxy/ui?model=m1", allow_redirects=False)
        assert resp.status == 303, f"the explorer without credentials answered {resp.status}"
        assert resp.headers["Location"] == "/detproxy/login?next=%2Fdetproxy%2Fui%3Fmodel%3Dm1"
        resp = await client.get(resp.headers["Location"])
        html = await resp.text()
        assert resp.status == 200 and 'name="token"' in html
        assert _hidden(html, "next") == "/detproxy/ui?model=m1"
        assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
        login_cookie = _set_cookies(resp)["detproxy_login"]["detproxy_login"]
        assert login_cookie["httponly"] and login_cookie["samesite"] == "Strict"
        assert login_cookie["path"] == "/detproxy/login"
        # A wrong token: the page again, with an error, 401, no session.
        resp = await _login(client, "wrong-token-0123456789")
        assert resp.status == 401, f"a wrong token answered {resp.status}"
        assert "Wrong token" in await resp.text()
        assert "detproxy_session" not in _set_cookies(resp)
        # The right one (pasted with a newline): a cookie that is not the token, and back.
        resp = await _login(client, TOKEN + "\n")
        assert resp.status == 303, f"the right token answered {resp.status}: {await resp.text()}"
        assert resp.headers["Location"] == "/detproxy/ui"
        cookie = _set_cookies(resp)["detproxy_session"]["detproxy_session"]
        assert TOKEN not in cookie.value and len(cookie.value) > 40
        assert cookie["httponly"] and cookie["samesite"] == "Strict" and not cookie["secure"]
        assert cookie["path"] == "/detproxy/" and cookie["max-age"] == str(12 * 3600)
        # The cookie opens the explorer (with a log-out button) and the JSON and metrics.
        resp = await client.get("/detproxy/ui")
        html = await resp.text()
        assert resp.status == 200 and 'id="logout"' in html, f"{resp.status}: {html[:300]}"
        csrf = _hidden(html, "csrf")
        for path in ("/detproxy/metrics", "/detproxy/incidents", "/detproxy/status"):
            assert (await client.get(path)).status == 200, f"{path} refused the session cookie"
        # Already logged in: the login page sends the browser on.
        resp = await client.get("/detproxy/login?next=/detproxy/status", allow_redirects=False)
        assert (resp.status, resp.headers["Location"]) == (303, "/detproxy/status")
        # A bearer header decides on its own: a wrong one is refused, cookie or not.
        resp = await client.get("/detproxy/metrics", headers={"Authorization": "Bearer nope"})
        assert resp.status == 401
        # Log-out needs the session's CSRF token, from this site.
        resp = await client.post("/detproxy/logout", allow_redirects=False)
        assert resp.status == 403, f"a log-out without its CSRF token answered {resp.status}"
        resp = await client.post(
            "/detproxy/logout",
            data={"csrf": csrf},
            headers={"Sec-Fetch-Site": "cross-site"},
            allow_redirects=False,
        )
        assert resp.status == 403, f"a cross-site log-out answered {resp.status}"
        assert (await client.get("/detproxy/ui")).status == 200, "still logged in"
        resp = await client.post("/detproxy/logout", data={"csrf": csrf}, allow_redirects=False)
        assert (resp.status, resp.headers["Location"]) == (303, "/detproxy/login")
        assert _set_cookies(resp)["detproxy_session"]["detproxy_session"]["max-age"] == "0"
        resp = await client.get("/detproxy/ui", allow_redirects=False)
        assert resp.status == 303, "the explorer opened after log-out"
        assert (await client.get("/detproxy/metrics")).status == 401


async def test_login_is_csrf_safe_and_goes_only_to_local_paths(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        # A form posted from another site: refused, token or not.
        resp = await _login(client, **{"Sec-Fetch-Site": "cross-site"})
        assert resp.status == 403 and "detproxy_session" not in _set_cookies(resp)
        # A form without the login page's cookie (a forged one, or cookies off): refused.
        csrf, _ = await _login_form(client)
        client.session.cookie_jar.clear()
        resp = await client.post(
            "/detproxy/login", data={"token": TOKEN, "csrf": csrf}, allow_redirects=False
        )
        assert resp.status == 403, f"a login without the login cookie answered {resp.status}"
        assert "detproxy_session" not in _set_cookies(resp)
        # next= elsewhere: the explorer instead.
        for evil in ("https://evil.example/", "//evil.example/x", "/detproxy/../v1/models"):
            client.session.cookie_jar.clear()
            csrf, next_path = await _login_form(client, evil)
            assert next_path == "/detproxy/ui"
            resp = await client.post(
                "/detproxy/login",
                data={"token": TOKEN, "csrf": csrf, "next": evil},
                allow_redirects=False,
            )
            assert (resp.status, resp.headers["Location"]) == (303, "/detproxy/ui"), evil
        # A form far larger than a token: not read.
        client.session.cookie_jar.clear()
        csrf, _ = await _login_form(client)
        resp = await client.post(
            "/detproxy/login", data={"token": "x" * 20_000, "csrf": csrf}, allow_redirects=False
        )
        assert resp.status == 413, f"a 20 kB login form answered {resp.status}"
        # Over https (a TLS-terminating ingress says so): the cookie is Secure.
        client.session.cookie_jar.clear()
        csrf, _ = await _login_form(client)
        resp = await client.post(
            "/detproxy/login",
            data={"token": TOKEN, "csrf": csrf},
            headers={"X-Forwarded-Proto": "https"},
            allow_redirects=False,
        )
        assert resp.status == 303
        assert _set_cookies(resp)["detproxy_session"]["detproxy_session"]["secure"]


async def test_other_unsafe_requests_with_the_cookie_need_its_csrf_token(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        assert (await _login(client)).status == 303
        csrf = _hidden(await (await client.get("/detproxy/ui")).text(), "csrf")
        for method in ("POST", "DELETE", "PUT"):
            resp = await client.request(method, "/detproxy/incidents")
            assert resp.status == 403, f"a {method} with the cookie alone answered {resp.status}"
            # Past the guard, the endpoint answers as it answers a bearer request (it takes
            # only GET: the catch-all's 404).
            bearer = await client.request(method, "/detproxy/incidents", headers=AUTH_HEADER)
            resp = await client.request(
                method, "/detproxy/incidents", headers={"X-Detproxy-Csrf": csrf}
            )
            assert resp.status == bearer.status != 403, (
                f"a {method} with its CSRF token answered {resp.status}, with the bearer token"
                f" {bearer.status}"
            )
        # The token as a form's field does as well; a wrong one does not.
        resp = await client.post("/detproxy/incidents", data={"csrf": csrf})
        assert resp.status == 404, f"a form with its CSRF token answered {resp.status}"
        resp = await client.post("/detproxy/incidents", data={"csrf": "x" * len(csrf)})
        assert resp.status == 403, f"a form with a wrong CSRF token answered {resp.status}"


async def test_wrong_tokens_are_rate_limited(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        for attempt in range(10):
            resp = await _login(client, f"wrong-token-{attempt:04d}-xxxxxxxx")
            assert resp.status == 401, f"wrong token {attempt + 1} answered {resp.status}"
        resp = await _login(client)  # even the right one, until a minute has passed
        assert resp.status == 429, f"an 11th try within a minute answered {resp.status}"
        assert 1 <= int(resp.headers["Retry-After"]) <= 61
        assert "Too many wrong tokens" in await resp.text()
        assert "detproxy_session" not in _set_cookies(resp)
        # Scripts with the bearer token are not locked out.
        assert (await client.get("/detproxy/metrics", headers=AUTH_HEADER)).status == 200


async def test_without_an_admin_token_there_is_no_login(make_proxy: Any) -> None:
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url)
        assert (await client.get("/detproxy/ui")).status == 200
        assert (await client.get("/detproxy/login")).status == 404
        html = await (await client.get("/detproxy/ui")).text()
        assert 'id="logout"' not in html, "a log-out button where there is no login"
        resp = await client.get("/detproxy/ui", headers=AUTH_HEADER)  # with the bearer token
        assert 'id="logout"' not in await resp.text()


async def test_a_login_cookie_works_on_every_worker(tmp_path: Path) -> None:
    """serve --workers 2: a cookie one worker made is good on the other (the kernel picks a
    worker per connection; status says which answered)."""
    port = free_port()
    async with (
        EmulatorServer() as emu,
        detproxy_serve(
            emu.url,
            "--workers",
            "2",
            port=port,
            env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN},
        ) as (base, _),
        aiohttp.ClientSession(
            cookie_jar=aiohttp.CookieJar(unsafe=True),
            connector=aiohttp.TCPConnector(force_close=True),  # a connection per request
        ) as http,
    ):
        async with http.get(base + "/detproxy/login") as resp:
            html = await resp.text()
        async with http.post(
            base + "/detproxy/login",
            data={"token": TOKEN, "csrf": _hidden(html, "csrf"), "next": "/detproxy/status"},
            allow_redirects=False,
        ) as resp:
            assert resp.status == 303, f"login answered {resp.status}"
        seen: dict[int, int] = {}
        for _ in range(300):
            async with http.get(base + "/detproxy/status") as resp:
                assert resp.status == 200, f"a worker refused the cookie: {resp.status}"
                seen[(await resp.json())["worker"]["index"]] = resp.status
            if len(seen) == 2:
                break
        assert len(seen) == 2, f"only workers {sorted(seen)} answered in 300 connections"


@pytest.fixture
async def two_listeners() -> AsyncIterator[tuple[str, str]]:
    """detproxy in process with ``server.admin_port`` and an admin token: (main, admin) URLs."""
    main, side = socket.socket(), socket.socket()
    main.bind(("127.0.0.1", 0))
    side.bind(("127.0.0.1", 0))
    async with EmulatorServer() as emu:
        env = {
            "DETPROXY_SERVER__ADMIN_TOKEN": TOKEN,
            "DETPROXY_SERVER__ADMIN_PORT": str(side.getsockname()[1]),
            "DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0",
        }
        settings = load_settings(env=env, flags={"upstream": emu.url})
        app = build_app(settings, registry=CollectorRegistry())
        async with serving(app, settings.server, main, side):
            yield (
                f"http://127.0.0.1:{main.getsockname()[1]}",
                f"http://127.0.0.1:{side.getsockname()[1]}",
            )


async def test_the_admin_listener_serves_the_guarded_endpoints_and_nothing_else(
    two_listeners: tuple[str, str],
) -> None:
    main, side = two_listeners
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        for base, path, status in [
            (main, "/detproxy/health", 200),  # for probes, on both
            (side, "/detproxy/health", 200),
            (main, "/detproxy/metrics", 404),  # with the token or not: not on this listener
            (main, "/detproxy/login", 404),
            (main, "/detproxy/nothing", 404),
            (side, "/detproxy/metrics", 401),  # the token's rules on the admin listener
            (side, "/v1/models", 404),  # which proxies nothing
            (main, "/v1/models", 200),
        ]:
            async with http.get(base + path, allow_redirects=False) as resp:
                assert resp.status == status, f"GET {base}{path} answered {resp.status}"
        async with http.get(main + "/detproxy/metrics", headers=AUTH_HEADER) as resp:
            assert resp.status == 404, "the main listener served metrics to the token"
        async with http.get(side + "/detproxy/metrics", headers=AUTH_HEADER) as resp:
            assert resp.status == 200 and "detproxy_requests" in await resp.text()
            assert resp.headers["Content-Type"].startswith("text/plain; version=")
        async with http.get(side + "/detproxy/status", headers=AUTH_HEADER) as resp:
            assert resp.status == 200 and resp.content_type == "application/json"
            assert (await resp.json())["upstream"].startswith("http://127.0.0.1:")
        async with http.get(side + "/detproxy/nothing", headers=AUTH_HEADER) as resp:
            assert resp.status == 404 and "no detproxy endpoint" in await resp.text()
        # A browser's log-in, on the admin listener: form, cookie, explorer, CSRF'd log-out.
        async with http.get(side + "/detproxy/ui", allow_redirects=False) as resp:
            assert resp.status == 303 and resp.headers["Location"].startswith("/detproxy/login")
        async with http.get(side + "/detproxy/login") as resp:
            csrf = _hidden(await resp.text(), "csrf")
        async with http.post(
            side + "/detproxy/login", data={"token": TOKEN, "csrf": csrf}, allow_redirects=False
        ) as resp:
            assert resp.status == 303, f"log-in on the admin listener answered {resp.status}"
        async with http.get(side + "/detproxy/ui") as resp:
            html = await resp.text()
            assert resp.status == 200 and 'id="logout"' in html, f"{resp.status}: {html[:200]}"
            assert resp.content_type == "text/html" and resp.charset == "utf-8"
        async with http.head(side + "/detproxy/ui") as resp:
            assert resp.status == 200 and await resp.read() == b""
        async with http.post(
            side + "/detproxy/logout", data={"csrf": _hidden(html, "csrf")}, allow_redirects=False
        ) as resp:
            assert (resp.status, resp.headers["Location"]) == (303, "/detproxy/login")


async def test_header_bytes_that_are_not_utf8_are_refused_never_a_fault(make_proxy: Any) -> None:
    """A byte that is not UTF-8 in what the guard compares (the bearer token, a cookie, the
    CSRF header): refused as any wrong value is, not a 500."""
    async with EmulatorServer() as emu:
        client = await make_proxy(emu.url, env={"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN})
        assert (await _login(client)).status == 303
        session = next(c.value for c in client.session.cookie_jar if c.key == "detproxy_session")
        for field, status in [
            (b"Authorization: Bearer s3cret\xff", 401),
            (b"Cookie: detproxy_session=v1.99.\xff.x", 401),
            (b"Cookie: detproxy_session=" + session.encode() + b"\xff", 401),
            (b"Cookie: detproxy_session=" + session.encode() + b"\r\nX-Detproxy-Csrf: \xff", 403),
        ]:
            method = b"POST" if b"Csrf" in field else b"GET"
            reader, writer = await asyncio.open_connection(client.host, client.port)
            writer.write(
                method + b" /detproxy/metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n"
                b"Connection: close\r\n" + field + b"\r\n\r\n"
            )
            head = await asyncio.wait_for(reader.read(), 5)
            writer.close()
            assert head.startswith(b"HTTP/1.1 %d " % status), f"{field!r} answered {head[:30]!r}"


# ---------------------------------------------------------------------------------------------
# Nothing open by accident: without a token, a listener others can reach serves only health and
# metrics; its bound address decides (SPEC 1.20)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.3.2.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("0.0.0.0", False),
        ("::", False),
        ("10.0.0.5", False),
        ("192.168.1.20", False),
        ("fe80::1%eth0", False),
        ("::ffff:10.0.0.5", False),
        ("localhost", False),  # a name, not what a socket reports: never trusted
    ],
)
def test_which_addresses_are_loopback(address: str, loopback: bool) -> None:
    assert is_loopback(address) is loopback


@contextlib.asynccontextmanager
async def listening(
    env: dict[str, str], host: str, admin_host: str | None = None
) -> AsyncIterator[tuple[str, str | None]]:
    """detproxy in process on its real listeners, the main one bound to ``host`` (and an
    admin listener to ``admin_host``): the URLs to reach them (from this machine)."""
    main = socket.socket()
    main.bind((host, 0))
    side = None
    if admin_host is not None:
        side = socket.socket()
        side.bind((admin_host, 0))
        env = {**env, "DETPROXY_SERVER__ADMIN_PORT": str(side.getsockname()[1])}
    async with EmulatorServer() as emu:
        env = {"DETPROXY_UPSTREAM__FINGERPRINT_INTERVAL_S": "0", **env}
        settings = load_settings(env=env, flags={"upstream": emu.url})
        app = build_app(settings, registry=CollectorRegistry())
        async with serving(app, settings.server, main, side):
            yield (
                f"http://127.0.0.1:{main.getsockname()[1]}",
                None if side is None else f"http://127.0.0.1:{side.getsockname()[1]}",
            )


ADMIN_PATHS = ("/detproxy/status", "/detproxy/incidents", "/detproxy/ui", "/detproxy/login")


async def _statuses(
    base: str, paths: tuple[str, ...], headers: dict[str, str] | None = None
) -> dict[str, int]:
    async with aiohttp.ClientSession() as http:
        found = {}
        for path in paths:
            async with http.get(base + path, headers=headers, allow_redirects=False) as resp:
                found[path] = resp.status
        return found


async def test_a_wildcard_address_without_a_token_serves_only_health_and_metrics() -> None:
    async with listening({}, "0.0.0.0") as (base, _), aiohttp.ClientSession() as http:
        assert await _statuses(base, ("/detproxy/health", "/detproxy/metrics")) == {
            "/detproxy/health": 200,
            "/detproxy/metrics": 200,
        }
        assert await _statuses(base, ADMIN_PATHS) == dict.fromkeys(ADMIN_PATHS, 403)
        async with http.get(base + "/detproxy/status") as resp:
            error = (await resp.json())["error"]
        assert error["code"] == 403
        # It says why, and how to open it.
        assert "not loopback" in error["message"]
        assert "server.admin_token" in error["message"]
        assert "server.admin_port" in error["message"]
        async with http.head(base + "/detproxy/metrics") as resp:
            assert resp.status == 200
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 200  # the proxied API is not the admin surface's business


async def test_a_loopback_address_without_a_token_serves_everything() -> None:
    async with listening({}, "127.0.0.1") as (base, _):
        assert await _statuses(base, ("/detproxy/status", "/detproxy/incidents")) == {
            "/detproxy/status": 200,
            "/detproxy/incidents": 200,
        }


async def test_a_wildcard_address_with_a_token_serves_everything_to_the_token() -> None:
    env = {"DETPROXY_SERVER__ADMIN_TOKEN": TOKEN}
    async with listening(env, "0.0.0.0") as (base, _):
        paths = ("/detproxy/status", "/detproxy/incidents", "/detproxy/metrics")
        assert await _statuses(base, paths, AUTH_HEADER) == dict.fromkeys(paths, 200)
        assert await _statuses(base, paths) == dict.fromkeys(paths, 401)


async def test_an_admin_listener_on_loopback_serves_everything_without_a_token() -> None:
    async with listening({}, "0.0.0.0", admin_host="127.0.0.1") as (main, side):
        assert side is not None
        paths = ("/detproxy/status", "/detproxy/incidents", "/detproxy/ui", "/detproxy/metrics")
        assert await _statuses(side, paths) == dict.fromkeys(paths, 200)
        # The main listener, which clients reach: health alone, as with any admin listener.
        assert await _statuses(main, ("/detproxy/health", "/detproxy/status")) == {
            "/detproxy/health": 200,
            "/detproxy/status": 404,
        }


async def test_an_admin_listener_others_can_reach_is_closed_without_a_token() -> None:
    async with listening({}, "127.0.0.1", admin_host="0.0.0.0") as (_, side):
        assert side is not None
        assert await _statuses(side, ("/detproxy/metrics", "/detproxy/status")) == {
            "/detproxy/metrics": 200,
            "/detproxy/status": 403,
        }


async def test_serve_on_all_addresses_without_a_token_says_what_it_serves(tmp_path: Path) -> None:
    """``detproxy serve --host 0.0.0.0``: its start-up summary says status is closed and how
    to open it; status answers 403, metrics 200."""
    port = free_port()
    async with EmulatorServer() as emu:
        proc = await asyncio.create_subprocess_exec(
            EXE, "serve", "--upstream", emu.url, "--host", "0.0.0.0", "--port", str(port),
            env=bare_env(DETPROXY_STATE_DIR=str(tmp_path)),
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        base = f"http://127.0.0.1:{port}"
        try:
            await wait_healthy(base + "/detproxy/health")
            found = await _statuses(base, ("/detproxy/metrics", "/detproxy/status"))
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert found == {"/detproxy/metrics": 200, "/detproxy/status": 403}
    text = err.decode()
    assert f"admin endpoints: health and metrics only on 0.0.0.0:{port}" in text, text
    assert "set it to open status, incidents and the explorer" in text, text


async def test_serve_with_its_admin_listener_on_loopback_opens_it_there(tmp_path: Path) -> None:
    """``--host 0.0.0.0`` with ``server.admin_port`` on a loopback ``server.admin_host``: the
    admin listener serves everything without a token; the start-up summary says so."""
    port, admin = free_port(), free_port()
    env = bare_env(
        DETPROXY_STATE_DIR=str(tmp_path),
        DETPROXY_SERVER__ADMIN_PORT=str(admin),
        DETPROXY_SERVER__ADMIN_HOST="127.0.0.1",
    )
    async with EmulatorServer() as emu:
        proc = await asyncio.create_subprocess_exec(
            EXE, "serve", "--upstream", emu.url, "--host", "0.0.0.0", "--port", str(port),
            env=env, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        side = f"http://127.0.0.1:{admin}"
        try:
            await wait_healthy(side + "/detproxy/health")
            found = await _statuses(side, ("/detproxy/status", "/detproxy/ui"))
        finally:
            proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 60)
    assert found == {"/detproxy/status": 200, "/detproxy/ui": 200}
    text = err.decode()
    assert f"admin on 127.0.0.1:{admin}" in text, text
    assert f"admin endpoints on 127.0.0.1:{admin}, no token (loopback" in text, text
