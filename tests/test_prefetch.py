"""first_event: a stream read up to its first data event before the client's response starts."""

from __future__ import annotations

from collections.abc import AsyncIterator

from proxy.fallback import first_event
from proxy.http.errors import UpstreamBodyError


class Scripted:
    def __init__(self, parts: list[bytes], error_after: int | None = None) -> None:
        self.status = 200
        self.headers = {"Content-Type": "text/event-stream"}
        self._parts = parts
        self._error_after = error_after
        self.calls = 0
        self.closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        self.calls += 1
        for i, part in enumerate(self._parts):
            if self._error_after == i:
                raise UpstreamBodyError("reset")
            yield part

    async def read(self) -> bytes:
        return b"".join(self._parts)

    def close(self) -> None:
        self.closed = True


async def relayed(upstream: Scripted) -> tuple[bytes, str | None]:
    response, failure = await first_event(upstream, 1 << 20)
    if failure is not None:
        return b"", failure
    return b"".join([part async for part in response.chunks()]), None


async def test_the_relay_gets_every_byte_from_one_reader() -> None:
    parts = [b": ping\n\n", b'data: {"choices"', b": []}\n\nda", b"ta: [DONE]\n\n"]
    upstream = Scripted(parts)
    body, failure = await relayed(upstream)
    assert failure is None
    assert body == b"".join(parts)
    assert upstream.calls == 1  # the native client closes the connection for a second reader


async def test_an_error_first_event_is_a_failure() -> None:
    upstream = Scripted([b'data: {"error": {"message": "boom", "code": 500}}\n\n'])
    _, failure = await relayed(upstream)
    assert failure == "stream opened with an error event: boom"


async def test_a_chunk_that_mentions_error_is_not_a_failure() -> None:
    event = b'data: {"choices": [{"delta": {"content": "\\"error\\""}}], "error": null}\n\n'
    body, failure = await relayed(Scripted([event]))
    assert failure is None and body == event


async def test_a_stream_that_ends_or_breaks_before_an_event_is_a_failure() -> None:
    assert (await relayed(Scripted([])))[1] == "stream ended before its first event"
    assert (await relayed(Scripted([b": ping\n\n"])))[1] == "stream ended before its first event"
    broke = await relayed(Scripted([b"data: {", b"x"], error_after=1))
    assert broke[1] == "stream broke before its first event (UpstreamBodyError)"
