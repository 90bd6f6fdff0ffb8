"""What detproxy adds to a client's request, and what it does when the upstream refuses it.

detproxy alters some requests on their way upstream: logprobs injected for an audit, vLLM's
``repetition_detection`` injected for loop detection. An upstream may refuse the altered request
where it would have answered the client's own: vLLM 0.23 answers 400 ("Out of range float values
are not JSON compliant: nan") when a model's logprobs come out NaN; an older vLLM or another server
may reject a parameter it does not know. The client must get what it would have got without
detproxy, so when the refusal is about an addition (``refused_additions``: a 400 or 422 whose
message or ``param`` names it) the client's own request goes instead (``proxy.fallback``); any
other error is the client's request's own, relayed once as it came. This guard keeps count:
after ``failures_to_suspend`` failures in a row for a model, that addition is suspended for the
model for ``suspend_s`` (doubled at each suspension in a row, up to ``max_suspend_s``), then
tried again. A failure is only the alteration's when the client's own request then succeeded:
a request the upstream refuses either way is the client's error.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from proxy.config import InjectionConfig
from proxy.events import EventBus, InjectionFailed, InjectionSuspended
from proxy.openai import error_detail

LOGPROBS = "logprobs"
REPETITION_DETECTION = "repetition_detection"
KINDS = (LOGPROBS, REPETITION_DETECTION)
# Models tracked at most: a state exists only for a model whose own request succeeded after an
# altered one failed, so this bounds memory against a misbehaving upstream, not clients.
MAX_TRACKED = 1024
_REASON_CHARS = 300
# The statuses a server refuses a request's fields with: vLLM's 400 (it never answers 422),
# FastAPI's own validation 422 (another server). 404, 401, 429 and 5xx are never an addition's.
_FIELD_REFUSALS = (400, 422)
# What names an addition in a refusal (lower case): its fields (logprobs, top_logprobs), vLLM's
# cap ("Requested sample logprobs of 20, which is greater than max allowed: 5"), and the NaN
# logprobs vLLM cannot serialise ("Out of range float values are not JSON compliant: nan").
_NAMED_BY = {
    LOGPROBS: ("logprob", "out of range float values"),
    REPETITION_DETECTION: ("repetition_detection",),
}
# Where a validation error starts quoting the request back (pydantic's ``input_value=``,
# FastAPI's ``'input':`` or ``"input":``): the quote holds the additions whatever the error is.
_ECHO = re.compile(r"input_value=|['\"]input['\"]:")


@dataclass
class _State:
    failures: int = 0  # in a row
    suspensions: int = 0  # in a row: each doubles the next suspension
    suspended_until: float | None = None  # monotonic clock
    total_failures: int = 0
    last_status: int | None = None
    last_reason: str | None = None
    last_failed_at: float | None = None  # wall clock


class InjectionGuard:
    def __init__(
        self,
        config: InjectionConfig,
        bus: EventBus,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self._config = config
        self._bus = bus
        self._clock = clock
        self._wall = wall
        self._states: dict[tuple[str, str], _State] = {}

    def allows(self, model: str, kind: str) -> bool:
        """May ``kind`` be added to a request for ``model`` now?"""
        state = self._states.get((model, kind))
        if state is None or state.suspended_until is None:
            return True
        if self._clock() < state.suspended_until:
            return False
        # The suspension is over: try again; the next failure suspends at once, for longer.
        state.suspended_until = None
        state.failures = self._config.failures_to_suspend - 1
        self._bus.publish(InjectionSuspended(model, kind, False, 0.0, state.last_reason or ""))
        return True

    def failed(
        self, model: str, endpoint: str, kinds: Iterable[str], status: int, reason: str
    ) -> None:
        """The altered request failed with ``status`` where the client's own succeeded:
        ``kinds`` are the additions the refusal was about."""
        for kind in kinds:
            state = self._state(model, kind)
            if state is None:
                continue
            state.failures += 1
            state.total_failures += 1
            state.last_status = status
            state.last_reason = reason
            state.last_failed_at = self._wall()
            self._bus.publish(InjectionFailed(model, endpoint, kind, status, reason))
            if state.failures >= self._config.failures_to_suspend:
                seconds = min(
                    self._config.max_suspend_s, self._config.suspend_s * 2**state.suspensions
                )
                state.suspensions += 1
                state.failures = 0
                state.suspended_until = self._clock() + seconds
                self._bus.publish(InjectionSuspended(model, kind, True, seconds, reason))

    def succeeded(self, model: str, kinds: Iterable[str]) -> None:
        """The altered request was answered: its additions work for ``model``."""
        for kind in kinds:
            state = self._states.get((model, kind))
            if state is not None and state.suspended_until is None:
                state.failures = 0
                state.suspensions = 0

    def suspended(self) -> list[tuple[str, str]]:
        """(model, kind) pairs suspended now."""
        now = self._clock()
        return [
            key
            for key, s in self._states.items()
            if s.suspended_until is not None and now < s.suspended_until
        ]

    def snapshot(self) -> dict[str, dict[str, dict[str, Any]]]:
        """Per model and kind, for ``/detproxy/status``."""
        now = self._clock()
        out: dict[str, dict[str, dict[str, Any]]] = {}
        for (model, kind), s in self._states.items():
            left = None
            if s.suspended_until is not None and now < s.suspended_until:
                left = round(s.suspended_until - now, 3)
            out.setdefault(model, {})[kind] = {
                "suspended": left is not None,
                "suspended_for_s": left,
                "failures_in_a_row": s.failures,
                "failures_total": s.total_failures,
                "last_status": s.last_status,
                "last_reason": s.last_reason,
                "last_failed_at": s.last_failed_at,
            }
        return out

    def _state(self, model: str, kind: str) -> _State | None:
        state = self._states.get((model, kind))
        if state is None:
            if len(self._states) >= MAX_TRACKED:
                return None
            state = self._states[(model, kind)] = _State()
        return state


def refused_additions(kinds: Sequence[str], status: int, payload: bytes) -> tuple[str, ...]:
    """The additions an upstream's error (``payload``: its body, or a stream's error event) is
    about: those its message or ``param`` names, where it refuses the request's fields (400,
    422). Empty: the error is the client's request's own."""
    if status not in _FIELD_REFUSALS:
        return ()
    text = _refusal_text(payload)
    return tuple(k for k in kinds if any(name in text for name in _NAMED_BY.get(k, (k,))))


def _refusal_text(payload: bytes) -> str:
    """An error's ``param`` and message, lower case, up to where it quotes the request."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    if type(body) is dict:
        err = body.get("error")
        param = (err if type(err) is dict else body).get("param")
        message = error_detail(body) or payload.decode("utf-8", "replace")
        if type(param) is str:
            message = param + " " + message
    else:
        message = payload.decode("utf-8", "replace")
    return _ECHO.split(message, 1)[0].lower()


def error_reason(status: int, payload: bytes) -> str:
    """A short reason from an upstream error body: OpenAI's nested ``error.message``, vLLM's
    older flat ``message``, llama.cpp's ``error.message``, or the body's start."""
    try:
        body = orjson.loads(payload)
    except orjson.JSONDecodeError:
        body = None
    message = error_detail(body) if type(body) is dict else None
    if message is None:
        message = payload[:_REASON_CHARS].decode("utf-8", "replace").strip() or f"HTTP {status}"
    return message[:_REASON_CHARS]
