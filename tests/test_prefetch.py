"""first_event: a stream read up to its first data event before the client's response starts."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest

from proxy.fallback import Prefetched, first_event
from proxy.http.errors import UpstreamBodyError
from proxy.http.sse import SSEDecoder, first_cut


class Scripted:
    """An upstream stream read from one position, however it is read (as the native client's
    connection is): ``chunks`` and ``pump`` go on from where the last reader stopped."""

    def __init__(self, parts: list[bytes], error_after: int | None = None) -> None:
        self.status = 200
        self.headers = {"Content-Type": "text/event-stream"}
        self.raw_fields: list[tuple[bytes, bytes]] | None = None
        self._parts = parts
        self._error_after = error_after
        self._next = 0
        self.closed = False

    def _take(self) -> bytes | None:
        if self._error_after == self._next:
            raise UpstreamBodyError("reset")
        if self._next == len(self._parts):
            return None
        self._next += 1
        return self._parts[self._next - 1]

    async def chunks(self) -> AsyncIterator[bytes]:
        while (part := self._take()) is not None:
            yield part

    async def pump(self, sink: Callable[[bytes], bool]) -> bool:
        while (part := self._take()) is not None:
            if not sink(part):
                return False
        return True

    async def read(self) -> bytes:
        return b"".join(self._parts)

    def close(self) -> None:
        self.closed = True


async def relayed(upstream: Scripted, pumped: bool = False) -> tuple[bytes, bytes | None]:
    """What the relay reads of the response ``first_event`` gives back, and the first event."""
    response, first = await first_event(upstream, 1 << 20)
    if pumped:  # as the streaming relay reads it
        parts: list[bytes] = []
        assert await response.pump(lambda data: parts.append(data) or True)
        return b"".join(parts), first
    return b"".join([part async for part in response.chunks()]), first


@pytest.mark.parametrize("pumped", [False, True])
async def test_the_relay_gets_every_byte_in_order(pumped: bool) -> None:
    parts = [b": ping\n\n", b'data: {"choices"', b": []}\n\nda", b"ta: [DONE]\n\n"]
    upstream = Scripted(parts)
    body, first = await relayed(upstream, pumped)
    assert first == b'{"choices": []}'
    assert body == b"".join(parts)
    assert not upstream.closed


async def test_an_event_past_the_size_bound_is_left_to_the_relay() -> None:
    parts = [b"data: " + b"x" * 64, b"x" * 64, b"\n\ndata: [DONE]\n\n"]
    response, first = await first_event(Scripted(parts), 32)
    assert first is None
    assert b"".join([part async for part in response.chunks()]) == b"".join(parts)


async def test_an_error_first_event_is_handed_back() -> None:
    event = b'{"error": {"message": "boom", "code": 500}}'
    body, first = await relayed(Scripted([b"data: " + event + b"\n\n"]))
    assert first == event
    assert body == b"data: " + event + b"\n\n"  # relayed when it is not about an addition


@pytest.mark.parametrize("pumped", [False, True])
async def test_a_stream_that_ends_before_an_event_is_relayed_as_it_came(pumped: bool) -> None:
    assert await relayed(Scripted([]), pumped) == (b"", None)
    assert await relayed(Scripted([b": ping\n\n"]), pumped) == (b": ping\n\n", None)


@pytest.mark.parametrize("pumped", [False, True])
async def test_a_stream_that_breaks_before_an_event_breaks_for_the_relay_too(pumped: bool) -> None:
    """The bytes read first, then the error that broke the stream, where the relay of an
    unaltered request meets it (it ends the client's stream with an in-band error)."""
    response, first = await first_event(Scripted([b"data: {", b"x"], error_after=1), 1 << 20)
    assert first is None
    parts: list[bytes] = []
    with pytest.raises(UpstreamBodyError):
        if pumped:
            await response.pump(lambda data: parts.append(data) or True)
        else:
            async for part in response.chunks():
                parts.append(part)
    assert parts == [b"data: {"]


@pytest.mark.parametrize(
    "parts",
    [
        [b": ping\n\n", b'data: {"choices"', b": []}\n\nda", b"ta: [DONE]\n\n", b": end\n\n"],
        [b'data: {"a": 1}\n\ndata: {"b"', b": 2}\n\n", b"data: [DONE]\n\n"],
        [b'data: {"a": 1}\r\n\r\n: x\r\n\r\n', b"data: [DONE]\r\n\r\n"],
        [b": ping\n\n", b"data: [DONE]"],  # ends without its blank line
    ],
)
async def test_the_first_events_are_handed_on_decoded_with_their_decoder(
    parts: list[bytes],
) -> None:
    """Decoded once: the events cut and the decoder that cut them (holding an unended event's
    bytes) go on; the bytes they came from are never handed out again."""
    response, first = await first_event(Scripted(parts), 1 << 20)
    assert isinstance(response, Prefetched)
    decoded = response.take_decoded()
    assert decoded is not None
    assert response.take_decoded() is None  # taken once
    rest = [part async for part in response.chunks()]
    head = b"".join(parts[: len(parts) - len(rest)])
    assert rest == parts[len(parts) - len(rest) :], "the head was handed out again"
    assert decoded.src + decoded.decoder.pending == head
    events = SSEDecoder().feed(head)
    assert decoded.raws == [event.raw for event in events]
    assert decoded.datas == [event.data for event in events]
    assert not decoded.overflowed
    assert first == next((data for data in decoded.datas if data is not None), None)


async def test_an_event_past_the_size_bound_is_handed_on_as_the_bytes_read() -> None:
    parts = [b": ping\n\ndata: " + b"x" * 64, b"x" * 64, b"\n\ndata: [DONE]\n\n"]
    response, first = await first_event(Scripted(parts), 32)
    assert isinstance(response, Prefetched) and first is None
    decoded = response.take_decoded()
    assert decoded is not None and decoded.overflowed
    assert decoded.src == parts[0] and decoded.datas == []
    assert [part async for part in response.chunks()] == parts[1:]


@pytest.mark.parametrize("pumped", [False, True])
async def test_a_long_first_read_is_decoded_up_to_its_cut_and_the_rest_handed_on(
    pumped: bool,
) -> None:
    """The first events of a long read (up to ``first_cut``) are decoded, for the relay to
    write before the rest; the rest comes next as the bytes it is; a reader that takes no
    events gets the whole read."""
    events = [b'data: {"n": %d, "pad": "%s"}\n\n' % (i, b"x" * 80) for i in range(40)]
    parts = [b"".join(events), b"data: [DONE]\n\n"]
    cut = first_cut(parts[0])
    assert cut
    response, first = await first_event(Scripted(parts), 1 << 20)
    assert isinstance(response, Prefetched) and first == events[0][6:-2]
    decoded = response.take_decoded()
    assert decoded is not None and decoded.src == parts[0][:cut]
    assert decoded.datas == [event[6:-2] for event in events[: len(decoded.datas)]]
    rest: list[bytes] = []
    if pumped:
        assert await response.pump(lambda data: rest.append(data) or True)
    else:
        rest = [part async for part in response.chunks()]
    assert rest == [parts[0][cut:], parts[1]]
    whole, _ = await relayed(Scripted(parts), pumped)
    assert whole == b"".join(parts)


async def test_a_long_first_read_whose_first_data_event_is_past_the_cut_is_decoded_whole() -> None:
    read = b": " + b"x" * 600 + b"\n\n" + b'data: {"a": 1}\n\n' * 200
    response, first = await first_event(Scripted([read]), 1 << 20)
    assert first == b'{"a": 1}'
    assert isinstance(response, Prefetched)
    decoded = response.take_decoded()
    assert decoded is not None and decoded.src == read and len(decoded.datas) == 201
    assert [part async for part in response.chunks()] == []
