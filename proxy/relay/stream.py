"""The streaming relay: upstream SSE bytes -> events -> deltas -> inspectors -> transforms ->
client, event by event.

Whole events are written as soon as they are complete, byte for byte as they arrived unless a
transform changes them, so a stream that breaks mid-event can still be ended cleanly with an
in-band error. One read path, whatever a read is (bytes from the upstream, or the events a
stage before the relay cut), and one result (the client gets the same bytes, whatever the split
of the reads, and ``StreamResult`` the same counts):

- cut (``_read``): a read that is one plain token event is read whole by a template, without
  the decoder; else ``_split`` cuts its complete events (``SSEDecoder``: a read of plain
  ``data:`` lines with bytes operations); a stage before the relay hands its cut events to
  ``_read_decoded``. Either way the events go to ``_cut``, which counts them and hands them to
  one of three stages, chosen by the relay's state, never by how the read was cut:
- raw (``_count``; ``raw``, decided once per stream): when nothing looks at the events (no
  inspector, nothing rewritten or held), the read's events are only read for the counts
  (templates, else a parse) and the read goes out as it came;
- inspected (``_events``): each event's data becomes a ``Delta`` (``proxy.relay.extract``:
  learned templates read token chunks without parsing them) or a parsed chunk, and goes
  through one step, ``_inspect``: counted (``proxy.relay.result.tally``) and handed to the
  inspectors (``InspectorSet``: a watcher's trigger stops the read at its event,
  ``plan.on_trigger`` answers it in the relay's task (never inside the upstream's data
  callback), and a retry or an abort ends the relay there); then the transform chain
  (``proxy.relay.transform``: the rewrites of a parsed chunk, reasoning held until it ends, the
  last chars of text held back). Unchanged events go out as slices of the read;
- rewrite-only (``_rewrite_events``): after inspection stopped, on a stream detproxy must
  still change, each event is rewritten where it parses, nothing tallied; on any other
  stream the reads then go out as they came, not cut.

The stream's last event, where it came without its blank line, goes through the same stages
(``_last_event``).

A stream's first read, when long (an upstream that had the answer ready: ``first_cut``), is
relayed in two: its first events go out at the end of a loop iteration of their own, then the
rest is inspected, so that the client's first token does not wait for the whole read.

Each response is decoded once: events a stage before the relay cut (``Decoded``: a stream's
first events, read to decide a fallback, with the decoder that cut them; a rendered
continuation's chat events, converted read by read) go through the same steps as cut, never
as bytes to decode again.

Inspection is best effort: malformed SSE or JSON switches it off for this response and the bytes
go on; what the client's bytes need (the rewrites) still applies to every event that parses.
``fast_paths=False`` is the reference the tests compare with: no raw path, no templates, every
event decoded and parsed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from policies.base import Abort, Decision, Retry, Trigger
from proxy.events import EventBus, InspectionStopped, UpstreamFailed
from proxy.exchange import CLIENT_GONE
from proxy.http.clientside import BodyWriter
from proxy.http.errors import inband_error_event
from proxy.http.sse import (
    Decoded,
    DecodedReads,
    SSEDecoder,
    SSEOverflow,
    ends_with_done,
    first_cut,
)
from proxy.http.upstream import READ_ERRORS, UpstreamResponse, read_error_kind
from proxy.relay.extract import Extractor
from proxy.relay.inspectors import InspectorSet, Item
from proxy.relay.result import StreamResult, tally
from proxy.relay.transform import transforms


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
        # Written out: compiled, unlike a generated one; made per attempt, it pays (README).
        object.__setattr__(self, "strip_logprobs", strip_logprobs)
        object.__setattr__(self, "id_override", id_override)
        object.__setattr__(self, "hold_reasoning", hold_reasoning)
        object.__setattr__(self, "hold_max_bytes", hold_max_bytes)
        object.__setattr__(self, "on_trigger", on_trigger)
        object.__setattr__(self, "reasoning_as_content", reasoning_as_content)
        object.__setattr__(self, "trailer", trailer)
        object.__setattr__(self, "hold_back_chars", hold_back_chars)


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
        self._inspected = bool(inspectors)
        self.inspecting = True
        self._bus = bus
        self._max_event_bytes = max_event_bytes
        self._decoder = SSEDecoder(max_event_bytes)
        self._t0 = t0
        self.plan = plan
        self.transforms = transforms(
            strip_logprobs=plan.strip_logprobs,
            id_override=plan.id_override,
            reasoning_as_content=plan.reasoning_as_content,
            hold_reasoning=plan.hold_reasoning,
            hold_max_bytes=plan.hold_max_bytes,
            hold_back_chars=plan.hold_back_chars,
            # Not a method of this relay: no reference cycle (it goes by reference counting).
            on_overflow=lambda: bus.publish(InspectionStopped(endpoint, "hold_overflow")),
        )
        # Changes the client's bytes need: they outlive inspection (``_rewrite_events``).
        self.rewriting = bool(self.transforms.rewrites)
        # The chars (content, reasoning) of the held-back tail a decision dropped.
        self.unshown: tuple[int, int] = (0, 0)
        # Templates: none where every chunk is rewritten (strip_logprobs changes them).
        self.extractor = Extractor(
            endpoint == "chat",
            templates=fast_paths and not plan.strip_logprobs,
            id_override=plan.id_override,
            reasoning_as_content=plan.reasoning_as_content,
        )
        self.result = StreamResult()
        self._counting = False  # the raw path: events counted, nothing inspected or changed
        # A trigger the policies have not answered yet: the read stopped at its event, kept
        # here with the rest of that read until the relay's task decides (never inside the
        # upstream's data callback).
        self._deferred: _Deferred | None = None
        # The rest of a stream's first read, cut (``first_cut``) where a trigger stopped it:
        # relayed once the trigger is decided.
        self._rest = b""

    @property
    def raw(self) -> bool:
        """Nothing looks at the events or changes them: each read's complete events go out as
        they came, and are only counted."""
        return self._fast and not (self.inspectors or self.rewriting or self.transforms.holds)

    def now(self) -> float:
        return self._clock() - self._t0

    def _stop_inspecting(self, reason: str) -> None:
        if self.inspecting:
            self.inspecting = False
            self._bus.publish(InspectionStopped(self._endpoint, reason))

    # -- one event: counted, inspected, transformed ------------------------------------------

    def _parsed(self, data: bytes | None, raw: bytes, at: float) -> bytes | None:
        """An event templates did not read; returns the bytes to write now (None: held, or
        withheld by a decision)."""
        if data is None or data == b"[DONE]":
            # [DONE] or a comment (anything else without data is malformed): whatever was held
            # goes first.
            if data is None and not raw.lstrip(b"\r\n").startswith(b":"):
                self._stop_inspecting("malformed_sse")
                return self.transforms.release(raw)
            return self.transforms.end_hold(raw)
        parsed = self._parse(data)
        if parsed is None:
            self._stop_inspecting("malformed_json")
            return self.transforms.end_hold(raw)
        chunk, item = parsed
        return self._inspect(item, chunk, raw, at)

    def _inspect(
        self, item: Item, chunk: dict[str, Any] | None, raw: bytes, at: float
    ) -> bytes | None:
        """One extracted event (a template's delta: ``chunk`` None) through the rest of the
        stages: counted and inspected (``observe``), then transformed: the bytes to write now
        (None: held). A trigger defers it instead (None, ``_deferred`` set)."""
        if self.observe(item, at):
            self._deferred = _Deferred(item, chunk, raw, at)
            return None
        return self._transform(item, chunk, raw)

    def _transform(self, item: Item, chunk: dict[str, Any] | None, raw: bytes) -> bytes | None:
        """An observed event through the transform chain (a delta is never rewritten)."""
        transforms = self.transforms
        if chunk is not None:
            return transforms.hold(item, transforms.rewrite(chunk, raw))
        return transforms.hold(item, raw) if transforms.holds else raw

    def _parse(self, data: bytes) -> tuple[dict[str, Any], Item] | None:
        """A data field parsed (None: not a JSON object), and what the inspectors see of it."""
        chunk = self.extractor.parse(data)
        if chunk is None:
            return None
        result = self.result
        if result.first_id is None:
            first = chunk.get("id")
            if type(first) is str:
                result.first_id = first
        delta = self.extractor.delta_of(chunk)
        return chunk, chunk if delta is None else delta

    def _count(self, datas: list[bytes | None], at: float) -> None:
        """The raw path: a read's data fields counted, as the inspected path counts them."""
        result = self.result
        extractor = self.extractor
        i, n = 0, len(datas)
        while i < n:
            run = extractor.deltas(datas, i)
            if run:
                for delta in run:
                    tally(result, delta, at)
                i += len(run)
                continue
            data = datas[i]
            i += 1
            if data is not None and data != b"[DONE]":
                parsed = self._parse(data)
                if parsed is not None:
                    tally(result, parsed[1], at)

    def observe(self, item: Item, at: float) -> bool:
        """An event counted and shown to the inspectors; True when a trigger stops the read
        at this event, for the policies to answer (``decide``, in the relay's task)."""
        result = self.result
        tally(result, item, at)
        if self._inspected:
            # Only the first trigger counts: after it the watchers are not asked again.
            trigger = self.inspectors.on_delta(item, result.trigger is None)
            if trigger is not None:
                result.trigger = trigger
                return self.plan.on_trigger is not None
        return False

    def decide(self) -> bytes:
        """The policies answer the deferred trigger (in the relay's task, not the upstream's
        data callback): a retry or an abort stops the relay (what was held is never shown);
        anything else lets the deferred event and the rest of its read go on: the bytes to
        write now."""
        deferred = self._deferred
        assert deferred is not None
        self._deferred = None
        result, plan = self.result, self.plan
        trigger = result.trigger
        assert trigger is not None and plan.on_trigger is not None
        decision = plan.on_trigger(trigger)
        if isinstance(decision, Retry | Abort):
            result.decision = decision
            result.hidden_reasoning_keys, self.unshown = self.transforms.drop()
            self._rest = b""  # never relayed
            return b""
        return self._resume(deferred)

    def _resume(self, deferred: _Deferred) -> bytes:
        """The deferred event (observed already) through the transforms, then the rest of its
        read as ``_read`` would have relayed it."""
        out = self._transform(deferred.item, deferred.chunk, deferred.raw) or b""
        if deferred.datas:
            out += self._events(deferred.src, deferred.datas, deferred.raws, deferred.at)
        if deferred.tail and not self.inspecting:
            out += self._stopped()
        rest, self._rest = self._rest, b""
        if rest:  # the rest of a first read cut before the trigger's event (``_cutting``)
            out += self._read(rest)
        return out

    def _rewrite_events(
        self, src: bytes, datas: list[bytes | None], raws: list[bytes] | None
    ) -> bytes:
        """Events after inspection stopped (laid out in ``src`` as in ``_events``), each
        rewritten if it parses, else as it came: the one rewrite-only path."""
        parts: list[bytes] = []
        kept = offset = 0
        extractor, transforms = self.extractor, self.transforms
        for i, data in enumerate(datas):
            size = len(raws[i]) if raws is not None else len(data or b"") + 8
            chunk = None if data is None or data == b"[DONE]" else extractor.parse(data)
            if chunk is not None:
                raw = src[offset : offset + size]
                written = transforms.rewrite(chunk, raw)
                if written is not raw:
                    kept = _splice(parts, src, kept, offset, size, written)
            offset += size
        return self._take(parts, src, kept, len(src))

    # -- one read ----------------------------------------------------------------------------

    def _read(self, data: bytes) -> bytes:
        """One upstream read: the bytes to write now. Its complete events are cut from it (a
        read that is one plain token event: read whole by a template, without the decoder;
        else ``_split``) and go on as ``_cut`` says; once inspection stopped on a stream
        nothing rewrites, the read goes out as it came."""
        if not self.inspecting:
            if not self.rewriting:
                return self.transforms.release(b"") + data
        elif not self._decoder.pending:
            # A token streamed on its own (never on the reference: it has no templates).
            delta = self.extractor.delta(data, event=True)
            if delta is not None:
                at = self._clock() - self._t0
                result = self.result
                result.add_events(1, at)
                if self._counting:
                    tally(result, delta, at)
                    return data
                written = self._inspect(delta, None, data, at)
                if self._deferred is not None:
                    self._deferred.tail = True  # the read's end follows, after the decision
                return written or b""
        try:
            src, datas, raws = self._split(data)
        except SSEOverflow as exc:
            return self._overflowed(exc.pending)
        return self._cut(src, datas, raws)

    def _read_decoded(self, decoded: Decoded) -> bytes:
        """Events a stage before the relay cut (``Decoded``): what ``_read`` of their bytes
        gives, without decoding them again."""
        src = decoded.src
        if decoded.overflowed:
            return self._overflowed(src)
        if not self.inspecting and not self.rewriting:
            return self.transforms.release(b"") + src
        return self._cut(src, decoded.datas, decoded.raws)

    def _cut(self, src: bytes, datas: list[bytes | None], raws: list[bytes] | None) -> bytes:
        """A read's complete events, however they were cut: the bytes to write now. Counted,
        then on the raw path only read for the counts (``_count``), else through the stages
        (``_events``); after inspection stopped (on a stream detproxy still rewrites), each
        is rewritten where it parses, nothing tallied."""
        if not self.inspecting:
            return self.transforms.release(b"") + self._rewrite_events(src, datas, raws)
        if not datas:
            return b""
        at = self.now()
        self.result.add_events(len(datas), at)
        if self._counting:
            self._count(datas, at)
            return src
        out = self._events(src, datas, raws, at)
        if self._deferred is not None:
            self._deferred.tail = True  # what follows the read's events, after the decision
        elif not self.inspecting:
            out += self._stopped()
        return out

    def _stopped(self) -> bytes:
        """What follows a read whose events stopped inspection: what was held, and (where
        nothing rewrites, so the reads after it go out as they come) the start of an event
        the decoder kept."""
        return self.transforms.release(b"" if self.rewriting else self._decoder.take_pending())

    def _overflowed(self, pending: bytes) -> bytes:
        """An event over the bound: nothing more is inspected; what the decoder kept goes on
        as it came."""
        if self._counting:
            self.inspecting = False  # nothing was inspected: nothing to report
            return pending
        self._stop_inspecting("event_too_large")
        return self.transforms.release(b"") + pending

    def _split(self, data: bytes) -> tuple[bytes, list[bytes | None], list[bytes] | None]:
        """A read's complete events: their bytes, their data fields, and each event's bytes
        where an event is not ``b"data: " + data + b"\n\n"`` (None: each is)."""
        decoder = self._decoder
        split = decoder.feed_data(data) if self._fast else None
        if split is None:
            events = decoder.feed(data)
            raws = [event.raw for event in events]
            return b"".join(raws), [event.data for event in events], raws
        return split[0], cast("list[bytes | None]", split[1]), None  # each a data field

    def _events(
        self, src: bytes, datas: list[bytes | None], raws: list[bytes] | None, at: float
    ) -> bytes:
        """A read's complete events (``src``; each ``b"data: " + data + b"\n\n"`` unless
        ``raws`` says otherwise) through the stages: the bytes to write now. Events that
        reach the client unchanged stay slices of ``src``."""
        parts: list[bytes] = []
        kept = 0  # src[kept:] is relayed unchanged so far
        offset = 0  # where datas[i]'s event starts in src
        i, n = 0, len(datas)
        extractor = self.extractor
        written: bytes | None
        while i < n:
            if not self.inspecting:
                if self.rewriting:  # the rest is rewritten, not inspected
                    rest = self._rewrite_events(
                        src[offset:], datas[i:], raws[i:] if raws is not None else None
                    )
                    return self._take(parts, src, kept, offset) + rest
                break  # the rest goes out as it came
            run = extractor.deltas(datas, i)
            if run:  # token chunks templates read
                # _inspect's two stages, written out for a run (a whole answer is read as one
                # run): no call and no slice per event where nothing holds (bench_instructions'
                # "200 whole": 7% fewer instructions a request).
                observe = self.observe
                transforms = self.transforms
                holds = transforms.holds
                for delta in run:
                    size = len(raws[i]) if raws is not None else len(datas[i] or b"") + 8
                    if observe(delta, at):
                        self._deferred = _Deferred(delta, None, at=at)  # _defer sets its raw
                        return self._defer(
                            parts, src, kept, offset, size, datas=datas, raws=raws, i=i
                        )
                    if holds:
                        raw = src if size == len(src) else src[offset : offset + size]
                        written = transforms.hold(delta, raw)
                        if written is not raw:
                            kept = _splice(parts, src, kept, offset, size, written)
                    offset += size
                    i += 1
                continue
            data = datas[i]
            size = len(raws[i]) if raws is not None else len(data or b"") + 8
            raw = src if size == len(src) else src[offset : offset + size]
            written = self._parsed(data, raw, at)
            if self._deferred is not None:
                return self._defer(parts, src, kept, offset, size, datas=datas, raws=raws, i=i)
            if written is not raw:
                kept = _splice(parts, src, kept, offset, size, written)
            offset += size
            i += 1
        return self._take(parts, src, kept, len(src))

    def _defer(
        self,
        parts: list[bytes],
        src: bytes,
        kept: int,
        offset: int,
        size: int,
        *,
        datas: list[bytes | None],
        raws: list[bytes] | None,
        i: int,
    ) -> bytes:
        """A trigger at event ``i`` of a read: the event and those after it kept for after the
        decision; returns the bytes before it."""
        deferred = self._deferred
        assert deferred is not None
        deferred.raw = src[offset : offset + size]
        if i + 1 < len(datas):
            deferred.src = src[offset + size :]
            deferred.datas = datas[i + 1 :]
            deferred.raws = raws[i + 1 :] if raws is not None else None
        return self._take(parts, src, kept, offset)

    @staticmethod
    def _take(parts: list[bytes], src: bytes, kept: int, end: int) -> bytes:
        """``src`` up to ``end``, with the changes in ``parts`` (up to ``src[kept]``)."""
        if not parts and not kept:
            return src if end == len(src) else src[:end]
        if end > kept:
            parts.append(src[kept:end])
        return b"".join(parts)

    # -- the stream -------------------------------------------------------------------------

    @property
    def decoder(self) -> SSEDecoder:
        """The decoder that cuts this stream's events: the one ``run`` was handed, if any."""
        return self._decoder

    async def run(
        self,
        upstream: UpstreamResponse,
        resp: BodyWriter,
        decoded: Decoded | None = None,
        reads: DecodedReads | None = None,
    ) -> StreamResult:
        """Relay until the upstream ends or a decision stops it. Client write errors and
        cancellation propagate; ``result.complete`` then tells whether the client had the
        whole stream. ``decoded``: the response's first events, cut by a stage before this one
        (the rest of ``upstream`` comes after them); the relay goes on with their decoder.
        ``reads``: ``upstream`` read as a stage before this one decodes it, read by read."""
        self._counting = self.raw
        if decoded is not None and decoded.decoder is not None:
            self._decoder = decoded.decoder
        return await self._run(upstream, resp, decoded, reads)

    def _cutting(self, hand: Callable[[Any], bool]) -> Callable[[Any], bool]:
        """``hand`` (the relay's sink), with the stream's first read cut in two when it is
        long (``first_cut``): the events before the cut handed on, then the read stops with
        the rest kept (``_rest``), handed on after an iteration of the event loop (whose end
        writes the first events: ``proxy.http.coalesce``), or after the decision where a
        trigger among the first events stopped the read (``_resume``)."""
        first = True

        def relay(data: Any) -> bool:
            nonlocal first
            if first:
                first = False
                cut = first_cut(data)
                if cut and not ends_with_done(data[:cut]):
                    hand(data[:cut])
                    self._rest = data[cut:]
                    return False  # the read stops here: the rest after a loop iteration
            return hand(data)

        return relay

    def _trailed(self, out: bytes) -> bytes:
        """``out`` with the plan's trailer before its ``[DONE]``, where it ends with one."""
        trailer = self.plan.trailer
        if trailer is None or not ends_with_done(out):
            return out
        at = max(out.rfind(b"data: [DONE]"), out.rfind(b"data:[DONE]"))
        if at < 0:
            return out
        return out[:at] + trailer(self.result) + out[at:]

    def _write(self, out: bytes, write: Callable[[bytes], bool], last: bytes) -> bytes:
        """``out`` (trailed where it ends the stream) handed to the client, outside the
        upstream's data callback: the bytes last handed over."""
        if not out:
            return last
        if self.plan.trailer is not None:
            out = self._trailed(out)
        write(out)
        return out

    def _client_left(self, last: bytes) -> None:
        """The client left (or its handler was cancelled) while the relay waited. A stream
        whose ``[DONE]`` it already has is whole: the openai SDK, say, closes the connection
        right after it, before the upstream's chunked framing has ended here. Any other stream
        is left to the caller, as broken."""
        if self.result.decision is None and ends_with_done(last):
            self.result.complete = True
            self.inspectors.on_end(True)

    def _last_event(self) -> bytes:
        """A last event without its blank line: through the stages as the last event of a
        read, relayed as it came unless a stage changes it."""
        tail = self._decoder.pending
        final = self._decoder.flush()
        if final is None:
            return tail
        at = self.now()
        if self._counting:
            self._count([final.data], at)
            return final.raw
        # As the last event of a read (not counted as one: it never ended).
        out = self._events(final.raw, [final.data], [final.raw], at)
        return self.decide() if self._deferred is not None else out

    async def _run(
        self,
        upstream: UpstreamResponse,
        resp: BodyWriter,
        decoded: Decoded | None,
        reads: DecodedReads | None,
    ) -> StreamResult:
        result = self.result
        last = b""  # the bytes last handed to the client
        write = resp.write_nowait  # looked up once, not per event
        # A read is bytes, or the events a stage before this one cut (``reads``); the raw
        # pass-through or the inspected pipeline is chosen once (``_counting``), in ``_cut``.
        read: Callable[[Any], bytes] = self._read if reads is None else self._read_decoded
        trailed = self.plan.trailer is not None

        def hand(data: Any) -> bool:
            # Called from the upstream read's callback: it only hands bytes on, and stops the
            # pump at a trigger (the policies answer it in this task, below).
            nonlocal last
            out = read(data)
            if not out:
                return self._deferred is None
            if trailed:
                out = self._trailed(out)
            more = write(out)
            last = out  # handed over: the write raised nothing
            return more and self._deferred is None

        # The stream's first read of bytes, when long, is relayed in two (``first_cut``); not
        # after events read already (``decoded``): they went first.
        relay = hand if reads is not None or decoded is not None else self._cutting(hand)
        try:
            ended = False
            if decoded is not None:  # read already: relayed as a read of its bytes would be
                last = self._write(self._read_decoded(decoded), write, last)
                await _next_iteration()  # written before the rest of their read is decoded
            while True:
                if self._deferred is None:  # else a trigger in the first events: decided first
                    ended = await (
                        upstream.pump(relay) if reads is None else reads.pump_decoded(relay)
                    )
                if self._deferred is not None:
                    out = self.decide()
                    if result.decision is not None:
                        return result
                    last = self._write(out, write, last)
                elif self._rest:  # a long first read cut: its first events are written first
                    await _next_iteration()
                    rest, self._rest = self._rest, b""
                    hand(rest)  # a trigger in it is decided next, before reading on
                if ended:
                    break
                await resp.drain()
        except CLIENT_GONE:
            self._client_left(last)
            raise
        except READ_ERRORS as exc:
            self._bus.publish(UpstreamFailed(self._endpoint, read_error_kind(exc), "body"))
            await resp.write(self._broken())
            self.inspectors.on_end(False)
            return result
        out = self._ending()
        if out:
            await resp.write(out)
        result.complete = result.decision is None
        self.inspectors.on_end(result.complete)
        return result

    def _broken(self) -> bytes:
        """What ends the client's stream where the upstream's broke: what was held, then an
        in-band error. Bytes of an unfinished event are dropped; a blank line first ends any
        partial line already relayed in raw mode, so the error event parses on its own."""
        prefix = self.transforms.release(b"") + (b"" if self.inspecting else b"\n\n")
        return prefix + inband_error_event(502, "upstream connection lost mid-stream")

    def _ending(self) -> bytes:
        """The stream's last bytes, once the upstream's ended: what was held, and a last
        event that came without its blank line."""
        out = self.transforms.release(b"")
        if self._decoder.pending:
            out += self._last_event() + self.transforms.release(b"")
        return self._trailed(out) if out and self.plan.trailer is not None else out


async def _next_iteration() -> None:
    """Let the event loop end its iteration: the client writes queued in it go out (the
    front writes a connection's writes at the iteration's end, ``proxy.http.coalesce``)."""
    await asyncio.sleep(0)


def _splice(
    parts: list[bytes], src: bytes, kept: int, offset: int, size: int, out: bytes | None
) -> int:
    """The event at ``src[offset:offset + size]`` becomes ``out`` (empty or None: withheld):
    the bytes before it go to ``parts`` unchanged, then ``out``; returns where ``src`` is kept
    from."""
    parts.append(src[kept:offset])
    if out:
        parts.append(out)
    return offset + size


class _Deferred:
    """The event a trigger stopped a read at (observed: counted and inspected), and the rest
    of that read, relayed once the policies let the stream go on."""

    __slots__ = ("at", "chunk", "datas", "item", "raw", "raws", "src", "tail")

    def __init__(
        self,
        item: Item,
        chunk: dict[str, Any] | None,
        raw: bytes = b"",
        at: float = 0.0,
        tail: bool = False,
    ) -> None:
        self.item = item
        self.chunk = chunk  # the parsed chunk (None: a template's delta)
        self.raw = raw  # the event's bytes
        self.src = b""  # the read's events after it, and their data fields
        self.datas: list[bytes | None] = []
        self.raws: list[bytes] | None = None
        self.at = at
        self.tail = tail  # the read's end follows (what _read does after its events)
