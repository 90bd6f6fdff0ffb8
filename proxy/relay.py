"""The streaming relay: upstream SSE bytes -> decoder -> inspectors -> client, event by event.

Whole events are written as soon as they are complete, byte for byte as they arrived, so a
stream that breaks mid-event can still be ended cleanly with an in-band error. Inspection is
best effort: malformed SSE or JSON switches it off for this response and the bytes go on.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from proxy.audit.inject import strip_logprobs
from proxy.errors import inband_error_event
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.inspect.base import InspectorSet
from proxy.sse import SSEDecoder, SSEEvent, SSEOverflow, encode_event
from proxy.upstream import UpstreamResponse, read_error_kind

_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


@dataclass(slots=True)
class StreamResult:
    complete: bool = False  # the upstream stream ended normally
    first_event_s: float | None = None  # since the start of the request
    events: int = 0


class StreamRelay:
    """Relays one upstream SSE response to one client response."""

    __slots__ = ("_bus", "_decoder", "_endpoint", "_inspecting", "_inspectors", "_strip", "_t0")

    def __init__(
        self,
        endpoint: str,
        inspectors: InspectorSet,
        bus: EventBus,
        max_event_bytes: int,
        t0: float,
        strip_logprobs: bool = False,
    ) -> None:
        self._endpoint = endpoint
        self._strip = strip_logprobs
        self._inspectors = inspectors
        self._inspecting = True
        self._bus = bus
        self._decoder = SSEDecoder(max_event_bytes)
        self._t0 = t0

    def _stop_inspecting(self, reason: str) -> None:
        if self._inspecting:
            self._inspecting = False
            self._bus.publish(InspectionStopped(self._endpoint, reason))

    def _inspect(self, event: SSEEvent) -> bytes:
        """Show the event to the inspectors; return the bytes to relay for it."""
        data = event.data
        if data is None or data == b"[DONE]":
            return event.raw
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            self._stop_inspecting("malformed_json")
            return event.raw
        if not isinstance(chunk, dict):
            self._stop_inspecting("malformed_json")
            return event.raw
        if self._inspectors:
            self._inspectors.on_chunk(chunk)
        if self._strip and "choices" in chunk:
            # Logprobs detproxy injected: the client gets the chunk as it asked for it.
            strip_logprobs(chunk)
            return encode_event(orjson.dumps(chunk))
        return event.raw

    async def run(self, upstream: UpstreamResponse, resp: web.StreamResponse) -> StreamResult:
        """Relay until the upstream ends. Client write errors propagate to the caller."""
        result = StreamResult()
        decoder = self._decoder
        try:
            async for data in upstream.chunks():
                if not self._inspecting:
                    await resp.write(data)
                    continue
                try:
                    events = decoder.feed(data)
                except SSEOverflow as exc:
                    self._stop_inspecting("event_too_large")
                    await resp.write(exc.pending)
                    continue
                if not events:
                    continue
                if result.first_event_s is None:
                    result.first_event_s = time.monotonic() - self._t0
                result.events += len(events)
                parts = []
                for event in events:
                    if not self._inspecting:
                        parts.append(event.raw)
                    elif event.data is None and not event.raw.lstrip(b"\r\n").startswith(b":"):
                        self._stop_inspecting("malformed_sse")
                        parts.append(event.raw)
                    else:
                        parts.append(self._inspect(event))
                out = parts[0] if len(parts) == 1 else b"".join(parts)
                if not self._inspecting:
                    out += decoder.take_pending()  # raw mode from here on
                await resp.write(out)
        except _READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            # Bytes of an unfinished event are dropped; a blank line first ends any partial
            # line already relayed in raw mode, so the error event parses on its own.
            prefix = b"" if self._inspecting else b"\n\n"
            await resp.write(
                prefix + inband_error_event(502, "upstream connection lost mid-stream")
            )
            self._inspectors.on_end(False)
            return result
        tail = decoder.pending
        if tail and self._inspecting:
            # A last event without its blank line: relayed as it came unless rewritten.
            final = decoder.flush()
            await resp.write(self._inspect(final) if final is not None else tail)
        result.complete = True
        self._inspectors.on_end(True)
        return result
