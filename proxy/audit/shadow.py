"""The shadow scheduler: replays audited requests off the request path, under budgets.

A bounded queue feeds a fixed number of owned workers (the concurrency budget). A token
bucket caps shadows per second and a running tally caps the tokens spent on shadows at an
allowance plus a share of the deterministic primaries' tokens; what does not fit is dropped
and counted, never queued without bound. ``quiet``
scheduling waits until detproxy's own in-flight count (and, when configured, the upstream's
``vllm:num_requests_running``) is low enough, up to a deadline.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from proxy.audit.outcome import Outcome, outcome_from_response
from proxy.audit.turns import EngineTurns, LocalTurns, Turn
from proxy.config import AuditConfig
from proxy.events import EventBus, ShadowDropped, ShadowQueue
from proxy.http.errors import UpstreamError
from proxy.http.upstream import Upstream
from proxy.injection import LOGPROBS, InjectionGuard, error_reason, refused_additions
from proxy.tasks import TaskOwner

log = logging.getLogger(__name__)


class ProxyLoad(Protocol):
    """detproxy's own traffic, as the forwarder counts it."""

    @property
    def inflight(self) -> int: ...

    @property
    def started(self) -> int: ...

    def inflight_now(self) -> int: ...


@dataclass(frozen=True, slots=True)
class ShadowResult:
    outcome: Outcome
    latency_s: float
    inflight: int  # detproxy's in-flight requests when the shadow was sent
    # Some client request ran while the shadow did: it may have shared a batch with it.
    overlapped: bool


@dataclass(frozen=True, slots=True)
class ShadowJob:
    model: str
    endpoint: str
    raw_path: str
    body: Mapping[str, Any]
    headers: Mapping[str, str]
    estimated_tokens: int
    on_result: Callable[[ShadowResult], None]


class TokenBucket:
    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._rate = rate
        self._capacity = max(1.0, rate)
        self._tokens = self._capacity
        self._clock = clock
        self._last = clock()

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self._capacity, self._tokens + (now - self._last) * self._rate)
        self._last = now

    def take(self) -> bool:
        self._refill()
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def wait_s(self) -> float:
        """How long until ``take`` succeeds (0: now): what a caller that paces itself waits."""
        self._refill()
        return max(0.0, (1.0 - self._tokens) / self._rate)


class ShadowScheduler:
    def __init__(
        self,
        config: AuditConfig,
        upstream: Upstream,
        bus: EventBus,
        load: ProxyLoad,
        upstream_running: Callable[[], Awaitable[int | None]] | None = None,
        guard: InjectionGuard | None = None,
        turns: EngineTurns | None = None,
    ) -> None:
        self._config = config
        self._guard = guard
        self._upstream = upstream
        self._bus = bus
        self._load = load
        self._upstream_running = upstream_running
        self._queue: asyncio.Queue[ShadowJob] = asyncio.Queue(maxsize=config.queue_size)
        self._bucket = TokenBucket(config.max_shadows_per_s)
        self._tasks = TaskOwner("shadow")
        self._running = 0  # taken off the queue: waiting for a quiet moment or sent
        self._sending = 0  # sent and not yet answered
        # A shadow is sent in its turn (proxy/audit/turns.py): not while a triage experiment
        # holds the engine, and within the server's concurrent shadows, whatever the workers.
        self._turns: EngineTurns = turns or LocalTurns(config.max_concurrent_shadows)
        self.sent = 0  # shadows sent upstream (a triage replay is alone only if none was)
        self.primary_tokens = 0
        self.shadow_tokens = 0

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    @property
    def running(self) -> int:
        return self._running

    @property
    def sending(self) -> int:
        """Shadows on the wire now (``running`` also counts those waiting to be sent)."""
        return self._sending

    @property
    def turns(self) -> EngineTurns:
        """The engine's turns, shared with triage."""
        return self._turns

    def start(self) -> None:
        for i in range(self._config.max_concurrent_shadows):
            self._tasks.spawn(self._worker(), name=f"worker-{i}")

    async def close(self) -> None:
        dropped = self._queue.qsize()
        await self._tasks.close()
        for _ in range(dropped):
            self._bus.publish(ShadowDropped("", "shutdown"))

    def count_primary_tokens(self, tokens: int) -> None:
        """A deterministic primary's tokens (audited or not): the token budget's base."""
        self.primary_tokens += tokens

    @property
    def token_budget(self) -> float:
        """Shadow tokens allowed so far: the allowance plus the share of the primaries'."""
        return self._config.token_allowance + self._config.max_token_share * self.primary_tokens

    def admit(self, model: str) -> bool:
        """Asked when a sampled primary starts: may a shadow follow it? The rate limit is
        taken here, and a spent token budget refuses here already, so that a primary that will
        not be replayed goes out as the client sent it (no logprobs injected for the audit,
        which the engine would have to compute) and is relayed without accumulating its
        output."""
        reason = None
        if self.shadow_tokens >= self.token_budget:
            reason = "token_budget"  # no shadow fits until primaries add to the budget
        elif not self._bucket.take():
            reason = "rate_limit"
        if reason is not None:
            self._bus.publish(ShadowDropped(model, reason))
            return False
        return True

    def submit(self, job: ShadowJob) -> bool:
        """After an admitted primary: queue its shadow, within the token budget and the queue."""
        reason = None
        if self.shadow_tokens + job.estimated_tokens > self.token_budget:
            reason = "token_budget"
        elif self._queue.full():
            reason = "queue_full"
        if reason is not None:
            self._bus.publish(ShadowDropped(job.model, reason))
            return False
        self.shadow_tokens += job.estimated_tokens
        self._queue.put_nowait(job)
        self._publish_state()
        return True

    def _publish_state(self) -> None:
        self._bus.publish(ShadowQueue(self._queue.qsize(), self._running))

    async def _worker(self) -> None:
        while True:
            job = await self._queue.get()
            self._running += 1
            self._publish_state()
            try:
                await self._run(job)
            except Exception:
                log.exception("shadow replay failed")
                self._bus.publish(ShadowDropped(job.model, "internal_error"))
            finally:
                self._running -= 1
                self._publish_state()

    async def _quiet_enough(self) -> bool:
        """Wait until the load has stayed low for ``quiet_settle_s``, up to the deadline."""
        cfg = self._config
        running = self._upstream_running if cfg.quiet_max_upstream_running is not None else None
        return await wait_quiet(
            self._load,
            cfg.quiet_max_inflight,
            running,
            cfg.quiet_max_upstream_running,
            settle_s=cfg.quiet_settle_s,
            deadline_s=cfg.quiet_deadline_s,
            poll_s=cfg.quiet_poll_s,
        )

    async def _turn(self) -> Turn | None:
        """Wait for the shadow's turn: (``quiet`` schedule) a quiet moment within the deadline,
        and then a turn on the engine; where an experiment holds it (or every slot is taken) the
        wait starts over, its time not counted against the deadline. None: the deadline
        passed."""
        cfg = self._config
        while True:
            if cfg.schedule == "quiet" and not await self._quiet_enough():
                return None
            turn = self._turns.try_shadow()
            if turn is not None:
                return turn
            await asyncio.sleep(cfg.quiet_poll_s)

    async def _run(self, job: ShadowJob) -> None:
        turn = await self._turn()
        if turn is None:
            self._bus.publish(ShadowDropped(job.model, "quiet_deadline"))
            return
        self.sent += 1
        self._sending += 1
        try:
            sent = await replay(
                self._upstream,
                self._load,
                job.raw_path,
                job.headers,
                job.body,
                self._config.shadow_timeout_s,
            )
        finally:
            self._sending -= 1
            turn.release()
        if isinstance(sent, str):
            self._bus.publish(ShadowDropped(job.model, sent))
            return
        resp_status, payload, parsed = sent.status, sent.payload, sent.parsed
        latency, inflight, overlapped = sent.latency_s, sent.inflight, sent.overlapped
        if resp_status != 200 or not isinstance(parsed, dict):
            self._bus.publish(ShadowDropped(job.model, "upstream_error"))
            if self._guard is not None and refused_additions([LOGPROBS], resp_status, payload):
                # The same request with its primary's logprobs was answered; replayed
                # non-streamed it is refused for them (vLLM: NaN logprobs). Shadows cannot work
                # for the model: the guard suspends them rather than spend a generation on
                # each. Any other refusal (a model gone, a key revoked) blames no addition.
                reason = error_reason(resp_status, payload)
                self._guard.failed(job.model, job.endpoint, [LOGPROBS], resp_status, reason)
            return
        if self._guard is not None:
            self._guard.succeeded(job.model, [LOGPROBS])
        outcome = outcome_from_response(job.endpoint, parsed)
        job.on_result(ShadowResult(outcome, latency, inflight, overlapped))


@dataclass(frozen=True, slots=True)
class Replayed:
    """One replay's answer: its status, body (parsed: a dict, or None for junk), how long it
    took and how busy detproxy was (client requests in flight when it was sent; whether any
    client request ran while it did)."""

    status: int
    payload: bytes
    parsed: Any
    latency_s: float
    inflight: int
    overlapped: bool


async def replay(
    upstream: Upstream,
    load: ProxyLoad,
    raw_path: str,
    headers: Mapping[str, str],
    body: Mapping[str, Any],
    timeout_s: float,
) -> Replayed | str:
    """Send one replay (a shadow, a triage experiment) and read its answer; a str says why
    there is none (``timeout`` or ``upstream_error``)."""
    inflight, started = load.inflight, load.started
    t0 = time.monotonic()
    try:
        async with asyncio.timeout(timeout_s):
            resp = await upstream.send("POST", raw_path, headers, orjson.dumps(body))
            try:
                payload = await resp.read()
            finally:
                resp.close()
    except TimeoutError:
        return "timeout"
    except UpstreamError as exc:
        log.info("replay failed: %s", exc)
        return "upstream_error"
    except Exception as exc:  # whatever else an Upstream implementation raises
        log.info("replay failed: %r", exc)
        return "upstream_error"
    latency = time.monotonic() - t0
    overlapped = inflight > 0 or load.started != started
    try:
        parsed = orjson.loads(payload)
    except orjson.JSONDecodeError:
        parsed = None
    return Replayed(resp.status, payload, parsed, latency, inflight, overlapped)


async def wait_quiet(
    load: ProxyLoad,
    max_inflight: int,
    upstream_running: Callable[[], Awaitable[int | None]] | None,
    max_upstream_running: int | None,
    *,
    settle_s: float,
    deadline_s: float,
    poll_s: float,
    busy: Callable[[], bool] | None = None,
) -> bool:
    """Wait until the load has stayed low for ``settle_s``, up to ``deadline_s``: detproxy's
    in-flight client requests at most ``max_inflight``, the upstream's running requests (where
    read) at most ``max_upstream_running``, and ``busy()`` (other work of detproxy's) false."""
    now = time.monotonic()
    deadline = now + deadline_s
    quiet_since: float | None = None
    while True:
        ok = load.inflight <= max_inflight and not (busy is not None and busy())
        if ok and max_upstream_running is not None and upstream_running is not None:
            running = await upstream_running()
            ok = running is not None and running <= max_upstream_running
        now = time.monotonic()
        if not ok:
            quiet_since = None
        elif quiet_since is None:
            quiet_since = now
        if quiet_since is not None and now - quiet_since >= settle_s:
            return True
        if now >= deadline:
            return False
        await asyncio.sleep(poll_s)
