"""Reading a client's body: already buffered or still arriving, bounded either way."""

from __future__ import annotations

import asyncio
from unittest import mock

import pytest
from aiohttp import web
from aiohttp.base_protocol import BaseProtocol
from aiohttp.streams import StreamReader
from aiohttp.test_utils import make_mocked_request

from proxy.http.body import BadRequest, ensure_json_content_type, read_bounded


def request(
    body: bytes | None, *, eof: bool = True, content_type: str = "application/json"
) -> tuple[web.Request, StreamReader]:
    loop = asyncio.get_running_loop()
    protocol = BaseProtocol(loop)
    protocol.connection_made(mock.Mock())  # a connection the rest of the body may come on
    payload = StreamReader(protocol, 2**16, loop=loop)
    if body is not None:
        payload.feed_data(body)
    if eof:
        payload.feed_eof()
    headers = {"Content-Type": content_type}  # no Content-Length: as with a chunked body
    return make_mocked_request("POST", "/v1/completions", headers, payload=payload), payload


async def test_a_buffered_body_is_read_whole_and_bounded() -> None:
    req, _ = request(b'{"a": 1}')
    assert await read_bounded(req, 8) == b'{"a": 1}'
    req, _ = request(b'{"a": 12}')
    with pytest.raises(BadRequest) as exc:
        await read_bounded(req, 8)
    assert exc.value.status == 413
    req, _ = request(None)
    assert await read_bounded(req, 8) == b""


async def test_a_body_still_arriving_is_read_to_its_end_and_bounded() -> None:
    req, payload = request(b'{"a"', eof=False)
    reading = asyncio.ensure_future(read_bounded(req, 100))
    await asyncio.sleep(0)
    assert not reading.done()
    payload.feed_data(b": 1}")
    payload.feed_eof()
    assert await reading == b'{"a": 1}'

    req, payload = request(b"x" * 8, eof=False)
    reading = asyncio.ensure_future(read_bounded(req, 10))
    await asyncio.sleep(0)
    payload.feed_data(b"x" * 8)  # past the limit before the end: 413 without waiting for it
    with pytest.raises(BadRequest) as exc:
        await reading
    assert exc.value.status == 413


@pytest.mark.parametrize(
    ("content_type", "ok"),
    [
        ("application/json", True),
        ("application/json; charset=utf-8", True),
        ("Application/JSON", True),
        ("application/json; charset=latin-1", False),
        ("application/jsonl", False),
        ("text/plain", False),
    ],
)
async def test_content_type(content_type: str, ok: bool) -> None:
    req, _ = request(b"{}", content_type=content_type)
    if ok:
        ensure_json_content_type(req.headers.get("Content-Type"))
    else:
        with pytest.raises(BadRequest):
            ensure_json_content_type(req.headers.get("Content-Type"))
