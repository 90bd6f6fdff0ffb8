"""A fake OpenAI-compatible upstream to test a detproxy configuration or policy against, that
answers each request as the test scripted it and records what it received; in two kinds:

- ``MockUpstream``: in process, no socket (as httpx ships ``MockTransport``): it implements
  detproxy's upstream seam (``proxy.http.upstream.Upstream``) and is given to the app,
  ``build_app(settings, upstream=MockUpstream(handler))``; every request detproxy makes to the
  engine (proxied, shadows, replays, its reads of /version, /metrics, ...) goes to it. A
  handler returns a ``Reply`` or a ``MockResponse`` (whose body may be any iterable or async
  iterable of byte pieces), or raises the ``UpstreamError`` a real client would;
- ``FakeUpstream``: an HTTP server on 127.0.0.1, in the test's own event loop, for what is
  about sockets or another process (``detproxy serve`` started with ``--upstream``).

Both answer alike (``script``, ``on``, a handler; ``received``, ``bodies``). Usage, in an async
test (pytest-asyncio or pytest-aiohttp)::

    from proxy.testing import FakeUpstream, Reply, chat_stream

    async def test_a_cut_stream_then_a_refusal() -> None:
        async with FakeUpstream() as upstream:  # answers "Hello!" where nothing is scripted
            upstream.script(
                "/v1/chat/completions",
                Reply.sse(chat_stream(["Hel", "lo"]), cut_after=2),  # 1st request: cut short
                Reply.error(503, "overloaded"),  # 2nd: refused; the 3rd gets "Hello!"
            )
            ...  # start detproxy with --upstream upstream.url, send requests through it
            first, *_ = upstream.received("/v1/chat/completions")
            assert first.json()["stream"] is True

The server runs in the test's event loop: wait on detproxy (a ``detproxy serve`` child
process, say) with async calls, never blocking ones. What no script answers, a handler does:
``FakeUpstream(handler)`` with a function of the ``Received`` request that returns a ``Reply``
(or an awaitable of one; ``answers()`` is the default), or ``FakeUpstream(forward=url)``, which
passes it on to a real server (an engine, the emulator) and records it on the way.
``on(path, reply)``, or ``routes``, answers every request to a path.
"""

from __future__ import annotations

import asyncio
import inspect
import re
import socket
from collections import deque
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Mapping,
    Sequence,
)
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeAlias

import orjson
from aiohttp import web
from multidict import CIMultiDict

from proxy.http.errors import UpstreamBodyError, UpstreamError, UpstreamFailure
from proxy.http.h1 import H1Upstream
from proxy.http.headers import HeaderFields, as_mapping
from proxy.http.upstream import Body, Sink, Upstream, UpstreamResponse

__all__ = [
    "FakeUpstream",
    "Handler",
    "MockResponse",
    "MockUpstream",
    "Received",
    "Reply",
    "answers",
    "chat_answer",
    "chat_chunk",
    "chat_stream",
    "completion_answer",
    "completion_stream",
    "not_found",
]

MODEL = "fake-model"


@dataclass(frozen=True, slots=True)
class Received:
    """One request the fake upstream received, as it came."""

    method: str
    path: str
    query: str
    headers: Mapping[str, str]  # case-insensitive
    body: bytes

    def json(self) -> Any:
        """The body as JSON; None where there was no body."""
        return orjson.loads(self.body) if self.body else None


@dataclass(frozen=True, slots=True)
class Reply:
    """What the fake upstream answers one request with: a whole body, or (``events`` set) an
    SSE stream written one event a write. ``cut_after``: the connection is closed after this
    many events, with no end of the stream (before any answer where there are no events)."""

    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    events: tuple[bytes, ...] | None = None
    cut_after: int | None = None
    delay_s: float = 0.0  # before the status line
    interval_s: float = 0.0  # between two events

    @classmethod
    def json(
        cls,
        body: Any,
        status: int = 200,
        *,
        headers: Mapping[str, str] | None = None,
        delay_s: float = 0.0,
    ) -> Reply:
        """A whole JSON answer."""
        head = (("Content-Type", "application/json"), *(headers or {}).items())
        return cls(status, head, orjson.dumps(body), delay_s=delay_s)

    @classmethod
    def text(
        cls, text: str, status: int = 200, *, content_type: str = "text/plain; charset=utf-8"
    ) -> Reply:
        """A whole text answer (a Prometheus page for /metrics, say)."""
        return cls(status, (("Content-Type", content_type),), text.encode())

    @classmethod
    def error(cls, status: int, message: str, *, kind: str = "BadRequestError") -> Reply:
        """An OpenAI-style error, as vLLM answers a request it refuses."""
        error = {"message": message, "type": kind, "param": None, "code": status}
        return cls.json({"error": error}, status)

    @classmethod
    def sse(
        cls,
        events: Iterable[Mapping[str, Any] | bytes],
        *,
        done: bool = True,
        cut_after: int | None = None,
        interval_s: float = 0.0,
        status: int = 200,
        headers: Mapping[str, str] | None = None,
    ) -> Reply:
        """A stream: each JSON event as ``data: <json>``, bytes written as they are, then
        ``data: [DONE]`` (unless not ``done``)."""
        framed = [
            e if isinstance(e, bytes) else b"data: " + orjson.dumps(e) + b"\n\n" for e in events
        ]
        if done:
            framed.append(b"data: [DONE]\n\n")
        head = (("Content-Type", "text/event-stream"), *(headers or {}).items())
        return cls(status, head, events=tuple(framed), cut_after=cut_after, interval_s=interval_s)

    @classmethod
    def cut(cls) -> Reply:
        """No answer: the connection is closed once the request has been read."""
        return cls(cut_after=0)


Answer: TypeAlias = "Reply | MockResponse"
Handler: TypeAlias = "Callable[[Received], Answer | Awaitable[Answer]]"


# -- answers in vLLM's shapes ---------------------------------------------------------------


def chat_chunk(
    delta: Mapping[str, Any],
    finish: str | None = None,
    *,
    model: str = MODEL,
    logprobs: Any = None,
) -> dict[str, Any]:
    """One ``chat.completion.chunk`` with one choice."""
    choice = {"index": 0, "delta": dict(delta), "logprobs": logprobs, "finish_reason": finish}
    return _body("chat.completion.chunk", model, [choice])


def chat_stream(
    pieces: Sequence[str],
    finish: str = "stop",
    *,
    reasoning: Sequence[str] = (),
    model: str = MODEL,
    logprobs: bool = False,
    usage: bool = False,
) -> list[dict[str, Any]]:
    """A streamed chat answer: the role chunk, one chunk a piece (the ``reasoning`` pieces
    first, in ``delta.reasoning``), the chunk with ``finish``, and a usage chunk (``usage``)."""
    out = [chat_chunk({"role": "assistant", "content": ""}, model=model)]
    for field, texts in (("reasoning", reasoning), ("content", pieces)):
        for text in texts:
            lp = {"content": [_logprob(text)]} if logprobs else None
            out.append(chat_chunk({field: text}, model=model, logprobs=lp))
    out.append(chat_chunk({}, finish, model=model))
    if usage:
        out.append(_body("chat.completion.chunk", model, [], len(reasoning) + len(pieces)))
    return out


def chat_answer(
    pieces: Sequence[str],
    finish: str = "stop",
    *,
    reasoning: Sequence[str] = (),
    model: str = MODEL,
    logprobs: bool = False,
) -> dict[str, Any]:
    """The same answer whole (``chat.completion``)."""
    message: dict[str, Any] = {"role": "assistant", "content": "".join(pieces)}
    if reasoning:
        message["reasoning"] = "".join(reasoning)
    lp = {"content": [_logprob(t) for t in [*reasoning, *pieces]]} if logprobs else None
    choice = {"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}
    return _body("chat.completion", model, [choice], len(reasoning) + len(pieces))


def completion_stream(
    pieces: Sequence[str],
    finish: str = "length",
    *,
    model: str = MODEL,
    logprobs: bool = False,
    usage: bool = False,
) -> list[dict[str, Any]]:
    """A streamed ``text_completion``: one chunk a piece, the chunk with ``finish``, and a
    usage chunk (``usage``)."""

    def chunk(text: str, finish: str | None, lp: Any) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}
        return _body("text_completion", model, [choice])

    out = [chunk(text, None, _legacy([text]) if logprobs else None) for text in pieces]
    out.append(chunk("", finish, None))
    if usage:
        out.append(_body("text_completion", model, [], len(pieces)))
    return out


def completion_answer(
    pieces: Sequence[str], finish: str = "length", *, model: str = MODEL, logprobs: bool = False
) -> dict[str, Any]:
    """The same answer whole."""
    lp = _legacy(pieces) if logprobs else None
    choice = {"index": 0, "text": "".join(pieces), "logprobs": lp, "finish_reason": finish}
    return _body("text_completion", model, [choice], len(pieces))


def _body(kind: str, model: str, choices: list[Any], tokens: int | None = None) -> dict[str, Any]:
    """An answer or chunk of this ``object`` kind; with ``usage`` where ``tokens`` is given
    (the prompt counted as one token)."""
    name = "chatcmpl-fake" if kind.startswith("chat") else "cmpl-fake"
    out: dict[str, Any] = {"id": name, "object": kind, "model": model, "choices": choices}
    if tokens is not None:
        out["usage"] = {"prompt_tokens": 1, "completion_tokens": tokens,
                        "total_tokens": 1 + tokens}  # fmt: skip
    return out


def _logprob(token: str) -> dict[str, Any]:
    entry = {"token": token, "logprob": 0.0, "bytes": list(token.encode())}
    return {**entry, "top_logprobs": [entry]}


def _legacy(tokens: Sequence[str]) -> dict[str, Any]:
    offsets = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    return {"tokens": list(tokens), "token_logprobs": [0.0] * len(tokens),
            "top_logprobs": [{t: 0.0} for t in tokens], "text_offset": offsets}  # fmt: skip


def not_found(request: Received) -> Reply:
    """The handler that answers every request 404, as vLLM (FastAPI) does an unknown path."""
    return Reply.json({"detail": "Not Found"}, 404)


def answers(text: str = "Hello!", *, model: str = MODEL) -> Handler:
    """A handler that answers as a greedy engine that always says ``text`` (one piece a
    word): chat and completions, whole or streamed as the request asks (with logprobs and
    a usage chunk where it asks for them), the model list, /health; 404 otherwise."""
    pieces = re.findall(r"\s*\S+\s*", text) or [text]

    def answer(request: Received) -> Reply:
        path = request.path
        if path == "/v1/models":
            return Reply.json({"object": "list", "data": [{"id": model, "object": "model"}]})
        if path == "/health":
            return Reply()
        if request.method != "POST" or not path.endswith("/completions"):
            return not_found(request)
        body = request.json() or {}
        logprobs = bool(body.get("logprobs"))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        if path.endswith("/chat/completions"):
            if body.get("stream"):
                return Reply.sse(chat_stream(pieces, model=model, logprobs=logprobs, usage=usage))
            return Reply.json(chat_answer(pieces, model=model, logprobs=logprobs))
        if body.get("stream"):
            chunks = completion_stream(pieces, "stop", model=model, logprobs=logprobs, usage=usage)
            return Reply.sse(chunks)
        return Reply.json(completion_answer(pieces, "stop", model=model, logprobs=logprobs))

    return answer


# -- what both kinds share: scripts, routes, a handler; what was received ---------------------


class _Answering:
    def __init__(
        self, handler: Handler | None, routes: Mapping[str, Reply | Handler] | None, model: str
    ) -> None:
        self.requests: list[Received] = []
        self.errors: list[Exception] = []  # what handlers raised (answered 500)
        # With routes alone, the paths they name are all it answers (404 elsewhere).
        self._handler = handler or (not_found if routes is not None else answers(model=model))
        self._scripts: dict[str, deque[Reply | Handler]] = {}
        self._routes: dict[str, Reply | Handler] = dict(routes or {})

    def script(self, path: str, *replies: Reply | Handler) -> None:
        """The next requests to ``path`` get these, one each, in order (after the replies
        already queued)."""
        self._scripts.setdefault(path, deque()).extend(replies)

    def on(self, path: str, reply: Reply | Handler | None) -> None:
        """Every request to ``path`` that no script answers gets ``reply`` (None: no more)."""
        if reply is None:
            self._routes.pop(path, None)
        else:
            self._routes[path] = reply

    def received(self, path: str | None = None) -> list[Received]:
        """The requests received (to ``path`` only, if given), oldest first."""
        return [r for r in self.requests if path is None or r.path == path]

    def bodies(self, path: str) -> list[Any]:
        """The JSON bodies of the requests to ``path``, oldest first."""
        return [r.json() for r in self.received(path)]

    def _next(self, path: str) -> Reply | Handler | None:
        queued = self._scripts.get(path)
        if queued:
            return queued.popleft()
        return self._routes.get(path)

    async def _answer(self, got: Reply | Handler, request: Received) -> Answer:
        """What the handler answers; 500 where it raised (raised again at the block's end).
        An ``UpstreamError`` is the upstream's fault the test asked for: it goes on."""
        if isinstance(got, Reply):
            return got
        try:
            answered = got(request)
            return await answered if inspect.isawaitable(answered) else answered
        except UpstreamError:
            raise
        except Exception as exc:  # a bug of the test's: raised again at the block's end
            self.errors.append(exc)
            name = type(self).__name__
            return Reply.text(f"{name} handler raised {exc!r}", 500)

    def _raise_errors(self) -> None:
        if self.errors:
            raise self.errors[0]


# -- in process: the upstream seam ---------------------------------------------------------------


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


class MockUpstream(_Answering):
    """detproxy's upstream seam in process (no socket): each request is recorded in
    ``requests``, then answered by the first of: the replies ``script()`` queued for its path,
    the reply ``on()`` (or ``routes``) set for its path, the ``handler`` (by default
    ``answers()``; ``not_found`` where ``routes`` are given without a handler). ``responses``:
    what it answered, in order (a test reads whether one was closed before its end). A handler
    that raises answers 500 and its error is raised again by ``close`` (or the ``async with``
    block's end); one that raises an ``UpstreamError`` (``UpstreamFailure(502, "...",
    "refused")``, say) makes ``send`` raise it, as a client does on that fault."""

    def __init__(
        self,
        handler: Handler | None = None,
        *,
        routes: Mapping[str, Reply | Handler] | None = None,
        model: str = MODEL,
    ) -> None:
        super().__init__(handler, routes, model)
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
        answer = await self._answer(self._next(path) or self._handler, request)
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


# -- on a socket: the server ---------------------------------------------------------------------

# Headers of one connection, not of the message: not passed on (``forward``).
_HOP = frozenset({"host", "connection", "keep-alive", "transfer-encoding", "upgrade"})
_NOT_PASSED = _HOP | {"content-length"}  # a forwarded request's: its client writes it


class FakeUpstream(_Answering):
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
