"""Header hygiene: what goes upstream, what comes back, and the request id."""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass

import pytest
from multidict import CIMultiDict, CIMultiDictProxy

from proxy.http.headers import (
    NOT_PASSED,
    REQUEST_ID_BATCH,
    EncodedFields,
    HeldNames,
    RequestIds,
    as_mapping,
    client_response_headers,
    connection_names_only_hop,
    decode_field,
    encode_head,
    headers_for_upstream,
    is_event_stream,
    is_passed,
    request_id_of,
    response_fields,
    upstream_request_headers,
    with_fields,
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


@dataclass
class Sent:
    """A client's request as ``headers_for_upstream`` reads it."""

    headers: CIMultiDictProxy[str]
    passed_fields: bytes | None


def test_fields_passed_as_they_came_get_the_request_id_and_identity_added() -> None:
    passed = b"Content-Type: application/json\r\nX-Obs: caf\xe9\r\n"
    out = headers_for_upstream(Sent(headers(("Host", "h")), passed), "rid-1")
    assert isinstance(out, EncodedFields)
    assert out.lines == passed + b"X-Request-Id: rid-1\r\nAccept-Encoding: identity\r\n"
    # Read as a mapping (aiohttp's client): decoded as the front decodes them.
    assert list(as_mapping(out).items()) == [
        ("Content-Type", "application/json"),
        ("X-Obs", decode_field(b"caf\xe9")),
        ("X-Request-Id", "rid-1"),
        ("Accept-Encoding", "identity"),
    ]
    # A server that keeps no bytes: its mapping is filtered.
    filtered = headers_for_upstream(Sent(headers(("Host", "h"), ("X-A", "1")), None), "r")
    assert list(as_mapping(filtered).items()) == [
        ("X-A", "1"),
        ("X-Request-Id", "r"),
        ("Accept-Encoding", "identity"),
    ]


def test_field_names_are_told_passed_or_held_whatever_their_case() -> None:
    for held in NOT_PASSED:
        for name in (held, held.upper(), held.title()):
            assert not is_passed(name.encode()), name
    for name in (
        b"Content-Type",
        b"User-Agent",
        b"Authorization",
        b"X-Stainless-Lang",
        b"Accept",
        b"Hosts",
        b"Tee",
        b"x-request-ids",
        b"caf\xe9",
        b"0",
        b"-",
        b"",
        b"Upgraded",
        b"connectio",
        b"Proxy-Authorizatio",
        b"x" * 200,
        b"[onnection",
        b"@ost",
    ):
        assert is_passed(name), name


def test_held_names_are_held_in_any_case_and_no_other_is() -> None:
    held = HeldNames(frozenset({"abc", "axy", "content-length"}))
    for name in (b"abc", b"ABC", b"Abc", b"aXy", b"axy", b"CONTENT-length", b"Content-Length"):
        assert held.holds(name), name
    for name in (b"abd", b"ab", b"bbc", b"content-lengtx", b"Content-Type", b"", b"\xe1bc"):
        assert not held.holds(name), name
    for bad in ("", "Host"):
        with pytest.raises(ValueError, match="held name"):
            HeldNames(frozenset({bad}))


def test_a_connection_header_that_names_another_field_is_told() -> None:
    for value in (b"keep-alive", b"close", b"Keep-Alive, TE", b"", b" , close"):
        assert connection_names_only_hop(value)
    for value in (b"keep-alive, X-Secret", b"x-foo", b"close,Authorization"):
        assert not connection_names_only_hop(value)


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


def test_response_fields_pass_as_they_came_less_hop_by_hop_and_the_length() -> None:
    raw = [
        (b"date", b"Wed, 02 Dec 2026 10:00:00 GMT"),
        (b"Content-Length", b"9"),
        (b"Keep-Alive", b"timeout=5"),
        (b"X-Obs", b"caf\xe9"),
        (b"connection", b"keep-alive"),
        (b"x-obs", b"2"),
    ]
    mapping = headers(*((n.decode(), decode_field(v)) for n, v in raw))
    out = response_fields(raw, "mine", False)
    assert out is not None
    assert out.lines == (
        b"date: Wed, 02 Dec 2026 10:00:00 GMT\r\nX-Obs: caf\xe9\r\nx-obs: 2\r\n"
        b"X-Request-Id: mine\r\n"
    )
    assert out.has_date and not out.has_length  # what the front writes itself, or not
    # The same fields as the mapping path gives them (what aiohttp's server is handed).
    assert list(as_mapping(out).items()) == list(client_response_headers(mapping, "mine").items())
    kept = response_fields(raw, "mine", True)
    assert kept is not None and kept.has_length and kept.has_date
    assert b"Content-Length: 9\r\n" in kept.lines
    undated = response_fields([(b"DATE-X", b"1"), (b"Datf", b"2")], "r", False)
    assert undated is not None and not undated.has_date
    with_id = response_fields([(b"X-REQUEST-ID", b"up")], "mine", False)
    assert with_id is not None and with_id.lines == b"X-REQUEST-ID: up\r\n"
    # A Connection header naming another field: left to the mapping's filter (None).
    named = [(b"Connection", b"close, X-Secret"), (b"X-Secret", b"s"), (b"A", b"1")]
    assert response_fields(named, "r", False) is None


def test_extra_fields_replace_those_of_their_names() -> None:
    fields = EncodedFields(b"A: 1\r\nX-Detproxy-Attempts: 9\r\n")
    assert with_fields(fields, {}) is fields
    out = with_fields(fields, {"x-detproxy-attempts": "2", "B": "3"})
    assert list(as_mapping(out).items()) == [("A", "1"), ("x-detproxy-attempts", "2"), ("B", "3")]


def test_request_id_is_kept_or_minted_as_a_uuid4() -> None:
    assert request_id_of(" abc ") == "abc"
    invalid = ("", "  ", "a\nb", "x" * 257)
    minted = {request_id_of(bad) for bad in invalid}
    minted |= {request_id_of(None) for _ in range(100)}
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
    minted = [request_id_of(None, ids) for _ in range(2 * REQUEST_ID_BATCH + 1)]
    assert reads == [16 * REQUEST_ID_BATCH] * 3  # one read for each batch begun
    assert len(set(minted)) == len(minted)
    for rid in minted:
        parsed = uuid.UUID(rid)
        assert parsed.hex == rid and parsed.version == 4 and parsed.variant == uuid.RFC_4122
    assert request_id_of("given", ids) == "given"
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
