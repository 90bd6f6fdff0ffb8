"""One client request's life: the ``Exchange`` every stage receives, and its lifecycle events.

The handler creates one ``Exchange`` per client request (mitmproxy's flow): the frozen
``RequestView`` of what was asked, its audit ticket, and its timings (its upstream attempts
are ``proxy.attempts.Attempts``). ``Lifecycle`` publishes what the metrics and the log
subscribe to: each request classified once, finished once, whichever path it ends on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from proxy.classify import RequestView
from proxy.events import (
    ClientDisconnected,
    EventBus,
    InspectionStopped,
    RequestClassified,
    RequestFinished,
)
from proxy.http.headers import HeaderFields

if TYPE_CHECKING:
    from proxy.audit.auditor import Auditor, AuditTicket
    from proxy.audit.outcome import Outcome
    from proxy.http.clientside import ClientSide

log = logging.getLogger(__name__)

# What writing to (or waiting for) a client that left raises.
CLIENT_GONE = (ConnectionResetError, asyncio.CancelledError)


def relayed_outcome(status: int) -> str:
    """A relayed upstream answer's outcome by its status class: ``ok``, ``client_error`` (4xx:
    the upstream refused the client's request: an unknown model, a bad field, 401, 429) or
    ``upstream_error`` (5xx: the upstream failed it, as when its connection breaks)."""
    if status < 400:
        return "ok"
    return "client_error" if status < 500 else "upstream_error"


class Exchange:
    """One client request, from its arrival to its last byte.

    A plain class, not a dataclass: compiled (mypyc), its fields are read as a C struct's by
    every stage, and its ``__init__`` is compiled too.
    """

    def __init__(
        self, client: ClientSide, endpoint: str, t0: float, inflight_at_start: int
    ) -> None:
        self.client = client  # the request, and the response written to it
        self.endpoint = endpoint  # chat | completions | other
        self.t0 = t0  # on the forwarder's clock
        # Client requests in flight when it arrived, itself included.
        self.inflight_at_start = inflight_at_start
        self.request_id = ""
        self.view: RequestView | None = None  # None until the body was classified
        self.body: dict[str, Any] | None = None  # the client's request, parsed
        self.original = b""  # the client's own bytes: what a fallback sends
        self.headers: HeaderFields = {}  # for the upstream
        self.ticket: AuditTicket | None = None  # the audit's plan; None when not audited
        self.first_byte_s: float | None = None  # upstream headers (whole answers) or first event
        self.counted = False  # RequestClassified was published
        self.finished = False  # RequestFinished was published

    @property
    def stream(self) -> bool:
        return self.view.stream if self.view is not None else False


class Lifecycle:
    """Publishes an exchange's lifecycle events and hands its answer to the audit; the audit
    is an observer: its failure never reaches the client."""

    def __init__(self, bus: EventBus, clock: Callable[[], float]) -> None:
        self._bus = bus
        self._clock = clock
        self.auditor: Auditor | None = None  # attached once the app's audit exists

    def classified(self, ex: Exchange) -> None:
        """``detproxy_requests_total`` counts a request once, when its labels are known."""
        ex.counted = True
        view = ex.view
        self._bus.publish(
            RequestClassified(
                ex.endpoint,
                view.model if view else "",
                view.stream if view else False,
                view.deterministic if view else False,
            )
        )

    def finished(self, ex: Exchange, status: int, outcome: str) -> None:
        """``outcome`` "ok": the upstream's answer was relayed whole, counted by its class."""
        ex.finished = True
        if outcome == "ok":
            outcome = relayed_outcome(status)
        if not ex.counted:  # refused or failed before it was classified
            self.classified(ex)
        view = ex.view
        self._bus.publish(
            RequestFinished(
                endpoint=ex.endpoint,
                model=view.model if view else "",
                stream=view.stream if view else False,
                deterministic=view.deterministic if view else False,
                status=status,
                outcome=outcome,
                duration_s=self._clock() - ex.t0,
                first_byte_s=ex.first_byte_s,
                request_id=ex.request_id,
            )
        )

    def client_left(self, ex: Exchange) -> None:
        self._bus.publish(ClientDisconnected(ex.endpoint, ex.stream))
        self.finished(ex, 499, "client_disconnect")

    def audit(self, ex: Exchange, outcome: Outcome) -> None:
        ticket = ex.ticket
        if ticket is None or self.auditor is None:
            return
        try:
            self.auditor.primary_done(ticket, outcome)
        except Exception:
            log.exception("audit of %s failed", ticket.request_id)
            self._bus.publish(InspectionStopped(ticket.view.endpoint, "audit_error"))
