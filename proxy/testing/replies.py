"""What a fake upstream answers (``Reply``), what it received (``Received``), and answers in
vLLM's shapes: ``answers()``, the handler that answers as a greedy engine."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import orjson

if TYPE_CHECKING:
    from proxy.testing.mock import MockResponse

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
    many events, with no end of the stream (before any answer where there are no events).
    ``end_delay_s``: the stream's end comes this long after its last event (a server that
    ends its framing late, after ``[DONE]`` say)."""

    status: int = 200
    headers: tuple[tuple[str, str], ...] = ()
    body: bytes = b""
    events: tuple[bytes, ...] | None = None
    cut_after: int | None = None
    delay_s: float = 0.0  # before the status line
    interval_s: float = 0.0  # between two events
    end_delay_s: float = 0.0  # between the last event and the stream's end

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
        end_delay_s: float = 0.0,
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
        return cls(
            status,
            head,
            events=tuple(framed),
            cut_after=cut_after,
            interval_s=interval_s,
            end_delay_s=end_delay_s,
        )

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
