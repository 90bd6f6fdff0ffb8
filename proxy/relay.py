"""The streaming relay: upstream SSE bytes -> decoder -> inspectors -> client, event by event.

Whole events are written as soon as they are complete, byte for byte as they arrived unless a
stage changes them (logprobs detproxy injected are stripped; a restarted attempt keeps the
original ``id``), so a stream that breaks mid-event can still be ended cleanly with an
in-band error. Inspection is best effort: malformed SSE or JSON switches it off for this
response and the bytes go on. With ``hold_reasoning``, reasoning events are held back until
reasoning ends (within a bound), so an attempt abandoned for a loop is never shown.

Three paths, one result (the client gets the same bytes, whatever the split of the reads):

- raw: when nothing looks at the events (no inspector, no loop watch, nothing rewritten or
  held), each read's complete events go out in one write, undecoded; ``RawTally`` counts what
  ``StreamResult`` reports with bytes searches (see ``proxy.rawtally`` for its approximations);
- simple: a read whose complete events are all single ``data: `` lines (what every engine
  sends) is split with bytes operations (``SSEDecoder.feed_data``); unchanged events go out as
  slices of the read, never re-encoded. Token chunks that match a learned ``ChunkTemplate``
  are not parsed at all: their texts are decoded in one call per run and fed to the loop watch
  at once (``LoopWatch.on_run``), which locates the chunk a trigger belongs to, so a decision
  stops at the same event as when each chunk is parsed. A read that is one such chunk (a
  token streamed on its own) is handled whole, not even split;
- general: any other read goes through the decoder and is parsed event by event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from policies.base import Abort, Continue, Decision, Retry, Trigger
from proxy.audit.inject import strip_logprobs
from proxy.errors import inband_error_event
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.inspect.base import InspectorSet
from proxy.inspect.loopwatch import LoopWatch
from proxy.rawtally import RawTally, tally_chunk
from proxy.relaysimple import SimpleReads
from proxy.sse import SSEDecoder, SSEEvent, SSEOverflow, encode_event
from proxy.template import Templates
from proxy.upstream import READ_ERRORS, UpstreamResponse, read_error_kind


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
    # The tokens the token events carried (a chunk can carry several: vLLM's stream interval,
    # speculative decoding), from usage growth, else logprobs entries, else one an event.
    tokens: int = 0
    first_tokens: int = 0  # those of the first token event (read, on the raw path)

    def speed(self) -> StreamSpeed | None:
        """The stream's speed in tokens; None when no token came."""
        first, last = self.first_token_s, self.last_token_s
        if first is None or last is None:
            return None
        total = self.completion_tokens or self.tokens
        after = total - self.first_tokens  # the tokens that came after the first token event
        decode_s = last - first
        return StreamSpeed(
            ttft_s=first,
            tokens=total,
            inter_token_s=decode_s / after if after > 0 else None,
            tokens_per_s=after / decode_s if after > 0 and decode_s > 0 else None,
        )


@dataclass(frozen=True, slots=True)
class StreamSpeed:
    ttft_s: float
    tokens: int  # the usage's completion_tokens when the upstream sent it
    inter_token_s: float | None  # mean time between the tokens after the first token event
    tokens_per_s: float | None  # decode rate between the first and the last token event


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


class StreamRelay(SimpleReads):
    """Relays one upstream SSE attempt to the client response."""

    def __init__(
        self,
        endpoint: str,
        inspectors: InspectorSet,
        bus: EventBus,
        max_event_bytes: int,
        t0: float,
        plan: StreamPlan = StreamPlan(),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # the speed metrics' time; tests inject theirs
        self._endpoint = endpoint
        self._inspectors = inspectors
        self._inspecting = True
        self._bus = bus
        self._max_event_bytes = max_event_bytes
        self._decoder = SSEDecoder(max_event_bytes)
        self._t0 = t0
        self._plan = plan
        self._holding = plan.hold_reasoning
        self._held: list[bytes] = []
        self._held_bytes = 0
        # Templates need chunks that reach the client unchanged and no inspector (they see
        # dicts); strip_logprobs changes them, a restarted attempt's id is checked on learning.
        self._templates = None if plan.strip_logprobs else Templates(endpoint == "chat")
        self.result = StreamResult()

    @property
    def raw(self) -> bool:
        """Nothing looks at the events: they are relayed undecoded."""
        plan = self._plan
        return not (
            self._inspectors
            or plan.loop_watch is not None
            or plan.strip_logprobs
            or plan.id_override is not None
            or plan.hold_reasoning
        )

    def _now(self) -> float:
        return self._clock() - self._t0

    def _stop_inspecting(self, reason: str) -> None:
        if self._inspecting:
            self._inspecting = False
            self._bus.publish(InspectionStopped(self._endpoint, reason))

    def _stop_inspecting_hold(self) -> None:
        self._bus.publish(InspectionStopped(self._endpoint, "hold_overflow"))

    # -- one event -------------------------------------------------------------------------

    def _parse(self, data: bytes | None) -> dict[str, Any] | None:
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
        chunk = self._parse(event.data)
        if chunk is None:  # [DONE], a comment, or malformed: whatever was held goes first
            self._holding = False
            return self._flush_held(event.raw)
        if self._observe(chunk):
            return None
        return self._transform(chunk, event.raw)

    def _observe(self, chunk: dict[str, Any]) -> bool:
        """What is measured and detected on one chunk; True when a decision stops the relay."""
        result = self.result
        if result.first_id is None and isinstance(chunk.get("id"), str):
            result.first_id = chunk["id"]
        tally_chunk(result, chunk, self._now)
        if self._inspectors:
            self._inspectors.on_chunk(chunk)
        watch = self._plan.loop_watch
        # Only the first trigger counts: after it the watch is not asked again.
        if watch is not None and result.trigger is None:
            trigger = watch.on_chunk(chunk)
            if trigger is not None:
                return self._decide(trigger)
        return False

    def _decide(self, trigger: Trigger) -> bool:
        result = self.result
        result.trigger = trigger
        plan = self._plan
        decision = plan.on_trigger(trigger) if plan.on_trigger else Continue()
        if isinstance(decision, Retry | Abort):
            result.decision = decision
            self._held.clear()  # a held looping attempt is never shown
            return True
        return False

    def _transform(self, chunk: dict[str, Any], raw: bytes) -> bytes | None:
        """The bytes one inspected chunk becomes now (None: held)."""
        plan = self._plan
        changed = False
        if plan.strip_logprobs and strip_logprobs(chunk):
            changed = True  # logprobs detproxy injected: the client did not ask
        if plan.id_override is not None and chunk.get("id") != plan.id_override:
            chunk["id"] = plan.id_override
            changed = True
        if changed:
            raw = encode_event(orjson.dumps(chunk))
        if self._holding:
            return self._hold(_releases_hold(chunk), raw)
        return self._emit(raw)

    def _hold(self, release: bool | None, raw: bytes) -> bytes | None:
        if release is True:
            self._holding = False
            return self._flush_held(raw)
        if release is False or self._held:
            self._held.append(raw)
            self._held_bytes += len(raw)
            if self._held_bytes > self._plan.hold_max_bytes:
                self._holding = False  # past the bound: show what was held, stop holding
                self._stop_inspecting_hold()
                return self._flush_held(b"")
            return None
        return self._emit(raw)

    def _flush_held(self, raw: bytes) -> bytes:
        if not self._held:
            return self._emit(raw)
        held = b"".join(self._held) + raw
        self._held.clear()
        return self._emit(held)

    def _emit(self, raw: bytes) -> bytes:
        if raw:
            self.result.shown = True
        return raw

    # -- one read ----------------------------------------------------------------------------

    def _relay_events(self, events: list[SSEEvent]) -> bytes:
        """The general path: decoded events, each parsed."""
        parts: list[bytes] = []
        for event in events:
            if not self._inspecting:
                parts.append(event.raw)
            elif event.data is None and not event.raw.lstrip(b"\r\n").startswith(b":"):
                self._stop_inspecting("malformed_sse")
                parts.append(self._flush_held(event.raw))
            else:
                out = self._process(event)
                if self.result.decision is not None:
                    break
                if out:
                    parts.append(out)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    # -- the stream -------------------------------------------------------------------------

    async def run(self, upstream: UpstreamResponse, resp: web.StreamResponse) -> StreamResult:
        """Relay until the upstream ends or a decision stops it. Client write errors propagate."""
        if self.raw:
            return await self._run_raw(upstream, resp)
        return await self._run_inspected(upstream, resp)

    async def _run_raw(self, upstream: UpstreamResponse, resp: web.StreamResponse) -> StreamResult:
        result = self.result
        tally = RawTally(self._endpoint, result, self._t0, self._max_event_bytes, self._clock)
        try:
            async for data in upstream.chunks():
                out = tally.feed(data)
                if out:
                    result.shown = True
                    await resp.write(out)
        except READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            # A blank line first ends an unfinished event relayed past the size bound.
            prefix = b"\n\n" if tally.partial else b""
            error = inband_error_event(502, "upstream connection lost mid-stream")
            await resp.write(prefix + error)
            self._inspectors.on_end(False)
            return result
        out = tally.finish()
        if out:
            result.shown = True
            await resp.write(out)
        result.complete = True
        self._inspectors.on_end(True)
        return result

    async def _run_inspected(
        self, upstream: UpstreamResponse, resp: web.StreamResponse
    ) -> StreamResult:
        result = self.result
        decoder = self._decoder
        try:
            async for data in upstream.chunks():
                if not self._inspecting:
                    await resp.write(self._flush_held(b"") + data)
                    continue
                if (
                    self._templates is not None
                    and self._templates.active
                    and not decoder.pending
                    and not self._inspectors
                ):
                    one = self._relay_one(data)
                    if one is not None:
                        if result.first_event_s is None:
                            result.first_event_s = self._now()
                        result.events += 1
                        if one:
                            result.shown = True
                            await resp.write(one)
                        if result.decision is not None:
                            return result
                        continue
                events: list[SSEEvent] = []
                try:
                    simple = decoder.feed_data(data)
                    if simple is None:
                        events = decoder.feed(data)
                except SSEOverflow as exc:
                    self._stop_inspecting("event_too_large")
                    await resp.write(self._flush_held(b"") + exc.pending)
                    continue
                n = len(simple[1]) if simple is not None else len(events)
                if not n:
                    continue
                if result.first_event_s is None:
                    result.first_event_s = self._now()
                result.events += n
                if simple is not None:
                    out = self._relay_simple(*simple)
                else:
                    out = self._relay_events(events)
                if not self._inspecting:
                    out += self._flush_held(decoder.take_pending())  # raw from here on
                if out:
                    result.shown = True
                    await resp.write(out)
                if result.decision is not None:
                    return result
        except READ_ERRORS as exc:
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
