from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.sse import SSEDecoder, SSEEvent, SSEOverflow

STREAM = (
    b'data: {"id":"1","choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}]}\n\n'
    b": keep-alive comment\n\n"
    b"event: note\nid: 7\ndata: line one\ndata: line two\n\n"
    b"data: [DONE]\n\n"
)


def decode_all(chunks: list[bytes]) -> tuple[list[SSEEvent], bytes]:
    dec = SSEDecoder()
    events: list[SSEEvent] = []
    for chunk in chunks:
        events.extend(dec.feed(chunk))
    pending = dec.pending
    final = dec.flush()  # end of stream: a lone "\r" can no longer become "\r\n"
    if final is not None:
        events.append(final)
        pending = b""
    return events, pending


def test_events_fields_and_raw_bytes() -> None:
    events, pending = decode_all([STREAM])
    assert pending == b""
    assert [e.data for e in events] == [
        b'{"id":"1","choices":[{"delta":{"role":"assistant","content":""}}]}',
        b'{"id":"1","choices":[{"delta":{"content":"Hi"}}]}',
        None,
        b"line one\nline two",
        b"[DONE]",
    ]
    assert events[3].event == "note" and events[3].id == "7"
    assert events[-1].is_done
    assert b"".join(e.raw for e in events) == STREAM


@pytest.mark.parametrize("newline", [b"\n", b"\r\n", b"\r"])
def test_every_line_ending(newline: bytes) -> None:
    stream = STREAM.replace(b"\n", newline)
    events, pending = decode_all([stream])
    assert [e.data for e in events] == [e.data for e in decode_all([STREAM])[0]]
    assert b"".join(e.raw for e in events) + pending == stream


def test_partial_event_is_held_until_complete() -> None:
    dec = SSEDecoder()
    assert dec.feed(b'data: {"a":') == []
    assert dec.pending == b'data: {"a":'
    (event,) = dec.feed(b"1}\n\n")
    assert event.data == b'{"a":1}'
    assert dec.pending == b""


def test_stray_blank_lines_stay_in_raw_bytes() -> None:
    stream = b"data: a\n\n\n\ndata: b\n\n\n"
    events, pending = decode_all([stream])
    assert [e.data for e in events] == [b"a", b"b"]
    assert b"".join(e.raw for e in events) + pending == stream


def test_overflow_hands_back_unrelayed_bytes() -> None:
    dec = SSEDecoder(max_event_bytes=16)
    assert dec.feed(b"data: 0123") == []
    with pytest.raises(SSEOverflow) as exc:
        dec.feed(b"456789abcdefghij")
    assert exc.value.pending == b"data: 0123456789abcdefghij"
    assert dec.pending == b""


def test_flush_returns_an_unterminated_last_event() -> None:
    dec = SSEDecoder()
    assert dec.feed(b"data: [DONE]\n") == []
    final = dec.flush()
    assert final is not None and final.is_done


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_split_yields_the_same_events(data: st.DataObject) -> None:
    stream = data.draw(
        st.sampled_from([STREAM, STREAM.replace(b"\n", b"\r\n"), STREAM.replace(b"\n", b"\r")])
    )
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=12)))
    chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
    events, pending = decode_all(chunks)
    whole, _ = decode_all([stream])
    assert [(e.data, e.event, e.id) for e in events] == [(e.data, e.event, e.id) for e in whole]
    assert b"".join(e.raw for e in events) + pending == stream
