"""The upstream seam: a protocol, and its aiohttp implementation with header hygiene and abort.

Closing an ``UpstreamResponse`` before it is fully read closes its TCP connection: that is
how vLLM learns a client went away and aborts the generation.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any, Protocol

import aiohttp
from yarl import URL

from proxy.config import UpstreamConfig
from proxy.errors import UpstreamFailure

Body = bytes | AsyncIterable[bytes] | None
LARGE_BODY = 1 << 20


class UpstreamResponse(Protocol):
    status: int
    headers: Mapping[str, str]

    def chunks(self) -> AsyncIterator[bytes]: ...

    async def read(self) -> bytes: ...

    def close(self) -> None: ...


class Upstream(Protocol):
    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: Body
    ) -> UpstreamResponse: ...


# What reading an upstream body can raise (the native client's UpstreamBodyError included).
READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


def is_event_stream(upstream: UpstreamResponse) -> bool:
    return upstream.headers.get("Content-Type", "").startswith("text/event-stream")


def read_error_kind(exc: BaseException) -> str:
    """Name an error raised while reading an upstream body (a metrics label)."""
    if isinstance(exc, asyncio.TimeoutError | aiohttp.ServerTimeoutError):
        return "timeout"
    return "reset"


class _AiohttpResponse:
    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status: int = resp.status
        self.headers: Mapping[str, str] = resp.headers

    def chunks(self) -> AsyncIterator[bytes]:
        return self._resp.content.iter_any()

    async def read(self) -> bytes:
        return await self._resp.read()

    def close(self) -> None:
        # close(), not release(): an unfinished response must not go back to the pool.
        self._resp.close()


class AiohttpUpstream:
    def __init__(self, session: aiohttp.ClientSession, base_url: str) -> None:
        self._session = session
        self._base = base_url.rstrip("/")

    async def send(
        self, method: str, raw_path: str, headers: Mapping[str, str], body: Body
    ) -> UpstreamResponse:
        url = URL(self._base + raw_path, encoded=True)
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
