"""Reading a client's request body: bounded, UTF-8 JSON, an object; or a clear 4xx."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web


class BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def ensure_json_content_type(value: str | None) -> None:
    """``value``: the request's Content-Type."""
    if value == "application/json":
        return  # what clients send: no parameters to parse
    mime, _, params = (value or "").partition(";")
    if mime.strip().lower() != "application/json":
        raise BadRequest(400, "Content-Type must be application/json")
    charset = _param(params, "charset")
    if charset and charset.lower().replace("_", "-") not in ("utf-8", "utf8"):
        raise BadRequest(400, f"unsupported charset {charset!r}: the body must be UTF-8 JSON")


def _param(params: str, name: str) -> str | None:
    """One parameter of a media type (``; charset="utf-8"``), unquoted."""
    for part in params.split(";"):
        key, eq, value = part.partition("=")
        if eq and key.strip().lower() == name:
            return value.strip().strip('"')
    return None


async def read_bounded(request: web.Request, limit: int) -> bytes:
    declared = request.content_length
    if declared is not None and declared > limit:
        raise BadRequest(413, f"request body of {declared} bytes exceeds the limit of {limit}")
    content = request.content
    if content.is_eof():
        # The whole body is buffered already (a small body came with the headers).
        body = content.read_nowait()
        if len(body) > limit:
            raise BadRequest(413, f"request body exceeds the limit of {limit} bytes")
        return body
    parts: list[bytes] = []
    size = 0
    async for part in content.iter_any():
        size += len(part)
        if size > limit:
            raise BadRequest(413, f"request body exceeds the limit of {limit} bytes")
        parts.append(part)
    return b"".join(parts)


def parse_answer(payload: bytes) -> dict[str, Any] | None:
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        return None
    return parsed if isinstance(parsed, dict) else None


def parse_object(body: bytes) -> dict[str, Any]:
    try:
        parsed = orjson.loads(body)
    except orjson.JSONDecodeError:
        try:
            body.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(400, "request body is not valid UTF-8") from None
        raise BadRequest(400, "request body is not valid JSON") from None
    if not isinstance(parsed, dict):
        raise BadRequest(400, "request body must be a JSON object")
    return parsed
