"""Prometheus text exposition, read for the few samples detproxy wants from an upstream.

An upstream's ``/metrics`` holds hundreds of lines (vLLM's histograms alone), of which
detproxy wants a handful of series: a line is looked at only when it starts with one of the
names asked for, so a whole text costs about one ``startswith`` a line
(``tests/bench/bench_promtext.py`` measures it against ``prometheus_client``'s parser).

A sample line is ``name[{labels}] value [timestamp]``; label values may hold spaces and
braces, so the value is read after the last ``}``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

__all__ = ["samples", "sum_samples"]


def _sample(line: str) -> tuple[str, float] | None:
    brace = line.find("{")
    if brace >= 0:
        name = line[:brace].rstrip()
        fields = line[line.rfind("}") + 1 :].split(None, 1)
    else:
        name, *fields = line.split(None, 2)
    if not fields:
        return None
    try:
        return name, float(fields[0])
    except ValueError:
        return None


def samples(text: str, prefixes: tuple[str, ...]) -> Iterator[tuple[str, float]]:
    """``(name, value)`` of each sample whose metric name starts with one of ``prefixes``
    (a whole name is a prefix of itself and of longer names: callers compare names)."""
    for line in text.splitlines():
        if line.startswith(prefixes):
            sample = _sample(line)
            if sample is not None:
                yield sample


def sum_samples(text: str, names: Iterable[str]) -> dict[str, float]:
    """Each of ``names`` that has samples in ``text``, with their sum over its label sets."""
    wanted = frozenset(names)
    totals: dict[str, float] = {}
    for name, value in samples(text, tuple(wanted)):
        if name in wanted:
            totals[name] = totals.get(name, 0.0) + value
    return totals
