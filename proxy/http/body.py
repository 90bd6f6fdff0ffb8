"""A client's request body: UTF-8 JSON, an object; or a clear 4xx (``BadRequest``; the front
bounds the reading, ``ClientSide.read_body``)."""

from __future__ import annotations

from typing import Any

import orjson


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
