"""OpenAI-shaped error bodies (vLLM >= 0.10.1 nesting) and the faults that map to them."""

from __future__ import annotations

from http import HTTPStatus

import orjson
from aiohttp import web

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


def error_response(
    status: int, message: str, *, param: str | None = None, request_id: str | None = None
) -> web.Response:
    headers = {"X-Request-Id": request_id} if request_id else None
    return web.Response(
        status=status,
        body=orjson.dumps(error_payload(status, message, param)),
        content_type="application/json",
        headers=headers,
    )


def inband_error_event(status: int, message: str) -> bytes:
    """An SSE error event followed by ``[DONE]``, as vLLM ends a stream that broke after headers."""
    return b"data: " + orjson.dumps(error_payload(status, message)) + b"\n\ndata: [DONE]\n\n"


class UpstreamFailure(Exception):
    """The upstream could not produce response headers; carries the status the client gets."""

    def __init__(self, status: int, message: str, kind: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind  # refused | reset | timeout | error: a metrics label
