from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.http.sse import (
    FIRST_CUT_AT,
    FIRST_CUT_MIN,
    SSEDecoder,
    SSEEvent,
    SSEOverflow,
    ends_with_done,
    first_cut,
)

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


# --- feed_data: the relay's fast path for single-line data events ---------------------------

SIMPLE = (
    b'data: {"id":"1","choices":[{"delta":{"role":"assistant","content":""}}]}\n\n'
    b'data: {"id":"1","choices":[{"delta":{"content":"Hi"}}]}\n\n'
    b'data: {"id":"1","choices":[{"delta":{"content":" there"}}]}\n\n'
    b"data: [DONE]\n\n"
)


def feed_data_all(chunks: list[bytes]) -> tuple[bytes, list[bytes], bytes]:
    dec = SSEDecoder()
    relayed, datas = b"", []
    for chunk in chunks:
        got = dec.feed_data(chunk)
        assert got is not None
        relayed += got[0]
        datas += got[1]
    return relayed, datas, dec.pending


def test_feed_data_gives_the_events_bytes_and_data_fields() -> None:
    relayed, datas, pending = feed_data_all([SIMPLE + b"data: {partial"])
    assert relayed == SIMPLE and pending == b"data: {partial"
    assert datas == [e.data for e in decode_all([SIMPLE])[0]]
    assert b"".join(b"data: " + d + b"\n\n" for d in datas) == relayed


@pytest.mark.parametrize(
    "other",
    [
        b": keep-alive\n\n",
        b"event: note\ndata: x\n\n",
        b"data: one\ndata: two\n\n",
        b"data:no-space\n\n",
        b"\n\n",  # a stray blank line
        b"garbage\n\n",
        b"data: crlf\r\n\r\n",
    ],
)
def test_feed_data_declines_other_shapes_and_consumes_nothing(other: bytes) -> None:
    dec = SSEDecoder()
    assert dec.feed_data(SIMPLE[:20]) == (b"", [])
    chunk = SIMPLE[20:] + other + b'data: {"a":1}\n\n'
    assert dec.feed_data(chunk) is None
    assert dec.pending == SIMPLE[:20]
    events = dec.feed(chunk)  # the general decoder takes over with the same state
    assert b"".join(e.raw for e in events) == SIMPLE + other + b'data: {"a":1}\n\n'


def test_feed_data_overflows_like_feed() -> None:
    for method in ("feed", "feed_data"):
        dec = SSEDecoder(max_event_bytes=16)
        with pytest.raises(SSEOverflow) as exc:
            getattr(dec, method)(b"data: a\n\ndata: 0123456789abcdefghij")
        assert exc.value.pending == b"data: a\n\ndata: 0123456789abcdefghij"
        assert dec.pending == b""


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_feed_data_any_split_matches_feed(data: st.DataObject) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(SIMPLE)), max_size=12)))
    chunks = [SIMPLE[a:b] for a, b in zip([0, *cuts], [*cuts, len(SIMPLE)], strict=True)]
    relayed, datas, pending = feed_data_all(chunks)
    events, _ = decode_all([SIMPLE])
    assert relayed == SIMPLE and pending == b""
    assert datas == [e.data for e in events]


@pytest.mark.parametrize(
    ("relayed", "done"),
    [
        (b"data: [DONE]\n\n", True),
        (b'data: {"a":1}\n\ndata: [DONE]\n\n', True),
        (b"data:[DONE]\r\n\r\n", True),
        (b"data: [DONE]\r\r", True),
        (b"data: [DONE]\n", False),  # not a whole event yet
        (b'data: {"text":"data: [DONE]"}\n\n', False),
        (b"data: [DONE]\n\ndata: {}\n\n", False),  # something came after it
        (b": data: [DONE]\n\n", False),  # a comment
        (b"", False),
    ],
)
def test_ends_with_done(relayed: bytes, done: bool) -> None:
    assert ends_with_done(relayed) is done


def test_a_long_first_read_is_cut_after_the_first_event_end_past_the_mark() -> None:
    events = [b"data: %03d%s\n\n" % (i, b"x" * 89) for i in range(40)]  # 100 bytes each
    read = b"".join(events)
    cut = first_cut(read)
    assert cut == 600 and read[cut - 2 : cut] == b"\n\n", "not just after an event's end"
    assert FIRST_CUT_AT < cut < FIRST_CUT_AT + len(events[0])
    assert SSEDecoder().feed(read[:cut]) == SSEDecoder().feed(read)[:6]


@pytest.mark.parametrize(
    "read",
    [
        b"data: x\n\n" * (FIRST_CUT_MIN // 9),  # not past FIRST_CUT_MIN bytes
        b"data: x\r\n\r\n" * 400,  # no LF blank line to cut at
        b"data: " + b"x" * 3000 + b"\n\n",  # one event: nothing after the cut
    ],
)
def test_a_short_read_or_one_with_no_event_end_to_cut_at_is_not_cut(read: bytes) -> None:
    assert first_cut(read) == 0
