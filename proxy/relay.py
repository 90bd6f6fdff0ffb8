"""The streaming relay: upstream SSE bytes -> decoder -> inspectors -> client, event by event.

Whole events are written as soon as they are complete, byte for byte as they arrived unless a
stage changes them (logprobs detproxy injected are stripped; a restarted attempt keeps the
original ``id``), so a stream that breaks mid-event can still be ended cleanly with an
in-band error. Inspection is best effort: malformed SSE or JSON switches it off for this
response and the bytes go on. With ``hold_reasoning``, reasoning events are held back until
reasoning ends (within a bound), so an attempt abandoned for a loop is never shown.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web

from policies.base import Abort, Continue, Decision, Retry, Trigger
from proxy.audit.inject import strip_logprobs
from proxy.errors import inband_error_event
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.inspect.base import InspectorSet
from proxy.inspect.loopwatch import LoopWatch
from proxy.sse import SSEDecoder, SSEEvent, SSEOverflow, encode_event
from proxy.upstream import UpstreamResponse, read_error_kind

_READ_ERRORS = (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, asyncio.TimeoutError)


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """How one attempt's stream is relayed."""

    strip_logprobs: bool = False
    id_override: str | None = None  # a restarted attempt continues under the first id
    hold_reasoning: bool = False
    hold_max_bytes: int = 256 * 1024
    loop_watch: LoopWatch | None = None
    on_trigger: Callable[[Trigger], Decision] | None = None


@dataclass(slots=True)
class StreamResult:
    complete: bool = False  # the upstream stream ended normally
    first_event_s: float | None = None  # since the start of the request
    events: int = 0
    first_id: str | None = None
    trigger: Trigger | None = None
    decision: Retry | Abort | None = None  # the relay stopped early on this
    shown: bool = False  # some of this attempt's content reached the client
    # Speed as the client sees it: token events (chunks carrying text), seconds since t0.
    token_events: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int | None = None  # from a usage chunk, when the upstream sends one


def _releases_hold(chunk: Mapping[str, Any]) -> bool | None:
    """True: reasoning is over; False: a reasoning delta; None: neither (e.g. the role chunk)."""
    choices = chunk.get("choices")
    if not isinstance(choices, list) or not choices:
        return True  # usage or error chunks end the hold
    reasoning = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None or choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("tool_calls"):
                return True
            if delta.get("reasoning") or delta.get("reasoning_content"):
                reasoning = True
    return False if reasoning else None


class StreamRelay:
    """Relays one upstream SSE attempt to the client response."""

    def __init__(
        self,
        endpoint: str,
        inspectors: InspectorSet,
        bus: EventBus,
        max_event_bytes: int,
        t0: float,
        plan: StreamPlan = StreamPlan(),
    ) -> None:
        self._endpoint = endpoint
        self._inspectors = inspectors
        self._inspecting = True
        self._bus = bus
        self._decoder = SSEDecoder(max_event_bytes)
        self._t0 = t0
        self._plan = plan
        self._holding = plan.hold_reasoning
        self._held: list[bytes] = []
        self._held_bytes = 0
        self.result = StreamResult()

    def _stop_inspecting(self, reason: str) -> None:
        if self._inspecting:
            self._inspecting = False
            self._bus.publish(InspectionStopped(self._endpoint, reason))

    def _parse(self, event: SSEEvent) -> dict[str, Any] | None:
        data = event.data
        if data is None or data == b"[DONE]":
            return None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            chunk = None
        if not isinstance(chunk, dict):
            self._stop_inspecting("malformed_json")
            return None
        return chunk

    def _process(self, event: SSEEvent) -> bytes | None:
        """Inspect one event; return the bytes to write now (None: held or withheld)."""
        chunk = self._parse(event)
        if chunk is None:  # [DONE], a comment, or malformed: whatever was held goes first
            self._holding = False
            return self._flush_held(event.raw)
        result = self.result
        if result.first_id is None and isinstance(chunk.get("id"), str):
            result.first_id = chunk["id"]
        self._time_tokens(chunk)
        if self._inspectors:
            self._inspectors.on_chunk(chunk)
        plan = self._plan
        if plan.loop_watch is not None:
            trigger = plan.loop_watch.on_chunk(chunk)
            if trigger is not None and result.trigger is None:
                result.trigger = trigger
                decision = plan.on_trigger(trigger) if plan.on_trigger else Continue()
                if isinstance(decision, Retry | Abort):
                    result.decision = decision
                    self._held.clear()  # a held looping attempt is never shown
                    return None
        raw = event.raw
        changed = False
        if plan.strip_logprobs and strip_logprobs(chunk):
            changed = True  # logprobs detproxy injected: the client did not ask
        if plan.id_override is not None and chunk.get("id") != plan.id_override:
            chunk["id"] = plan.id_override
            changed = True
        if changed:
            raw = encode_event(orjson.dumps(chunk))
        if self._holding:
            release = _releases_hold(chunk)
            if release is True:
                self._holding = False
                return self._flush_held(raw)
            if release is False or self._held:
                self._held.append(raw)
                self._held_bytes += len(raw)
                if self._held_bytes > plan.hold_max_bytes:
                    self._holding = False  # past the bound: show what was held, stop holding
                    self._stop_inspecting_hold()
                    return self._flush_held(b"")
                return None
        return self._emit(raw)

    def _time_tokens(self, chunk: dict[str, Any]) -> None:
        choices = chunk.get("choices")
        if isinstance(choices, list):
            for choice in choices:
                if not isinstance(choice, dict):
                    continue
                delta = choice.get("delta")
                if isinstance(delta, dict):
                    text = (
                        delta.get("content")
                        or delta.get("reasoning")
                        or delta.get("reasoning_content")
                    )
                else:
                    text = choice.get("text")
                if text:
                    result = self.result
                    now = time.monotonic() - self._t0
                    if result.first_token_s is None:
                        result.first_token_s = now
                    result.last_token_s = now
                    result.token_events += 1
                    break
        usage = chunk.get("usage")
        if isinstance(usage, dict) and isinstance(usage.get("completion_tokens"), int):
            self.result.completion_tokens = usage["completion_tokens"]

    def _stop_inspecting_hold(self) -> None:
        self._bus.publish(InspectionStopped(self._endpoint, "hold_overflow"))

    def _flush_held(self, raw: bytes) -> bytes:
        held = b"".join(self._held) + raw
        self._held.clear()
        return self._emit(held)

    def _emit(self, raw: bytes) -> bytes:
        if raw:
            self.result.shown = True
        return raw

    async def run(self, upstream: UpstreamResponse, resp: web.StreamResponse) -> StreamResult:
        """Relay until the upstream ends or a decision stops it. Client write errors propagate."""
        result = self.result
        decoder = self._decoder
        try:
            async for data in upstream.chunks():
                if not self._inspecting:
                    await resp.write(self._flush_held(b"") + data)
                    continue
                try:
                    events = decoder.feed(data)
                except SSEOverflow as exc:
                    self._stop_inspecting("event_too_large")
                    await resp.write(self._flush_held(b"") + exc.pending)
                    continue
                if not events:
                    continue
                if result.first_event_s is None:
                    result.first_event_s = time.monotonic() - self._t0
                result.events += len(events)
                parts: list[bytes] = []
                for event in events:
                    if not self._inspecting:
                        parts.append(event.raw)
                    elif event.data is None and not event.raw.lstrip(b"\r\n").startswith(b":"):
                        self._stop_inspecting("malformed_sse")
                        parts.append(self._flush_held(event.raw))
                    else:
                        out = self._process(event)
                        if result.decision is not None:
                            break
                        if out:
                            parts.append(out)
                if not self._inspecting:
                    parts.append(self._flush_held(decoder.take_pending()))  # raw from here on
                out = parts[0] if len(parts) == 1 else b"".join(parts)
                if out:
                    await resp.write(out)
                if result.decision is not None:
                    return result
        except _READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            # Bytes of an unfinished event are dropped; a blank line first ends any partial
            # line already relayed in raw mode, so the error event parses on its own.
            prefix = self._flush_held(b"") + (b"" if self._inspecting else b"\n\n")
            error = inband_error_event(502, "upstream connection lost mid-stream")
            await resp.write(prefix + error)
            self._inspectors.on_end(False)
            return result
        tail = decoder.pending
        out = self._flush_held(b"")
        if tail and self._inspecting:
            # A last event without its blank line: relayed as it came unless rewritten.
            final = decoder.flush()
            processed = self._process(final) if final is not None else tail
            out += (processed or b"") + self._flush_held(b"")
        if out:
            await resp.write(out)
        result.complete = result.decision is None
        self._inspectors.on_end(result.complete)
        return result
