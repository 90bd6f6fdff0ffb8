"""Request handlers: the OpenAI endpoints detproxy reads, and pass-through for everything else.

The path of a request: read a bounded body -> validate -> classify -> forward the original
bytes -> relay (streamed through the inspectors, or whole, after the policy chain decided).
No policy or audit logic lives here; it only calls the seams.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

import orjson
from aiohttp import web

from policies.base import CONTINUE, Abort, Decision, PolicyChain, PolicyContext, Retry
from proxy.audit.auditor import Auditor, AuditTicket
from proxy.audit.inject import strip_logprobs
from proxy.audit.outcome import Outcome, outcome_from_response, usage_of
from proxy.body import (
    BadRequest,
    ensure_json_content_type,
    parse_answer,
    parse_object,
    read_bounded,
)
from proxy.classify import ENDPOINTS, RequestView, classify
from proxy.config import Settings
from proxy.continuation import LIMIT_FIELDS, content_of, merge_answer
from proxy.errors import UpstreamFailure, error_response
from proxy.events import (
    ClientDisconnected,
    EventBus,
    InspectionStopped,
    RequestClassified,
    RequestFinished,
    RequestStarted,
    ShadowDropped,
    UpstreamFailed,
)
from proxy.fallback import Altered, FallbackSender
from proxy.headers import client_response_headers, request_id_of, upstream_request_headers
from proxy.injection import LOGPROBS, REPETITION_DETECTION, InjectionGuard
from proxy.inspect.base import InspectorFactory
from proxy.recovery import Attempts, Recovery, cut_answer
from proxy.streaming import CLIENT_GONE, INFLIGHT, MAX_ATTEMPTS, StreamResponses
from proxy.upstream import Upstream, UpstreamResponse, is_event_stream, read_error_kind

log = logging.getLogger(__name__)

_FINISHED = web.RequestKey("detproxy_finished", bool)
_COUNTED = web.RequestKey("detproxy_counted", bool)  # detproxy_requests_total has it
_VIEW = web.RequestKey("detproxy_view", RequestView)


class Forwarder(StreamResponses):
    """Handles client requests against one upstream. One instance per app."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        bus: EventBus,
        inspector_factories: Sequence[InspectorFactory] = (),
        policies: PolicyChain | None = None,
        recovery: Recovery | None = None,
        guard: InjectionGuard | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock  # the time of durations and speeds; tests inject theirs
        self._auditor: Auditor | None = None
        self.guard = guard or InjectionGuard(settings.injection, bus)
        self._sender = FallbackSender(
            upstream, self.guard, bus, settings.server.max_sse_event_bytes
        )
        self._recovery = recovery
        self._settings = settings
        self._upstream = upstream
        self._bus = bus
        self._inspector_factories = list(inspector_factories)
        self._policies = policies or PolicyChain()
        # Whether anything besides an audit reads a non-streamed answer: if not, it is not parsed.
        self._reads_answers = (
            recovery.reads_answers if recovery is not None else self._policies.reads_clean_answers
        )
        self.inflight = 0
        self.started = 0  # client requests ever started: tells a shadow whether it overlapped

    def attach_auditor(self, auditor: Auditor) -> None:
        self._auditor = auditor

    # -- dispatch ---------------------------------------------------------------------------

    async def handle(self, request: web.Request) -> web.StreamResponse:
        endpoint = ENDPOINTS.get(request.path)
        self.inflight += 1
        self.started += 1
        request[INFLIGHT] = self.inflight
        self._bus.publish(RequestStarted(endpoint or "other"))
        t0 = self._clock()
        try:
            if endpoint is not None and request.method == "POST":
                return await self._openai(request, endpoint)
            return await self._passthrough(request)
        except asyncio.CancelledError:
            # The client left while detproxy waited (for the upstream's headers, say).
            if not request.get(_FINISHED):
                self._client_left(request.get(_VIEW), endpoint or "other", t0, None, request)
            raise
        finally:
            self.inflight -= 1
            if not request.get(_FINISHED):
                # A fault of detproxy's own: still pair every start with one finish.
                self._finish(None, endpoint or "other", 500, "proxy_error", t0, None, request)

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
        request[_FINISHED] = True
        if not request.get(_COUNTED):  # refused or failed before it was classified
            self._count(view, endpoint, request)
        self._bus.publish(
            RequestFinished(
                endpoint=endpoint,
                model=view.model if view else "",
                stream=view.stream if view else False,
                deterministic=view.deterministic if view else False,
                status=status,
                outcome=outcome,
                duration_s=self._clock() - t0,
                first_byte_s=first_byte_s,
            )
        )

    def _count(self, view: RequestView | None, endpoint: str, request: web.Request) -> None:
        """``detproxy_requests_total`` counts a request once, when its labels are known."""
        request[_COUNTED] = True
        self._bus.publish(
            RequestClassified(
                endpoint,
                view.model if view else "",
                view.stream if view else False,
                view.deterministic if view else False,
            )
        )

    # -- the OpenAI endpoints ---------------------------------------------------------------

    async def _openai(self, request: web.Request, endpoint: str) -> web.StreamResponse:
        t0 = self._clock()
        rid = request_id_of(request.headers)
        try:
            ensure_json_content_type(request)
            raw = await read_bounded(request, self._settings.server.max_body_bytes)
            body = parse_object(raw)
        except BadRequest as exc:
            self._finish(None, endpoint, exc.status, "bad_request", t0, None, request)
            return error_response(exc.status, exc.message, request_id=rid)
        cfg = self._settings.classify
        view = classify(
            endpoint,
            body,
            default_temperature=cfg.default_temperature,
            seeded_is_deterministic=cfg.seeded_is_deterministic,
        )
        headers = upstream_request_headers(request.headers, rid, proxy_reads_body=True)
        request[_VIEW] = view
        self._count(view, endpoint, request)

        ticket = (
            self._auditor.plan(view, body, rid, request.raw_path, request.headers)
            if self._auditor is not None
            else None
        )
        original = raw
        kinds: list[str] = []
        if ticket is not None and ticket.injected:
            raw = orjson.dumps(ticket.upstream_body)  # logprobs injected for the audit
            kinds.append(LOGPROBS)
        sent = ticket.upstream_body if ticket is not None else body
        # A retry starts from the client's request: the audit's logprobs are not asked again
        # (an answer produced under overrides is not audited, and would not be stripped).
        retry_base = body
        if self._recovery is not None and self._recovery.enabled:
            prepared = self._recovery.prepare(sent, view.model)
            if prepared is not sent:
                sent, raw = prepared, orjson.dumps(prepared)
                retry_base = self._recovery.prepare(body, view.model)
                kinds.append(REPETITION_DETECTION)
        altered = Altered(kinds, original, view.model, endpoint) if kinds else None
        attempts = Attempts(rid, view.model, endpoint, view.stream, max_tokens=max_tokens_of(body))

        try:
            upstream, fell_back = await self._sender.send(request.raw_path, headers, raw, altered)
        except UpstreamFailure as exc:
            self._bus.publish(UpstreamFailed(endpoint, exc.kind, "headers"))
            self._finish(view, endpoint, exc.status, "upstream_error", t0, None, request)
            return error_response(exc.status, exc.message, request_id=rid)
        if fell_back:
            retry_base = body  # the upstream refused an addition: none in this request's retries
            if ticket is not None and ticket.injected:
                # The client's own request carries no logprobs: nothing to compare.
                self._bus.publish(ShadowDropped(view.model, "injection_failed"))
                ticket = None
        if is_event_stream(upstream):
            return await self._stream(
                request, upstream, view, rid, t0, ticket, attempts, headers, retry_base, original
            )
        return await self._answer(
            request, upstream, view, rid, t0, ticket, attempts, headers, retry_base
        )

    async def _answer(
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
    ) -> web.StreamResponse:
        """A non-streamed answer: read whole, looked at, retried while the policies say so."""
        endpoint = view.endpoint
        injected = ticket is not None and ticket.injected
        outcome: Outcome | None = None
        # The last answer that can be relayed: a retry that fails gives it back to the client.
        kept: tuple[UpstreamResponse, bytes] | None = None
        first_byte_s: float | None = None
        continued: str | None = None  # the prefix the pending attempt continues
        prompt_tokens: Any = None  # the client request's, from its first answer
        while True:
            try:
                payload = await upstream.read()
            except CLIENT_GONE:
                upstream.close()
                self._client_left(view, endpoint, t0, None, request)
                raise
            except Exception as exc:
                upstream.close()
                kind = read_error_kind(exc)
                self._bus.publish(UpstreamFailed(endpoint, kind, "body"))
                if kept is not None:
                    self._recovery_failed(attempts)
                    upstream, payload = kept
                    break
                status = 504 if kind == "timeout" else 502
                self._finish(view, endpoint, status, "upstream_error", t0, None, request)
                return error_response(
                    status,
                    "upstream connection lost before the response was complete",
                    request_id=rid,
                )
            if kept is not None and upstream.status >= 400:
                self._recovery_failed(attempts)  # the retry's overrides were refused
                upstream, payload = kept
                break
            first_byte_s = self._clock() - t0
            answer = parse_answer(payload) if ticket is not None or self._reads_answers else None
            if injected and answer is not None and upstream.status == 200:
                if ticket is not None:
                    outcome = outcome_from_response(endpoint, answer)
                if strip_logprobs(answer):
                    payload = orjson.dumps(answer)
            injected = False  # retries are sent without the audit's logprobs
            used_prompt, used_completion = usage_of(answer) if answer is not None else (None, None)
            generated = used_completion or 0
            if attempts.count == 1:
                prompt_tokens = used_prompt
            if continued is not None and answer is not None and upstream.status == 200:
                merge_answer(endpoint, answer, continued, prompt_tokens)  # prefix + continuation
                payload = orjson.dumps(answer)
            decision = self._decide_answer(attempts, upstream.status, answer)
            if self._recovery is not None and upstream.status == 200:
                self._recovery.attempt_ended(attempts, generated)
            if isinstance(decision, Retry) and attempts.count < MAX_ATTEMPTS:
                body: dict[str, Any] = {**retry_base, **decision.overrides}
                continued = None
                if self._recovery is not None:
                    text = content_of(endpoint, answer)
                    body, continued = self._recovery.next_attempt(
                        attempts, decision, retry_base, text
                    )
                attempts.count += 1
                ticket = None  # an answer produced under overrides is not audited
                kept = (upstream, payload)
                try:
                    upstream = await self._upstream.send(
                        "POST", request.raw_path, headers, orjson.dumps(body)
                    )
                except UpstreamFailure as exc:
                    self._bus.publish(UpstreamFailed(endpoint, exc.kind, "headers"))
                    self._recovery_failed(attempts)
                    upstream, payload = kept
                    break
                continue
            if isinstance(decision, Abort) and answer is not None and attempts.trigger:
                cut_answer(answer, endpoint, attempts.trigger)
                payload = orjson.dumps(answer)
            break

        if ticket is not None and upstream.status == 200:
            if outcome is None and answer is not None:
                outcome = outcome_from_response(endpoint, answer)
            if outcome is not None:
                self._auditor_done(ticket, outcome)
        out_headers = client_response_headers(upstream.headers, rid)
        if attempts.count > 1 or attempts.looped:
            out_headers["X-Detproxy-Attempts"] = str(attempts.count)
        if attempts.looped:
            out_headers["X-Detproxy-Recovered"] = "true" if attempts.recovered else "false"
        if attempts.count > 1:
            out_headers["X-Detproxy-Strategy"] = attempts.strategy
        self._finish(view, endpoint, upstream.status, "ok", t0, first_byte_s, request)
        return web.Response(status=upstream.status, body=payload, headers=out_headers)

    def _recovery_failed(self, attempts: Attempts) -> None:
        if self._recovery is not None:
            self._recovery.retry_failed(attempts)

    def _decide_answer(
        self, attempts: Attempts, status: int, answer: dict[str, Any] | None
    ) -> Decision:
        """Loop checks on a whole non-streamed answer, then the policies' decision."""
        trigger = None
        if self._recovery is None:
            if not self._policies.reads_clean_answers:
                return CONTINUE
            return self._policies.decide(
                PolicyContext(
                    attempts.endpoint, attempts.model, False, attempts.count, status, None, answer
                )
            )
        watch = self._recovery.watch(attempts.endpoint)
        if watch is not None and answer is not None and status == 200:
            trigger = watch.on_answer(answer)
        attempts.trigger = trigger
        return self._recovery.decide(attempts, trigger, status, answer)

    def _auditor_done(self, ticket: AuditTicket, outcome: Outcome) -> None:
        assert self._auditor is not None
        try:
            self._auditor.primary_done(ticket, outcome)
        except Exception:
            # The audit is an observer: its failure never reaches the client.
            log.exception("audit of %s failed", ticket.request_id)
            self._bus.publish(InspectionStopped(ticket.view.endpoint, "audit_error"))

    def _client_left(
        self,
        view: RequestView | None,
        endpoint: str,
        t0: float,
        first_byte_s: float | None,
        request: web.Request,
    ) -> None:
        self._bus.publish(ClientDisconnected(endpoint, view.stream if view else False))
        self._finish(view, endpoint, 499, "client_disconnect", t0, first_byte_s, request)

    # -- everything else --------------------------------------------------------------------

    async def _passthrough(self, request: web.Request) -> web.StreamResponse:
        t0 = self._clock()
        self._count(None, "other", request)
        rid = request_id_of(request.headers)
        headers = upstream_request_headers(request.headers, rid, proxy_reads_body=False)
        body: AsyncIterator[bytes] | None = (
            request.content.iter_chunked(64 * 1024) if request.body_exists else None
        )
        try:
            upstream = await self._upstream.send(request.method, request.raw_path, headers, body)
        except UpstreamFailure as exc:
            self._bus.publish(UpstreamFailed("other", exc.kind, "headers"))
            self._finish(None, "other", exc.status, "upstream_error", t0, None, request)
            return error_response(exc.status, exc.message, request_id=rid)
        first_byte_s = self._clock() - t0
        resp = web.StreamResponse(
            status=upstream.status,
            headers=client_response_headers(upstream.headers, rid, keep_length=True),
        )
        try:
            await resp.prepare(request)
            async for data in upstream.chunks():
                await resp.write(data)
            await resp.write_eof()
        except CLIENT_GONE as exc:
            self._client_left(None, "other", t0, first_byte_s, request)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return resp
        except Exception as exc:
            # Headers are gone already: all that is left is to cut the connection short.
            self._bus.publish(UpstreamFailed("other", read_error_kind(exc), "body"))
            self._finish(
                None, "other", upstream.status, "upstream_error", t0, first_byte_s, request
            )
            raise
        finally:
            upstream.close()
        self._finish(None, "other", upstream.status, "ok", t0, first_byte_s, request)
        return resp


def max_tokens_of(body: dict[str, Any]) -> int | None:
    """The output limit a request set (``max_completion_tokens`` is chat's newer name)."""
    for name in LIMIT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
