"""Header hygiene for a reverse proxy (RFC 9110 section 7.6.1 hop-by-hop fields)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from functools import lru_cache
from typing import Final

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


def forwarded_headers(headers: Mapping[str, str]) -> CIMultiDict[str]:
    """A request's headers for the next hop, as they came but for hop-by-hop and framing."""
    return _filter(headers, _TO_UPSTREAM)


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
    out = _filter(headers, _TO_CLIENT_KEEP_LENGTH if keep_length else _TO_CLIENT)
    if REQUEST_ID not in out:
        out[REQUEST_ID] = request_id
    return out


def is_event_stream(headers: Mapping[str, str]) -> bool:
    """A response's headers say it is an SSE stream."""
    return headers.get("Content-Type", "").startswith("text/event-stream")


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


def request_id_of(headers: Mapping[str, str], ids: RequestIds | None = None) -> str:
    """Keep the caller's ``X-Request-Id`` (vLLM uses it as the engine id), else mint one
    (from ``ids`` where given)."""
    rid = headers.get(REQUEST_ID)
    if rid:
        rid = rid.strip()
        if rid and len(rid) <= 256 and rid.isprintable():
            return rid
    return new_request_id() if ids is None else ids.new()
