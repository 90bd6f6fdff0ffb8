"""Incremental Server-Sent Events decoder: bytes in (any split), whole events out.

Each event keeps the exact bytes it arrived as (``raw``), so the relay can forward
unchanged events byte for byte and rewrite only the ones a stage changes. Memory is
bounded: a partial event larger than ``max_event_bytes`` raises ``SSEOverflow``.

``feed_data`` is the relay's fast path for the framing every OpenAI-compatible server uses
(single-line ``data: ...`` events, LF line ends): it splits with bytes operations and hands back
only the data fields, or declines (``None``, nothing consumed) so the caller uses ``feed``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple, Protocol

_LINE_END = re.compile(rb"\r\n|\r|\n")
# Byte values, not one-byte strings: ``13 in data`` is a memchr, ``b"\r" in data`` costs
# several times more on a short event.
_CR, _LF = 13, 10


class SSEOverflow(Exception):
    """A single event grew past the decoder's bound without being terminated.

    ``pending`` holds the bytes the decoder had kept, so the caller can still relay them.
    """

    def __init__(self, message: str, pending: bytes) -> None:
        super().__init__(message)
        self.pending = pending


class SSEEvent(NamedTuple):
    """One event. A NamedTuple, not a dataclass: one is built per streamed chunk."""

    raw: bytes  # the event's bytes as received, terminating blank line included
    data: bytes | None  # data lines joined with b"\n"; None when the event had no data field
    event: str | None = None
    id: str | None = None

    @property
    def is_done(self) -> bool:
        return self.data == b"[DONE]"


class SSEDecoder:
    def __init__(self, max_event_bytes: int = 8 * 1024 * 1024) -> None:
        self._buf = b""
        self._max = max_event_bytes

    @property
    def pending(self) -> bytes:
        """Bytes of an event that has started but not ended yet."""
        return self._buf

    def feed(self, chunk: bytes) -> list[SSEEvent]:
        buf = self._buf + chunk if self._buf else chunk
        # Fast path for the framing every OpenAI-compatible server uses: "data: ...\n\n".
        if _CR not in buf:
            return self._feed_lf(buf)
        return self._feed_general(buf)

    def feed_data(self, chunk: bytes) -> tuple[bytes, list[bytes]] | None:
        """Like ``feed`` when every complete event buffered is one ``data: `` line.

        Returns the complete events' bytes (exactly the ``raw`` of the events ``feed`` would
        return, concatenated) and their data fields, each event being ``b"data: " + data +
        b"\n\n"``; ``(b"", [])`` while no event is complete. Returns ``None`` and consumes
        nothing when any of them is another shape (a comment, another field, several lines,
        stray blank lines, CR line ends): ``feed(chunk)`` then decodes it. Raises
        ``SSEOverflow`` exactly when ``feed`` would.
        """
        buf = self._buf + chunk if self._buf else chunk
        if _CR in buf:
            return None
        end = buf.rfind(b"\n\n")
        if end < 0:
            self._keep(buf, 0)
            return b"", []
        datas = buf[:end].split(b"\n\ndata: ")
        first = datas[0]
        # Every event is single-line iff no data field holds a newline: a comment, a field
        # other than data, a second line or a stray blank line leaves one inside a piece.
        if first[:6] != b"data: " or _LF in b"".join(datas):
            return None
        datas[0] = first[6:]
        end += 2
        if end == len(buf):
            self._buf = b""
            return buf, datas
        self._keep(buf, end)
        return buf[:end], datas

    def _feed_lf(self, buf: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        ev_start = start = 0
        while True:
            end = buf.find(b"\n\n", start)
            if end < 0:
                break
            block = buf[start:end]
            start = end + 2
            if block:
                # Stray blank lines before an event stay in its raw bytes, so none are lost.
                if block[:6] == b"data: " and _LF not in block:  # what every server sends
                    events.append(SSEEvent(buf[ev_start:start], block[6:]))
                else:
                    events.append(_parse_block(buf[ev_start:start], block.split(b"\n")))
                ev_start = start
        self._keep(buf, ev_start)
        return events

    def _feed_general(self, buf: bytes) -> list[SSEEvent]:
        events: list[SSEEvent] = []
        event_start = 0
        lines: list[bytes] = []
        pos = 0
        while True:
            m = _LINE_END.search(buf, pos)
            if m is None:
                break
            # A lone "\r" at the very end may be the first half of "\r\n": wait for more.
            if m.group() == b"\r" and m.end() == len(buf):
                break
            line = buf[pos : m.start()]
            pos = m.end()
            if line:
                lines.append(line)
                continue
            if lines:
                events.append(_parse_block(buf[event_start:pos], lines))
                lines = []
                event_start = pos
        self._keep(buf, event_start)
        return events

    def _keep(self, buf: bytes, start: int) -> None:
        rest = buf[start:]
        if len(rest) > self._max:
            self._buf = b""
            # Hand back everything this call was given, complete events included.
            raise SSEOverflow(f"SSE event larger than {self._max} bytes", buf)
        self._buf = rest

    def take_pending(self) -> bytes:
        """Give up on decoding: return the buffered bytes and forget them."""
        rest, self._buf = self._buf, b""
        return rest

    def flush(self) -> SSEEvent | None:
        """At end of stream: a final event that lacked its blank line, if any."""
        rest, self._buf = self._buf, b""
        lines = [ln for ln in _LINE_END.split(rest) if ln]
        return _parse_block(rest, lines) if lines else None


class Decoded:
    """Events cut from a response's bytes by a stage before the relay, handed on so that the
    relay goes on from them and no byte of the response is decoded twice: a stream's first
    events (``proxy.fallback.first_event``), with the ``decoder`` that cut them (holding the
    bytes of an event not ended yet: the relay goes on with it), or a converted stream's events
    read by read (``proxy.loops.rendered``: ``decoder`` None, the relay decodes nothing of it).
    ``src`` is the events' bytes (``raws``, one per event, laid out in it; ``datas`` their data
    fields); ``overflowed``: the decoder gave up on an event over its bound, and ``src`` is
    every byte it was given (no events)."""

    __slots__ = ("datas", "decoder", "overflowed", "raws", "src")

    def __init__(
        self,
        decoder: SSEDecoder | None,
        events: list[SSEEvent],
        *,
        overflowed: bytes | None = None,
    ) -> None:
        self.decoder = decoder
        self.raws = [event.raw for event in events]
        self.datas: list[bytes | None] = [event.data for event in events]
        self.src = b"".join(self.raws) if overflowed is None else overflowed
        self.overflowed = overflowed is not None


class DecodedReads(Protocol):
    """A response a stage decodes as it reads it (and converts: ``proxy.loops.rendered``):
    each read handed on as the events it cut (``Decoded``), not as bytes to decode again."""

    async def pump_decoded(self, sink: Callable[[Decoded], bool]) -> bool:
        """As ``UpstreamResponse.pump``, a read's events to ``sink`` (none: not called)."""
        ...


# A stream's first read longer than ``FIRST_CUT_MIN`` bytes (an upstream that had a burst ready:
# a cached answer, a proxy that buffered, an engine that was fast) is relayed in two: its events
# up to the first event end at or past ``FIRST_CUT_AT`` bytes, written at once, then the rest.
# The client's first token does not wait for the inspection of the whole burst (about 5 us an
# event, 200 events: a millisecond).
FIRST_CUT_AT = 512
FIRST_CUT_MIN = 4 * FIRST_CUT_AT


def first_cut(data: bytes) -> int:
    """Where a stream's first read is cut (``FIRST_CUT_AT``): just after an event's blank line,
    with bytes after it; 0 where the read is short, or has no such line (the events of a read
    cut there are the same: a decoder takes any split)."""
    if len(data) <= FIRST_CUT_MIN:
        return 0
    end = data.find(b"\n\n", FIRST_CUT_AT)
    return end + 2 if 0 <= end < len(data) - 2 else 0


def ends_with_done(relayed: bytes) -> bool:
    """Whether relayed bytes end with a whole ``data: [DONE]`` event: the stream's end, as a
    client reads it (the upstream's own framing may still be on its way)."""
    if not relayed.endswith((b"\n\n", b"\r\r", b"\r\n\r\n")):
        return False
    block = relayed.rstrip(b"\r\n")
    start = max(block.rfind(b"\n"), block.rfind(b"\r")) + 1
    return block[start:] in (b"data: [DONE]", b"data:[DONE]")


def _parse_block(raw: bytes, lines: list[bytes]) -> SSEEvent:
    data: list[bytes] = []
    event: str | None = None
    ev_id: str | None = None
    for line in lines:
        if line[:1] == b":":
            continue  # comment
        name, sep, value = line.partition(b":")
        if sep and value[:1] == b" ":
            value = value[1:]
        if name == b"data":
            data.append(value)
        elif name == b"event":
            event = value.decode("utf-8", "replace")
        elif name == b"id":
            ev_id = value.decode("utf-8", "replace")
    return SSEEvent(raw=raw, data=b"\n".join(data) if data else None, event=event, id=ev_id)


def encode_event(data: bytes) -> bytes:
    """Encode one data-only event the way vLLM does."""
    return b"data: " + data + b"\n\n"
