"""A streamed answer: one client response over one or more upstream attempts.

Each attempt is relayed through a ``StreamRelay``; a loop trigger stops its read and asks the
policies in this exchange's task (not the upstream's data callback), and a retry closes it.
A restart is marked with an SSE comment (the client sees the answer start again, under the
first attempt's id); a continuation simply goes on after what the client already has. A
refused retry relays the client's own request instead, as it would have been; an abort ends
the stream cleanly. The attempts themselves are ``proxy.attempts.Attempts``'s (the relay
reports a trigger to ``Attempts.decided``), driven by ``run_attempts``.
"""

from __future__ import annotations

import asyncio

import orjson

from policies.base import Abort, Decision, Retry
from proxy.attempts import AttemptEnd, Attempts, Generated, NextAttempt, Stages, run_attempts
from proxy.audit.outcome import StreamAccumulator
from proxy.events import InspectionStopped, StreamTimed, UpstreamFailed
from proxy.exchange import CLIENT_GONE, Exchange
from proxy.fallback import Prefetched
from proxy.http.errors import UpstreamFailure, inband_error_event
from proxy.http.headers import headers_for_client, is_event_stream_response
from proxy.http.upstream import UpstreamResponse
from proxy.loops.continuation import Continued, reasoning_event, text_event
from proxy.loops.next_attempt import Fallback
from proxy.loops.recovery import abort_chunk, recovery_chunk, recovery_info, retry_comment
from proxy.loops.rendered import RenderedResponse
from proxy.loops.verdict import RECOVERED, ending
from proxy.loops.watch import LoopWatch
from proxy.relay.inspectors import InspectorSet, StreamInspector
from proxy.relay.result import StreamResult
from proxy.relay.stream import StreamPlan, StreamRelay


class StreamedAnswer:
    """The attempts of one streamed exchange, relayed to one client response."""

    def __init__(
        self, stages: Stages, ex: Exchange, attempts: Attempts, upstream: UpstreamResponse
    ) -> None:
        self.exchange = ex
        self.attempts = attempts
        self._stages = stages
        self._upstream = upstream
        self._client = ex.client
        self._inspectors = InspectorSet([], on_failure=lambda name: None)
        self._accumulator: StreamAccumulator | None = None  # the audited attempt's
        self._watch: LoopWatch | None = None
        self._result: StreamResult | None = None  # the last attempt's
        self._first_id: str | None = None  # a restarted attempt keeps the first attempt's id
        # What the current attempt goes on from, one value (None: the client's own request, or
        # a restart): its assistant message, the reasoning it carried, what was held back.
        self._continued: Continued | None = None
        # The client left after the whole answer: settled as answered, then raised again.
        self._gone: BaseException | None = None
        # The current attempt's text chars (content, reasoning) held back and never shown.
        self._unshown: tuple[int, int] = (0, 0)
        # How the current (retried) attempt ended, once read (its trailer reads it first).
        self._ended: str | None = None

    async def respond(self) -> None:
        ex, stages = self.exchange, self._stages
        client = self._client
        decision: Decision | None = None
        try:
            upstream = self._upstream
            headers = headers_for_client(upstream, ex.request_id)
            await client.start(upstream.status, headers)
            decision = await run_attempts(self)
            result = self._result
            if self._gone is None:
                if (
                    isinstance(decision, Abort | Retry)
                    and result is not None
                    and result.trigger is not None
                ):
                    assert ex.view is not None
                    attempts = self.attempts
                    strategy = attempts.strategy if attempts.count > 1 else "abort"
                    await client.write(
                        abort_chunk(
                            ex.endpoint,
                            self._first_id,
                            ex.view.model,
                            result.trigger.choice,
                            recovery_info(False, attempts.count, strategy),
                        )
                    )
                await client.end()
        except CLIENT_GONE as exc:
            self._upstream.close()
            if self._result is None or not self._result.complete:
                self._inspectors.on_end(False)
                stages.lifecycle.client_left(ex)
                if isinstance(exc, asyncio.CancelledError):
                    raise
                return
            self._gone = exc  # it left while the answer's end was written: it has the answer
        finally:
            self._upstream.close()
        result = self._result
        complete = result is not None and result.complete
        if ex.ticket is not None and self._accumulator is not None and complete:
            stages.lifecycle.audit(ex, self._accumulator.outcome())
        if complete:
            assert result is not None and ex.view is not None
            timed = speed_event(ex.endpoint, ex.view.model, ex.inflight_at_start, result)
            if timed is not None:
                stages.bus.publish(timed)
        ended = complete or (result is not None and result.decision is not None)
        outcome = "ok" if ended else "upstream_error"
        stages.lifecycle.finished(ex, self._upstream.status, outcome)
        if isinstance(self._gone, asyncio.CancelledError):
            raise self._gone

    # -- one attempt -------------------------------------------------------------------------

    async def attempt(self) -> AttemptEnd:
        ex, stages, attempts = self.exchange, self._stages, self.attempts
        assert ex.view is not None
        view = ex.view
        found: list[StreamInspector] = [
            i for f in stages.inspector_factories if (i := f(view)) is not None
        ]
        self._accumulator = None
        self._ended = None
        if ex.ticket is not None:
            self._accumulator = StreamAccumulator(ex.endpoint)
            found.append(self._accumulator)
        recovery = stages.recovery
        # A fallback after a refused retry is relayed as it comes: nothing to recover to.
        inspected = not attempts.fell_back
        self._watch = attempts.started()
        bus = stages.bus
        self._inspectors = InspectorSet(
            found,
            on_failure=lambda name: bus.publish(InspectionStopped(ex.endpoint, "inspector_error")),
            # Its triggers go to the policies (on_trigger).
            watchers=[self._watch] if self._watch is not None else [],
        )
        plan = StreamPlan(
            strip_logprobs=ex.ticket is not None and ex.ticket.injected,
            id_override=self._first_id,
            hold_reasoning=recovery.hold_reasoning,
            hold_max_bytes=recovery.hold_max_bytes,
            on_trigger=attempts.decided if inspected else None,
            reasoning_as_content=_after_reasoning(self._continued),
            # A retry's attempt: its end says what the recovery came to (SPEC 5).
            trailer=self._trailer if attempts.count > 1 else None,
            hold_back_chars=recovery.hold_back_chars if inspected else 0,
        )
        relay = StreamRelay(
            ex.endpoint,
            self._inspectors,
            bus,
            stages.settings.server.max_sse_event_bytes,
            ex.t0,
            plan,
            stages.clock,
        )
        result = self._result = relay.result
        upstream = self._upstream
        # A stream read up to its first event (the fallback's check): the relay goes on with
        # the events cut and their decoder, not decoding those bytes again.
        decoded = upstream.take_decoded() if isinstance(upstream, Prefetched) else None
        # A rendered continuation's events, converted as read: the relay takes them as cut.
        reads = upstream if isinstance(upstream, RenderedResponse) else None
        try:
            await relay.run(upstream, self._client, decoded, reads)
        except CLIENT_GONE as exc:
            if not result.complete:
                raise
            # The client has the whole stream: this attempt is decided and accounted as any
            # clean end (a pending retry recovered), with no await before ``respond`` re-raises.
            self._gone = exc
        finally:
            # Kept, not the relay: its plan holds this answer's bound methods (a cycle).
            self._unshown = relay.unshown
        self._upstream.close()  # an abandoned attempt's connection closes at once
        self._first_id = self._first_id or result.first_id
        if ex.first_byte_s is None:
            ex.first_byte_s = result.first_event_s
        # A clean end is decided too: it settles a pending retry's outcome.
        clean = result.trigger is None and result.complete
        return AttemptEnd(
            result.completion_tokens or result.tokens,
            decision=result.decision,
            decide=clean,
            ending=self._ending(result) if clean and attempts.pending_retry else None,
        )

    def _trailer(self, result: StreamResult) -> bytes:
        ex, attempts = self.exchange, self.attempts
        assert ex.view is not None
        # A fallback (the client's own request, the retry refused) recovered nothing; else only
        # an answer that ended stop (or a tool call) with content and no loop at its end.
        recovered = not attempts.fell_back and self._ending(result) == RECOVERED
        info = recovery_info(recovered, attempts.count, attempts.strategy)
        return recovery_chunk(ex.endpoint, self._first_id, ex.view.model, info)

    def generated(self) -> Generated:
        result, watch, continued = self._result, self._watch, self._continued
        # A continued attempt's answer had its reasoning before it.
        reasoning = (continued.reasoning if continued is not None else "") or (
            watch.kept(0, "reasoning") if watch is not None else None
        )
        if watch is None or result is None or result.trigger is None:
            return Generated(None, reasoning)
        trigger = result.trigger
        kept = watch.kept(trigger.choice, trigger.channel)
        if not self._stages.recovery.stream_continues:
            return Generated(kept, reasoning)
        # The text the model wrote (what this attempt continued, then its own), and how much
        # of it the client was shown: the next attempt goes on from the loop's onset and one
        # unit, as a non-streamed one does, after what the client holds.
        content = continued is not None and trigger.channel == "content"
        prior = continued.message if continued is not None and content else ""
        client = continued.shown if continued is not None and content else ""
        shown = watch.shown(trigger.choice, trigger.channel)
        if kept is None or shown is None:
            return Generated(prior or None, reasoning, prior, len(prior), client)
        unshown_content, unshown_reasoning = self._unshown
        held = unshown_reasoning if trigger.channel == "reasoning" else unshown_content
        if held:
            shown = shown[: max(0, len(shown) - held)]
        return Generated(prior + kept, reasoning, prior + shown, len(prior), client)

    def _ending(self, result: StreamResult) -> str:
        """How a retried attempt's stream ended (``proxy.loops.verdict``): its finish, and the
        whole content the client got (what it held before this attempt, then the attempt's)."""
        if self._ended is None:
            self._ended = self._read_ending(result)
        return self._ended

    def _read_ending(self, result: StreamResult) -> str:
        watch, continued = self._watch, self._continued
        if result.trigger is not None or watch is None:
            return "looped_again" if result.trigger is not None else "unfinished"
        finish, answered = watch.ended(0)
        own = watch.kept(0, "content")
        text = None
        if own is not None:
            text = (continued.shown if continued is not None else "") + own
        return ending(finish, answered, text, self._stages.recovery.detector)

    # -- the next attempt ----------------------------------------------------------------------

    async def retry(self, nxt: NextAttempt, decision: Retry) -> bool:
        """Send ``nxt``, else (refused) each of its fallbacks in turn, as ``next_attempt``
        decided them; an attempt from the answer's start is marked with an SSE comment once."""
        ex, attempts = self.exchange, self.attempts
        if self._gone is not None:
            return False  # nobody to answer any more
        assert ex.view is not None
        model = ex.view.model
        marker = retry_comment(attempts.count, decision.reason)
        marked = False
        hidden = self._result.hidden_reasoning_keys if self._result is not None else ()
        tries = (Fallback(nxt.body, nxt.continued), *nxt.fallbacks)
        for number, attempt in enumerate(tries):
            if number == 1:
                attempts.refused(fallback=True)  # the retry's outcome; the client's own follows
            continued = attempt.continued
            if continued is None and not marked:  # the client sees the answer start again
                await self._client.write(marker)
                marked = True
            body = ex.original if attempt.body is None else orjson.dumps(attempt.body)
            self._continued = continued
            # A fallback is the client's own request: sent as it is, not on a rendered prompt.
            upstream = await self._open(body, continued if number == 0 else None)
            if upstream is None:
                continue
            if continued is not None and continued.missing:
                # What makes the client's text the prefix the continuation goes on from (with
                # whole repeats): its part held back, or the rest of a unit shown in part.
                await self._client.write(
                    text_event(ex.endpoint, self._first_id, model, continued.missing)
                )
            if continued is not None and continued.closes_reasoning and hidden:
                # The reasoning was held, never shown: the client gets the kept part of it.
                await self._client.write(
                    reasoning_event(self._first_id, model, continued.prefix, hidden)
                )
            self._upstream = upstream
            return True
        self._continued = None
        await self._client.write(inband_error_event(502, "retry after a loop failed"))
        return False

    async def _open(
        self, body: bytes, continued: Continued | None = None
    ) -> UpstreamResponse | None:
        ex, stages = self.exchange, self._stages
        try:
            upstream: UpstreamResponse | None = None
            if continued is not None and (continued.closes_reasoning or continued.reasoning):
                # A template that drops assistant reasoning: the rendered prompt keeps it.
                upstream = await stages.recovery.rendered.open(
                    stages.upstream, ex.client.raw_path, ex.headers, orjson.loads(body), continued
                )
            if upstream is None:
                upstream = await stages.upstream.send("POST", ex.client.raw_path, ex.headers, body)
        except UpstreamFailure as exc:
            stages.bus.publish(UpstreamFailed(ex.endpoint, exc.kind, "headers"))
            return None
        if upstream.status != 200 or not is_event_stream_response(upstream):
            upstream.close()
            return None
        return upstream


def _after_reasoning(continued: Continued | None) -> bool:
    """Whether an attempt goes on after a reasoning (closed, or carried before a continued
    content): its reasoning deltas are the answer's content."""
    return continued is not None and (continued.closes_reasoning or bool(continued.reasoning))


def speed_event(
    endpoint: str, model: str, inflight: int, result: StreamResult
) -> StreamTimed | None:
    """A finished stream's speed, in tokens, not events (a chunk can carry several); None
    when no token came."""
    speed = result.speed()
    if speed is None:
        return None
    return StreamTimed(
        endpoint=endpoint,
        model=model,
        inflight=inflight,
        ttft_s=speed.ttft_s,
        inter_token_s=speed.inter_token_s,
        tokens=speed.tokens,
        tokens_per_s=speed.tokens_per_s,
    )
