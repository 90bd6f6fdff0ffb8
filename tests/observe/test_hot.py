"""The lock-free families render what prometheus_client's own Counter and Histogram render."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from proxy.observe.hot import CounterFamily, HistogramFamily

BUCKETS = (0.005, 0.01, 0.1, 1, 10)


@pytest.fixture(autouse=True)
def one_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both libraries stamp ``_created`` with ``time.time()``: one value makes them comparable."""
    monkeypatch.setattr(time, "time", lambda: 1_765_000_000.25)


def test_a_counter_renders_as_prometheus_clients() -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Counter("x_requests", "Requests", ["endpoint", "code"], registry=theirs)
    family = CounterFamily("x_requests", "Requests", ["endpoint", "code"])
    ours.register(family)
    for endpoint, code, amount in [("chat", 200, 1), ("chat", 502, 1), ("chat", 200, 2.5)]:
        reference.labels(endpoint, code).inc(amount)
        family(endpoint, code).inc(amount)
    assert generate_latest(ours) == generate_latest(theirs)
    assert ours.get_sample_value("x_requests_total", {"endpoint": "chat", "code": "200"}) == 3.5


def test_a_value_and_its_string_are_one_series() -> None:
    registry = CollectorRegistry()
    family = CounterFamily("x_responses", "Responses", ["code"])
    registry.register(family)
    family(200).inc()
    family("200").inc()
    text = generate_latest(registry).decode()
    assert text.count('x_responses_total{code="200"}') == 1
    assert registry.get_sample_value("x_responses_total", {"code": "200"}) == 2


@pytest.mark.parametrize(
    "values",
    [
        [0.001, 0.005, 0.0051, 0.01, 0.5, 1.0, 3, 10, 11, 1e9],  # on, between, past the bounds
        [math.inf, 0.0, -1.0],
        [math.nan, 0.2],  # prometheus_client counts NaN in no bucket; its sum becomes NaN
    ],
)
def test_a_histogram_renders_as_prometheus_clients(values: list[float]) -> None:
    theirs, ours = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("x_seconds", "Time", ["stream"], buckets=BUCKETS, registry=theirs)
    family = HistogramFamily("x_seconds", "Time", ["stream"], BUCKETS)
    ours.register(family)
    for at, value in enumerate(values):
        stream = "true" if at % 3 == 0 else "false"
        reference.labels(stream).observe(value)
        family(stream).observe(value)
    assert generate_latest(ours) == generate_latest(theirs)


def test_created_samples_follow_prometheus_clients_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    registry = CollectorRegistry()
    counter = CounterFamily("x_requests", "Requests", ["endpoint"])
    histogram = HistogramFamily("x_seconds", "Time", ["endpoint"], BUCKETS)
    registry.register(counter)
    registry.register(histogram)
    counter("chat").inc()
    histogram("chat").observe(0.2)
    assert b"_created" in generate_latest(registry)
    monkeypatch.setenv("PROMETHEUS_DISABLE_CREATED_SERIES", "true")
    text = generate_latest(registry)
    assert b"_created" not in text
    assert b'x_requests_total{endpoint="chat"} 1.0' in text


def test_a_negative_increment_is_refused_as_prometheus_client_refuses_it() -> None:
    cell = CounterFamily("x_requests", "Requests", ["endpoint"])("chat")
    with pytest.raises(ValueError, match="non-negative"):
        cell.inc(-1)
    assert cell.value == 0


def test_the_wrong_number_of_label_values_is_refused() -> None:
    family = HistogramFamily("x_seconds", "Time", ["endpoint", "stream"], BUCKETS)
    with pytest.raises(ValueError, match="x_seconds"):
        family("chat")
    with pytest.raises(ValueError, match="x_seconds"):
        family("chat", "true", "extra")


def test_buckets_out_of_order_are_refused() -> None:
    with pytest.raises(ValueError, match="order"):
        HistogramFamily("x_seconds", "Time", ["endpoint"], (1, 0.5))


def test_a_registry_refuses_a_second_family_of_the_same_name() -> None:
    registry = CollectorRegistry()
    registry.register(CounterFamily("x_requests", "Requests", ["endpoint"]))
    with pytest.raises(ValueError, match="Duplicated"):
        registry.register(Counter("x_requests", "Requests again", ["endpoint"], registry=None))
