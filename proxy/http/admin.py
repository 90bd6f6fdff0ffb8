"""detproxy's own endpoints (``/detproxy/...``), and who may see them.

The lean front (``proxy.http.front``) serves them on its listeners as it serves the proxied
routes: ``Admin.serve`` reads the request as an ``AdminRequest``, guards it, routes it, and
writes the handler's ``Reply`` whole.

With ``server.admin_token`` set, every admin endpoint but health asks for
``Authorization: Bearer <token>`` (Prometheus sends it with ``authorization`` in its scrape
config). With ``server.admin_port`` set, the admin endpoints are served only on that listener
(health stays on both, for probes), and that listener serves nothing else.

Nothing is open by accident: without a token, a listener bound to an address other machines
can reach (a wildcard such as 0.0.0.0 or ::, or any address but loopback) serves only health
and metrics, for probes and scrapes; status, incidents and the explorer answer 403, saying how
to open them (``server.admin_token``, or ``server.admin_port`` on a loopback
``server.admin_host``). The listener's bound address decides, not the client's: a connection
forwarded to it from this machine (``kubectl port-forward``, a sidecar) comes from loopback.

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
login page sets (double submit). Origin is not compared with Host (a proxy in front may rewrite
Host). Failed log-ins are limited per process (10 a minute; then 429 until the oldest is a
minute old), counted for the whole process: behind an ingress every request comes from one
address.
"""

from __future__ import annotations

import base64
import collections
import hashlib
import hmac
import ipaddress
import posixpath
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from http.cookies import CookieError, SimpleCookie
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

import orjson
from multidict import CIMultiDict, MultiDict, MultiDictProxy

from proxy.config import ServerConfig
from proxy.http.body import BadRequest
from proxy.http.clientside import ClientSide
from proxy.http.errors import error_payload, send_error
from proxy.observe.ui.login import LOGIN_CSP, login_page
from proxy.observe.ui.page import LOGIN_PATH, LOGOUT_PATH, UI_PATH

ADMIN_PREFIX = "/detproxy/"
HEALTH = "/detproxy/health"
METRICS = "/detproxy/metrics"
# What a listener others can reach serves without a token: probes and scrapes need no more.
OPEN_PATHS = frozenset({HEALTH, METRICS})
CLOSED = (
    "only /detproxy/health and /detproxy/metrics are served here: this listener's address is"
    " not loopback and server.admin_token is not set; set server.admin_token"
    " (DETPROXY_SERVER__ADMIN_TOKEN) and send it as 'Authorization: Bearer <token>', or serve"
    " the admin endpoints on server.admin_port with server.admin_host a loopback address"
)

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
_FORM = "application/x-www-form-urlencoded"


def _mac(key: bytes, message: str) -> str:
    digest = hmac.new(key, message.encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _raw(value: str) -> bytes:
    """A value given by the client as its bytes came (a header's byte that is not UTF-8, a
    surrogate escape once decoded, included), to compare: never an error."""
    return value.encode("utf-8", "surrogateescape")


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
        return hmac.compare_digest(_raw(given), self._token)

    def issue(self) -> str:
        expiry = int(self._clock()) + self.ttl_s
        body = f"{_VERSION}.{expiry}.{secrets.token_urlsafe(12)}"
        return f"{body}.{_mac(self._session_key, body)}"

    def valid(self, value: str) -> bool:
        """Made with this key, not expired, and not lasting longer than the ttl allows."""
        body, _, mac = value.rpartition(".")
        parts = body.split(".")
        if len(parts) != 3 or parts[0] != _VERSION or not body.isascii():
            return False
        if not hmac.compare_digest(_raw(mac), _mac(self._session_key, body).encode()):
            return False
        if not parts[1].isdigit():
            return False
        now = self._clock()
        return now < int(parts[1]) <= now + self.ttl_s + _CLOCK_SLACK_S

    def csrf(self, purpose: str, bound_to: str) -> str:
        """The form token for ``bound_to`` (a session cookie, or the login cookie's nonce)."""
        return _mac(self._csrf_key, f"{purpose}|{bound_to}")

    def csrf_ok(self, purpose: str, bound_to: str, given: str) -> bool:
        return hmac.compare_digest(_raw(given), self.csrf(purpose, bound_to).encode())


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


class AdminRequest:
    """A request for an admin endpoint, as its handler reads it (a ``ClientSide`` underneath)."""

    __slots__ = (
        "_client",
        "_form",
        "headers",
        "match",
        "method",
        "path",
        "query",
        "raw_path",
        "session_csrf",
    )

    def __init__(self, client: ClientSide) -> None:
        self._client = client
        self.method = client.method
        self.path = client.path
        self.raw_path = client.raw_path
        self.headers = client.headers
        query = urlsplit(client.raw_path).query
        self.query: MultiDictProxy[str] = MultiDictProxy(
            MultiDict(parse_qsl(query, keep_blank_values=True))
        )
        self.match = ""  # the path's last part, for a route added with ``add_under``
        # The CSRF token of the session cookie that authorised the request (None: it came with
        # a bearer token, or no admin token is set): the explorer's log-out form carries it.
        self.session_csrf: str | None = None
        self._form: dict[str, str] | None = None

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    @property
    def cookies(self) -> Mapping[str, str]:
        jar: SimpleCookie = SimpleCookie()
        try:
            jar.load(self.headers.get("Cookie", ""))
        except CookieError:
            return {}
        return {name: morsel.value for name, morsel in jar.items()}

    @property
    def is_https(self) -> bool:
        """As a TLS-terminating proxy in front says (the front itself speaks plain HTTP)."""
        proto = self.headers.get("X-Forwarded-Proto", "").split(",")[0].strip().lower()
        return proto == "https"

    @property
    def cross_site(self) -> bool:
        """The browser says the request came from another site (absent: not a browser that
        says, or plain http to a host that is not local; the CSRF token then stands alone)."""
        site = self.headers.get("Sec-Fetch-Site")
        return site is not None and site not in ("same-origin", "none")

    async def form(self) -> dict[str, str] | None:
        """A small urlencoded form's text fields, read once; None when the body is too large."""
        if self._form is None:
            try:
                body = await self._client.read_body(MAX_FORM_BYTES)
            except BadRequest:
                return None
            self._form = {}
            if self.content_type == _FORM:
                try:
                    text = body.decode()
                    self._form = dict(parse_qsl(text, keep_blank_values=True, max_num_fields=16))
                except (UnicodeDecodeError, ValueError):
                    pass
        return self._form


class Reply:
    """An admin endpoint's whole response."""

    __slots__ = ("body", "headers", "status")

    def __init__(
        self,
        status: int = 200,
        body: bytes = b"",
        content_type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        self.status = status
        self.body = body
        self.headers: CIMultiDict[str] = CIMultiDict(headers or {})
        if content_type is not None:
            self.headers["Content-Type"] = content_type

    def set_cookie(self, name: str, value: str, *, max_age: int, path: str, secure: bool) -> None:
        """HttpOnly and SameSite=Strict, as every cookie of detproxy's is."""
        jar: SimpleCookie = SimpleCookie()
        jar[name] = value
        morsel = jar[name]
        morsel["max-age"] = str(max_age)
        morsel["path"] = path
        morsel["httponly"] = True
        morsel["samesite"] = "Strict"
        if max_age == 0:
            morsel["expires"] = "Thu, 01 Jan 1970 00:00:00 GMT"
        if secure:
            morsel["secure"] = True
        self.headers.add("Set-Cookie", morsel.OutputString())


def json_reply(data: object, status: int = 200) -> Reply:
    return Reply(status, orjson.dumps(data, option=orjson.OPT_NON_STR_KEYS), "application/json")


def error_reply(status: int, message: str, param: str | None = None) -> Reply:
    """The OpenAI-shaped error body (``proxy.http.errors``), as an admin reply."""
    return json_reply(error_payload(status, message, param), status)


def html_reply(text: str, status: int = 200, headers: Mapping[str, str] | None = None) -> Reply:
    return Reply(status, text.encode(), "text/html; charset=utf-8", headers)


Handler = Callable[[AdminRequest], Awaitable[Reply]]
ClientHandler = Callable[[ClientSide], Awaitable[None]]


def _page_headers() -> dict[str, str]:
    return {
        "Content-Security-Policy": LOGIN_CSP,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        "X-Frame-Options": "DENY",
        "Referrer-Policy": "no-referrer",
    }


def _see_other(location: str) -> Reply:
    return Reply(303, headers={"Location": location, "Cache-Control": "no-store"})


def _not_allowed(method: str, allowed: str) -> Reply:
    reply = error_reply(405, f"{method} is not allowed here (only {allowed})")
    reply.headers["Allow"] = allowed
    return reply


def _unauthorised() -> Reply:
    reply = error_reply(401, "detproxy admin endpoints need a bearer token")
    reply.headers["WWW-Authenticate"] = 'Bearer realm="detproxy"'
    return reply


class Login:
    """``/detproxy/login`` (GET: the form; POST: the token for a cookie) and
    ``/detproxy/logout`` (POST)."""

    def __init__(self, sessions: Sessions, throttle: LoginThrottle) -> None:
        self.sessions = sessions
        self.throttle = throttle

    def _page(
        self, request: AdminRequest, next_path: str, status: int = 200, error: str | None = None
    ) -> Reply:
        """The form, with a fresh login cookie and the token bound to it."""
        nonce = secrets.token_urlsafe(16)
        page = login_page(next_path, self.sessions.csrf("login", nonce), error)
        reply = html_reply(page, status, _page_headers())
        reply.set_cookie(
            LOGIN_COOKIE,
            nonce,
            max_age=LOGIN_COOKIE_TTL_S,
            path=LOGIN_PATH,
            secure=request.is_https,
        )
        return reply

    def _logged_in(self, request: AdminRequest) -> str | None:
        value = request.cookies.get(SESSION_COOKIE)
        return value if value is not None and self.sessions.valid(value) else None

    async def handle(self, request: AdminRequest) -> Reply:
        if request.method in ("GET", "HEAD"):
            next_path = local_next(request.query.get("next"))
            if self._logged_in(request) is not None:
                return _see_other(next_path)
            return self._page(request, next_path)
        if request.method != "POST":
            return _not_allowed(request.method, "GET, POST")
        return await self._post(request)

    async def _post(self, request: AdminRequest) -> Reply:
        if request.cross_site:
            return self._page(request, UI_PATH, 403, "A log-in from another site is refused.")
        wait = self.throttle.wait_s()
        if wait > 0:
            reply = self._page(
                request,
                UI_PATH,
                429,
                f"Too many wrong tokens: try again in {int(wait) + 1} s.",
            )
            reply.headers["Retry-After"] = str(int(wait) + 1)
            return reply
        form = await request.form()
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
        reply = _see_other(next_path)
        reply.set_cookie(
            SESSION_COOKIE,
            self.sessions.issue(),
            max_age=self.sessions.ttl_s,
            path=COOKIE_PATH,
            secure=request.is_https,
        )
        reply.set_cookie(LOGIN_COOKIE, "", max_age=0, path=LOGIN_PATH, secure=False)
        return reply

    async def logout(self, request: AdminRequest) -> Reply:
        if request.method != "POST":
            return _not_allowed(request.method, "POST")
        session = self._logged_in(request)
        if session is not None:  # a session to end: only its own page may end it
            form = await request.form() or {}
            given = form.get(CSRF_FIELD) or request.headers.get(CSRF_HEADER) or ""
            if request.cross_site or not self.sessions.csrf_ok("session", session, given):
                return error_reply(
                    403,
                    "log-out needs the CSRF token of this session's own page: reload the"
                    " explorer and log out from there",
                )
        reply = _see_other(LOGIN_PATH)
        reply.set_cookie(SESSION_COOKIE, "", max_age=0, path=COOKIE_PATH, secure=request.is_https)
        return reply


def is_loopback(address: str) -> bool:
    """Whether only this machine can connect to a listener bound to ``address`` (an IP as the
    socket reports it): 127.0.0.0/8, ::1 and their IPv4-mapped forms. A wildcard (0.0.0.0,
    ::) takes connections on every address this machine has: not loopback."""
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])  # an IPv6 scope: not the address
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


def serves_all(admin_token: str | None, address: str) -> bool:
    """Whether a listener bound to ``address`` serves every admin endpoint: the token guards
    them, or only this machine can connect. Otherwise only ``OPEN_PATHS``."""
    return bool(admin_token) or is_loopback(address)


def _is_ui(path: str) -> bool:
    return path == UI_PATH or path.startswith(UI_PATH + "/")


class Admin:
    """detproxy's own endpoints: GET routes (HEAD answered as GET), behind the guard the
    configuration asks for (``server.admin_token``); the listeners they are served on decide
    ``server.admin_port`` (``main_listener``, ``admin_listener``), and how much each serves
    its bound address (``serves_all``)."""

    def __init__(self, config: ServerConfig) -> None:
        token = self._token = config.admin_token
        self._expected = ("Bearer " + token).encode() if token else None
        self._sessions = Sessions(token, config.session_ttl_s) if token else None
        self._login = Login(self._sessions, LoginThrottle()) if self._sessions else None
        self._routes: dict[str, Handler] = {}
        self._under: list[tuple[str, Handler]] = []
        self._separate = config.admin_port is not None  # served on a listener of their own

    def add(self, path: str, handler: Handler) -> None:
        self._routes[path] = handler

    @property
    def paths(self) -> frozenset[str]:
        """The exact paths answered (GET and HEAD): what a probe or a scrape may name."""
        return frozenset(self._routes)

    def add_under(self, prefix: str, handler: Handler) -> None:
        """``handler`` for ``prefix`` + one more path segment (``request.match``)."""
        self._under.append((prefix, handler))

    async def serve(self, client: ClientSide) -> None:
        """Answer one admin request, whole."""
        reply = await self.answer(AdminRequest(client))
        await client.respond(reply.status, reply.headers, reply.body)

    async def answer(self, request: AdminRequest) -> Reply:
        path = request.path
        sessions, login = self._sessions, self._login
        if path == HEALTH or self._expected is None or sessions is None or login is None:
            return await self._route(request)
        if path == LOGIN_PATH:
            return await login.handle(request)
        if path == LOGOUT_PATH:
            return await login.logout(request)
        given = request.headers.get("Authorization")
        if given is not None:  # scripts and Prometheus: as ever
            if hmac.compare_digest(_raw(given), self._expected):
                return await self._route(request)
            return _unauthorised()
        cookie = request.cookies.get(SESSION_COOKIE)
        if cookie is not None and sessions.valid(cookie):
            return await self._with_session(request, sessions, cookie)
        if _is_ui(path) and request.method in ("GET", "HEAD"):
            return _see_other(f"{LOGIN_PATH}?{urlencode({'next': request.raw_path})}")
        return _unauthorised()

    async def _with_session(self, request: AdminRequest, sessions: Sessions, cookie: str) -> Reply:
        """A request the session cookie authorises: unsafe methods need the session's CSRF
        token, which the handler gets as ``request.session_csrf``."""
        csrf = sessions.csrf("session", cookie)
        if request.method not in _SAFE:
            given = request.headers.get(CSRF_HEADER, "")
            if not given and request.content_type == _FORM:
                given = (await request.form() or {}).get(CSRF_FIELD, "")
            if request.cross_site or not hmac.compare_digest(_raw(given), csrf.encode()):
                return error_reply(
                    403, f"a {request.method} with a session cookie needs its CSRF token"
                )
        request.session_csrf = csrf
        return await self._route(request)

    async def _route(self, request: AdminRequest) -> Reply:
        path = request.path
        handler = self._routes.get(path) if request.method in ("GET", "HEAD") else None
        if handler is None and request.method in ("GET", "HEAD"):
            for prefix, under in self._under:
                rest = path[len(prefix) :]
                if path.startswith(prefix) and rest and "/" not in rest:
                    request.match, handler = rest, under
                    break
        if handler is None:
            return error_reply(404, f"no detproxy endpoint at {path}")
        return await handler(request)

    def _for(self, address: str) -> ClientHandler:
        """The ``/detproxy/...`` handler of a listener bound to ``address`` (``serves_all``)."""
        if serves_all(self._token, address):
            return self.serve

        async def open_paths_only(client: ClientSide) -> None:
            if client.path in OPEN_PATHS:
                await self.serve(client)
            else:
                await send_error(client, 403, CLOSED)

        return open_paths_only

    def main_listener(
        self, forward: ClientHandler, address: str
    ) -> tuple[ClientHandler, ClientHandler]:
        """The main listener's two handlers (it is bound to ``address``): the proxied routes
        (``forward``) and ``/detproxy/...`` (only health there when the admin endpoints have a
        listener of their own)."""
        if not self._separate:
            return forward, self._for(address)

        async def health_only(client: ClientSide) -> None:
            if client.path == HEALTH:
                await self.serve(client)
            else:
                await send_error(client, 404, f"nothing at {client.path} on this listener")

        return forward, health_only

    def admin_listener(self, address: str) -> tuple[ClientHandler, ClientHandler]:
        """``server.admin_port``'s two handlers (it is bound to ``address``): nothing proxied,
        and ``/detproxy/...``."""

        async def nothing_here(client: ClientSide) -> None:
            await send_error(client, 404, f"nothing at {client.path} on this listener")

        return nothing_here, self._for(address)
