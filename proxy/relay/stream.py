"""The streaming relay: upstream SSE bytes -> decoder -> inspectors -> client, event by event.

Whole events are written as soon as they are complete, byte for byte as they arrived unless a
stage changes them (logprobs detproxy injected are stripped; a restarted attempt keeps the
original ``id``), so a stream that breaks mid-event can still be ended cleanly with an
in-band error. Inspection is best effort: malformed SSE or JSON switches it off for this
response and the bytes go on; what the client's bytes need (injected logprobs stripped, the
first id kept, reasoning moved to content) still applies to every event that parses. With
``hold_reasoning``, reasoning events are held back until reasoning ends (within a bound), so an
attempt abandoned for a loop is never shown.

Three paths, one result (the client gets the same bytes, whatever the split of the reads):

- raw: when nothing looks at the events (no inspector, no loop watch, nothing rewritten or
  held), each read's complete events go out in one write, undecoded; ``RawTally`` counts what
  ``StreamResult`` reports with bytes searches (see ``proxy.relay.raw`` for its approximations);
- simple: a read whose complete events are all single ``data: `` lines (what every engine
  sends) is split with bytes operations (``SSEDecoder.feed_data``); unchanged events go out as
  slices of the read, never re-encoded. Token chunks that match a learned ``ChunkTemplate``
  are not parsed at all: their texts are decoded in one call per run and fed to the loop watch
  at once (``LoopWatch.on_run``), which locates the chunk a trigger belongs to, so a decision
  stops at the same event as when each chunk is parsed. A read that is one such chunk (a
  token streamed on its own) is handled whole, not even split, and its text is held with the
  next ones until the loop watch would look at them (``InspectorSet.on_text``);
- general: any other read goes through the decoder and is parsed event by event.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import orjson

from policies.base import Abort, Continue, Decision, Retry, Trigger
from proxy.audit.inject import strip_logprobs
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.exchange import CLIENT_GONE
from proxy.http.clientside import ClientSide
from proxy.http.errors import inband_error_event
from proxy.http.sse import SSEDecoder, SSEEvent, SSEOverflow, encode_event, ends_with_done
from proxy.http.upstream import READ_ERRORS, UpstreamResponse, read_error_kind
from proxy.loops.continuation import move_reasoning_to_content
from proxy.openai import REASONING_KEYS, reasoning_of
from proxy.relay.inspectors import InspectorSet
from proxy.relay.raw import RawTally
from proxy.relay.result import StreamResult, tally_chunk
from proxy.relay.simple import SimpleReads
from proxy.relay.template import Templates


@dataclass(frozen=True, slots=True)
class StreamPlan:
    """How one attempt's stream is relayed."""

    strip_logprobs: bool = False
    id_override: str | None = None  # a restarted attempt continues under the first id
    hold_reasoning: bool = False
    hold_max_bytes: int = 256 * 1024
    # What a trigger of an inspector (the loop watch) leads to; None: nothing (observed).
    on_trigger: Callable[[Trigger], Decision] | None = None
    # After a closed reasoning (close_reasoning): reasoning deltas are the answer's content.
    reasoning_as_content: bool = False
    # The event written before the stream's ``[DONE]`` (a recovery's ``detproxy`` chunk),
    # given the attempt's result; None: nothing added.
    trailer: Callable[[StreamResult], bytes] | None = None
    # The last chars of text deltas held back from the client (0: none), released as more
    # come and at the stream's end; a loop found while they are held is never shown.
    hold_back_chars: int = 0

    def __init__(
        self,
        strip_logprobs: bool = False,
        id_override: str | None = None,
        hold_reasoning: bool = False,
        hold_max_bytes: int = 256 * 1024,
        on_trigger: Callable[[Trigger], Decision] | None = None,
        reasoning_as_content: bool = False,
        *,
        trailer: Callable[[StreamResult], bytes] | None = None,
        hold_back_chars: int = 0,
    ) -> None:
        # Written out: mypyc compiles this one; the generated one runs interpreted (README
        # "The compiled build"). The fields above and these arguments are the same, in order.
        object.__setattr__(self, "strip_logprobs", strip_logprobs)
        object.__setattr__(self, "id_override", id_override)
        object.__setattr__(self, "hold_reasoning", hold_reasoning)
        object.__setattr__(self, "hold_max_bytes", hold_max_bytes)
        object.__setattr__(self, "on_trigger", on_trigger)
        object.__setattr__(self, "reasoning_as_content", reasoning_as_content)
        object.__setattr__(self, "trailer", trailer)
        object.__setattr__(self, "hold_back_chars", hold_back_chars)


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
            if reasoning_of(delta) is not None:
                reasoning = True
    return False if reasoning else None


def _texts(chunk: Mapping[str, Any]) -> tuple[int, int] | None:
    """The chars of a chunk that carries text deltas only (content, reasoning); None for any
    other chunk (no choices, a finish, tool calls)."""
    choices = chunk.get("choices")
    if type(choices) is not list or not choices:
        return None
    content = reasoning = 0
    for choice in choices:
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return None
        text = choice.get("text")
        if type(text) is str:
            content += len(text)
        delta = choice.get("delta")
        if type(delta) is dict:
            if delta.get("tool_calls"):
                return None
            own = delta.get("content")
            if type(own) is str:
                content += len(own)
            thought = reasoning_of(delta)
            if thought:
                reasoning += len(thought)
    return content, reasoning


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
        clock: Callable[[], float] = time.monotonic,
        *,
        fast_paths: bool = True,
    ) -> None:
        """``fast_paths=False``: every event decoded and parsed, no template, no raw relay:
        the reference the fast paths must agree with (the tests compare them)."""
        self._clock = clock  # the speed metrics' time; tests inject theirs
        self._fast = fast_paths
        self._endpoint = endpoint
        self.inspectors = inspectors
        self.inspecting = True
        self._bus = bus
        self._max_event_bytes = max_event_bytes
        self._decoder = SSEDecoder(max_event_bytes)
        self._t0 = t0
        self.plan = plan
        self.holding = plan.hold_reasoning
        # Changes the client's bytes need: they outlive inspection (see rewrite_only).
        self.rewriting = (
            plan.strip_logprobs or plan.id_override is not None or plan.reasoning_as_content
        )
        self.held: list[bytes] = []
        self.heldbytes_ = 0
        # The held-back tail (plan.hold_back_chars): each chunk's bytes and its text's chars
        # (content, reasoning); dropped by a decision, its chars then in ``unshown``.
        self.tail: list[tuple[bytes, int, int]] = []
        self.tail_chars = 0
        self.unshown: tuple[int, int] = (0, 0)
        # Templates need chunks that reach the client unchanged and no inspector (they see
        # dicts); strip_logprobs changes them, a restarted attempt's id is checked on learning.
        self._simple = SimpleReads(
            self,
            None
            if plan.strip_logprobs or plan.reasoning_as_content or not fast_paths
            else Templates(endpoint == "chat"),
        )
        self.result = StreamResult()

    @property
    def templates(self) -> Templates | None:
        """The chunk templates the simple path learned (None: it learns none)."""
        return self._simple.templates

    @property
    def raw(self) -> bool:
        """Nothing looks at the events: they are relayed undecoded."""
        plan = self.plan
        return self._fast and not (
            self.inspectors
            or plan.strip_logprobs
            or plan.id_override is not None
            or plan.hold_reasoning
            or plan.reasoning_as_content
            or plan.hold_back_chars > 0
        )

    def now(self) -> float:
        return self._clock() - self._t0

    def _stop_inspecting(self, reason: str) -> None:
        if self.inspecting:
            self.inspecting = False
            self._bus.publish(InspectionStopped(self._endpoint, reason))

    def _stop_inspecting_hold(self) -> None:
        self._bus.publish(InspectionStopped(self._endpoint, "hold_overflow"))

    # -- one event -------------------------------------------------------------------------

    def parse(self, data: bytes | None) -> dict[str, Any] | None:
        """The chunk of a data field; None for [DONE], no data, or malformed JSON (which stops
        inspection)."""
        if data is None or data == b"[DONE]":
            return None
        chunk = self._chunk(data)
        if chunk is None:
            self._stop_inspecting("malformed_json")
        return chunk

    def _chunk(self, data: bytes) -> dict[str, Any] | None:
        """A data field as a JSON object (None: it is not one), its reasoning moved to content
        where the plan says so."""
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if type(chunk) is not dict:
            return None
        if self.plan.reasoning_as_content:
            move_reasoning_to_content(chunk)  # seen, counted and relayed as content
        return chunk

    def _process(self, event: SSEEvent) -> bytes | None:
        """Inspect one event; return the bytes to write now (None: held or withheld)."""
        chunk = self.parse(event.data)
        if chunk is None:  # [DONE], a comment, or malformed: whatever was held goes first
            self.holding = False
            return self.flush_held(event.raw)
        if self.observe(chunk):
            return None
        return self.transform(chunk, event.raw)

    def observe(self, chunk: dict[str, Any]) -> bool:
        """What is measured and detected on one chunk; True when a decision stops the relay."""
        result = self.result
        if result.first_id is None and isinstance(chunk.get("id"), str):
            result.first_id = chunk["id"]
        tally_chunk(result, chunk, self.now)
        if self.inspectors:
            # Only the first trigger counts: after it the watchers are not asked again.
            trigger = self.inspectors.on_chunk(chunk, result.trigger is None)
            if trigger is not None:
                return self.decide(trigger)
        return False

    def decide(self, trigger: Trigger) -> bool:
        result = self.result
        result.trigger = trigger
        plan = self.plan
        decision = plan.on_trigger(trigger) if plan.on_trigger else Continue()
        if isinstance(decision, Retry | Abort):
            result.decision = decision
            if self.held:  # a held looping attempt is never shown
                held = b"".join(self.held)
                result.hidden_reasoning_keys = (
                    tuple(k for k in REASONING_KEYS if b'"' + k.encode() + b'":"' in held)
                    or REASONING_KEYS[:1]
                )
                self.held.clear()
            if self.tail:  # the held-back tail is never shown either
                content = sum(c for _, c, _ in self.tail)
                self.unshown = (content, sum(r for _, _, r in self.tail))
                self.tail.clear()
                self.tail_chars = 0
            return True
        return False

    def transform(self, chunk: dict[str, Any], raw: bytes) -> bytes | None:
        """The bytes one inspected chunk becomes now (None: held)."""
        raw = self.rewrite(chunk, raw)
        if self.holding:
            return self.hold(_releases_hold(chunk), raw)
        if self.plan.hold_back_chars > 0:
            return self.hold_back(chunk, raw)
        return raw

    def hold_back(self, chunk: dict[str, Any], raw: bytes) -> bytes | None:
        """Hold a text chunk in the tail; release what the tail holds past its bound. Any
        other chunk (a finish, usage, tool calls) releases the whole tail before it."""
        texts = _texts(chunk)
        if texts is None:
            return self.flush_held(raw)
        content, reasoning = texts
        self.tail.append((raw, content, reasoning))
        self.tail_chars += content + reasoning
        released: list[bytes] = []
        bound = self.plan.hold_back_chars
        while self.tail and self.tail_chars > bound:
            out, c, r = self.tail.pop(0)
            self.tail_chars -= c + r
            released.append(out)
        return b"".join(released) if released else None

    def rewrite(self, chunk: dict[str, Any], raw: bytes) -> bytes:
        """The bytes of one parsed chunk as the client gets them (``parse`` already moved its
        reasoning, where the plan says so)."""
        plan = self.plan
        changed = False
        if plan.strip_logprobs and strip_logprobs(chunk):
            changed = True  # logprobs detproxy injected: the client did not ask
        if plan.id_override is not None and chunk.get("id") != plan.id_override:
            chunk["id"] = plan.id_override
            changed = True
        if plan.reasoning_as_content:
            changed = True  # parse moved its reasoning
        if changed:
            raw = encode_event(orjson.dumps(chunk))
        return raw

    def rewrite_only(self, data: bytes | None, raw: bytes) -> bytes:
        """One event after inspection stopped: rewritten if it parses, else as it came."""
        chunk = None if data is None or data == b"[DONE]" else self._chunk(data)
        return raw if chunk is None else self.rewrite(chunk, raw)

    def _rewrite_read(self, data: bytes) -> bytes:
        """A read after inspection stopped, on a stream whose bytes detproxy must still change:
        decoded, nothing observed. Past an event too large to decode, its tail decodes as one
        event without data (relayed as it came) and the events after it are decoded again."""
        try:
            events = self._decoder.feed(data)
        except SSEOverflow as exc:
            return exc.pending
        if not events:
            return b""
        return b"".join([self.rewrite_only(event.data, event.raw) for event in events])

    def hold(self, release: bool | None, raw: bytes) -> bytes | None:
        if release is True:
            self.holding = False
            return self.flush_held(raw)
        if release is False or self.held:
            self.held.append(raw)
            self.heldbytes_ += len(raw)
            if self.heldbytes_ > self.plan.hold_max_bytes:
                self.holding = False  # past the bound: show what was held, stop holding
                self._stop_inspecting_hold()
                return self.flush_held(b"")
            return None
        return raw

    def flush_held(self, raw: bytes) -> bytes:
        if self.tail:
            raw = b"".join([t[0] for t in self.tail]) + raw
            self.tail.clear()
            self.tail_chars = 0
        if not self.held:
            return raw
        held = b"".join(self.held) + raw
        self.held.clear()
        return held

    # -- one read ----------------------------------------------------------------------------

    def _relay_events(self, events: list[SSEEvent]) -> bytes:
        """The general path: decoded events, each parsed."""
        parts: list[bytes] = []
        for event in events:
            if not self.inspecting:
                parts.append(
                    self.rewrite_only(event.data, event.raw) if self.rewriting else event.raw
                )
            elif event.data is None and not event.raw.lstrip(b"\r\n").startswith(b":"):
                self._stop_inspecting("malformed_sse")
                parts.append(self.flush_held(event.raw))
            else:
                out = self._process(event)
                if self.result.decision is not None:
                    break
                if out:
                    parts.append(out)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def _read(self, data: bytes) -> bytes:
        """One upstream read, inspected: the bytes to write now."""
        if not self.inspecting:
            return self.flush_held(b"") + (self._rewrite_read(data) if self.rewriting else data)
        simple = self._simple
        decoder = self._decoder
        templates = simple.templates
        if templates is not None and templates.active and not decoder.pending:
            one = simple.relay_one(data) if simple.reads_runs else None
            if one is not None:
                return one
        events: list[SSEEvent] = []
        try:
            split = decoder.feed_data(data) if self._fast else None
            if split is None:
                events = decoder.feed(data)
        except SSEOverflow as exc:
            self._stop_inspecting("event_too_large")
            return self.flush_held(b"") + exc.pending
        n = len(split[1]) if split is not None else len(events)
        if not n:
            return b""
        self.result.add_events(n, self.now())
        out = simple.relay_simple(*split) if split is not None else self._relay_events(events)
        if not self.inspecting:  # raw from here on, or decoded for rewriting alone
            out += self.flush_held(b"" if self.rewriting else decoder.take_pending())
        return out

    # -- the stream -------------------------------------------------------------------------

    async def run(self, upstream: UpstreamResponse, resp: ClientSide) -> StreamResult:
        """Relay until the upstream ends or a decision stops it. Client write errors and
        cancellation propagate; ``result.complete`` then tells whether the client had the
        whole stream."""
        try:
            if self.raw:
                return await self._run_raw(upstream, resp)
            return await self._run_inspected(upstream, resp)
        finally:
            # The simple path points back at this relay: cut the cycle, so that the stream's
            # objects (its exchange, client, inspectors) go when it ends, by reference count,
            # not in the cyclic collector's next pass, which pauses the loop (issue 16).
            self._simple.detach()

    def _trailed(self, out: bytes) -> bytes:
        """``out`` with the plan's trailer before its ``[DONE]``, where it ends with one."""
        trailer = self.plan.trailer
        if trailer is None or not ends_with_done(out):
            return out
        at = max(out.rfind(b"data: [DONE]"), out.rfind(b"data:[DONE]"))
        if at < 0:
            return out
        return out[:at] + trailer(self.result) + out[at:]

    def _client_left(self, last: bytes) -> None:
        """The client left (or its handler was cancelled) while the relay waited. A stream
        whose ``[DONE]`` it already has is whole: the openai SDK, say, closes the connection
        right after it, before the upstream's chunked framing has ended here. Any other stream
        is left to the caller, as broken."""
        if self.result.decision is None and ends_with_done(last):
            self.result.complete = True
            self.inspectors.on_end(True)

    async def _run_raw(self, upstream: UpstreamResponse, resp: ClientSide) -> StreamResult:
        result = self.result
        tally = RawTally(self._endpoint, result, self._t0, self._max_event_bytes, self._clock)

        last = b""  # the bytes last handed to the client
        write = resp.write_nowait  # looked up once, not per event
        trailed = self.plan.trailer is not None

        def relay(data: bytes) -> bool:
            nonlocal last
            out = tally.feed(data)
            if not out:
                return True
            if trailed:
                out = self._trailed(out)
            more = write(out)
            last = out  # handed over: the write raised nothing
            return more

        try:
            while not await upstream.pump(relay):
                await resp.drain()
        except CLIENT_GONE:
            self._client_left(last)
            raise
        except READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            # A blank line first ends an unfinished event relayed past the size bound.
            prefix = b"\n\n" if tally.partial else b""
            error = inband_error_event(502, "upstream connection lost mid-stream")
            await resp.write(prefix + error)
            self.inspectors.on_end(False)
            return result
        out = tally.finish()
        if out:
            await resp.write(self._trailed(out) if trailed else out)
        result.complete = True
        self.inspectors.on_end(True)
        return result

    async def _run_inspected(self, upstream: UpstreamResponse, resp: ClientSide) -> StreamResult:
        result = self.result
        decoder = self._decoder

        last = b""  # the bytes last handed to the client
        write = resp.write_nowait  # looked up once, not per event
        trailed = self.plan.trailer is not None

        def relay(data: bytes) -> bool:
            # Called from the upstream read's callback: a decision stops the pump at once.
            nonlocal last
            out = self._read(data)
            if not out:
                return result.decision is None
            if trailed:
                out = self._trailed(out)
            more = write(out)
            last = out  # handed over: the write raised nothing
            return more and result.decision is None

        try:
            while not await upstream.pump(relay):
                await resp.drain()
                if result.decision is not None:
                    return result
        except CLIENT_GONE:
            self._client_left(last)
            raise
        except READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            # Bytes of an unfinished event are dropped; a blank line first ends any partial
            # line already relayed in raw mode, so the error event parses on its own.
            prefix = self.flush_held(b"") + (b"" if self.inspecting else b"\n\n")
            error = inband_error_event(502, "upstream connection lost mid-stream")
            await resp.write(prefix + error)
            self.inspectors.on_end(False)
            return result
        tail = decoder.pending
        out = self.flush_held(b"")
        if tail:
            # A last event without its blank line: relayed as it came unless rewritten.
            final = decoder.flush()
            if final is None:
                processed: bytes | None = tail
            elif self.inspecting:
                processed = self._process(final)
            else:
                processed = self.rewrite_only(final.data, final.raw)
            out += (processed or b"") + self.flush_held(b"")
        if out:
            await resp.write(self._trailed(out) if trailed else out)
        result.complete = result.decision is None
        self.inspectors.on_end(result.complete)
        return result
