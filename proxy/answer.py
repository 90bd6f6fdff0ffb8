"""A non-streamed answer: each attempt read whole, looked at, and the last one relayed.

What detproxy injected for its audit is stripped from the answer; a continuation's answer gets
its kept prefix back in front; a retry whose upstream fails or refuses gives the client the
answer it already had; an abort ends the answer at the loop. The attempts themselves are
``proxy.attempts.Attempts``'s, driven by ``run_attempts``.
"""

from __future__ import annotations

from typing import Any

import orjson

from policies.base import Abort, Retry
from proxy.attempts import AttemptEnd, Attempts, Generated, NextAttempt, Stages, run_attempts
from proxy.audit.outcome import Outcome, outcome_from_response
from proxy.events import UpstreamFailed
from proxy.exchange import CLIENT_GONE, Exchange
from proxy.http.body import parse_answer
from proxy.http.errors import UpstreamFailure, send_error
from proxy.http.headers import headers_for_client, with_fields
from proxy.http.upstream import UpstreamResponse, read_error_kind
from proxy.loops.continuation import (
    Continued,
    content_of,
    merge_answer,
    merge_closed,
    reasoning_keys,
)
from proxy.loops.recovery import cut_answer, is_empty
from proxy.loops.verdict import ending
from proxy.openai import first_choice, first_message, strip_logprobs, usage_of


def attempt_headers(attempts: Attempts) -> dict[str, str]:
    """The headers that tell a client its request was retried or recovered."""
    out: dict[str, str] = {}
    if attempts.count > 1 or attempts.looped:
        out["X-Detproxy-Attempts"] = str(attempts.count)
    if attempts.looped:
        out["X-Detproxy-Recovered"] = "true" if attempts.recovered else "false"
    if attempts.count > 1:
        out["X-Detproxy-Strategy"] = attempts.strategy
    return out


class WholeAnswer:
    """The attempts of one non-streamed exchange."""

    def __init__(
        self,
        stages: Stages,
        ex: Exchange,
        attempts: Attempts,
        upstream: UpstreamResponse,
        reads_answers: bool,
    ) -> None:
        self.exchange = ex
        self.attempts = attempts
        self._stages = stages
        self._upstream = upstream
        self._reads_answers = reads_answers
        self._injected = ex.ticket is not None and ex.ticket.injected
        self._payload = b""
        self._answer: dict[str, Any] | None = None
        self._outcome: Outcome | None = None  # the audited (first) answer's
        # The last answer that can be relayed: a retry that fails gives it back to the client.
        self._kept: tuple[UpstreamResponse, bytes, dict[str, Any] | None] | None = None
        # The exchange failed with nothing to relay: the status and message the client gets.
        self._error: tuple[int, str] | None = None
        self._continued: Continued | None = None  # what the pending attempt goes on from
        self._reasoning_keys: tuple[str, ...] = ()  # where the looping answer had reasoning
        self._prompt_tokens: Any = None  # the client request's, from its first answer

    async def respond(self) -> None:
        ex = self.exchange
        decision = await run_attempts(self)
        if self._error is not None:
            status, message = self._error
            return await send_error(ex.client, status, message, request_id=ex.request_id)
        upstream, answer = self._upstream, self._answer
        attempts = self.attempts
        if isinstance(decision, Abort) and answer is not None and attempts.trigger:
            cut_answer(answer, ex.endpoint, attempts.trigger)
            self._payload = orjson.dumps(answer)
        if ex.ticket is not None and upstream.status == 200:
            outcome = self._outcome
            if outcome is None and answer is not None:
                outcome = outcome_from_response(ex.endpoint, answer)
            if outcome is not None:
                self._stages.lifecycle.audit(ex, outcome)
        headers = headers_for_client(upstream, ex.request_id)
        headers = with_fields(headers, attempt_headers(attempts))
        self._stages.lifecycle.finished(ex, upstream.status, "ok")
        await ex.client.respond(upstream.status, headers, self._payload)

    async def attempt(self) -> AttemptEnd | None:
        ex, stages = self.exchange, self._stages
        upstream = self._upstream
        try:
            payload = await upstream.read()
        except CLIENT_GONE:
            upstream.close()
            stages.lifecycle.client_left(ex)
            raise
        except Exception as exc:
            upstream.close()
            kind = read_error_kind(exc)
            stages.bus.publish(UpstreamFailed(ex.endpoint, kind, "body"))
            if self._restore_kept():
                return None
            status = 504 if kind == "timeout" else 502
            stages.lifecycle.finished(ex, status, "upstream_error")
            self._error = (status, "upstream connection lost before the response was complete")
            return None
        status = upstream.status
        if self._kept is not None and status >= 400:
            self._restore_kept()  # the retry's overrides were refused
            return None
        ex.first_byte_s = stages.now(ex)
        answer = parse_answer(payload) if ex.ticket is not None or self._reads_answers else None
        injected, self._injected = self._injected, False  # retries are sent without them
        generated = None
        if status == 200:  # what this attempt generated (before a kept prefix joins it)
            generated = (usage_of(answer)[1] if answer is not None else None) or 0
        # Nothing of its own: judged before a continued content's prefix joins it (after a
        # reasoning, once what the engine wrote is read as the answer's content).
        continued = self._continued
        plain = continued is None or not (continued.closes_reasoning or continued.reasoning)
        empty = plain and status == 200 and is_empty(ex.endpoint, answer)
        if answer is not None and status == 200:
            payload = self._rewrite(answer, payload, injected)
            if not plain:
                empty = is_empty(ex.endpoint, answer)
        self._payload, self._answer = payload, answer
        trigger = None
        attempts = self.attempts
        watch = attempts.started()
        if watch is not None and answer is not None and status == 200:
            trigger = watch.on_answer(answer)
        end = AttemptEnd(
            generated, decide=True, trigger=trigger, status=status, answer=answer, empty=empty
        )
        if attempts.pending_retry and trigger is None and not empty and answer is not None:
            end.ending = self._ending(answer)
        return end

    def _ending(self, answer: dict[str, Any]) -> str:
        """How a retry's whole answer ended (``proxy.loops.verdict``): its first choice's
        finish, and its content (the kept prefix included)."""
        choice = first_choice(answer)
        finish = choice.get("finish_reason") if choice is not None else None
        endpoint = self.exchange.endpoint
        text = content_of(endpoint, answer)
        message = first_message(answer) if endpoint == "chat" else None
        answered = bool(text and text.strip()) or bool(message and message.get("tool_calls"))
        return ending(finish, answered, text, self._stages.recovery.detector)

    def _rewrite(self, answer: dict[str, Any], payload: bytes, injected: bool) -> bytes:
        """What the client gets of a good answer: without the logprobs the audit injected,
        and with the kept prefix in front of a continuation."""
        ex = self.exchange
        if injected:
            if ex.ticket is not None:
                self._outcome = outcome_from_response(ex.endpoint, answer)
            if strip_logprobs(answer):
                payload = orjson.dumps(answer)
        if self.attempts.count == 1:
            self._prompt_tokens = usage_of(answer)[0]
        continued = self._continued
        if continued is not None:
            if continued.closes_reasoning:
                merge_closed(answer, continued, self._reasoning_keys, self._prompt_tokens)
            else:
                merge_answer(
                    ex.endpoint,
                    answer,
                    continued.prefix,
                    self._prompt_tokens,
                    continued.reasoning,
                    self._reasoning_keys,
                )
            payload = orjson.dumps(answer)
        return payload

    def generated(self) -> Generated:
        endpoint, answer, trigger = self.exchange.endpoint, self._answer, self.attempts.trigger
        channel = trigger.channel if trigger is not None else "content"
        text = content_of(endpoint, answer, channel)
        return Generated(text, content_of(endpoint, answer, "reasoning"))

    async def retry(self, nxt: NextAttempt, decision: Retry) -> bool:
        """Send ``nxt``; refused, the client has the answer it had (not ``nxt.fallbacks``)."""
        ex, stages = self.exchange, self._stages
        continued = nxt.continued
        body = orjson.dumps(nxt.body)
        # The answer goes on after a reasoning: the fields the looping answer carried it in.
        after_reasoning = continued is not None and (
            continued.closes_reasoning or bool(continued.reasoning)
        )
        if after_reasoning:
            self._reasoning_keys = reasoning_keys(ex.endpoint, self._answer)
        self._continued = continued
        self._kept = (self._upstream, self._payload, self._answer)
        try:
            rendered: UpstreamResponse | None = None
            if continued is not None and after_reasoning:
                # A template that drops assistant reasoning: the rendered prompt keeps it.
                rendered = await stages.recovery.rendered.open(
                    stages.upstream,
                    ex.client.raw_path,
                    ex.headers,
                    orjson.loads(body),
                    continued,
                    self._answer,
                )
            self._upstream = rendered or await stages.upstream.send(
                "POST", ex.client.raw_path, ex.headers, body
            )
        except UpstreamFailure as exc:
            stages.bus.publish(UpstreamFailed(ex.endpoint, exc.kind, "headers"))
            self._restore_kept()
            return False
        return True

    def _restore_kept(self) -> bool:
        """A retry failed: the answer it would have replaced is the client's."""
        if self._kept is None:
            return False
        self.attempts.refused()
        self._upstream, self._payload, self._answer = self._kept
        self._kept = None
        return True
