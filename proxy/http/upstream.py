"""The upstream seam: what detproxy sends every request to an engine through (``proxy.http.h1``
implements it; ``proxy.testing.MockUpstream`` in process): the proxied requests, shadows,
triage replays, and the engine-side reads (``proxy.engine``: ``get``).

Closing an ``UpstreamResponse`` before it is fully read closes its TCP connection: that is
how vLLM learns a client went away and aborts the generation. An implementation raises
detproxy's ``UpstreamError`` tree (``proxy.http.errors``): ``send`` an ``UpstreamFailure``, a body
read an ``UpstreamBodyError`` or an ``UpstreamTimeout``.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Protocol
from urllib.parse import unquote, urlsplit

from proxy.http.errors import UpstreamError, UpstreamTimeout
from proxy.http.headers import HeaderFields

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


@dataclass(frozen=True, slots=True)
class Got:
    """A whole answer to ``get``."""

    status: int
    body: bytes


async def get(
    upstream: Upstream, path: str, timeout_s: float, headers: Mapping[str, str] | None = None
) -> Got:
    """``GET path`` (below the upstream's base URL), its status and whole body within
    ``timeout_s``: the engine-side reads. Raises the ``UpstreamError`` tree only (``whole``)."""
    return await whole(upstream, "GET", path, timeout_s, headers)


async def whole(
    upstream: Upstream,
    method: str,
    path: str,
    timeout_s: float,
    headers: Mapping[str, str] | None = None,
    body: bytes | None = None,
) -> Got:
    """One request and its whole answer within ``timeout_s``. Raises the ``UpstreamError``
    tree only: what ``send`` and the body's read raise, and an ``UpstreamTimeout`` past
    ``timeout_s``. Cancelled, the response is closed (its generation aborted)."""
    resp: UpstreamResponse | None = None
    try:
        async with asyncio.timeout(timeout_s):
            resp = await upstream.send(method, path, headers or {}, body)
            return Got(resp.status, await resp.read())
    except UpstreamError:
        raise
    except TimeoutError as exc:
        raise UpstreamTimeout(f"no answer within {timeout_s:g} s") from exc
    finally:
        if resp is not None:
            resp.close()  # read whole: nothing to close; cut short: its connection goes


def url_auth(url: str) -> dict[str, str]:
    """The Basic ``Authorization`` of a URL's credentials (``http://user:pass@host``), as an
    HTTP client sends them for a URL it is given; none without credentials."""
    parts = urlsplit(url)
    if parts.username is None:
        return {}
    user = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return {"Authorization": "Basic " + base64.b64encode(user.encode("latin-1")).decode()}
