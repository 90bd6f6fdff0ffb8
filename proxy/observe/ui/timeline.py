"""Verdict counts over time and the upstream's fingerprint on the same axis (pure functions).

Counts come as points (a time, a model, a verdict, a count): from the live history's buckets,
from the differences of successive tally lines of one process, or, where no tally says how
many audits were identical, from the incidents themselves (no rate then).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from proxy.audit.verdict import VERDICTS
from proxy.tools.report.load import Tally

COLUMNS = 48


@dataclass(frozen=True, slots=True)
class Point:
    ts: float
    model: str
    verdict: str
    count: int


@dataclass(frozen=True, slots=True)
class Column:
    start: float
    end: float
    counts: tuple[tuple[str, int], ...]  # (verdict, count), in ladder order, zeros left out

    def count(self, verdict: str) -> int:
        return sum(n for v, n in self.counts if v == verdict)

    @property
    def total(self) -> int:
        return sum(n for _, n in self.counts)

    @property
    def comparable(self) -> int:
        return self.total - self.count("incomparable")

    @property
    def unstable(self) -> int:
        return self.comparable - self.count("identical")

    @property
    def rate(self) -> float | None:
        """Non-identical share of the comparable audits (meaningful with denominators)."""
        return self.unstable / self.comparable if self.comparable else None


def _order(verdict: str) -> tuple[int, str]:
    return (VERDICTS.index(verdict) if verdict in VERDICTS else len(VERDICTS), verdict)


def columns(
    points: Iterable[Point], start: float, end: float, n: int = COLUMNS
) -> tuple[Column, ...]:
    """``n`` equal columns over ``[start, end]``; points outside are left out."""
    width = (end - start) / n if end > start else 1.0
    sums: list[Counter[str]] = [Counter() for _ in range(n)]
    for p in points:
        if p.ts < start or p.ts > end or p.count <= 0:
            continue
        sums[min(n - 1, int((p.ts - start) / width))][p.verdict] += p.count
    return tuple(
        Column(
            start + i * width,
            start + (i + 1) * width,
            tuple((v, c[v]) for v in sorted(c, key=_order)),
        )
        for i, c in enumerate(sums)
    )


def points_from_tallies(tallies: Iterable[Tally]) -> list[Point]:
    """What each process counted between its successive tally lines, at the later line's time
    (a process's first line: what it counted since it started)."""
    by_process: dict[str, list[Tally]] = defaultdict(list)
    for t in tallies:
        by_process[t.process].append(t)
    out: list[Point] = []
    for lines in by_process.values():
        lines.sort(key=lambda t: (t.ts, t.weight))
        previous: dict[tuple[str, str, str], int] = {}
        for t in lines:
            step: Counter[tuple[str, str]] = Counter()
            for key, n in t.audits.items():
                step[(key[0], key[2])] += max(0, n - previous.get(key, 0))
            previous = dict(t.audits)
            out += [Point(t.ts, m, v, n) for (m, v), n in step.items() if n > 0]
    return out


@dataclass(frozen=True, slots=True)
class Observation:
    ts: float
    fingerprint: str
    kind: str | None
    version: str | None


@dataclass(frozen=True, slots=True)
class Span:
    """The upstream showed one fingerprint from ``first`` to ``last`` (as far as seen)."""

    fingerprint: str
    kind: str | None
    version: str | None
    first: float
    last: float


def spans(observations: Sequence[Observation]) -> tuple[Span, ...]:
    """Successive observations of the same fingerprint merged, in time order."""
    out: list[Span] = []
    for ob in sorted(observations, key=lambda o: o.ts):
        if out and out[-1].fingerprint == ob.fingerprint:
            last = out[-1]
            out[-1] = Span(last.fingerprint, last.kind, last.version, last.first, ob.ts)
        else:
            out.append(Span(ob.fingerprint, ob.kind, ob.version, ob.ts, ob.ts))
    return tuple(out)
