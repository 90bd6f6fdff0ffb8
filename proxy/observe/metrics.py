"""Prometheus metrics, built once against an injected registry and fed only by events."""

from __future__ import annotations

import os
from collections.abc import Callable, Hashable, Iterator
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from proxy.audit.verdict import VERDICTS
from proxy.engine.identity import Fingerprint
from proxy.events import (
    AuditCompleted,
    CauseAttributed,
    ClientDisconnected,
    EngineFactsRead,
    EventBus,
    FallbackSent,
    InjectionFailed,
    InjectionSuspended,
    InspectionStopped,
    LoopDetected,
    PolicyActed,
    RecoveryBudgetUsed,
    RecoveryTokens,
    RequestClassified,
    RequestFinished,
    RequestStarted,
    ShadowDropped,
    ShadowQueue,
    SharedStoreFailed,
    StreamTimed,
    TriageDropped,
    UpstreamFailed,
    UpstreamFingerprinted,
    UpstreamRestarted,
    UpstreamUnreachable,
)
from proxy.http.admin import AdminRequest, Reply
from proxy.observe.hot import CounterFamily, HistogramFamily

# LLM requests last from milliseconds (errors, cached prefill) to an hour (long reasoning).
DURATION_BUCKETS = (
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
    600,
    1800,
    3600,
)
POSITION_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# 1e-6 nats and below is float rounding; 0.25-3 nats is a different computation.
DELTA_BUCKETS = (1e-9, 1e-6, 1e-4, 1e-3, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 3, 5, 10)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 150, 200, 300, 500, 1000, 2000)
INFLIGHT_BUCKETS = (
    (1, "1"),
    (2, "2"),
    (4, "3-4"),
    (8, "5-8"),
    (16, "9-16"),
    (32, "17-32"),
    (64, "33-64"),
)


def inflight_bucket(n: int) -> str:
    """A bounded label for a concurrency level: the throughput-versus-concurrency axis."""
    return next((name for top, name in INFLIGHT_BUCKETS if n <= top), "65+")


FIRST_BYTE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BoundedLabel:
    """Caps the distinct values a client-controlled label (the model name) can take."""

    def __init__(self, limit: int = 64, overflow: str = "other") -> None:
        self._seen: set[str] = set()
        self._limit = limit
        self._overflow = overflow

    def __call__(self, value: str) -> str:
        if value in self._seen:
            return value
        if len(self._seen) >= self._limit:
            return self._overflow
        self._seen.add(value)
        return value


class _Counts(Protocol):
    def inc(self, amount: float = 1.0) -> None: ...


class _Observes(Protocol):
    def observe(self, amount: float) -> None: ...


class _Children:
    """A labelled prometheus_client metric's children, cached by their label values (the
    per-request families under ``--workers``, where the values live in shared files).

    prometheus_client's ``labels`` takes a lock and converts every value on each call: too
    slow for the per-request path. Holds one entry per child the metric holds, so it is as
    bounded as the metric's labels are; values are converted with ``str``, as ``labels`` does.
    """

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Counter | Histogram) -> None:
        self._metric = metric
        self._children: dict[tuple[Hashable, ...], Counter | Histogram] = {}

    def __call__(self, *values: Hashable) -> Any:  # the metric's own class: Counter or Histogram
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*map(str, values))
        return child


class _FailureCollector:
    """Exposes the isolated-failure counts kept by the bus and the policy chain."""

    def __init__(self, sources: dict[str, Callable[[], dict[str, int]]]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[CounterMetricFamily]:
        family = CounterMetricFamily(
            "detproxy_isolated_failures",
            "Failures of subscribers, inspectors or policies that were isolated",
            labels=["component", "name"],
        )
        for component, source in self._sources.items():
            for name, count in source().items():
                family.add_metric([component, name], count)
        yield family


class _UpstreamCollector:
    """The upstream's identity as an info metric, and the load it reports, as last read.

    Absent readings are not exported (no made-up zeros).
    """

    GAUGES = {
        "running": ("detproxy_upstream_requests_running", "Requests the upstream says it runs"),
        "waiting": ("detproxy_upstream_requests_waiting", "Requests the upstream says wait"),
        "prefix_cache_hit_ratio": (
            "detproxy_upstream_prefix_cache_hit_ratio",
            "Prefix cache hits over queries since the last reading",
        ),
        "spec_decode_acceptance_rate": (
            "detproxy_upstream_spec_decode_acceptance_rate",
            "Accepted over drafted tokens since the last reading",
        ),
        "spec_decode_mean_acceptance_length": (
            "detproxy_upstream_spec_decode_mean_acceptance_length",
            "1 + accepted tokens per draft since the last reading",
        ),
    }

    def __init__(self) -> None:
        self.current: Fingerprint | None = None
        self.up: bool | None = None  # None: not read yet, or never read (no poller)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            "detproxy_upstream_up",
            "1 while the upstream's readings say what it runs, 0 while they do not"
            " (refused, timed out, loading); no sample before the first reading",
        )
        if self.up is not None:
            up.add_metric([], int(self.up))
        yield up
        fp = self.current
        if fp is None:
            return
        info = GaugeMetricFamily(
            "detproxy_upstream_info",
            "What the upstream says it runs (value 1)",
            labels=["kind", "version", "model", "fingerprint"],
        )
        for model in fp.models or ("",):
            info.add_metric([fp.kind, fp.version or "", model, fp.fingerprint], 1)
        yield info
        for key, (name, text) in self.GAUGES.items():
            if key in fp.load:
                yield GaugeMetricFamily(name, text, value=fp.load[key])


class _SupervisorCollector:
    """With ``--workers``: how many workers the supervisor runs and how often each restarted."""

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        from proxy.workers import supervisor_state

        state = supervisor_state()
        if state is None:
            return
        yield GaugeMetricFamily(
            "detproxy_workers", "Serving processes the supervisor runs", value=state["workers"]
        )
        restarts = CounterMetricFamily(
            "detproxy_worker_restarts",
            "Workers that exited and were started again, by worker index",
            labels=["worker"],
        )
        for index, count in sorted(state["restarts"].items()):
            restarts.add_metric([index], count)
        yield restarts


class Metrics:
    """``multiprocess``: prometheus_client's multiprocess mode is on (``detproxy serve
    --workers N`` sets ``PROMETHEUS_MULTIPROC_DIR`` for its workers): values live in files
    shared by the workers and a scrape, whichever worker answers it, sums them."""

    def __init__(self, registry: CollectorRegistry, budget_shared: bool = False) -> None:
        """``budget_shared``: the recovery budget is the whole server's or fleet's (the workers'
        folder, Redis), so every worker reports the same account: across workers it is their
        max, not their sum."""
        self.registry = registry
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self._own: list[Collector] = []  # exported by this process itself, multiprocess or not
        self.model = BoundedLabel()
        # The families every request (or stream) updates: see ``_counter``.
        self._requests = self._counter(
            "detproxy_requests",
            "Client requests by model, endpoint, stream and determinism",
            ["model", "endpoint", "stream", "deterministic"],
        )
        self._responses = self._counter(
            "detproxy_responses",
            "Client responses by status code and outcome",
            ["endpoint", "code", "outcome"],
        )
        self._duration = self._histogram(
            "detproxy_request_duration_seconds",
            "Time from request to the last byte relayed",
            ["endpoint", "stream"],
            DURATION_BUCKETS,
        )
        self._first_byte = self._histogram(
            "detproxy_time_to_first_byte_seconds",
            "Time to the upstream's response headers (non-streamed) or first SSE event (streamed)",
            ["endpoint", "stream"],
            FIRST_BYTE_BUCKETS,
        )
        self.inflight = Gauge(
            "detproxy_inflight_requests",
            "Client requests in flight",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self._inflight = 0  # read at scrape time: a plain int costs nothing per request
        if not self.multiprocess:  # else a scrape reads the files: the gauge is kept in them
            self.inflight.set_function(lambda: self._inflight)
        self.upstream_errors = Counter(
            "detproxy_upstream_errors",
            "Upstream failures by kind and stage",
            ["endpoint", "kind", "stage"],
            registry=registry,
        )
        self.inspection_stopped = Counter(
            "detproxy_inspection_stopped",
            "Responses whose inspection stopped, by reason",
            ["endpoint", "reason"],
            registry=registry,
        )
        self.disconnects = Counter(
            "detproxy_client_disconnects",
            "Clients that left before their response ended",
            ["endpoint", "stream"],
            registry=registry,
        )

        self.audits = Counter(
            "detproxy_audits",
            "Audited choices by model, mode and verdict",
            ["model", "mode", "verdict"],
            registry=registry,
        )
        self.divergence_position = Histogram(
            "detproxy_divergence_position_tokens",
            "Index of the first divergent token (text and answer divergences)",
            ["model", "mode"],
            buckets=POSITION_BUCKETS,
            registry=registry,
        )
        self.logprob_delta = Histogram(
            "detproxy_logprob_delta_nats",
            "Largest |delta logprob| over the common prefix of non-identical audits",
            ["model", "mode"],
            buckets=DELTA_BUCKETS,
            registry=registry,
        )
        self.loops = Counter(
            "detproxy_loops",
            "Repetition loops by channel and source (proxy, engine, runaway)",
            ["model", "channel", "source"],
            registry=registry,
        )
        self.policy_actions = Counter(
            "detproxy_policy_actions",
            "Policy decisions on loops, by action and outcome",
            ["model", "action", "outcome"],
            registry=registry,
        )
        speed_labels = ["model", "inflight"]
        self._ttft = self._histogram(
            "detproxy_time_to_first_token_seconds",
            "Time to the first streamed token, by detproxy's in-flight requests at arrival",
            speed_labels,
            FIRST_BYTE_BUCKETS,
        )
        self._itl = self._histogram(
            "detproxy_inter_token_latency_seconds",
            "Mean time between streamed tokens of a request, by in-flight requests",
            speed_labels,
            ITL_BUCKETS,
        )
        self._tokens_per_s = self._histogram(
            "detproxy_output_tokens_per_second",
            "Decode rate of a streamed request (tokens/s), by in-flight requests",
            speed_labels,
            RATE_BUCKETS,
        )
        # Every worker (--workers N) reads the upstream and counts what it reads: summed over
        # the workers, one change would count N times. Under --workers these two are gauges
        # of mode "max" (dead workers' files included, so they never go down): the count of
        # the worker that saw the most, which increase() reads as it reads a counter.
        self.upstream_changes = self._upstream_count(
            "detproxy_upstream_changes",
            "Changes of the upstream's fingerprint between two readings that said what it runs"
            " (redeploys); never an outage or a restart",
        )
        self.upstream_restarts = self._upstream_count(
            "detproxy_upstream_restarts",
            "The same upstream identity back after an outage or with a new process start time",
        )
        self.upstream = _UpstreamCollector()
        registry.register(self.upstream)
        self._own.append(self.upstream)  # every worker reads the same upstream
        self.shadow_dropped = Counter(
            "detproxy_shadow_dropped",
            "Shadow replays not made or not answered, by reason",
            ["reason"],
            registry=registry,
        )
        self.divergence_causes = Counter(
            "detproxy_divergence_causes",
            "Divergent audits by the cause triage attributed them to (intrinsic | batch |"
            " prefix_cache | speculative | recipe_change | unknown)",
            ["model", "cause"],
            registry=registry,
        )
        self.divergence_causes_revised = Counter(
            "detproxy_divergence_causes_revised",
            "Causes replaced when an incident was triaged again (an unknown for the budget,"
            " once it freed): detproxy_divergence_causes_total less this, per cause, is the"
            " incidents' causes now",
            ["model", "cause"],
            registry=registry,
        )
        self.triage_dropped = Counter(
            "detproxy_triage_dropped",
            "Divergent audits whose triage experiments were not run, by reason (queue_full |"
            " rate_limit | token_budget | quiet_deadline | other_worker | error | shutdown)",
            ["reason"],
            registry=registry,
        )
        self.shadow_queue = Gauge(
            "detproxy_shadow_queue_depth",
            "Shadow replays waiting",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.shadow_inflight = Gauge(
            "detproxy_shadow_inflight",
            "Shadow replays in flight",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.injection_failures = Counter(
            "detproxy_injection_failures",
            "Requests detproxy altered (kind: logprobs | repetition_detection) that the upstream"
            " refused where the client's own request succeeded (shadows included: a replay"
            " refused where its primary was answered)",
            ["model", "endpoint", "kind", "status"],
            registry=registry,
        )
        self.injection_suspended = Gauge(
            "detproxy_injection_suspended",
            "1 while adding kind to model's requests is suspended after repeated failures",
            ["model", "kind"],
            registry=registry,
            multiprocess_mode="livemax",
        )
        self.recovery_budget = Gauge(
            "detproxy_recovery_budget_tokens",
            "Per model over the budget's window: tokens loop recoveries generated or hold"
            " reserved (kind=spent), and what the window allows (kind=allowed)",
            ["model", "kind"],
            registry=registry,
            # One account every worker reports whole where it is shared; else each its own.
            multiprocess_mode="livemax" if budget_shared else "livesum",
        )
        self.recoveries = Counter(
            "detproxy_recoveries",
            "Loop retries by how they recovered (strategy: restart | continue |"
            " close_reasoning) and how that ended (recovered: stop or a tool call with content"
            " and no loop at its end; looped_again, length, empty, unfinished, error)",
            ["model", "strategy", "outcome"],
            registry=registry,
        )
        self.recovery_tokens = Counter(
            "detproxy_recovery_tokens",
            "Tokens of loop recoveries: generated (extra work for the engine) and, when"
            " continuing, kept (generated before the loop, not generated again)",
            ["model", "strategy", "kind"],
            registry=registry,
        )
        self.shared_store_errors = Counter(
            "detproxy_shared_store_errors",
            "Syncs with a store the replicas share (Redis) that failed, by store"
            " (recovery_budget) and reason; the replica decides alone meanwhile",
            ["store", "reason"],
            registry=registry,
        )
        self.fallbacks = Counter(
            "detproxy_fallbacks",
            "Client requests sent again as the client sent them after an altered one failed,"
            " by outcome (recovered | same_error)",
            ["model", "endpoint", "outcome"],
            registry=registry,
        )
        self.engine_mismatch = Gauge(
            "detproxy_engine_expectation_mismatch",
            "1 while a field declared in [upstream.expect] is not what the engine says it"
            " loaded (0 once it is; only declared fields)",
            ["field"],
            registry=registry,
            multiprocess_mode="livemax",
        )

        self._audit_series: set[tuple[str, str]] = set()  # (model, mode) with every verdict

    def _upstream_count(self, name: str, text: str) -> _Counts:
        if self.multiprocess:
            return Gauge(name + "_total", text, registry=self.registry, multiprocess_mode="max")
        return Counter(name, text, registry=self.registry)

    def _counter(self, name: str, text: str, labels: list[str]) -> Callable[..., _Counts]:
        """A family every request updates: lock-free cells in one process (``proxy.observe.hot``),
        prometheus_client's file-backed metric under ``--workers``."""
        if self.multiprocess:
            return _Children(Counter(name, text, labels, registry=self.registry))
        family = CounterFamily(name, text, labels)
        self.registry.register(family)
        return family

    def _histogram(
        self, name: str, text: str, labels: list[str], buckets: tuple[float, ...]
    ) -> Callable[..., _Observes]:
        if self.multiprocess:
            metric = Histogram(name, text, labels, buckets=buckets, registry=self.registry)
            return _Children(metric)
        family = HistogramFamily(name, text, labels, buckets)
        self.registry.register(family)
        return family

    def watch_failures(self, sources: dict[str, Callable[[], dict[str, int]]]) -> None:
        collector = _FailureCollector(sources)
        self.registry.register(collector)
        self._own.append(collector)  # the answering worker's own

    def subscribe(self, bus: EventBus) -> None:
        bus.subscribe(RequestStarted, self._started)
        bus.subscribe(EngineFactsRead, self._engine_facts)
        bus.subscribe(RequestClassified, self._classified)
        bus.subscribe(RequestFinished, self._finished)
        bus.subscribe(UpstreamFailed, self._upstream_failed)
        bus.subscribe(InspectionStopped, self._inspection_stopped)
        bus.subscribe(ClientDisconnected, self._disconnected)
        bus.subscribe(AuditCompleted, self._audited)
        bus.subscribe(ShadowDropped, self._shadow_dropped)
        bus.subscribe(ShadowQueue, self._shadow_queue)
        bus.subscribe(CauseAttributed, self._cause)
        bus.subscribe(TriageDropped, self._triage_dropped)
        bus.subscribe(LoopDetected, self._loop)
        bus.subscribe(PolicyActed, self._policy)
        bus.subscribe(UpstreamFingerprinted, self._fingerprinted)
        bus.subscribe(UpstreamUnreachable, self._upstream_down)
        bus.subscribe(UpstreamRestarted, self._upstream_restarted)
        bus.subscribe(StreamTimed, self._timed)
        bus.subscribe(InjectionFailed, self._injection_failed)
        bus.subscribe(InjectionSuspended, self._injection_suspended)
        bus.subscribe(FallbackSent, self._fallback)
        bus.subscribe(RecoveryBudgetUsed, self._recovery_budget)
        bus.subscribe(RecoveryTokens, self._recovery_tokens)
        bus.subscribe(SharedStoreFailed, self._shared_store_failed)
        if self.multiprocess:
            bus.subscribe(RequestStarted, self._inflight_file_up)
            bus.subscribe(RequestFinished, self._inflight_file_down)

    def _inflight_file_up(self, ev: RequestStarted) -> None:
        self.inflight.inc()

    def _inflight_file_down(self, ev: RequestFinished) -> None:
        self.inflight.dec()

    def _shared_store_failed(self, ev: SharedStoreFailed) -> None:
        self.shared_store_errors.labels(ev.store, ev.reason).inc()

    def _recovery_tokens(self, ev: RecoveryTokens) -> None:
        model = self.model(ev.model)
        self.recovery_tokens.labels(model, ev.strategy, "generated").inc(ev.generated)
        self.recovery_tokens.labels(model, ev.strategy, "kept").inc(ev.kept)

    def _recovery_budget(self, ev: RecoveryBudgetUsed) -> None:
        model = self.model(ev.model)
        self.recovery_budget.labels(model, "spent").set(ev.spent)
        self.recovery_budget.labels(model, "allowed").set(ev.allowed)

    def _injection_failed(self, ev: InjectionFailed) -> None:
        self.injection_failures.labels(
            self.model(ev.model), ev.endpoint, ev.kind, str(ev.status)
        ).inc()

    def _injection_suspended(self, ev: InjectionSuspended) -> None:
        self.injection_suspended.labels(self.model(ev.model), ev.kind).set(int(ev.suspended))

    def _fallback(self, ev: FallbackSent) -> None:
        self.fallbacks.labels(self.model(ev.model), ev.endpoint, ev.outcome).inc()

    def _timed(self, ev: StreamTimed) -> None:
        labels = (self.model(ev.model), inflight_bucket(ev.inflight))
        self._ttft(*labels).observe(ev.ttft_s)
        if ev.inter_token_s is not None:
            self._itl(*labels).observe(ev.inter_token_s)
        if ev.tokens_per_s is not None:
            self._tokens_per_s(*labels).observe(ev.tokens_per_s)

    def _fingerprinted(self, ev: UpstreamFingerprinted) -> None:
        self.upstream.current = ev.fingerprint
        self.upstream.up = True
        if ev.changed:
            self.upstream_changes.inc()

    def _engine_facts(self, ev: EngineFactsRead) -> None:
        wrong = {str(m.field) for m in ev.mismatches}
        for name in ev.declared:
            self.engine_mismatch.labels(name).set(1 if name in wrong else 0)

    def _upstream_down(self, ev: UpstreamUnreachable) -> None:
        self.upstream.up = False

    def _upstream_restarted(self, ev: UpstreamRestarted) -> None:
        self.upstream_restarts.inc()

    def _loop(self, ev: LoopDetected) -> None:
        self.loops.labels(self.model(ev.model), ev.trigger.channel, ev.trigger.source).inc()

    def _policy(self, ev: PolicyActed) -> None:
        model = self.model(ev.model)
        self.policy_actions.labels(model, ev.action, ev.outcome).inc()
        if ev.action == "retry":
            self.recoveries.labels(model, ev.strategy, ev.outcome).inc()

    def _audited(self, ev: AuditCompleted) -> None:
        model = self.model(ev.model)
        verdict = ev.verdict
        if (model, ev.mode) not in self._audit_series:
            # Every verdict's series starts at 0 together: rate() misses what a series counted
            # before its first scrape, so series born at different times bias the ratios.
            self._audit_series.add((model, ev.mode))
            for name in VERDICTS:
                self.audits.labels(model, ev.mode, name)
        self.audits.labels(model, ev.mode, verdict.verdict).inc()
        if verdict.verdict in ("text_divergence", "answer_divergence") and verdict.divergence:
            self.divergence_position.labels(model, ev.mode).observe(verdict.divergence.index)
        delta = verdict.max_abs_logprob_delta
        if verdict.verdict not in ("identical", "incomparable") and delta is not None:
            self.logprob_delta.labels(model, ev.mode).observe(delta)

    def _shadow_dropped(self, ev: ShadowDropped) -> None:
        self.shadow_dropped.labels(ev.reason).inc()

    def _cause(self, ev: CauseAttributed) -> None:
        self.divergence_causes.labels(ev.model, ev.cause).inc()
        if ev.revises is not None:
            self.divergence_causes_revised.labels(ev.model, ev.revises).inc()

    def _triage_dropped(self, ev: TriageDropped) -> None:
        self.triage_dropped.labels(ev.reason).inc()

    def _shadow_queue(self, ev: ShadowQueue) -> None:
        self.shadow_queue.set(ev.queued)
        self.shadow_inflight.set(ev.running)

    def _started(self, ev: RequestStarted) -> None:
        self._inflight += 1

    def _classified(self, ev: RequestClassified) -> None:
        stream = "true" if ev.stream else "false"
        self._requests(
            self.model(ev.model), ev.endpoint, stream, "true" if ev.deterministic else "false"
        ).inc()

    def _finished(self, ev: RequestFinished) -> None:
        self._inflight -= 1
        stream = "true" if ev.stream else "false"
        self._responses(ev.endpoint, ev.status, ev.outcome).inc()
        self._duration(ev.endpoint, stream).observe(ev.duration_s)
        if ev.first_byte_s is not None:
            self._first_byte(ev.endpoint, stream).observe(ev.first_byte_s)

    def _upstream_failed(self, ev: UpstreamFailed) -> None:
        self.upstream_errors.labels(ev.endpoint, ev.kind, ev.stage).inc()

    def _inspection_stopped(self, ev: InspectionStopped) -> None:
        self.inspection_stopped.labels(ev.endpoint, ev.reason).inc()

    def _disconnected(self, ev: ClientDisconnected) -> None:
        self.disconnects.labels(ev.endpoint, "true" if ev.stream else "false").inc()

    def exposition(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
        for collector in [*self._own, _SupervisorCollector()]:
            registry.register(collector)
        return generate_latest(registry)

    async def handle(self, request: AdminRequest) -> Reply:
        return Reply(200, self.exposition(), CONTENT_TYPE_LATEST)
