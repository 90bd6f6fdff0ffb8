"""``FakeUpstream``: a fake upstream on a socket of 127.0.0.1, in the test's event loop, for what
is about the wire or another process (``detproxy serve --upstream``); or forwarding to a real
server, recording on the way."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Mapping
from types import TracebackType

from aiohttp import web
from multidict import CIMultiDict

from proxy.http.errors import UpstreamBodyError, UpstreamError, UpstreamFailure
from proxy.http.h1 import H1Upstream
from proxy.testing.mock import MockResponse
from proxy.testing.replies import MODEL, Handler, Received, Reply
from proxy.testing.scripted import Answering

_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "upgrade"})
_NOT_PASSED = _HOP | {"content-length"}  # a forwarded request's: its client writes it


class FakeUpstream(Answering):
    """An OpenAI-compatible server on a free port of 127.0.0.1 while the ``async with``
    block runs; ``url`` is its base URL (detproxy's ``--upstream``). Each request is
    recorded in ``requests``, then answered by the first of: the replies ``script()`` queued
    for its path (one each, in order), the reply ``on()`` (or ``routes``) set for its path, the
    server at ``forward``, the ``handler`` (by default ``answers()``; ``not_found`` where
    ``routes`` are given without a handler). A handler that raises answers 500, and its
    error is raised again when the block ends."""

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        routes: Mapping[str, Reply | Handler] | None = None,
        forward: str | None = None,
        model: str = MODEL,
    ) -> None:
        if handler is not None and forward is not None:
            raise ValueError("FakeUpstream answers with a handler or forwards, not both")
        super().__init__(handler, routes, model)
        self._forward = forward.rstrip("/") if forward else None
        self._runner: web.AppRunner | None = None
        self._client: H1Upstream | None = None  # to ``forward``
        self._url: str | None = None

    @property
    def url(self) -> str:
        if self._url is None:
            raise RuntimeError("FakeUpstream.url is known inside its `async with` block")
        return self._url

    async def __aenter__(self) -> FakeUpstream:
        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        runner = web.AppRunner(app, handle_signals=False, access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(runner, sock).start()
        except BaseException:
            sock.close()
            await runner.cleanup()
            raise
        self._runner = runner
        if self._forward is not None:
            self._client = H1Upstream(self._forward)
        self._url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        runner, client = self._runner, self._client
        self._runner, self._client, self._url = None, None, None
        if client is not None:
            await client.close()
        if runner is not None:
            await runner.cleanup()
        if exc is None:
            self._raise_errors()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        got = Received(
            request.method,
            request.path,
            request.query_string,
            request.headers,
            await request.read(),
        )
        self.requests.append(got)
        reply = self._next(got.path)
        if reply is None and self._client is not None:
            return await self._pass_on(request, got, self._client)
        answer = await self._answer(reply or self._handler, got)
        if isinstance(answer, MockResponse):
            return await _send_response(request, answer)
        return await _send(request, answer)

    async def _pass_on(
        self, request: web.Request, got: Received, client: H1Upstream
    ) -> web.StreamResponse:
        """Through detproxy's own upstream client: the request as it came (its length is
        the client's to write), the answer passed on as it is read."""
        headers = CIMultiDict(
            (k, v) for k, v in request.headers.items() if k.lower() not in _NOT_PASSED
        )
        try:
            answer = await client.send(got.method, request.path_qs, headers, got.body)
        except UpstreamFailure as exc:
            return web.Response(status=exc.status, text=exc.message)
        try:
            resp = web.StreamResponse(status=answer.status)
            for key, value in answer.headers.items():
                if key.lower() not in _HOP:
                    resp.headers.add(key, value)
            await resp.prepare(request)
            try:
                async for data in answer.chunks():
                    await resp.write(data)
                await resp.write_eof()
            except ConnectionResetError:
                pass  # the client (detproxy) left
            except UpstreamError:
                return _cut(request, resp)  # as the engine cut it
            return resp
        finally:
            answer.close()


async def _send(request: web.Request, reply: Reply) -> web.StreamResponse:
    if reply.delay_s:
        await asyncio.sleep(reply.delay_s)
    if reply.events is None and reply.cut_after == 0:
        return _cut(request, web.StreamResponse())
    resp = web.StreamResponse(status=reply.status)
    for key, value in reply.headers:
        resp.headers.add(key, value)
    if reply.events is None:
        resp.content_length = len(reply.body)
        await resp.prepare(request)
        await resp.write(reply.body)
        await resp.write_eof()
        return resp
    await resp.prepare(request)
    try:
        for i, event in enumerate(reply.events):
            if i == reply.cut_after:
                return _cut(request, resp)
            if i and reply.interval_s:
                await asyncio.sleep(reply.interval_s)
            await resp.write(event)
        if reply.cut_after is not None:
            return _cut(request, resp)
        if reply.end_delay_s:
            await asyncio.sleep(reply.end_delay_s)  # the fake's late end
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client (detproxy) left
    return resp


async def _send_response(request: web.Request, answer: MockResponse) -> web.StreamResponse:
    resp = web.StreamResponse(status=answer.status)
    for key, value in answer.headers.items():
        resp.headers.add(key, value)
    await resp.prepare(request)
    try:
        async for piece in answer.chunks():
            await resp.write(piece)
    except UpstreamBodyError:
        return _cut(request, resp)
    await resp.write_eof()
    return resp


def _cut(request: web.Request, resp: web.StreamResponse) -> web.StreamResponse:
    """Close the connection where the answer is now: what was written is flushed first."""
    if request.transport is not None:
        request.transport.close()
    return resp
