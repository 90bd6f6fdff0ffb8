"""The upstream seam: a protocol, and its aiohttp implementation with header hygiene and abort.

Closing an ``UpstreamResponse`` before it is fully read closes its TCP connection: that is
how vLLM learns a client went away and aborts the generation. Both implementations raise
detproxy's ``UpstreamError`` tree (``proxy.http.errors``): ``send`` an ``UpstreamFailure``, a body
read an ``UpstreamBodyError`` or an ``UpstreamTimeout``; the aiohttp one translates aiohttp's.
"""

from __future__ import annotations

import io
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from typing import Any, Protocol

import aiohttp
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.http.errors import UpstreamBodyError, UpstreamError, UpstreamFailure, UpstreamTimeout
from proxy.http.headers import HeaderFields, as_mapping

Body = bytes | AsyncIterable[bytes] | None
LARGE_BODY = 1 << 20
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


# What reading an upstream body raises: both clients raise the UpstreamError tree only.
READ_ERRORS: tuple[type[BaseException], ...] = (UpstreamError,)


def read_error_kind(exc: BaseException) -> str:
    """Name an error raised while reading an upstream body (a metrics label)."""
    if isinstance(exc, UpstreamError):
        return exc.kind
    return "timeout" if isinstance(exc, TimeoutError) else "reset"


def _body_error(exc: Exception) -> UpstreamError:
    """detproxy's error for one of aiohttp's, raised while reading a body."""
    if isinstance(exc, TimeoutError):  # aiohttp's ServerTimeoutError is one
        return UpstreamTimeout(str(exc) or "upstream sent nothing within the read timeout")
    return UpstreamBodyError(str(exc) or type(exc).__name__)


async def pump_chunks(chunks: AsyncIterator[bytes], sink: Sink) -> bool:
    """``pump`` for a response that can only be iterated: ``chunks`` is kept across calls."""
    async for data in chunks:
        if not sink(data):
            return False
    return True


class _AiohttpResponse:
    __slots__ = ("_body", "_resp", "headers", "raw_fields", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self._body: AsyncIterator[bytes] | None = None  # pump's
        self.status: int = resp.status
        self.headers: Mapping[str, str] = resp.headers
        self.raw_fields: list[tuple[bytes, bytes]] | None = list(resp.raw_headers)

    async def pump(self, sink: Sink) -> bool:
        if self._body is None:
            self._body = self.chunks()
        return await pump_chunks(self._body, sink)

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for data in self._resp.content.iter_any():
                yield data
        except (aiohttp.ClientError, OSError) as exc:  # OSError: TimeoutError, resets
            raise _body_error(exc) from exc

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, OSError) as exc:  # OSError: TimeoutError, resets
            raise _body_error(exc) from exc

    def close(self) -> None:
        # close(), not release(): an unfinished response must not go back to the pool.
        self._resp.close()


class AiohttpUpstream:
    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._base = base_url.rstrip("/")

    async def send(
        self, method: str, raw_path: str, fields: HeaderFields, body: Body
    ) -> UpstreamResponse:
        url = URL(self._base + raw_path, encoded=True)
        headers = as_mapping(fields)
        data: Any = body
        if isinstance(body, bytes) and len(body) > LARGE_BODY:
            data = io.BytesIO(body)  # aiohttp streams it instead of one large write
        try:
            try:
                resp = await self._session.request(
                    method, url, headers=headers, data=data, allow_redirects=False
                )
            except aiohttp.ServerDisconnectedError:
                # A pooled keep-alive connection the upstream had already closed (seen with
                # llama.cpp's server under load): nothing was answered, so try once more on a
                # fresh connection. A streamed request body cannot be sent twice.
                if not isinstance(body, bytes | None):
                    raise
                if isinstance(data, io.BytesIO):
                    data.seek(0)
                resp = await self._session.request(
                    method, url, headers=headers, data=data, allow_redirects=False
                )
        except aiohttp.ClientConnectorError as exc:
            raise UpstreamFailure(
                502, f"upstream refused the connection: {exc.os_error}", "refused"
            ) from exc
        except (TimeoutError, aiohttp.ServerTimeoutError) as exc:
            raise UpstreamFailure(
                504, "upstream timed out before sending response headers", "timeout"
            ) from exc
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
            raise UpstreamFailure(
                502, "upstream closed the connection before responding", "reset"
            ) from exc
        except aiohttp.ClientError as exc:
            raise UpstreamFailure(502, f"upstream error: {type(exc).__name__}", "error") from exc
        return _AiohttpResponse(resp)

    async def close(self) -> None:
        """Nothing of its own: the session it sends on is the app's, closed with it."""


def make_session(config: UpstreamConfig) -> aiohttp.ClientSession:
    """The one ClientSession of an app: no total timeout (generations can take hours)."""
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
    )
