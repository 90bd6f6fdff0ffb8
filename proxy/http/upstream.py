"""The upstream seam: what the pipeline sends requests through (``proxy.http.h1`` implements
it), and the aiohttp session of the engine-side reads (``proxy.engine``).

Closing an ``UpstreamResponse`` before it is fully read closes its TCP connection: that is
how vLLM learns a client went away and aborts the generation. An implementation raises
detproxy's ``UpstreamError`` tree (``proxy.http.errors``): ``send`` an ``UpstreamFailure``, a body
read an ``UpstreamBodyError`` or an ``UpstreamTimeout``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Protocol

import aiohttp

from proxy.config import UpstreamConfig
from proxy.http.errors import UpstreamError
from proxy.http.headers import VIA, HeaderFields

Body = bytes | AsyncIterable[bytes] | None
# Takes one body piece; False: stop (``pump`` returns, the rest is read by the next call).
Sink = Callable[[bytes], bool]


class UpstreamResponse(Protocol):
    status: int
    # The same fields as the upstream sent them, (name, value) bytes in order; None where
    # the client keeps no such thing.
    raw_fields: list[tuple[bytes, bytes]] | None

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive, repeated names kept (the native client's, decoded when asked)."""
        ...

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def pump(self, sink: Sink) -> bool:
        """The body to ``sink`` piece by piece; True at its end, False when the sink stopped.
        Read either with ``pump`` or with ``chunks``, not both."""
        ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    async def send(
        self, method: str, raw_path: str, headers: HeaderFields, body: Body
    ) -> UpstreamResponse: ...

    async def close(self) -> None:
        """Release what this client holds (its idle connections); responses are closed first."""


# What reading an upstream body raises: the UpstreamError tree only.
READ_ERRORS: tuple[type[BaseException], ...] = (UpstreamError,)


def read_error_kind(exc: BaseException) -> str:
    """Name an error raised while reading an upstream body (a metrics label)."""
    if isinstance(exc, UpstreamError):
        return exc.kind
    return "timeout" if isinstance(exc, TimeoutError) else "reset"


def make_session(config: UpstreamConfig, server_id: str | None = None) -> aiohttp.ClientSession:
    """The one ClientSession of an app, for its engine-side reads (``proxy.engine``: the
    fingerprint poller, the load reader), which set their own timeouts per request; marked
    with ``X-Detproxy-Via`` as the proxied requests are (proxy/selfloop.py)."""
    timeout = aiohttp.ClientTimeout(
        total=None,
        sock_connect=config.connect_timeout_s,
        sock_read=config.read_timeout_s,
    )
    connector = aiohttp.TCPConnector(
        limit=config.max_connections,
        limit_per_host=0,
        # Below the upstream's own idle timeout (uvicorn, hence vLLM: 5 s), so an idle pooled
        # connection is dropped here before the upstream closes it under a new request.
        keepalive_timeout=config.keepalive_timeout_s,
    )
    return aiohttp.ClientSession(
        connector=connector,
        timeout=timeout,
        auto_decompress=False,  # relay encoded bytes untouched
        cookie_jar=aiohttp.DummyCookieJar(),
        skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding"),
        headers={VIA: server_id} if server_id else None,
    )
