"""What ``StreamResult`` reports, counted on a stream relayed without decoding it.

The raw relay path (nothing inspects the events) hands each upstream read to ``RawTally.feed``,
which returns the bytes to write: the read's complete events, a partial last event waiting for
its end as it would in the decoder, so a stream that breaks mid-event still ends with a clean
in-band error. It counts with bytes operations over the complete events of each read, for LF
framing (what every OpenAI-compatible server sends):

- ``events``: the number of blank-line separators (``\\n\\n``); exact but for runs of four or
  more newlines (stray blank lines), which count one event per extra pair;
- ``first_id``: from the first data event only, the one event parsed for it (a stream whose
  first chunk lacks an id reports none);
- ``token_events``: per read, non-empty ``"content":"`` fields plus the larger of the non-empty
  ``"reasoning":"`` and ``"reasoning_content":"`` fields (vLLM sends one of them or both
  duplicated; ``"text":"`` for completions), in the spacing the first event uses. Exact unless
  one event carries both content and reasoning text, or a read mixes events sending only
  ``reasoning`` with events sending only ``reasoning_content``;
- ``first_token_s`` / ``last_token_s``: the time of the read (all its events arrived together);
- ``completion_tokens``: from the last event of a read that has ``"completion_tokens"``,
  found by a bytes search; only that event is parsed;
- ``tokens`` (and ``first_tokens``, those of the first read with text): what the read's token
  events carry, which can be several tokens an event (vLLM's stream interval, speculative
  decoding): the growth of ``completion_tokens`` over the read where it grew (continuous usage
  stats), else the entries of the ``logprobs`` of its text events (a read with a logprobs
  object is parsed event by event for them), else its token events.

Any CR in the stream switches to the decoder (``SSEDecoder``) and parses every event: exact,
and as slow as the inspected path, for a framing no engine uses. An event larger than
``max_event_bytes`` switches to relaying bytes as they come, uncounted, as the inspected path
does (``partial`` then tells the relay that an unfinished event may have been relayed).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import orjson

from proxy.http.sse import SSEDecoder, SSEOverflow, event_data
from proxy.openai import completion_tokens_of
from proxy.relay.result import StreamResult, count_tokens, tally_chunk, text_tokens

_BYTES, _DECODED, _PASS = 0, 1, 2
_CR = 13  # ``13 in data``: a memchr (``b"\r" in data`` costs more on a short read)
_LF = 10
_USAGE = b'"completion_tokens"'


class _Patterns:
    """The bytes that open a text field, in one spacing (``"k":"`` or ``"k": "``)."""

    __slots__ = ("content", "reasoning", "reasoning_content", "text")

    def __init__(self, colon: bytes) -> None:
        def pair(key: bytes) -> tuple[bytes, bytes]:
            opening = b'"' + key + b'"' + colon + b'"'
            return opening, opening + b'"'  # any field, and the empty one

        self.content = pair(b"content")
        self.reasoning = pair(b"reasoning")
        self.reasoning_content = pair(b"reasoning_content")
        self.text = pair(b"text")


_COMPACT = _Patterns(b":")
_SPACED = _Patterns(b": ")
_LOGPROBS = {_COMPACT: b'"logprobs":{', _SPACED: b'"logprobs": {'}


def _nonempty(buf: bytes, pattern: tuple[bytes, bytes]) -> int:
    n = buf.count(pattern[0])
    return n - buf.count(pattern[1]) if n else 0


class RawTally:
    """Cuts one attempt's reads at event boundaries and counts them for ``StreamResult``."""

    __slots__ = (
        "_chat",
        "_clock",
        "_decoder",
        "_first_seen",
        "_max",
        "_mode",
        "_patterns",
        "_pending",
        "_result",
        "_t0",
        "partial",
    )

    def __init__(
        self,
        endpoint: str,
        result: StreamResult,
        t0: float,
        max_event_bytes: int,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._clock = clock
        self._chat = endpoint == "chat"
        self._result = result
        self._t0 = t0
        self._max = max_event_bytes
        self._mode = _BYTES
        self._pending = b""
        self._decoder: SSEDecoder | None = None
        self._first_seen = False  # the first data event was parsed
        self._patterns = _COMPACT
        self.partial = False  # bytes of an unfinished event may have been relayed

    def _now(self) -> float:
        return self._clock() - self._t0

    def feed(self, data: bytes) -> bytes:
        """One upstream read; returns the bytes to write now."""
        if self._mode != _BYTES or _CR in data:
            return data if self._mode == _PASS else self._feed_decoded(data)
        buf = self._pending + data if self._pending else data
        size = len(buf)
        if size >= 2 and buf[size - 1] == _LF and buf[size - 2] == _LF:
            end = size  # the read ends where an event does: the usual, no search
        else:
            end = buf.rfind(b"\n\n") + 2
            if end < 2:
                end = 0
        if size - end > self._max:
            return self._overflow(buf)
        if not end:
            self._pending = buf
            return b""
        if end == size:
            out, self._pending = buf, b""
        else:
            out, self._pending = buf[:end], buf[end:]
        # The complete events as one object: every search below runs over all of it, and a
        # search without bounds costs a third less than one with them.
        now = self._clock() - self._t0
        # One event of one line (a paced engine's read): its only line feed is its end's.
        events = 1 if out.find(_LF) == end - 2 else out.count(b"\n\n")
        self._result.add_events(events, now)
        if not self._first_seen:
            self._first(out)
        self._count_text(out, now)
        return out

    def finish(self) -> bytes:
        """At the end of the stream: a last event that lacked its blank line, counted."""
        if self._mode == _BYTES:
            tail, self._pending = self._pending, b""
            if tail:
                if not self._first_seen:
                    self._first(tail, event=True)
                self._count_text(tail, None)
            return tail
        if self._mode == _DECODED and self._decoder is not None:
            tail = self._decoder.pending
            final = self._decoder.flush()
            if final is not None and final.data is not None:
                self._tally(final.data)
            return tail
        return b""

    def _overflow(self, buf: bytes) -> bytes:
        self._mode = _PASS
        self._pending = b""
        self._decoder = None
        self.partial = True
        return buf

    def _count_text(self, buf: bytes, now: float | None) -> None:
        """Token events, their tokens and usage in ``buf`` (complete events)."""
        before = self._result.completion_tokens
        self._count_usage(buf)
        patterns = self._patterns
        if self._chat:
            field, empty = patterns.content
            tokens = buf.count(field)
            if tokens:
                tokens -= buf.count(empty)
            if buf.find(b'"reasoning') >= 0:
                tokens += max(
                    _nonempty(buf, patterns.reasoning),
                    _nonempty(buf, patterns.reasoning_content),
                )
        else:
            tokens = _nonempty(buf, patterns.text)
        if not tokens:
            return
        usage = self._result.completion_tokens
        grown = usage - (before or 0) if usage is not None and usage != before else 0
        if grown <= 0 and buf.find(_LOGPROBS[patterns]) >= 0:
            grown = self._listed(buf)
        at = self._now() if now is None else now
        count_tokens(self._result, tokens, at, grown if grown > 0 else None)

    def _listed(self, buf: bytes) -> int:
        """The logprobs entries of the text events in ``buf``, each event parsed."""
        end = len(buf)
        listed, pos = 0, 0
        while pos < end:
            stop = buf.find(b"\n\n", pos, end)
            stop = end if stop < 0 else stop
            data = event_data(buf[pos:stop])
            pos = stop + 2
            if data is None or data == b"[DONE]":
                continue
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                continue
            if type(chunk) is dict:
                found, n = text_tokens(chunk)
                listed += n if found else 0
        return listed

    def _count_usage(self, buf: bytes) -> None:
        """``completion_tokens`` from the last event in ``buf`` that has it."""
        at = buf.rfind(_USAGE)
        while at >= 0:
            sep = buf.rfind(b"\n\n", 0, at)
            start = sep + 2 if sep >= 0 else 0
            stop = buf.find(b"\n\n", at)
            data = event_data(buf[start:stop] if stop >= 0 else buf[start:])
            if data is not None and self._usage(data):
                return
            at = buf.rfind(_USAGE, 0, start)

    def _usage(self, data: bytes) -> bool:
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return False
        usage = completion_tokens_of(chunk) if type(chunk) is dict else None
        if usage is not None:
            self._result.completion_tokens = usage
            return True
        return False

    def _first(self, buf: bytes, event: bool = False) -> None:
        """Parse the first data event (its id, its spacing); ``event``: ``buf`` is one event
        without its blank line."""
        end = len(buf)
        pos = 0
        while pos < end:
            stop = end if event else buf.find(b"\n\n", pos, end)
            if stop < 0:
                return
            data = event_data(buf[pos:stop])
            pos = stop + 2
            if data is None or data == b"[DONE]":
                continue
            self._first_seen = True
            if data[:2] == b'{"':
                key_end = data.find(b'"', 2)
                if key_end > 0 and data[key_end + 1 : key_end + 3] == b": ":
                    self._patterns = _SPACED
            try:
                chunk = orjson.loads(data)
            except orjson.JSONDecodeError:
                return
            if type(chunk) is dict and isinstance(chunk.get("id"), str):
                self._result.first_id = chunk["id"]
            return

    def _feed_decoded(self, data: bytes) -> bytes:
        decoder = self._decoder
        if decoder is None:
            decoder = self._decoder = SSEDecoder(self._max)
            self._mode = _DECODED
            data, self._pending = self._pending + data, b""
        try:
            events = decoder.feed(data)
        except SSEOverflow as exc:
            return self._overflow(exc.pending)
        if not events:
            return b""
        result = self._result
        result.add_events(len(events), self._now())
        for event in events:
            if event.data is not None:
                self._tally(event.data)
        return b"".join(event.raw for event in events)

    def _tally(self, data: bytes) -> None:
        if data == b"[DONE]":
            return
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return
        if type(chunk) is not dict:
            return
        result = self._result
        if result.first_id is None and isinstance(chunk.get("id"), str):
            result.first_id = chunk["id"]
        tally_chunk(result, chunk, self._now)
