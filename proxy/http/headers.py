"""Header hygiene for a reverse proxy (RFC 9110 section 7.6.1 hop-by-hop fields)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Final, Protocol

from multidict import CIMultiDict, istr

HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by whoever writes the next hop's message.
_FRAMING = frozenset({"host", "content-length"})
# The proxy reads these bodies itself, so it asks for them uncompressed.
_READ_BY_PROXY = frozenset({"accept-encoding"})

# What each direction drops before the Connection header's own tokens are added.
_TO_UPSTREAM = HOP_BY_HOP | _FRAMING
_TO_UPSTREAM_READ = _TO_UPSTREAM | _READ_BY_PROXY
_TO_CLIENT = HOP_BY_HOP | {"content-length"}
_TO_CLIENT_KEEP_LENGTH = HOP_BY_HOP

REQUEST_ID = "X-Request-Id"
# On every request detproxy sends upstream: the sending server's id (proxy/selfloop.py), one
# field per detproxy the request went through, so that one whose upstream leads back to it
# knows its own requests when they come back.
VIA = "X-Detproxy-Via"
REQUEST_ID_BATCH: Final = 256  # request ids minted from one read of random bytes


@lru_cache(maxsize=256)  # a few distinct Connection values in practice; bounded for the rest
def _dropped(base: frozenset[str], connection: str | None) -> tuple[istr, ...]:
    names = set(base)
    if connection:
        names.update(tok.strip().lower() for tok in connection.split(","))
        names.discard("")
    return tuple(istr(name) for name in sorted(names))


def _filter(headers: Mapping[str, str], base: frozenset[str]) -> CIMultiDict[str]:
    # Copying all and deleting the few present costs a fifth of filtering one by one.
    out = CIMultiDict(headers)
    for name in _dropped(base, headers.get("Connection")):
        if name in out:
            del out[name]
    return out


class HeldNames:
    """A set of header names (lowercase) that a parser's field names (bytes, any case) are
    told against: the name lowercased, looked up."""

    __slots__ = ("_names",)

    def __init__(self, names: frozenset[str]) -> None:
        for name in names:
            if not name or name != name.lower():
                raise ValueError(f"a held name is lowercase and not empty: {name!r}")
        self._names = frozenset(name.encode() for name in names)

    def holds(self, name: bytes) -> bool:
        return name.lower() in self._names


# The fields a proxied request does not pass on as they came: hop-by-hop, framing, what the
# proxy asks for itself (it reads the answer), and the request id it sets.
NOT_PASSED: Final = frozenset(_TO_UPSTREAM_READ | {REQUEST_ID.lower()})
_REQUEST_HELD: Final = HeldNames(NOT_PASSED)
# And those of a response: hop-by-hop, and the length this server writes itself (or not).
_RESPONSE_HELD: Final = HeldNames(frozenset(_TO_CLIENT))
_RESPONSE_HELD_BUT_LENGTH: Final = HeldNames(frozenset(_TO_CLIENT_KEEP_LENGTH))
_REQUEST_ID_NAME: Final = HeldNames(frozenset({REQUEST_ID.lower()}))
_DATE_NAME: Final = HeldNames(frozenset({"date"}))
_LENGTH_NAME: Final = HeldNames(frozenset({"content-length"}))
_CONTENT_TYPE: Final = HeldNames(frozenset({"content-type"}))
_CONNECTION: Final = HeldNames(frozenset({"connection"}))
FRAMING_NAMES: Final = HeldNames(frozenset({"content-length", "transfer-encoding"}))
_HOP_TOKENS: Final = frozenset(n.encode() for n in HOP_BY_HOP | {"close"})


def is_passed(name: bytes) -> bool:
    """Whether a proxied request passes the field ``name`` on as it came (not NOT_PASSED)."""
    return not _REQUEST_HELD.holds(name)


def connection_names_only_hop(value: bytes) -> bool:
    """A Connection header's tokens name nothing but hop-by-hop fields (``keep-alive``,
    ``close``): no other field the client sent is dropped because of it."""
    lowered = value.lower()
    if lowered == b"keep-alive" or lowered == b"close":
        return True
    for token in lowered.split(b","):
        token = token.strip()
        if token and token not in _HOP_TOKENS:
            return False
    return True


def names_other_fields(name: bytes, value: bytes) -> bool:
    """A Connection field whose tokens name a field that is not hop-by-hop: that field is
    left out too, which fields passed on as they came cannot do (the mapping's filter does)."""
    return _CONNECTION.holds(name) and not connection_names_only_hop(value)


class EncodedFields:
    """Header fields already as they go on the wire, one ``Name: value`` line each, CRLF-ended.

    A proxied request's fields are the client's own bytes less ``NOT_PASSED``, a response's
    the upstream's less hop-by-hop ones: the native upstream client and the lean front write
    ``lines`` as they are, so no field is decoded, filtered and encoded again per message.
    ``mapping()`` reads them where a mapping is wanted (headers added to an answer's)."""

    __slots__ = ("has_date", "has_length", "lines")

    def __init__(self, lines: bytes, *, has_date: bool = False, has_length: bool = False) -> None:
        self.lines = lines
        # What a writer of the head needs to know of them: whether it adds a Date, whether
        # the body's length is declared among them (the one who encoded them knows).
        self.has_date = has_date
        self.has_length = has_length

    def mapping(self) -> CIMultiDict[str]:
        out: CIMultiDict[str] = CIMultiDict()
        for line in self.lines.split(b"\r\n"):
            if line:
                name, _, value = line.partition(b":")
                out.add(name.decode("latin-1"), decode_field(value.strip(b" \t")))
        return out


# A message's header fields as detproxy hands them to a writer: a mapping, or encoded.
HeaderFields = Mapping[str, str] | EncodedFields


def as_mapping(headers: HeaderFields) -> Mapping[str, str]:
    return headers.mapping() if isinstance(headers, EncodedFields) else headers


def upstream_request_headers(
    headers: Mapping[str, str], request_id: str, *, proxy_reads_body: bool
) -> CIMultiDict[str]:
    out = _filter(headers, _TO_UPSTREAM_READ if proxy_reads_body else _TO_UPSTREAM)
    out[REQUEST_ID] = request_id
    if proxy_reads_body:
        out["Accept-Encoding"] = "identity"
    return out


def client_response_headers(
    headers: Mapping[str, str], request_id: str, *, keep_length: bool = False
) -> CIMultiDict[str]:
    """The upstream response's headers for the client: hop-by-hop ones left out (and the
    length, which the front writes itself, unless ``keep_length``), the request id added
    where the upstream gave none (``response_fields`` does the same from their bytes)."""
    out = _filter(headers, _TO_CLIENT_KEEP_LENGTH if keep_length else _TO_CLIENT)
    if REQUEST_ID not in out:
        out[REQUEST_ID] = request_id
    return out


def response_fields(
    raw: list[tuple[bytes, bytes]], request_id: str, keep_length: bool
) -> EncodedFields | None:
    """``client_response_headers`` of a response's fields as they came, (name, value) bytes:
    passed on as they came. None where the Connection header names another field to leave
    out (then the mapping is filtered)."""
    held = _RESPONSE_HELD_BUT_LENGTH if keep_length else _RESPONSE_HELD
    parts: list[bytes] = []
    has_id = has_date = has_length = False
    for name, value in raw:
        if held.holds(name):
            if names_other_fields(name, value):
                return None
            continue
        size = len(name)
        if size == 12 and _REQUEST_ID_NAME.holds(name):
            has_id = True
        elif size == 4 and _DATE_NAME.holds(name):
            has_date = True
        elif size == 14 and keep_length and _LENGTH_NAME.holds(name):
            has_length = True
        parts.append(name + b": " + value)
    if not has_id:
        parts.append(b"X-Request-Id: " + encode_head(request_id))
    lines = b"\r\n".join(parts) + b"\r\n"
    return EncodedFields(lines, has_date=has_date, has_length=has_length)


def with_fields(headers: HeaderFields, extra: dict[str, str]) -> HeaderFields:
    """``headers`` with ``extra``'s fields set (replacing those of the same names)."""
    if not extra:
        return headers
    out = CIMultiDict(as_mapping(headers))
    out.update(extra)
    return out


def is_event_stream(headers: Mapping[str, str]) -> bool:
    """A response's headers say it is an SSE stream."""
    return headers.get("Content-Type", "").startswith("text/event-stream")


class SentFields(Protocol):
    """What ``headers_for_upstream`` reads of a client's request (``ClientSide`` is one)."""

    @property
    def headers(self) -> Mapping[str, str]: ...

    @property
    def passed_fields(self) -> bytes | None: ...


def headers_for_upstream(request: SentFields, request_id: str) -> HeaderFields:
    """``upstream_request_headers`` of a request whose answer the proxy reads: the client's
    fields as they came, less ``NOT_PASSED`` (``passed_fields``), where its server kept
    them (no mapping decoded for it); then the request id and ``Accept-Encoding: identity``."""
    passed = request.passed_fields
    if passed is None:
        return upstream_request_headers(request.headers, request_id, proxy_reads_body=True)
    rid = encode_head(request_id)
    return EncodedFields(passed + b"X-Request-Id: " + rid + b"\r\nAccept-Encoding: identity\r\n")


class ReceivedFields(Protocol):
    """What the helpers below read of a received message (``UpstreamResponse`` is one)."""

    raw_fields: list[tuple[bytes, bytes]] | None

    @property
    def headers(self) -> Mapping[str, str]: ...


def is_event_stream_response(response: ReceivedFields) -> bool:
    """``is_event_stream`` of the response's headers, read from its fields' bytes where the
    client keeps them (no mapping decoded for it)."""
    raw = response.raw_fields
    if raw is None:
        return is_event_stream(response.headers)
    for name, value in raw:
        if len(name) == 12 and _CONTENT_TYPE.holds(name):
            return value.startswith(b"text/event-stream")
    return False


def headers_for_client(
    response: ReceivedFields, request_id: str, *, keep_length: bool = False
) -> HeaderFields:
    """``client_response_headers`` of the response: from its fields' bytes, passed on as they
    came, where the client keeps them (no mapping decoded for it)."""
    raw = response.raw_fields
    if raw is not None:
        fields = response_fields(raw, request_id, keep_length)
        if fields is not None:
            return fields
    return client_response_headers(response.headers, request_id, keep_length=keep_length)


def decode_field(data: bytes) -> str:
    """A field's bytes as aiohttp decodes them: UTF-8, a byte that is not UTF-8 kept as a
    surrogate escape (``encode_head`` gives the bytes back)."""
    try:
        # Strict first: compiled, a strict UTF-8 decode is a direct call, and one with an
        # error handler a codec lookup by name (twice the cost of a short field's decode).
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return data.decode("utf-8", "surrogateescape")


def encode_head(text: str) -> bytes:
    """A message head written from header text. Field bytes are decoded as aiohttp decodes
    them (UTF-8, a byte that is not UTF-8 kept as a surrogate escape), so this gives back the
    bytes that came in; text that is neither (a lone surrogate) is replaced, never raised."""
    try:
        return text.encode("utf-8")  # strict first, as in decode_field
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def via_field(server_id: str | None) -> bytes:
    """The ``X-Detproxy-Via`` field a server's upstream requests carry (none without an id)."""
    return b"" if not server_id else encode_head(f"{VIA}: {server_id}\r\n")


def new_request_id() -> str:
    """``uuid.uuid4().hex`` without the UUID object: 128 random bits, the version (4) and the
    RFC 4122 variant set in place."""
    return _uuid4_hex(os.urandom(16), 0)


def _uuid4_hex(random: bytes, at: int) -> str:
    raw = bytearray(random[at : at + 16])
    raw[6] = (raw[6] & 0x0F) | 0x40
    raw[8] = (raw[8] & 0x3F) | 0x80
    return raw.hex()


class RequestIds:
    """Mints request ids as ``new_request_id`` does, from the kernel's random bytes read for
    256 ids at once: one ``getrandom`` call a request was a fifth of detproxy's system calls
    on a non-streamed request. The ids stay unpredictable (vLLM keys its requests by them).
    One per process: ``--workers`` starts each worker as a new program, never as a fork that
    would share the bytes not yet used."""

    __slots__ = ("_at", "_random")

    def __init__(self) -> None:
        self._random = b""
        self._at = 0

    def new(self) -> str:
        at = self._at
        if at >= len(self._random):
            self._random = os.urandom(16 * REQUEST_ID_BATCH)
            at = 0
        self._at = at + 16
        return _uuid4_hex(self._random, at)


def request_id_of(given: str | None, ids: RequestIds | None = None) -> str:
    """Keep the caller's ``X-Request-Id`` (``given``: vLLM uses it as the engine id), else
    mint one (from ``ids`` where given)."""
    rid = given
    if rid:
        rid = rid.strip()
        if rid and len(rid) <= 256 and rid.isprintable():
            return rid
    return new_request_id() if ids is None else ids.new()
