"""Metric readers: samples of an in-process registry, or of a Prometheus text page."""

from __future__ import annotations

import urllib.request

from prometheus_client import CollectorRegistry


def metric(registry: CollectorRegistry, sample: str, **labels: str) -> float:
    """One sample of an in-process registry; 0 where it was never set."""
    return registry.get_sample_value(sample, labels) or 0.0


def metric_total(registry: CollectorRegistry, sample: str) -> float:
    """One sample of an in-process registry summed over all its label sets."""
    return sum(s.value for family in registry.collect() for s in family.samples if s.name == sample)


def metric_samples(text: str, prefix: str | tuple[str, ...] = "") -> dict[str, float]:
    """The samples of a Prometheus text page whose names start with ``prefix``, keyed by
    ``name{labels}`` as written."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and line.startswith(prefix):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def scrape(url: str, prefix: str | tuple[str, ...] = "") -> dict[str, float]:
    """``metric_samples`` of the page at ``url`` (a blocking GET, for the integration tests)."""
    with urllib.request.urlopen(url) as resp:
        return metric_samples(resp.read().decode(), prefix)
