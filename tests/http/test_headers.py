"""Header hygiene: what goes upstream, what comes back, and the request id."""

from __future__ import annotations

import os
import uuid

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.http.headers import (
    REQUEST_ID_BATCH,
    RequestIds,
    client_response_headers,
    decode_field,
    encode_head,
    is_event_stream,
    request_id_of,
    upstream_request_headers,
)


def headers(*items: tuple[str, str]) -> CIMultiDictProxy[str]:
    return CIMultiDictProxy(CIMultiDict(items))


def test_hop_by_hop_framing_and_connection_tokens_stay_behind() -> None:
    sent = headers(
        ("Host", "proxy:8080"),
        ("Connection", "keep-alive, X-Secret"),
        ("KEEP-ALIVE", "timeout=5"),
        ("Content-Length", "12"),
        ("Transfer-Encoding", "chunked"),
        ("te", "trailers"),
        ("Proxy-Authorization", "Basic x"),
        ("x-secret", "hop"),
        ("Accept", "application/json"),
        ("X-Many", "1"),
        ("Authorization", "Bearer k"),
        ("x-many", "2"),
        ("Accept-Encoding", "gzip"),
    )
    out = upstream_request_headers(sent, "rid-1", proxy_reads_body=False)
    # The rest, in order, repeated fields included.
    assert list(out.items()) == [
        ("Accept", "application/json"),
        ("X-Many", "1"),
        ("Authorization", "Bearer k"),
        ("x-many", "2"),
        ("Accept-Encoding", "gzip"),
        ("X-Request-Id", "rid-1"),
    ]
    read = upstream_request_headers(sent, "rid-1", proxy_reads_body=True)
    assert read.getall("Accept-Encoding") == ["identity"]


def test_connection_tokens_of_one_message_do_not_stick_to_the_next() -> None:
    first = headers(("Connection", "X-Foo"), ("X-Foo", "1"))
    assert "X-Foo" not in upstream_request_headers(first, "r", proxy_reads_body=False)
    for connection in ("keep-alive", "close", ""):
        second = headers(("Connection", connection), ("X-Foo", "1"))
        assert upstream_request_headers(second, "r", proxy_reads_body=False)["X-Foo"] == "1"
    assert upstream_request_headers(headers(("X-Foo", "1")), "r", proxy_reads_body=False)


def test_response_headers_keep_the_upstream_id_and_drop_the_length_unless_asked() -> None:
    got = headers(
        ("Content-Length", "9"),
        ("Content-Type", "application/json"),
        ("Connection", "close"),
        ("X-Request-Id", "upstream-id"),
    )
    out = client_response_headers(got, "mine")
    assert list(out.items()) == [
        ("Content-Type", "application/json"),
        ("X-Request-Id", "upstream-id"),
    ]
    kept = client_response_headers(headers(("content-length", "9")), "mine", keep_length=True)
    assert list(kept.items()) == [("content-length", "9"), ("X-Request-Id", "mine")]


def test_request_id_is_kept_or_minted_as_a_uuid4() -> None:
    assert request_id_of(headers(("x-request-id", " abc "))) == "abc"
    invalid = ("", "  ", "a\nb", "x" * 257)
    minted = {request_id_of(headers(("X-Request-Id", bad))) for bad in invalid}
    minted |= {request_id_of(headers()) for _ in range(100)}
    assert len(minted) == 104
    for rid in minted:
        parsed = uuid.UUID(rid)
        assert parsed.hex == rid and parsed.version == 4 and parsed.variant == uuid.RFC_4122


def test_request_ids_minted_in_batches_are_distinct_uuid4s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    reads: list[int] = []
    urandom = os.urandom

    def counted(n: int) -> bytes:
        reads.append(n)
        return urandom(n)

    monkeypatch.setattr(os, "urandom", counted)
    ids = RequestIds()
    minted = [request_id_of(headers(), ids) for _ in range(2 * REQUEST_ID_BATCH + 1)]
    assert reads == [16 * REQUEST_ID_BATCH] * 3  # one read for each batch begun
    assert len(set(minted)) == len(minted)
    for rid in minted:
        parsed = uuid.UUID(rid)
        assert parsed.hex == rid and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert request_id_of(headers(("x-request-id", "given")), ids) == "given"
    assert reads == [16 * REQUEST_ID_BATCH] * 3


def test_a_head_is_encoded_back_to_its_bytes_and_never_raises() -> None:
    received = b"caf\xe9 \xe2\x98\x83"  # an obs-text byte, then UTF-8
    assert decode_field(received) == received.decode("utf-8", "surrogateescape")
    assert encode_head(decode_field(received)) == received
    for plain in (b"", b"application/json", "caf\u00e9 \u2603".encode()):
        assert decode_field(plain) == plain.decode()
        assert encode_head(decode_field(plain)) == plain
    assert encode_head("x\ud800y") == b"x?y"  # a lone surrogate no parser makes: replaced


def test_an_event_stream_is_told_by_its_content_type() -> None:
    assert is_event_stream(headers(("content-type", "text/event-stream; charset=utf-8")))
    assert not is_event_stream(headers(("Content-Type", "application/json")))
    assert not is_event_stream(headers())
