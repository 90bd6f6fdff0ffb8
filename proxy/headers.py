"""Header hygiene for a reverse proxy (RFC 9110 section 7.6.1 hop-by-hop fields)."""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping

from multidict import CIMultiDict

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

REQUEST_ID = "X-Request-Id"


def _connection_tokens(headers: Mapping[str, str]) -> set[str]:
    value = headers.get("Connection", "")
    return {tok.strip().lower() for tok in value.split(",") if tok.strip()}


def _filter(headers: Iterable[tuple[str, str]], drop: set[str]) -> CIMultiDict[str]:
    out: CIMultiDict[str] = CIMultiDict()
    for name, value in headers:
        if name.lower() not in drop:
            out.add(name, value)
    return out


def upstream_request_headers(
    headers: Mapping[str, str], request_id: str, *, proxy_reads_body: bool
) -> CIMultiDict[str]:
    drop = set(HOP_BY_HOP) | _FRAMING | _connection_tokens(headers)
    if proxy_reads_body:
        drop |= _READ_BY_PROXY
    out = _filter(headers.items(), drop)
    out[REQUEST_ID] = request_id
    if proxy_reads_body:
        out["Accept-Encoding"] = "identity"
    return out


def client_response_headers(
    headers: Mapping[str, str], request_id: str, *, keep_length: bool = False
) -> CIMultiDict[str]:
    drop = set(HOP_BY_HOP) | _connection_tokens(headers)
    if not keep_length:
        drop.add("content-length")
    out = _filter(headers.items(), drop)
    if REQUEST_ID not in out:
        out[REQUEST_ID] = request_id
    return out


def request_id_of(headers: Mapping[str, str]) -> str:
    """Keep the caller's ``X-Request-Id`` (vLLM uses it as the engine id), else mint one."""
    rid = headers.get(REQUEST_ID, "").strip()
    if rid and len(rid) <= 256 and rid.isprintable():
        return rid
    return uuid.uuid4().hex
