"""``MockUpstream``: detproxy's upstream seam (``proxy.http.upstream``) in process, no socket, as
httpx ships ``MockTransport``; ``MockResponse``: one answer, its body whole or in pieces (or
another upstream's answer passed on as it is read)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Mapping
from types import TracebackType

from multidict import CIMultiDict

from proxy.http.errors import UpstreamBodyError, UpstreamFailure
from proxy.http.headers import HeaderFields, as_mapping
from proxy.http.upstream import Body, Sink, Upstream, UpstreamResponse
from proxy.testing.replies import MODEL, Handler, Received, Reply
from proxy.testing.scripted import Answering


class MockResponse:
    """One answer in memory, as the seam's ``UpstreamResponse``: ``body`` whole, or in pieces
    (a list, or an async iterator: its pieces as they come; what it raises, an
    ``UpstreamBodyError`` say, is what reading the body raises)."""

    def __init__(
        self,
        status: int = 200,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
        body: bytes | Iterable[bytes] | AsyncIterable[bytes] = b"",
    ) -> None:
        pairs = list(headers.items() if isinstance(headers, Mapping) else headers)
        self.status = status
        self.raw_fields: list[tuple[bytes, bytes]] | None = [
            (k.encode("latin-1"), v.encode()) for k, v in pairs
        ]
        self._headers = CIMultiDict(pairs)
        self._body = _pieces(body)
        self.closed = False  # closed before its end (what aborts a generation upstream)
        self.complete = False  # read to its end

    @property
    def headers(self) -> Mapping[str, str]:
        return self._headers

    def chunks(self) -> AsyncIterator[bytes]:
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self.closed or self.complete:
            raise StopAsyncIteration
        try:
            return await anext(self._body)
        except StopAsyncIteration:
            self.complete = True
            raise
        except BaseException:
            self.close()
            raise

    async def pump(self, sink: Sink) -> bool:
        async for piece in self:  # goes on where the last call stopped
            if not sink(piece):
                return False
        return True

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self])

    def close(self) -> None:
        if not self.complete:
            self.closed = True


class PassedResponse(MockResponse):
    """Another upstream's answer passed on as it is read (``MockUpstream(forward=...)``): its
    status and fields as they came; closing this closes that one too."""

    def __init__(self, passed: UpstreamResponse) -> None:
        super().__init__(passed.status, list(passed.headers.items()), passed.chunks())
        if passed.raw_fields is not None:
            self.raw_fields = passed.raw_fields
        self._passed = passed

    def close(self) -> None:
        super().close()
        self._passed.close()


async def _pieces(body: bytes | Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    if isinstance(body, bytes):
        if body:
            yield body
    elif isinstance(body, AsyncIterable):
        async for piece in body:
            yield piece
    else:
        for piece in body:
            yield piece


async def _events(reply: Reply) -> AsyncIterator[bytes]:
    for i, event in enumerate(reply.events or ()):
        if i == reply.cut_after:
            raise UpstreamBodyError("upstream closed the connection mid-answer")
        if i and reply.interval_s:
            await asyncio.sleep(reply.interval_s)  # the fake's pace
        yield event
    if reply.cut_after is not None:
        raise UpstreamBodyError("upstream closed the connection mid-answer")
    if reply.end_delay_s:
        await asyncio.sleep(reply.end_delay_s)  # the fake's late end


async def _as_response(reply: Reply) -> MockResponse:
    """A ``Reply`` as ``MockResponse``: its delay waited, a cut raised as a client would."""
    if reply.delay_s:
        await asyncio.sleep(reply.delay_s)
    if reply.events is None and reply.cut_after == 0:
        raise UpstreamFailure(502, "upstream closed the connection before responding", "reset")
    if reply.events is None:
        head = (*reply.headers, ("Content-Length", str(len(reply.body))))
        return MockResponse(reply.status, head, reply.body)
    return MockResponse(reply.status, reply.headers, _events(reply))


class MockUpstream(Answering):
    """detproxy's upstream seam in process (no socket): each request is recorded in
    ``requests``, then answered by the first of: the replies ``script()`` queued for its path,
    the reply ``on()`` (or ``routes``) set for its path, the upstream at ``forward`` (an engine
    or the emulator through ``proxy.http.h1.H1Upstream``, say: the caller's, not closed here),
    the ``handler`` (by default ``answers()``; ``not_found`` where ``routes`` are given without
    a handler). ``responses``:
    what it answered, in order (a test reads whether one was closed before its end). A handler
    that raises answers 500 and its error is raised again by ``close`` (or the ``async with``
    block's end); one that raises an ``UpstreamError`` (``UpstreamFailure(502, "...",
    "refused")``, say) makes ``send`` raise it, as a client does on that fault."""

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        routes: Mapping[str, Reply | Handler] | None = None,
        forward: Upstream | None = None,
        model: str = MODEL,
    ) -> None:
        if handler is not None and forward is not None:
            raise ValueError("MockUpstream answers with a handler or forwards, not both")
        super().__init__(handler, routes, model)
        self._forward = forward
        self.responses: list[MockResponse] = []

    async def send(
        self, method: str, raw_path: str, headers: HeaderFields, body: Body
    ) -> MockResponse:
        path, _, query = raw_path.partition("?")
        if body is None or isinstance(body, bytes):
            data = body or b""
        else:
            data = b"".join([piece async for piece in body])
        request = Received(method, path, query, CIMultiDict(as_mapping(headers)), data)
        self.requests.append(request)
        got = self._next(path)
        if got is None and self._forward is not None:
            passed = await self._forward.send(
                method, raw_path, headers, None if body is None else data
            )
            resp: MockResponse = PassedResponse(passed)
            self.responses.append(resp)
            return resp
        answer = await self._answer(got or self._handler, request)
        resp = answer if isinstance(answer, MockResponse) else await _as_response(answer)
        self.responses.append(resp)
        return resp

    async def close(self) -> None:
        self._raise_errors()

    async def __aenter__(self) -> MockUpstream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self._raise_errors()


def _implements_the_seam(
    mock: MockUpstream, resp: MockResponse
) -> tuple[Upstream, UpstreamResponse]:
    """Never called: here mypy checks that the mocks implement the seam's protocols."""
    return mock, resp
