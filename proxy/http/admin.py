"""Who may see detproxy's own endpoints (``/detproxy/...``).

With ``server.admin_token`` set, every admin endpoint but health asks for
``Authorization: Bearer <token>`` (Prometheus sends it with ``authorization`` in its scrape
config). With ``server.admin_port`` set, the admin endpoints are served only on that listener
(health stays on both, for probes), and that listener serves nothing else.

A browser cannot send a bearer header from the address bar, so it logs in instead: a request
for the explorer (``/detproxy/ui``) with neither header nor session is sent to
``/detproxy/login``, where the operator pastes the token; the right token is exchanged for a
session cookie (HttpOnly, SameSite=Strict, Path=/detproxy/, Secure over https, ``Max-Age`` of
``server.session_ttl_s``), which every admin endpoint accepts as it accepts the header.

The cookie is not the token. It is ``v1.<expiry>.<id>.<mac>``: an HMAC-SHA256 over the rest,
keyed by ``HMAC(admin_token, "detproxy-session")``. Every worker of ``serve --workers N`` (and
the next start) derives the same key, so a cookie one worker made is good on all of them with
nothing shared; a new admin token ends every session. Logging out clears the browser's cookie
(a copy kept elsewhere lasts until its expiry: change the token to end them all).

Cross-site requests: the cookie is SameSite=Strict, and anything but GET and HEAD that the
cookie authorises (log-out included) must carry a CSRF token bound to that session (the form's
``csrf`` field or an ``X-Detproxy-Csrf`` header) and must not be marked cross-site by the
browser (``Sec-Fetch-Site``). The log-in form carries a token bound to a short-lived cookie the
login page sets (double submit). Origin is not compared with Host: the lean front relays admin
requests to this app with a Host of its own. Failed log-ins are limited per process (10 a
minute; then 429 until the oldest is a minute old), counted for the whole process since behind
the lean front every request comes from the loopback.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import posixpath
import secrets
import time
from collections.abc import Callable
from typing import Any, Final
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from aiohttp import web
from aiohttp.typedefs import Handler, Middleware

from proxy.config import ServerConfig
from proxy.http.errors import error_response
from proxy.observe.ui.login import LOGIN_CSP, login_page
from proxy.observe.ui.page import LOGIN_PATH, LOGOUT_PATH, UI_PATH

ADMIN_PREFIX = "/detproxy/"
HEALTH = "/detproxy/health"

SESSION_COOKIE = "detproxy_session"
LOGIN_COOKIE = "detproxy_login"  # the login form's double-submit nonce
LOGIN_COOKIE_TTL_S = 3600
COOKIE_PATH = ADMIN_PREFIX
CSRF_FIELD = "csrf"
CSRF_HEADER = "X-Detproxy-Csrf"
MAX_FORM_BYTES = 16 * 1024
LOGIN_FAILURES = 10  # per process, in any LOGIN_WINDOW_S
LOGIN_WINDOW_S = 60.0
_CLOCK_SLACK_S = 60  # a cookie's expiry may be this much past now + ttl (clocks, a lowered ttl)
_SAFE = frozenset({"GET", "HEAD", "OPTIONS"})
_VERSION = "v1"
# aiohttp >= 3.12 asks for typed request keys; older ones take a string.
_SESSION_CSRF: Final[Any] = (
    web.RequestKey("detproxy_session_csrf", str)
    if hasattr(web, "RequestKey")
    else "detproxy_session_csrf"
)


def _mac(key: bytes, message: str) -> str:
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def derive_key(admin_token: str, purpose: str) -> bytes:
    """A key of its own for each use of the token, the same in every process that has it."""
    return hmac.new(admin_token.encode(), purpose.encode(), hashlib.sha256).digest()


class Sessions:
    """Session cookies and CSRF tokens, made and checked with keys derived from the admin
    token: nothing stored, nothing shared between workers."""

    def __init__(
        self, admin_token: str, ttl_s: int, clock: Callable[[], float] = time.time
    ) -> None:
        self._session_key = derive_key(admin_token, "detproxy-session")
        self._csrf_key = derive_key(admin_token, "detproxy-csrf")
        self._token = admin_token.encode()
        self.ttl_s = ttl_s
        self._clock = clock

    def token_matches(self, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self._token)

    def issue(self) -> str:
        expiry = int(self._clock()) + self.ttl_s
        body = f"{_VERSION}.{expiry}.{secrets.token_urlsafe(12)}"
        return f"{body}.{_mac(self._session_key, body)}"

    def valid(self, value: str) -> bool:
        """Made with this key, not expired, and not lasting longer than the ttl allows."""
        body, _, mac = value.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not parts[1].isascii():
            return False
        if not hmac.compare_digest(mac.encode(), _mac(self._session_key, body).encode()):
            return False
        if not parts[1].isdigit():
            return False
        now = self._clock()
        return now < int(parts[1]) <= now + self.ttl_s + _CLOCK_SLACK_S

    def csrf(self, purpose: str, bound_to: str) -> str:
        """The form token for ``bound_to`` (a session cookie, or the login cookie's nonce)."""
        return _mac(self._csrf_key, f"{purpose}|{bound_to}")

    def csrf_ok(self, purpose: str, bound_to: str, given: str) -> bool:
        return hmac.compare_digest(given.encode(), self.csrf(purpose, bound_to).encode())


class LoginThrottle:
    """At most ``limit`` failed log-ins in any ``window_s`` (per process)."""

    def __init__(
        self,
        limit: int = LOGIN_FAILURES,
        window_s: float = LOGIN_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._failures: collections.deque[float] = collections.deque(maxlen=limit)
        self._window_s = window_s
        self._clock = clock

    def wait_s(self) -> float:
        """How long until the next try is allowed (0: now)."""
        failures = self._failures
        if len(failures) < (failures.maxlen or 0):
            return 0.0
        return max(0.0, failures[0] + self._window_s - self._clock())

    def failed(self) -> None:
        self._failures.append(self._clock())


def local_next(value: str | None) -> str:
    """Where to send a browser after logging in: a path under /detproxy/ on this server (what
    it was going to), never elsewhere; the explorer when in doubt."""
    if not value or len(value) > 2048 or any(c < " " or c in "\\\x7f" for c in value):
        return UI_PATH
    parts = urlsplit(value)
    if parts.scheme or parts.netloc or not value.startswith(ADMIN_PREFIX):
        return UI_PATH
    path = unquote(parts.path)
    normal = posixpath.normpath(path) + ("/" if path.endswith("/") else "")
    if normal != path or normal in (LOGIN_PATH, LOGOUT_PATH):
        return UI_PATH
    return value


def session_csrf(request: web.Request) -> str | None:
    """The CSRF token of the session cookie that authorised ``request`` (None: it came with a
    bearer token, or no admin token is set): the explorer's log-out form carries it."""
    value = request.get(_SESSION_CSRF)
    return value if isinstance(value, str) else None


def _is_https(request: web.Request) -> bool:
    proto = request.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
    return proto == "https" or request.secure


def _cross_site(request: web.Request) -> bool:
    """The browser says the request came from another site (absent: not a browser that
    says, or plain http to a host that is not local; the CSRF token then stands alone)."""
    site = request.headers.get("Sec-Fetch-Site")
    return site is not None and site not in ("same-origin", "none")


async def _form(request: web.Request) -> dict[str, str] | None:
    """A small urlencoded form's text fields; None when the body is too large."""
    length = request.content_length
    if length is not None and length > MAX_FORM_BYTES:
        return None
    body = bytearray()
    while len(body) <= MAX_FORM_BYTES:
        data = await request.content.read(MAX_FORM_BYTES + 1 - len(body))
        if not data:
            break
        body += data
    if len(body) > MAX_FORM_BYTES:
        return None
    if request.content_type != "application/x-www-form-urlencoded":
        return {}
    try:
        pairs = parse_qsl(body.decode(), keep_blank_values=True, max_num_fields=16)
    except (UnicodeDecodeError, ValueError):
        return {}
    return dict(pairs)


def _page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": LOGIN_CSP,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }


def _see_other(location: str) -> web.Response:
    return web.Response(status=303, headers={"Location": location, "Cache-Control": "no-store"})


def _not_allowed(method: str, allowed: str) -> web.Response:
    resp = error_response(405, f"{method} is not allowed here (only {allowed})")
    resp.headers["Allow"] = allowed
    return resp


def _unauthorised() -> web.Response:
    resp = error_response(401, "detproxy admin endpoints need a bearer token")
    resp.headers["WWW-Authenticate"] = 'Bearer realm="detproxy"'
    return resp


class Login:
    """``/detproxy/login`` (GET: the form; POST: the token for a cookie) and
    ``/detproxy/logout`` (POST)."""

    def __init__(self, sessions: Sessions, throttle: LoginThrottle) -> None:
        self.sessions = sessions
        self.throttle = throttle

    def _page(
        self, request: web.Request, next_path: str, status: int = 200, error: str | None = None
    ) -> web.Response:
        """The form, with a fresh login cookie and the token bound to it."""
        nonce = secrets.token_urlsafe(16)
        resp = web.Response(
            text=login_page(next_path, self.sessions.csrf("login", nonce), error),
            status=status,
            content_type="text/html",
            charset="utf-8",
            headers=_page_headers(),
        )
        resp.set_cookie(
            LOGIN_COOKIE,
            nonce,
            max_age=LOGIN_COOKIE_TTL_S,
            path=LOGIN_PATH,
            httponly=True,
            samesite="Strict",
            secure=_is_https(request) or None,
        )
        return resp

    def _logged_in(self, request: web.Request) -> str | None:
        value = request.cookies.get(SESSION_COOKIE)
        return value if value is not None and self.sessions.valid(value) else None

    async def handle(self, request: web.Request) -> web.StreamResponse:
        if request.method in ("GET", "HEAD"):
            next_path = local_next(request.query.get("next"))
            if self._logged_in(request) is not None:
                return _see_other(next_path)
            return self._page(request, next_path)
        if request.method != "POST":
            return _not_allowed(request.method, "GET, POST")
        return await self._post(request)

    async def _post(self, request: web.Request) -> web.StreamResponse:
        if _cross_site(request):
            return self._page(request, UI_PATH, 403, "A log-in from another site is refused.")
        wait = self.throttle.wait_s()
        if wait > 0:
            resp = self._page(
                request,
                UI_PATH,
                429,
                f"Too many wrong tokens: try again in {int(wait) + 1} s.",
            )
            resp.headers["Retry-After"] = str(int(wait) + 1)
            return resp
        form = await _form(request)
        if form is None:
            return self._page(request, UI_PATH, 413, "That form was too large.")
        next_path = local_next(form.get("next"))
        nonce = request.cookies.get(LOGIN_COOKIE)
        if nonce is None or not self.sessions.csrf_ok("login", nonce, form.get(CSRF_FIELD, "")):
            return self._page(
                request,
                next_path,
                403,
                "The log-in form had expired (or cookies are off): try again.",
            )
        if not self.sessions.token_matches(form.get("token", "").strip()):
            self.throttle.failed()
            return self._page(request, next_path, 401, "Wrong token.")
        resp = _see_other(next_path)
        resp.set_cookie(
            SESSION_COOKIE,
            self.sessions.issue(),
            max_age=self.sessions.ttl_s,
            path=COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=_is_https(request) or None,
        )
        resp.del_cookie(LOGIN_COOKIE, path=LOGIN_PATH)
        return resp

    async def logout(self, request: web.Request) -> web.StreamResponse:
        if request.method != "POST":
            return _not_allowed(request.method, "POST")
        session = self._logged_in(request)
        if session is not None:  # a session to end: only its own page may end it
            form = await _form(request) or {}
            given = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
            if _cross_site(request) or not self.sessions.csrf_ok("session", session, given):
                return error_response(
                    403,
                    "log-out needs the CSRF token of this session's own page: reload the"
                    " explorer and log out from there",
                )
        resp = _see_other(LOGIN_PATH)
        resp.set_cookie(
            SESSION_COOKIE,
            "",
            max_age=0,
            path=COOKIE_PATH,
            httponly=True,
            samesite="Strict",
            secure=_is_https(request) or None,
        )
        return resp


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


def _is_ui(path: str) -> bool:
    return path == UI_PATH or path.startswith(UI_PATH + "/")


async def _with_session(
    request: web.Request, handler: Handler, sessions: Sessions, cookie: str
) -> web.StreamResponse:
    """A request the session cookie authorises: unsafe methods need the session's CSRF token."""
    csrf = sessions.csrf("session", cookie)
    if request.method not in _SAFE:
        given = request.headers.get(CSRF_HEADER, "")
        if not given and request.content_type == "application/x-www-form-urlencoded":
            field = (await request.post()).get(CSRF_FIELD)
            given = field if isinstance(field, str) else ""
        if _cross_site(request) or not hmac.compare_digest(given.encode(), csrf.encode()):
            return error_response(
                403, f"a {request.method} with a session cookie needs its CSRF token"
            )
    request[_SESSION_CSRF] = csrf
    return await handler(request)


def admin_guard(config: ServerConfig) -> Middleware:
    expected = (b"Bearer " + config.admin_token.encode()) if config.admin_token else None
    sessions = Sessions(config.admin_token, config.session_ttl_s) if config.admin_token else None
    login = Login(sessions, LoginThrottle()) if sessions is not None else None
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
        if not is_admin or expected is None or sessions is None or login is None:
            return await handler(request)
        if path == LOGIN_PATH:
            return await login.handle(request)
        if path == LOGOUT_PATH:
            return await login.logout(request)
        given = request.headers.get("Authorization")
        if given is not None:  # scripts and Prometheus: as ever
            if hmac.compare_digest(given.encode(), expected):
                return await handler(request)
            return _unauthorised()
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie is not None and sessions.valid(cookie):
            return await _with_session(request, handler, sessions, cookie)
        if _is_ui(path) and request.method in ("GET", "HEAD"):
            return _see_other(f"{LOGIN_PATH}?{urlencode({'next': request.raw_path})}")
        return _unauthorised()

    return guard
