"""Streamed answers: one client response over one or more upstream attempts.

Each attempt is relayed through a ``StreamRelay``; a loop trigger asks the policies, and a
retry closes the attempt at once, marks the restart with an SSE comment and continues under
the first attempt's id; an abort ends the stream cleanly. Mixed into ``Forwarder``, which
owns the request's bookkeeping (``_finish``, ``_client_left``, ``_auditor_done``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from policies.base import Abort, Decision, Retry, Trigger
from proxy.audit.outcome import Outcome, StreamAccumulator
from proxy.classify import RequestView
from proxy.config import Settings
from proxy.errors import UpstreamFailure, inband_error_event
from proxy.events import EventBus, InspectionStopped, StreamTimed, UpstreamFailed
from proxy.headers import client_response_headers
from proxy.inspect.base import InspectorFactory, InspectorSet, StreamInspector
from proxy.recovery import Attempts, Recovery, abort_chunk, retry_comment
from proxy.relay import StreamPlan, StreamRelay, StreamResult
from proxy.upstream import Upstream, UpstreamResponse, is_event_stream

if TYPE_CHECKING:
    from proxy.audit.auditor import AuditTicket

CLIENT_GONE = (ConnectionResetError, asyncio.CancelledError)
# A hard stop under whatever the policies decide; their own budgets are tighter.
MAX_ATTEMPTS = 8
INFLIGHT = web.RequestKey("detproxy_inflight_at_start", int)


class StreamResponses:
    _settings: Settings
    _upstream: Upstream
    _bus: EventBus
    _inspector_factories: list[InspectorFactory]
    _recovery: Recovery | None
    _clock: Callable[[], float]

    def _finish(
        self,
        view: RequestView | None,
        endpoint: str,
        status: int,
        outcome: str,
        t0: float,
        first_byte_s: float | None,
        request: web.Request,
    ) -> None:
        raise NotImplementedError

    def _client_left(
        self,
        view: RequestView | None,
        endpoint: str,
        t0: float,
        first_byte_s: float | None,
        request: web.Request,
    ) -> None:
        raise NotImplementedError

    def _auditor_done(self, ticket: AuditTicket, outcome: Outcome) -> None:
        raise NotImplementedError

    async def _stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        view: RequestView,
        rid: str,
        t0: float,
        ticket: AuditTicket | None,
        attempts: Attempts,
        headers: Mapping[str, str],
        retry_base: dict[str, Any],
        original: bytes,
    ) -> web.StreamResponse:
        """Relay a stream; a retry merges its overrides into ``retry_base``; when a retry is
        refused, the client's ``original`` request is relayed instead, as it would have been."""
        resp = web.StreamResponse(
            status=upstream.status, headers=client_response_headers(upstream.headers, rid)
        )
        recovery = self._recovery
        first_id: str | None = None
        first_event_s: float | None = None
        inspectors = InspectorSet([], on_failure=lambda name: None)
        result = None
        try:
            await resp.prepare(request)
            while True:
                found: list[StreamInspector] = [
                    i for f in self._inspector_factories if (i := f(view)) is not None
                ]
                accumulator = None
                if ticket is not None:
                    accumulator = StreamAccumulator(view.endpoint)
                    found.append(accumulator)
                inspectors = InspectorSet(
                    found,
                    on_failure=lambda name: self._bus.publish(
                        InspectionStopped(view.endpoint, "inspector_error")
                    ),
                )
                # A fallback after a refused retry is relayed as it comes: nothing to recover to.
                inspected = recovery is not None and not attempts.fell_back
                watch = recovery.watch(view.endpoint) if inspected and recovery else None
                plan = StreamPlan(
                    strip_logprobs=ticket is not None and ticket.injected,
                    id_override=first_id,
                    hold_reasoning=recovery is not None and recovery.hold_reasoning,
                    hold_max_bytes=recovery.hold_max_bytes if recovery is not None else 0,
                    loop_watch=watch,
                    on_trigger=(lambda trig: self._on_stream_trigger(attempts, trig))
                    if inspected
                    else None,
                )
                relay = StreamRelay(
                    view.endpoint,
                    inspectors,
                    self._bus,
                    self._settings.server.max_sse_event_bytes,
                    t0,
                    plan,
                    self._clock,
                )
                result = await relay.run(upstream, resp)
                upstream.close()  # an abandoned attempt's connection closes at once
                if recovery is not None:
                    recovery.attempt_ended(attempts, result.completion_tokens or result.tokens)
                first_id = first_id or result.first_id
                first_event_s = first_event_s or result.first_event_s
                if recovery is not None and result.trigger is None and result.complete:
                    recovery.decide(attempts, None, 200)  # resolves a pending retry
                if isinstance(result.decision, Retry) and attempts.count < MAX_ATTEMPTS:
                    assert recovery is not None
                    text = (
                        watch.content(result.trigger.choice) if watch and result.trigger else None
                    )
                    body, prefix = recovery.next_attempt(
                        attempts, result.decision, retry_base, text
                    )
                    attempts.count += 1
                    ticket = None
                    marker = retry_comment(attempts.count, result.decision.reason)
                    if prefix is None:  # a restart: the client sees the answer start again
                        await resp.write(marker)
                    nxt = await self._retry_stream(
                        attempts, headers, orjson.dumps(body), original, request.raw_path
                    )
                    if nxt is not None and attempts.fell_back and prefix is not None:
                        await resp.write(marker)  # the client's own request, from its start
                    if nxt is None:
                        await resp.write(inband_error_event(502, "retry after a loop failed"))
                        break
                    upstream = nxt
                    continue
                if isinstance(result.decision, Abort | Retry) and result.trigger is not None:
                    await resp.write(
                        abort_chunk(view.endpoint, first_id, view.model, result.trigger.choice)
                    )
                break
            await resp.write_eof()
        except CLIENT_GONE as exc:
            upstream.close()
            inspectors.on_end(False)
            self._client_left(view, view.endpoint, t0, first_event_s, request)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return resp
        finally:
            upstream.close()
        complete = result is not None and (result.complete or result.decision is not None)
        if (
            ticket is not None
            and accumulator is not None
            and result is not None
            and result.complete
        ):
            self._auditor_done(ticket, accumulator.outcome())
        outcome = "ok" if complete else "upstream_error"
        if result is not None and result.complete:
            self._publish_speed(view, request[INFLIGHT], result)
        self._finish(view, view.endpoint, upstream.status, outcome, t0, first_event_s, request)
        return resp

    def _publish_speed(self, view: RequestView, inflight: int, result: StreamResult) -> None:
        speed = result.speed()  # in tokens, not events: a chunk can carry several
        if speed is None:
            return
        self._bus.publish(
            StreamTimed(
                endpoint=view.endpoint,
                model=view.model,
                inflight=inflight,
                ttft_s=speed.ttft_s,
                inter_token_s=speed.inter_token_s,
                tokens=speed.tokens,
                tokens_per_s=speed.tokens_per_s,
            )
        )

    def _on_stream_trigger(self, attempts: Attempts, trigger: Trigger) -> Decision:
        assert self._recovery is not None
        attempts.trigger = trigger
        return self._recovery.decide(attempts, trigger, 200)

    async def _retry_stream(
        self,
        attempts: Attempts,
        headers: Mapping[str, str],
        body: bytes,
        original: bytes,
        raw_path: str,
    ) -> UpstreamResponse | None:
        """The next attempt's stream; when the upstream refuses the retry, the client's own
        request (the answer it would have had), or None when that fails too."""
        assert self._recovery is not None
        upstream = await self._open_stream(attempts, headers, body, raw_path)
        if upstream is not None:
            return upstream
        self._recovery.retry_failed(attempts)
        attempts.fell_back = True
        return await self._open_stream(attempts, headers, original, raw_path)

    async def _open_stream(
        self, attempts: Attempts, headers: Mapping[str, str], body: bytes, raw_path: str
    ) -> UpstreamResponse | None:
        try:
            upstream = await self._upstream.send("POST", raw_path, headers, body)
        except UpstreamFailure as exc:
            self._bus.publish(UpstreamFailed(attempts.endpoint, exc.kind, "headers"))
            return None
        if upstream.status != 200 or not is_event_stream(upstream):
            upstream.close()
            return None
        return upstream
