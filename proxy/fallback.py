"""Sending a request detproxy altered, with the client's own request as the fallback.

When the upstream answers an error (4xx or 5xx) to the altered request, or its stream fails
before its first event (ends, breaks, or opens with an error event), the client's original
bytes go upstream instead and that answer is relayed: the client gets what it would have got
without detproxy. Nothing has reached the client by then: a streamed answer's first event is
read before the client's response starts, then handed on with the rest (``Prefetched``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass

import orjson

from proxy.events import EventBus, FallbackSent
from proxy.http.headers import HeaderFields, is_event_stream_response
from proxy.http.sse import SSEDecoder, SSEOverflow
from proxy.http.upstream import (
    READ_ERRORS,
    Sink,
    Upstream,
    UpstreamResponse,
)
from proxy.injection import LOGPROBS, InjectionGuard, error_reason

log = logging.getLogger(__name__)

# An error body longer than this is not read to its end: only its message is wanted.
_ERROR_BODY_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class Altered:
    """A request detproxy changed: what it added, and the client's own bytes to fall back to."""

    kinds: Sequence[str]  # logprobs | repetition_detection
    original: bytes
    model: str
    endpoint: str


class Prefetched:
    """An upstream response whose first bytes ``first_event`` already read (it pumped them, so
    no reader of the response was left half-way): ``chunks`` and ``pump`` hand those over first,
    then read on from the response."""

    __slots__ = ("_head", "_inner", "_rest", "raw_fields", "status")

    def __init__(self, inner: UpstreamResponse, head: bytes) -> None:
        self._inner = inner
        self._head = head
        self._rest: AsyncIterator[bytes] | None = None
        self.status = inner.status
        self.raw_fields = inner.raw_fields

    @property
    def headers(self) -> Mapping[str, str]:
        return self._inner.headers

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
        if self._rest is None:
            self._rest = self._inner.chunks()
        return await self._rest.__anext__()

    async def pump(self, sink: Sink) -> bool:
        if self._head:
            head, self._head = self._head, b""
            if not sink(head):
                return False
        return await self._inner.pump(sink)

    async def read(self) -> bytes:
        parts: list[bytes] = []
        async for data in self.chunks():
            parts.append(data)
        return b"".join(parts)

    def close(self) -> None:
        self._inner.close()


async def first_event(
    upstream: UpstreamResponse, max_event_bytes: int
) -> tuple[UpstreamResponse, str | None]:
    """Read a stream up to its first data event. Returns the response to relay (the bytes read
    kept in front) and ``None``, or a reason when the stream failed before that event."""
    decoder = SSEDecoder(max_event_bytes)
    head: list[bytes] = []
    first: list[bytes] = []  # the first data event's data
    overflow = False

    def until_first(data: bytes) -> bool:
        nonlocal overflow
        head.append(data)
        try:
            events = decoder.feed(data)
        except SSEOverflow:
            overflow = True  # the relay decides what to do with it
            return False
        for event in events:
            if event.data is not None:  # not a comment or a keep-alive
                first.append(event.data)
                return False
        return True

    try:
        await upstream.pump(until_first)
    except READ_ERRORS as exc:
        return upstream, f"stream broke before its first event ({type(exc).__name__})"
    if overflow:
        return Prefetched(upstream, b"".join(head)), None
    if first:
        return Prefetched(upstream, b"".join(head)), _error_event(first[0])
    return upstream, "stream ended before its first event"


def _error_event(data: bytes) -> str | None:
    if not data.startswith(b"{") or b'"error"' not in data:
        return None
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError:
        return None
    if isinstance(chunk, dict) and chunk.get("error") is not None and "choices" not in chunk:
        return "stream opened with an error event: " + error_reason(200, data)
    return None


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
        status = upstream.status
        if status >= 400:
            reason = error_reason(status, await _read_error(upstream))
        elif is_event_stream_response(upstream):
            try:
                upstream, failure = await first_event(upstream, self._max_event_bytes)
            except BaseException:  # the client left while the first event was awaited
                upstream.close()
                raise
            if failure is None:
                # A stream carrying the audit's logprobs does not show that its shadow will
                # work: shadows are non-streamed, and vLLM refuses NaN logprobs there while it
                # streams them as null. The shadow's own answer tells (proxy.audit.shadow).
                worked = [k for k in altered.kinds if k != LOGPROBS]
                self._guard.succeeded(altered.model, worked)
                return upstream, False
            upstream.close()
            reason = failure
        else:
            self._guard.succeeded(altered.model, altered.kinds)
            return upstream, False
        again = await self._upstream.send("POST", raw_path, headers, altered.original)
        if again.status < 400:
            outcome = "recovered"
            self._guard.failed(altered.model, altered.endpoint, altered.kinds, status, reason)
            log.warning(
                "upstream refused a request with %s added (%s: %s); sent the client's own",
                "+".join(altered.kinds),
                status,
                reason,
            )
        else:
            outcome = "same_error"  # the client's own request is refused too: its answer
        self._bus.publish(FallbackSent(altered.model, altered.endpoint, again.status, outcome))
        return again, True


async def _read_error(upstream: UpstreamResponse) -> bytes:
    """The start of an error body; the connection is closed either way."""
    parts: list[bytes] = []
    size = 0
    try:
        async for data in upstream.chunks():
            parts.append(data)
            size += len(data)
            if size >= _ERROR_BODY_BYTES:
                break
    except READ_ERRORS:
        pass
    finally:
        upstream.close()
    return b"".join(parts)[:_ERROR_BODY_BYTES]
