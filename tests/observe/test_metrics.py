"""Metrics fed by events: the per-request figures, through the cached label children."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from proxy.audit.verdict import VERDICTS, Verdict
from proxy.events import (
    AuditCompleted,
    EventBus,
    RequestClassified,
    RequestFinished,
    RequestStarted,
    StreamTimed,
)
from proxy.observe.metrics import Metrics
from tests.helpers import metric


def finished(status: int = 200, model: str = "m", stream: bool = False) -> RequestFinished:
    return RequestFinished("chat", model, stream, True, status, "ok", 0.002, 0.001)


def test_requests_responses_and_durations_by_label() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    requests = "detproxy_requests_total"
    labels = {"endpoint": "chat", "deterministic": "true"}
    for ev in (finished(), finished(), finished(502), finished(model="n", stream=True)):
        bus.publish(RequestClassified(ev.endpoint, ev.model, ev.stream, ev.deterministic))
    # Counted as they start: before any of them has finished.
    assert metric(registry, requests, model="m", stream="false", **labels) == 3
    assert metric(registry, requests, model="n", stream="true", **labels) == 1
    for ev in (finished(), finished(), finished(502), finished(model="n", stream=True)):
        bus.publish(ev)
    assert metric(registry, requests, model="m", stream="false", **labels) == 3  # not again
    assert metric(registry, requests, model="n", stream="true", **labels) == 1
    responses = "detproxy_responses_total"
    assert metric(registry, responses, endpoint="chat", code="200", outcome="ok") == 3
    assert metric(registry, responses, endpoint="chat", code="502", outcome="ok") == 1
    duration = "detproxy_request_duration_seconds_count"
    assert metric(registry, duration, endpoint="chat", stream="false") == 3
    assert (
        metric(registry, "detproxy_time_to_first_byte_seconds_sum", endpoint="chat", stream="true")
        == 0.001
    )


def test_inflight_follows_starts_and_finishes() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    for _ in range(3):
        bus.publish(RequestStarted("chat"))
    bus.publish(finished())
    assert metric(registry, "detproxy_inflight_requests") == 2
    assert b"\ndetproxy_inflight_requests 2.0\n" in generate_latest(registry)


def test_stream_speed_by_model_and_concurrency() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    for inflight in (1, 1, 3):
        bus.publish(StreamTimed("chat", "m", inflight, 0.1, 0.01, 10, 100.0))
    bus.publish(StreamTimed("chat", "m", 1, 0.1, None, 1, None))
    ttft = "detproxy_time_to_first_token_seconds_count"
    assert metric(registry, ttft, model="m", inflight="1") == 3
    assert metric(registry, ttft, model="m", inflight="3-4") == 1
    itl = "detproxy_inter_token_latency_seconds_count"
    assert metric(registry, itl, model="m", inflight="1") == 2


def test_every_verdict_series_of_a_model_and_mode_starts_together_at_zero() -> None:
    registry = CollectorRegistry()
    bus = EventBus()
    Metrics(registry).subscribe(bus)
    verdict = Verdict("identical", None, None, None, "h", "h", 3, 3)
    bus.publish(
        AuditCompleted("r1", "m", "chat", "full", 0, verdict, "k", 1, 0, 0.1, 0.1, "same", 0.0)
    )
    text = generate_latest(registry).decode()
    for name in VERDICTS:
        line = f'detproxy_audits_total{{mode="full",model="m",verdict="{name}"}}'
        assert f"{line} {'1.0' if name == 'identical' else '0.0'}" in text, name
    assert 'mode="prefill"' not in text  # only the mode that was seen


def test_a_shared_recovery_budget_is_the_max_across_workers_not_the_sum() -> None:
    # Every worker reports the fleet's account when Redis shares it (--workers N aggregates
    # gauges by their multiprocess mode); its own part of the budget otherwise.
    own = Metrics(CollectorRegistry()).recovery_budget
    shared = Metrics(CollectorRegistry(), budget_shared=True).recovery_budget
    assert own._multiprocess_mode == "livesum"
    assert shared._multiprocess_mode == "livemax"
