"""Counters and histograms for the per-request path: plain numbers, no lock, read at a scrape.

prometheus_client's metrics take a lock on every ``inc`` and ``observe`` and walk their
buckets in interpreted Python: the three lifecycle events of a request cost 8.6 us there.
detproxy publishes events on its event loop's one thread and answers scrapes on it too, so a
cell here is two plain attributes. A scrape renders the cells sample for sample as
prometheus_client renders its own ``Counter`` and ``Histogram``: ``_total`` and ``_created``;
``_bucket``, ``_count``, ``_sum`` and ``_created``.

One process only: under ``--workers``, prometheus_client's multiprocess mode keeps the values
in files the workers share, and ``Metrics`` uses its metrics there.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString


def _created_series() -> bool:
    """prometheus_client's own switch for the ``_created`` samples, read the same way."""
    off = os.environ.get("PROMETHEUS_DISABLE_CREATED_SERIES", "False")
    return off.lower() not in ("true", "1", "t")


class CounterCell:
    """One labelled child of a counter."""

    __slots__ = ("created", "value")

    def __init__(self) -> None:
        self.value = 0.0
        self.created = time.time()

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError("Counters can only be incremented by non-negative amounts.")
        self.value += amount


class HistogramCell:
    """One labelled child of a histogram: a count per bucket (not cumulative) and the sum."""

    __slots__ = ("_bounds", "counts", "created", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self._bounds = bounds
        self.counts = [0] * len(bounds)
        self.sum = 0.0
        self.created = time.time()

    def observe(self, amount: float) -> None:
        self.sum += amount
        counts = self.counts
        # prometheus_client's rule: the first bucket whose bound is >= amount (NaN: none).
        for i, bound in enumerate(self._bounds):
            if amount <= bound:
                counts[i] += 1
                break


C = TypeVar("C", CounterCell, HistogramCell)


class _Family(Generic[C]):
    """A labelled metric's cells, by the label values as passed and as strings."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        new_cell: Callable[[], C],
    ) -> None:
        self.name = name
        self._documentation = documentation
        self._labelnames = tuple(labelnames)
        self._new_cell: Callable[[], C] = new_cell
        # As passed: the hot lookup, no conversion. As strings: one series per label set,
        # however the values were passed (200 and "200" are one series, as with ``labels``).
        # Values equal in Python (1 and True) share a cell: a label takes one type per caller.
        self._by_values: dict[tuple[Hashable, ...], C] = {}
        self._by_labels: dict[tuple[str, ...], C] = {}

    def __call__(self, *values: Hashable) -> C:
        cell = self._by_values.get(values)
        if cell is None:
            if len(values) != len(self._labelnames):
                raise ValueError(f"{self.name} takes {self._labelnames}, got {values!r}")
            labels = tuple(str(value) for value in values)
            cell = self._by_labels.get(labels)
            if cell is None:
                cell = self._by_labels[labels] = self._new_cell()
            self._by_values[values] = cell
        return cell

    def _metric(self, kind: str) -> Metric:
        return Metric(self.name, self._documentation, kind)

    def _series(self) -> Iterable[tuple[dict[str, str], C]]:
        for labels, cell in self._by_labels.items():
            yield dict(zip(self._labelnames, labels, strict=True)), cell


class CounterFamily(_Family[CounterCell]):
    """A labelled counter (``name`` without ``_total``, as prometheus_client's ``Counter``)."""

    def __init__(self, name: str, documentation: str, labelnames: Sequence[str]) -> None:
        super().__init__(name, documentation, labelnames, CounterCell)

    def describe(self) -> Iterable[Metric]:
        return [self._metric("counter")]

    def collect(self) -> Iterable[Metric]:
        metric = self._metric("counter")
        created = _created_series()
        for names, cell in self._series():
            metric.add_sample(self.name + "_total", names, cell.value)
            if created:
                metric.add_sample(self.name + "_created", names, cell.created)
        return [metric]


class HistogramFamily(_Family[HistogramCell]):
    """A labelled histogram with fixed buckets (``+Inf`` added, as prometheus_client does)."""

    def __init__(
        self,
        name: str,
        documentation: str,
        labelnames: Sequence[str],
        buckets: Sequence[float],
    ) -> None:
        bounds = [float(b) for b in buckets]
        if bounds != sorted(bounds):
            raise ValueError(f"{name}: buckets not in order")
        if not bounds or bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = tuple(bounds)
        self._le = tuple(floatToGoString(b) for b in bounds)  # type: ignore[no-untyped-call]
        super().__init__(name, documentation, labelnames, self._cell)

    def _cell(self) -> HistogramCell:
        return HistogramCell(self._bounds)

    def describe(self) -> Iterable[Metric]:
        return [self._metric("histogram")]

    def collect(self) -> Iterable[Metric]:
        metric = self._metric("histogram")
        created = _created_series()
        name = self.name
        for names, cell in self._series():
            total = 0.0
            for le, count in zip(self._le, cell.counts, strict=True):
                total += count
                metric.add_sample(name + "_bucket", {**names, "le": le}, total)
            metric.add_sample(name + "_count", names, total)
            if self._bounds[0] >= 0:  # as prometheus_client: no sum when buckets go negative
                metric.add_sample(name + "_sum", names, cell.sum)
            if created:
                metric.add_sample(name + "_created", names, cell.created)
        return [metric]
