"""Request handlers: the OpenAI endpoints detproxy reads, and pass-through for everything else.

The path of a request: read a bounded body -> validate -> classify -> plan the audit and what is
added to the request -> send it (falling back to the client's own bytes when an addition is
refused) -> the answer, streamed (``proxy.streaming``) or whole (``proxy.answer``), over one
attempt or several (``proxy.attempts``). Every stage receives the request's ``Exchange``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import orjson

from proxy.answer import WholeAnswer
from proxy.attempts import Attempts, Stages
from proxy.audit.auditor import Auditor
from proxy.audit.server_load import SharedLoad
from proxy.classify import ENDPOINTS, classify
from proxy.config import Settings
from proxy.events import EventBus, RequestStarted, ShadowDropped, UpstreamFailed
from proxy.exchange import CLIENT_GONE, Exchange, Lifecycle
from proxy.fallback import Altered, FallbackSender
from proxy.http.body import BadRequest, ensure_json_content_type, parse_object
from proxy.http.clientside import ClientSide
from proxy.http.errors import UpstreamFailure, send_error
from proxy.http.headers import (
    RequestIds,
    headers_for_client,
    headers_for_upstream,
    is_event_stream,
    is_event_stream_response,
    request_id_of,
    upstream_request_headers,
)
from proxy.http.sse import ends_with_done
from proxy.http.upstream import Upstream, read_error_kind
from proxy.injection import LOGPROBS, REPETITION_DETECTION, InjectionGuard
from proxy.loops.continuation import LIMIT_FIELDS
from proxy.loops.recovery import Recovery
from proxy.relay.inspectors import InspectorFactory
from proxy.selfloop import LOOP_MESSAGE, LOOP_STATUS, VIA_NAME, came_back
from proxy.streaming import StreamedAnswer


class Forwarder:
    """Handles client requests against one upstream. One instance per app."""

    def __init__(
        self,
        settings: Settings,
        upstream: Upstream,
        bus: EventBus,
        recovery: Recovery,
        inspector_factories: Sequence[InspectorFactory] = (),
        guard: InjectionGuard | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        server_id: str | None = None,
    ) -> None:
        """``server_id``: the id this server's upstream requests carry (proxy/selfloop.py);
        one that comes back with it is answered 508. None: no such check."""
        self._clock = clock  # the time of durations and speeds; tests inject theirs
        self._server_id = server_id
        self._lifecycle = Lifecycle(bus, clock)
        self.guard = guard or InjectionGuard(settings.injection, bus)
        self._sender = FallbackSender(
            upstream, self.guard, bus, settings.server.max_sse_event_bytes
        )
        self._recovery = recovery
        # What each request reads of the settings, read once (compiled: loads, not lookups).
        self._max_body_bytes = settings.server.max_body_bytes
        self._default_temperature = settings.classify.default_temperature
        self._seeded_is_deterministic = settings.classify.seeded_is_deterministic
        self._upstream = upstream
        self._bus = bus
        self._stages = Stages(
            settings, upstream, bus, recovery, self._lifecycle, tuple(inspector_factories), clock
        )
        self._ids = RequestIds()
        self.inflight = 0
        self.started = 0  # client requests ever started: tells a shadow whether it overlapped
        # With several workers, the server's counts: this worker writes its own into its slot
        # (proxy/audit/server_load.py), where shadows and triage read every worker's.
        self._shared_load: SharedLoad | None = None

    def inflight_now(self) -> int:
        """Client requests in progress (a method, not a lambda: compiled, it runs natively)."""
        return self.inflight

    def share_load(self, shared: SharedLoad) -> None:
        """Write this worker's counts into the server's (``serve --workers N``)."""
        self._shared_load = shared
        shared.publish(self.inflight, self.started)

    def attach_auditor(self, auditor: Auditor) -> None:
        self._lifecycle.auditor = auditor

    # -- dispatch ---------------------------------------------------------------------------

    async def handle(self, client: ClientSide) -> None:
        """Answers one client request, whichever server received it."""
        endpoint = ENDPOINTS.get(client.path)
        self.inflight += 1
        self.started += 1
        shared = self._shared_load
        if shared is not None:
            shared.publish(self.inflight, self.started)
        ex = Exchange(client, endpoint or "other", self._clock(), self.inflight)
        self._bus.publish(RequestStarted(ex.endpoint))
        try:
            own = self._server_id
            # A request marked by a detproxy is rare: the usual one costs one field lookup.
            if own is not None and client.header(VIA_NAME) is not None and came_back(client, own):
                await self._loop_detected(ex)
            elif endpoint is not None and client.method == "POST":
                await self._openai(ex)
            else:
                await self._passthrough(ex)
        except asyncio.CancelledError:
            # The client left while detproxy waited (for the upstream's headers, say).
            if not ex.finished:
                self._lifecycle.client_left(ex)
            raise
        finally:
            self.inflight -= 1
            if shared is not None:
                shared.publish(self.inflight, self.started)
            if not ex.finished:
                # A fault of detproxy's own: still pair every start with one finish.
                self._lifecycle.finished(ex, 500, "proxy_error")

    async def _loop_detected(self, ex: Exchange) -> None:
        """A request this server sent upstream came back to it: the upstream leads back here.
        Answered at once, never forwarded (each hop would forward it again)."""
        client = ex.client
        ex.request_id = rid = request_id_of(client.header(b"x-request-id"), self._ids)
        self._bus.publish(UpstreamFailed(ex.endpoint, "loop", "headers"))
        self._lifecycle.finished(ex, LOOP_STATUS, "upstream_error")
        await send_error(client, LOOP_STATUS, LOOP_MESSAGE, request_id=rid)

    # -- the OpenAI endpoints ---------------------------------------------------------------

    async def _openai(self, ex: Exchange) -> None:
        client = ex.client
        ex.request_id = rid = request_id_of(client.header(b"x-request-id"), self._ids)
        try:
            ensure_json_content_type(client.header(b"content-type"))
            raw = await client.read_body(self._max_body_bytes)
            body = parse_object(raw)
        except BadRequest as bad:  # its own name: compiled, one name holds one type
            self._lifecycle.finished(ex, bad.status, "bad_request")
            return await send_error(client, bad.status, bad.message, request_id=rid)
        view = classify(
            ex.endpoint,
            body,
            default_temperature=self._default_temperature,
            seeded_is_deterministic=self._seeded_is_deterministic,
        )
        ex.view, ex.body, ex.original = view, body, raw
        ex.headers = headers_for_upstream(client, rid)
        self._lifecycle.classified(ex)
        auditor = self._lifecycle.auditor
        if auditor is not None:
            authorization = client.header(b"authorization")
            ex.ticket = auditor.plan(view, body, rid, client.raw_path, authorization)
        sent, altered, retry_base = self._altered(ex)
        try:
            upstream, fell_back = await self._sender.send(
                client.raw_path, ex.headers, sent, altered
            )
        except UpstreamFailure as exc:
            self._bus.publish(UpstreamFailed(ex.endpoint, exc.kind, "headers"))
            self._lifecycle.finished(ex, exc.status, "upstream_error")
            return await send_error(client, exc.status, exc.message, request_id=rid)
        if fell_back:
            retry_base = body  # the upstream refused an addition: none in this request's retries
            if ex.ticket is not None and ex.ticket.injected:
                if upstream.status < 400:
                    # The client's own request carries no logprobs: nothing to compare. (Refused
                    # too, it is a failed primary: no answer to replay, no drop to count.)
                    self._bus.publish(ShadowDropped(view.model, "injection_failed"))
                ex.ticket = None
        recovery = self._recovery
        attempts = Attempts(
            recovery.context,
            rid,
            view.model,
            ex.endpoint,
            view.stream,
            max_tokens_of(body),
            retry_base,
        )
        if is_event_stream_response(upstream):
            await StreamedAnswer(self._stages, ex, attempts, upstream).respond()
        else:
            reads = recovery.reads_answers
            await WholeAnswer(self._stages, ex, attempts, upstream, reads).respond()

    def _altered(self, ex: Exchange) -> tuple[bytes, Altered | None, dict[str, Any]]:
        """The bytes sent for the client's request, what detproxy added to them (the audit's
        logprobs, vLLM's ``repetition_detection``), and what a retry starts from."""
        assert ex.body is not None and ex.view is not None
        body, raw, ticket = ex.body, ex.original, ex.ticket
        kinds: list[str] = []
        sent = ticket.upstream_body if ticket is not None else body
        if ticket is not None and ticket.injected:
            raw = orjson.dumps(sent)  # logprobs injected for the audit
            kinds.append(LOGPROBS)
        # A retry starts from the client's request: the audit's logprobs are not asked again
        # (an answer produced under overrides is not audited, and would not be stripped).
        retry_base = body
        if self._recovery.enabled:
            prepared = self._recovery.prepare(sent, ex.view.model)
            if prepared is not sent:
                raw = orjson.dumps(prepared)
                retry_base = self._recovery.prepare(body, ex.view.model)
                kinds.append(REPETITION_DETECTION)
        altered = Altered(kinds, ex.original, ex.view.model, ex.endpoint) if kinds else None
        return raw, altered, retry_base

    # -- everything else --------------------------------------------------------------------

    async def _passthrough(self, ex: Exchange) -> None:
        client = ex.client
        self._lifecycle.classified(ex)
        ex.request_id = rid = request_id_of(client.header(b"x-request-id"), self._ids)
        headers = upstream_request_headers(client.headers, rid, proxy_reads_body=False)
        body: AsyncIterator[bytes] | None = client.body_chunks() if client.has_body else None
        try:
            upstream = await self._upstream.send(client.method, client.raw_path, headers, body)
        except UpstreamFailure as exc:
            self._bus.publish(UpstreamFailed("other", exc.kind, "headers"))
            self._lifecycle.finished(ex, exc.status, "upstream_error")
            return await send_error(client, exc.status, exc.message, request_id=rid)
        ex.first_byte_s = self._clock() - ex.t0
        last = b""  # the bytes last handed to the client
        try:
            await client.start(
                upstream.status,
                headers_for_client(upstream, rid, keep_length=True),
            )
            async for data in upstream.chunks():
                await client.write(data)
                last = data
            await client.end()
        except CLIENT_GONE as exc:
            if is_event_stream(upstream.headers) and ends_with_done(last):
                # As on the OpenAI routes: a client that leaves on [DONE] (the openai SDK
                # does) had the whole stream, even when the upstream's framing had not ended.
                self._lifecycle.finished(ex, upstream.status, "ok")
            else:
                self._lifecycle.client_left(ex)
            if isinstance(exc, asyncio.CancelledError):
                raise
            return
        except Exception as exc:
            # Headers are gone already: all that is left is to cut the connection short.
            self._bus.publish(UpstreamFailed("other", read_error_kind(exc), "body"))
            self._lifecycle.finished(ex, upstream.status, "upstream_error")
            raise
        finally:
            upstream.close()
        self._lifecycle.finished(ex, upstream.status, "ok")


def max_tokens_of(body: dict[str, Any]) -> int | None:
    """The output limit a request set (``max_completion_tokens`` is chat's newer name)."""
    for name in LIMIT_FIELDS:
        value = body.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None
