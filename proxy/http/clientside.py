"""The client seam: one client request and its response, whichever server received it.

The stages never see a server's own request or response objects. They read the request and
write the response through a ``ClientSide``: ``proxy.http.front`` implements it on detproxy's
lean HTTP/1.1 server; the admin endpoints read it too (``proxy.http.admin.AdminRequest``), and
tests may implement it on anything. A response is either whole (``respond``) or streamed
(``start``, ``write`` per piece, ``end``); writing to a client that left raises
``ConnectionResetError``. ``write_nowait`` is ``write`` without waiting, for a relay that
writes from an upstream read's callback: it says when to ``drain`` before writing more.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Protocol

from proxy.http.headers import HeaderFields


class BodyWriter(Protocol):
    """The writing half of a streamed response, after its head: all a relay writes through
    (``proxy.relay.stream``), so that a test can hand it a recorder of the writes."""

    async def write(self, data: bytes) -> None: ...

    def write_nowait(self, data: bytes) -> bool:
        """Queue ``data`` in order; False: ``drain`` before the next write (the client is
        slower, or this server writes only when awaited)."""
        ...

    async def drain(self) -> None:
        """Until what ``write_nowait`` queued is on its way and the client takes more."""
        ...


class ClientSide(BodyWriter, Protocol):
    """One client request, and the response detproxy writes to it (its body's writes are
    ``BodyWriter``'s)."""

    @property
    def method(self) -> str: ...

    @property
    def path(self) -> str:
        """The decoded path, without the query."""
        ...

    @property
    def raw_path(self) -> str:
        """The path and query as the client sent them: what the upstream is sent."""
        ...

    @property
    def headers(self) -> Mapping[str, str]:
        """Case-insensitive, repeated names kept."""
        ...

    def header(self, name: bytes) -> str | None:
        """The first field named ``name`` (lowercase), decoded as ``headers`` decodes it:
        what the stages read of a request's fields, without a mapping of them all."""
        ...

    @property
    def passed_fields(self) -> bytes | None:
        """The header fields as the client sent them (``Name: value`` lines, CRLF-ended),
        less those a proxy does not pass on as they came (``proxy.http.headers.NOT_PASSED``):
        what the upstream is sent. None where the server does not keep them (``headers`` is
        filtered instead)."""
        ...

    @property
    def has_body(self) -> bool: ...

    async def read_body(self, limit: int) -> bytes:
        """The whole body; ``BadRequest`` (413) past ``limit`` bytes."""
        ...

    def body_chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives, unbounded (what a pass-through relays)."""
        ...

    async def respond(self, status: int, headers: HeaderFields, body: bytes) -> None:
        """A whole response (``headers``: a mapping, or fields already encoded)."""
        ...

    async def start(self, status: int, headers: HeaderFields) -> None:
        """A streamed response's head; its body follows in ``write`` calls."""
        ...

    async def end(self) -> None:
        """The streamed response is complete."""
        ...
