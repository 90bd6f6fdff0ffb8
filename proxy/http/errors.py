"""OpenAI-shaped error bodies (vLLM >= 0.10.1 nesting) and the faults that map to them.

The upstream's faults are detproxy's own exceptions (``proxy.http.h1`` raises them)::

    UpstreamError                 any fault of the upstream's transport; ``kind``: a metrics label
    +-- UpstreamFailure           no response head came: carries the status the client gets
    +-- UpstreamBodyError         the body ended before it was complete (cut, malformed): "reset"
    +-- UpstreamTimeout           the body went silent past the read timeout: "timeout"
                                  (also a TimeoutError, as asyncio's and aiohttp's are)
"""

from __future__ import annotations

from http import HTTPStatus
from typing import TYPE_CHECKING

import orjson

if TYPE_CHECKING:
    from proxy.http.clientside import ClientSide

_TYPES = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestEntityTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
    504: "GatewayTimeoutError",
}


def error_payload(status: int, message: str, param: str | None = None) -> dict[str, object]:
    """The body vLLM answers with: ``{"error": {message, type, param, code}}``."""
    err_type = _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


async def send_error(
    client: ClientSide,
    status: int,
    message: str,
    *,
    param: str | None = None,
    request_id: str | None = None,
) -> None:
    """The error body, and its request id, written to a ``ClientSide``."""
    headers = {"Content-Type": "application/json"}
    if request_id:
        headers["X-Request-Id"] = request_id
    await client.respond(status, headers, orjson.dumps(error_payload(status, message, param)))


def inband_error_event(status: int, message: str) -> bytes:
    """An SSE error event followed by ``[DONE]``, as vLLM ends a stream that broke after headers."""
    return b"data: " + orjson.dumps(error_payload(status, message)) + b"\n\ndata: [DONE]\n\n"


class UpstreamError(Exception):
    """A fault of the upstream's transport (see the module docstring for the tree)."""

    kind = "error"  # refused | reset | timeout | error: a metrics label


class UpstreamFailure(UpstreamError):
    """The upstream could not produce response headers; carries the status the client gets."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


class UpstreamBodyError(UpstreamError):
    """The upstream's body ended before it was complete: cut short, or malformed."""

    kind = "reset"


class UpstreamTimeout(UpstreamError, TimeoutError):
    """The upstream sent nothing within the read timeout while a body was being read."""

    kind = "timeout"
