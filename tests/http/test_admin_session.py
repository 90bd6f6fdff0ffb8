"""The browser's session cookie and CSRF tokens (proxy/http/admin.py), without a server: made,
accepted, expired, tampered with, made with another token, made by another process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from proxy.http.admin import LoginThrottle, Sessions, derive_key, local_next

TOKEN = "s3cret-admin-token-0123"
TTL = 3600


class Clock:
    def __init__(self, now: float = 1_800_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_cookie_is_accepted_until_it_expires() -> None:
    clock = Clock()
    sessions = Sessions(TOKEN, TTL, clock)
    cookie = sessions.issue()
    assert TOKEN not in cookie and derive_key(TOKEN, "detproxy-session").hex() not in cookie
    assert sessions.valid(cookie), f"a fresh cookie was refused: {cookie}"
    clock.now += TTL - 1
    assert sessions.valid(cookie), "a cookie was refused a second before its expiry"
    clock.now += 1
    assert not sessions.valid(cookie), "a cookie was accepted at its expiry"
    clock.now += 86400
    assert not sessions.valid(cookie), "a day-old expired cookie was accepted"


def test_each_login_gets_its_own_cookie() -> None:
    sessions = Sessions(TOKEN, TTL, Clock())
    one, two = sessions.issue(), sessions.issue()
    assert one != two, "two log-ins in the same second got the same cookie"
    assert sessions.csrf("session", one) != sessions.csrf("session", two)


def _tampered(cookie: str) -> list[str]:
    version, expiry, sid, mac = cookie.split(".")
    flip = "A" if mac[0] != "A" else "B"
    return [
        f"{version}.{int(expiry) + 3600}.{sid}.{mac}",  # a longer life
        f"{version}.{expiry}.{sid[:-1]}{'x' if sid[-1] != 'x' else 'y'}.{mac}",  # another id
        f"{version}.{expiry}.{sid}.{flip}{mac[1:]}",  # a forged mac
        f"v2.{expiry}.{sid}.{mac}",
        f"{version}.{expiry}.{sid}",
        f"{version}.{expiry}.{sid}.{mac}.",
        f"{version}.{expiry}.{sid}.",
        f"{version}.{expiry}.{sid}.{mac}x",
        f"{version}.-{expiry}.{sid}.{mac}",
        f"{version}.{expiry}\u0661.{sid}.{mac}",  # a non-ASCII digit
        TOKEN,
        "",
        ".",
        "...",
    ]


def test_a_tampered_cookie_is_refused() -> None:
    sessions = Sessions(TOKEN, TTL, Clock())
    cookie = sessions.issue()
    for bad in _tampered(cookie):
        assert not sessions.valid(bad), f"a tampered cookie was accepted: {bad!r}"


def test_a_cookie_made_with_another_token_is_refused() -> None:
    clock = Clock()
    cookie = Sessions("another-admin-token-456", TTL, clock).issue()
    assert not Sessions(TOKEN, TTL, clock).valid(cookie), "another token's cookie was accepted"


def test_a_cookie_lasting_longer_than_the_ttl_now_allows_is_refused() -> None:
    clock = Clock()
    cookie = Sessions(TOKEN, 12 * 3600, clock).issue()
    assert not Sessions(TOKEN, 3600, clock).valid(cookie), (
        "a 12 h cookie was accepted after the ttl was lowered to 1 h"
    )


def test_another_worker_accepts_the_cookie() -> None:
    """Workers are processes that share nothing but the configuration: a cookie made by one
    (here another Python process) is good on another, as is its CSRF token."""
    made = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from proxy.http.admin import Sessions; s = Sessions({TOKEN!r}, {TTL});"
            " c = s.issue(); print(c); print(s.csrf('session', c))",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    cookie, csrf = made.stdout.split()
    here = Sessions(TOKEN, TTL)
    assert here.valid(cookie), f"another process's cookie was refused: {cookie}"
    assert here.csrf_ok("session", cookie, csrf), "another process's CSRF token was refused"
    assert not Sessions("another-admin-token-456", TTL).valid(cookie)


def test_csrf_tokens_are_bound_to_what_they_were_made_for() -> None:
    sessions = Sessions(TOKEN, TTL, Clock())
    one, two = sessions.issue(), sessions.issue()
    token = sessions.csrf("session", one)
    assert sessions.csrf_ok("session", one, token)
    assert not sessions.csrf_ok("session", two, token), "a CSRF token worked for another session"
    assert not sessions.csrf_ok("login", one, token), "a session's CSRF token worked for login"
    assert not sessions.csrf_ok("session", one, ""), "an empty CSRF token was accepted"
    other = Sessions("another-admin-token-456", TTL, Clock())
    assert not other.csrf_ok("session", one, token), "a CSRF token worked with another key"


def test_the_token_comparison() -> None:
    sessions = Sessions(TOKEN, TTL)
    assert sessions.token_matches(TOKEN)
    for wrong in ("", TOKEN[:-1], TOKEN + "x", TOKEN.upper(), "Bearer " + TOKEN):
        assert not sessions.token_matches(wrong), f"{wrong!r} was taken for the token"


def test_failed_logins_are_limited_per_window() -> None:
    clock = Clock(100.0)
    throttle = LoginThrottle(limit=3, window_s=60.0, clock=clock)
    for _ in range(3):
        assert throttle.wait_s() == 0
        throttle.failed()
        clock.now += 1
    assert throttle.wait_s() == pytest.approx(57.0), "a 4th try within the minute was allowed"
    clock.now += 57
    assert throttle.wait_s() == 0, "the oldest failure aged out but no try was allowed"
    throttle.failed()
    assert throttle.wait_s() == pytest.approx(1.0)  # the 2nd failure is now the oldest


@pytest.mark.parametrize(
    ("given", "goes_to"),
    [
        ("/detproxy/ui", "/detproxy/ui"),
        ("/detproxy/ui?model=m&verdict=loop", "/detproxy/ui?model=m&verdict=loop"),
        ("/detproxy/ui/incident/0123456789abcdef", "/detproxy/ui/incident/0123456789abcdef"),
        ("/detproxy/metrics", "/detproxy/metrics"),
        (None, "/detproxy/ui"),
        ("", "/detproxy/ui"),
        ("https://evil.example/detproxy/ui", "/detproxy/ui"),
        ("//evil.example/detproxy/ui", "/detproxy/ui"),
        ("/\\evil.example/", "/detproxy/ui"),
        ("/detproxy/\\\\evil.example", "/detproxy/ui"),
        ("/detproxy/../evil", "/detproxy/ui"),
        ("/detproxy/%2e%2e/evil", "/detproxy/ui"),
        ("/detproxy/ui\r\nSet-Cookie: x=1", "/detproxy/ui"),
        ("/detproxy/login", "/detproxy/ui"),
        ("/detproxy/logout", "/detproxy/ui"),
        ("javascript:alert(1)", "/detproxy/ui"),
        ("/v1/models", "/detproxy/ui"),
        ("/detproxy/ui" + "x" * 3000, "/detproxy/ui"),
    ],
)
def test_after_login_only_local_detproxy_paths(given: str | None, goes_to: str) -> None:
    assert local_next(given) == goes_to
