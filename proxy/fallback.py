"""Sending a request detproxy altered, with the client's own request as the fallback.

When the upstream refuses the altered request because of what detproxy added (a 400 or 422,
or a stream opening with such an error event, whose message or ``param`` names the addition:
``proxy.injection.refused_additions``), the client's original bytes go upstream instead and that
answer is relayed: the client gets what it would have got without detproxy. Any other answer
(an unknown model's 404, a 401, a 429, a 400 about the messages, a 5xx, a stream that ends or
breaks before its first event) is the client's request's own: relayed once, as it came. Nothing
has reached the client by then: what was read to decide (an error body's start, a stream's
first event) is handed on in front of the rest (``Prefetched``); a stream's first events go on
as the decoder that cut them left them (``Prefetched.take_decoded``): the relay goes on with
that decoder, not decoding those bytes again.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

from proxy.events import EventBus, FallbackSent
from proxy.http.headers import HeaderFields, is_event_stream_response
from proxy.http.sse import Decoded, SSEDecoder, SSEEvent, SSEOverflow, first_cut
from proxy.http.upstream import (
    READ_ERRORS,
    Sink,
    Upstream,
    UpstreamResponse,
)
from proxy.injection import LOGPROBS, InjectionGuard, error_reason, refused_additions

log = logging.getLogger(__name__)

# An error body is read this far to decide whose error it is; the rest is relayed as it comes.
_ERROR_BODY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Altered:
    """A request detproxy changed: what it added, and the client's own bytes to fall back to."""

    kinds: Sequence[str]  # logprobs | repetition_detection
    original: bytes
    model: str
    endpoint: str


class Prefetched:
    """An upstream response whose first bytes were read already (pumped, so no reader of the
    response was left half-way): ``chunks`` and ``pump`` hand those over first, then what came
    after them: the rest of the response, its end (``ended``), or the error that broke it
    (``error``), raised again where a reader of the response would have met it."""

    __slots__ = (
        "_decoded",
        "_ended",
        "_error",
        "_head",
        "_inner",
        "_rest",
        "_undecoded",
        "raw_fields",
        "status",
    )

    def __init__(
        self,
        inner: UpstreamResponse,
        head: bytes,
        *,
        ended: bool = False,
        error: BaseException | None = None,
        decoded: Decoded | None = None,
        undecoded: bytes = b"",
    ) -> None:
        self._inner = inner
        self._head = head
        self._decoded = decoded  # the head's events, where a decoder cut them
        # The end of the head that decoder was not given (a long first read's rest, cut by
        # ``first_cut``): handed out as bytes after the events, whoever takes them.
        self._undecoded = undecoded
        # The inner response is done: never read again (its connection went back to the pool).
        self._ended = ended
        self._error = error
        self._rest: AsyncIterator[bytes] | None = None
        self.status = inner.status
        self.raw_fields = inner.raw_fields

    @property
    def headers(self) -> Mapping[str, str]:
        return self._inner.headers

    def take_decoded(self) -> Decoded | None:
        """The head as the events a decoder cut from it, and that decoder (None: not
        decoded): the head is then the taker's, never handed out again as bytes, so that no
        second decoder reads it (the relay goes on with this one); what that decoder was not
        given comes next, as bytes."""
        decoded, self._decoded = self._decoded, None
        if decoded is not None:
            self._head, self._undecoded = self._undecoded, b""
        return decoded

    def chunks(self) -> AsyncIterator[bytes]:
        """The head, then the response's own chunks (an async iterator, not a generator:
        mypyc compiles no async generators)."""
        return self

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self

    async def __anext__(self) -> bytes:
        if self._head:
            head, self._head = self._head, b""
            return head
        if self._after_head():
            raise StopAsyncIteration
        if self._rest is None:
            self._rest = self._inner.chunks()
        return await self._rest.__anext__()

    async def pump(self, sink: Sink) -> bool:
        if self._head:
            head, self._head = self._head, b""
            if not sink(head):
                return False
        if self._after_head():
            return True
        return await self._inner.pump(sink)

    def _after_head(self) -> bool:
        """True where the response ended with its head; raises the error that broke it."""
        error, self._error = self._error, None
        if error is not None:
            self._ended = True
            raise error
        return self._ended

    async def read(self) -> bytes:
        parts: list[bytes] = []
        async for data in self.chunks():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        self._inner.close()


async def first_event(
    upstream: UpstreamResponse, max_event_bytes: int
) -> tuple[UpstreamResponse, bytes | None]:
    """Read a stream up to its first data event. Returns the response to relay (the bytes
    read kept in front, and the events cut from them with their decoder: ``take_decoded``;
    then the rest as it comes) and that event's data: None where the
    stream ended or broke before one, or its first event is over the size bound (the relay
    decides what to do with it). A long first read is decoded up to its cut (``first_cut``)
    when the first data event is in that part: the rest of it is left to the relay, which
    writes those first events before it decodes the rest."""
    decoder = SSEDecoder(max_event_bytes)
    head: list[bytes] = []
    decoded: list[SSEEvent] = []  # every event cut so far: the relay goes on from them
    first: list[bytes] = []  # the first data event's data
    overflowed: list[bytes] = []
    undecoded: list[bytes] = []  # the end of a long first read, after its first data event

    def until_first(data: bytes) -> bool:
        cut = 0 if head else first_cut(data)
        if cut:
            if not feed(data[:cut]):
                undecoded.append(data[cut:])
                return False
            data = data[cut:]
        return feed(data)

    def feed(data: bytes) -> bool:
        head.append(data)
        try:
            events = decoder.feed(data)
        except SSEOverflow:
            overflowed.append(b"".join(head))
            return False
        decoded.extend(events)
        for event in events:
            if event.data is not None:  # not a comment or a keep-alive
                first.append(event.data)
                return False
        return True

    def handed_on(ended: bool, error: BaseException | None) -> Prefetched:
        cut = Decoded(decoder, decoded, overflowed=overflowed[0] if overflowed else None)
        rest = undecoded[0] if undecoded else b""
        return Prefetched(
            upstream,
            b"".join(head) + rest,
            ended=ended,
            error=error,
            decoded=cut,
            undecoded=rest,
        )

    try:
        ended = await upstream.pump(until_first)
    except READ_ERRORS as exc:
        return handed_on(False, exc), None
    return handed_on(ended, None), first[0] if first else None


async def _error_start(upstream: UpstreamResponse) -> tuple[UpstreamResponse, bytes]:
    """An error answer with its body's start read (up to ``_ERROR_BODY_BYTES``): the response
    to relay (that start in front, then the rest as it comes) and that start."""
    parts: list[bytes] = []
    size = 0

    def until_enough(data: bytes) -> bool:
        nonlocal size
        parts.append(data)
        size += len(data)
        return size < _ERROR_BODY_BYTES

    try:
        ended = await upstream.pump(until_enough)
    except READ_ERRORS as exc:
        head = b"".join(parts)
        return Prefetched(upstream, head, error=exc), head
    head = b"".join(parts)
    return Prefetched(upstream, head, ended=ended), head


def _error_event(data: bytes) -> int | None:
    """The status an error event says (its ``code``; 200 where it has none); None where the
    event is not an error."""
    if not data.startswith(b"{") or b'"error"' not in data:
        return None
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if type(chunk) is not dict or "choices" in chunk:
        return None
    err = chunk.get("error")
    if err is None and chunk.get("object") != "error":  # nested since vLLM 0.10.1, flat before
        return None
    code = (err if type(err) is dict else chunk).get("code")
    return code if type(code) is int else 200


class FallbackSender:
    """Sends a request; an altered one that fails is sent again as the client sent it."""

    def __init__(
        self, upstream: Upstream, guard: InjectionGuard, bus: EventBus, max_event_bytes: int
    ) -> None:
        self._upstream = upstream
        self._guard = guard
        self._bus = bus
        self._max_event_bytes = max_event_bytes

    async def send(
        self, raw_path: str, headers: HeaderFields, body: bytes, altered: Altered | None
    ) -> tuple[UpstreamResponse, bool]:
        """The response to relay, and whether it answers the client's own request in place
        of the altered one. ``UpstreamFailure`` propagates (a transport fault is not the
        alteration's)."""
        upstream = await self._upstream.send("POST", raw_path, headers, body)
        if altered is None:
            return upstream, False
        try:
            upstream, refused, reason = await self._refusal(upstream, altered)
        except BaseException:  # the client left while the answer's start was awaited
            upstream.close()
            raise
        if not refused:
            return upstream, False
        status = upstream.status
        upstream.close()
        again = await self._upstream.send("POST", raw_path, headers, altered.original)
        if again.status < 400:
            outcome = "recovered"
            self._guard.failed(altered.model, altered.endpoint, refused, status, reason)
            log.warning(
                "upstream refused a request with %s added (%s: %s); sent the client's own",
                "+".join(refused),
                status,
                reason,
            )
        else:
            outcome = "same_error"  # the client's own request is refused too: its answer
        self._bus.publish(FallbackSent(altered.model, altered.endpoint, again.status, outcome))
        return again, True

    async def _refusal(
        self, upstream: UpstreamResponse, altered: Altered
    ) -> tuple[UpstreamResponse, tuple[str, ...], str]:
        """The response to relay (what was read of it kept in front), the additions the
        upstream refused (none: relay it, it is the client's request's own answer), and the
        upstream's reason for refusing them."""
        kinds = altered.kinds
        status = upstream.status
        if status >= 400:
            upstream, payload = await _error_start(upstream)
            refused = refused_additions(kinds, status, payload)
            return upstream, refused, error_reason(status, payload) if refused else ""
        if not is_event_stream_response(upstream):
            self._guard.succeeded(altered.model, kinds)
            return upstream, (), ""
        upstream, data = await first_event(upstream, self._max_event_bytes)
        if data is None:  # ended or broke first: relayed as an unaltered request's would be
            return upstream, (), ""
        code = _error_event(data)
        if code is None:
            # A stream carrying the audit's logprobs does not show that its shadow will
            # work: shadows are non-streamed, and vLLM refuses NaN logprobs there while it
            # streams them as null. The shadow's own answer tells (proxy.audit.shadow).
            self._guard.succeeded(altered.model, [k for k in kinds if k != LOGPROBS])
            return upstream, (), ""
        refused = refused_additions(kinds, code, data)
        if not refused:  # the engine's own error, as it would have opened the client's stream
            return upstream, (), ""
        return upstream, refused, "stream opened with an error event: " + error_reason(code, data)
