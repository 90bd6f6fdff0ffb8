r"""Online repetition-loop detector for streamed text (one per choice and channel).

``LoopDetector.feed(delta)`` is called with each text delta of one channel (``reasoning`` or
``content``) as it streams. It looks for a unit of text repeated back-to-back at the *tail* of
the stream (the stream may stop mid-unit) and returns a ``LoopReport`` the first time one is
long enough, then ``None`` for ever. It is pure: no I/O, no clock, no asyncio, no shared state.

How it works
------------
Deltas are appended to a list; at every multiple of ``check_every_chars`` in *stream offset*
(exact multiples, whatever the delta boundaries: any split of a text gives the same report) the
tail window is checked:

1. the last 64 chars (the anchor) are searched backwards in the window with ``str.rfind``; each
   earlier occurrence at distance ``d <= max_period`` is a candidate period, nearest first;
2. a candidate is dropped cheaply (C-level ``startswith``, no copy) unless the last 128 chars
   also recur at distance ``d`` and the anchor at ``2d`` (both must, for a run that qualifies);
3. a survivor gets its back-to-back run measured exactly (``buf[i] == buf[i + d]`` for every
   ``i`` in the run; exponential then binary search over slice comparisons, or only the new
   chars when the previous check measured the same candidate). It fires when ``d`` is the
   primitive unit (``"abcdabcd"`` reports 4, never 8) and the run covers
   ``DetectorConfig.required_chars(d)``. Otherwise every candidate inside the run is skipped (it
   would reduce to the same unit and run), and the search continues with a longer needle (the
   run plus the char that ended it), so an earlier copy of a long run of ``"~"`` or ``"- "``
   does not yield one candidate per char.

The smallest qualifying period wins; a brute-force oracle checks this in the tests.

Probes
------
Most text has no candidate at any check, and most checks need not search to know it. A run that
fires at check ``e`` with period ``d`` covers at least ``need(d) >= max(min_covered_chars,
reps * d)`` chars (``reps`` the smaller of the two repeat counts), so it reaches at least
``kept = min_covered_chars - ceil(min_covered_chars / reps)`` chars before its last unit (192
with the defaults): the anchor of every check up to ``kept - 64`` chars before ``e`` lies in the
run and recurs at distance ``d`` too. So outside an exact stretch the anchor is searched for only
at every ``stride``-th check (``(kept - 64) // check_every_chars + 1``: 5 with the defaults),
back as far as any check it vouches for could look; where it occurs, the ``stride - 1`` checks
after it are done exactly, as above. A check that fires is always done exactly, with the same
window and the same report; ordinary text costs a fifth of the searches.

Per streamed token the cost is a list append, plus a probe every ``stride * check_every_chars``
chars whose work is about ``max_period`` chars of ``rfind`` (see ``tests/bench/bench_loops.py``).
Memory is bounded: the window never exceeds ``window_chars`` and the pending deltas stay under
``stride * check_every_chars`` plus the last delta. After firing, the buffers are dropped.

Thresholds (the defaults, and the cases that drove them)
--------------------------------------------------------
A run of a unit of period ``p`` fires when it covers ``required_chars(p)`` chars::

    required = max(min_covered_chars, p * reps)   reps = min_short_repeats if p < short_period
                                                         else min_repeats

``min_covered_chars=256`` is what makes short units stricter: a 4-char unit must repeat 64
times, an 8-char one 32 times, a 14-char one (SmolLM2's shortest loops) 19 times, a 64-char one
4 times. Legit short repetition stays well below 256 chars of exact repetition: ``No. No. No.``,
``very, very, very``, ``0x00, `` x 32, an 8-row zero matrix ``[0, 0, ...],`` (240 chars), a
chorus line sung three times (240 chars), a quote given twice (corpus
``short_repetition.md``). ``min_repeats=4`` for long units: the ~180-char thinking paragraph
fires after 720 chars (4 of its 22 copies, ~180 tokens); a 400-char SmolLM2 loop after 1600
chars, which still fits in the ~2000 chars a 512-token budget allows. Three back-to-back copies
of a long paragraph would almost always be a loop too; four leaves a margin for quoted or
templated text. ``min_short_repeats=16`` below ``short_period=16`` is a floor that binds only
when an operator lowers ``min_covered_chars``.

Trivial units, shorter than ``min_period`` (``"-"``, ``"\n"``, ``"ha "``) or without any letter
or digit (``"| --- "``, ``"---|"``, ``"= "``), need ``min_trivial_covered_chars=1024`` chars:
``=====`` underlines and ``-----`` rules (80-300 chars), table separator rows, ``ha ha ha``,
ellipses, indentation and blank lines stay below it, while a model that emits a kilobyte of one
punctuation or whitespace unit is stuck. ``None`` turns trivial units off.

Digits are not normalised: ``1. foo\n2. foo\n`` is not periodic (the units differ), so the
corpus's numbered list (120 items identical but for the number), counting to 2000, table and
JSON records with ids, and log lines with timestamps never match.

``max_period=4096`` with ``min_repeats=4`` needs 16,384 chars of look-back; ``window_chars``
(17,408: 17 KiB per channel for ASCII) is the bound on what is kept. ``check_every_chars=32``
(about 8 tokens) bounds the extra lag: a loop starting at offset ``o`` is reported by the first
check after its run covers ``required_chars(p)``, at an offset below
``o + required_chars(p) + check_every_chars`` (its reported start may be up to one unit before
``o`` when the text before the loop happens to end like the unit).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

from proxy.config import DETECTOR_ANCHOR_CHARS, DetectorConfig

__all__ = ["DetectorConfig", "LoopDetector", "LoopReport"]

# Final: the compiled module reads them as constants, not from its globals at each use.
_ANCHOR: Final = DETECTOR_ANCHOR_CHARS
# Length of the tail probe used to reject a candidate before measuring its run.
_PROBE: Final = 128
_PREVIEW: Final = 120
# A letter or a digit (any script): a unit without one is "trivial".
_ALNUM = re.compile(r"[^\W_]")


@dataclass(frozen=True, slots=True)
class LoopReport:
    """One detected loop.

    ``start_offset + covered_chars`` is the stream offset of the check that found it (a multiple
    of ``check_every_chars``); every field but ``detected_at`` is independent of how the text
    was split into deltas. ``start_offset`` may be up to one unit before the true onset when the
    text before the loop ends like the unit (``unit_preview`` is then a rotation of it), and is
    the window's start when the run is longer than the window.
    """

    period: int  # unit length in chars (the primitive unit, never a multiple of it)
    repeats: int  # full back-to-back units at the tail: covered_chars // period
    start_offset: int  # stream offset (chars) where the run begins
    unit_preview: str  # the first <= 120 chars of the unit, as it first appears in the run
    detected_at: int  # total chars fed when it fired (>= start_offset + covered_chars)
    covered_chars: int  # length of the periodic run, partial last unit included
    trivial: bool  # the unit has no letter or digit, or is shorter than min_period


class LoopDetector:
    """Finds a unit repeated back-to-back at the tail of one streamed channel."""

    __slots__ = (
        "_buf",
        "_buf_end",
        "_config",
        "_every",
        "_exact_until",
        "_keep",
        "_max_period",
        "_min_covered",
        "_min_repeats",
        "_next_check",
        "_pending",
        "_probe_every",
        "_report",
        "_runs",
        "_runs_at",
        "_total",
        "_wake_at",
        "_window",
    )

    def __init__(self, config: DetectorConfig | None = None) -> None:
        self._config = config = config if config is not None else DetectorConfig()
        # The thresholds each check reads, copied: compiled, a field of this object is a load,
        # one of the configuration's (interpreted) dataclass an attribute lookup.
        self._every = config.check_every_chars
        self._window = config.window_chars
        self._min_covered = config.min_covered_chars
        self._max_period = config.max_period
        self._min_repeats = config.min_repeats
        # When the window is full it is cut back to this (the longest required run plus one
        # check interval), so that it is cut only every few checks, not at each one. Worked
        # out when first needed: most streams never fill the window.
        self._keep = 0
        self._buf = ""  # the kept tail window; it ends at stream offset _buf_end
        self._buf_end = 0  # stream offset of the last check (end of _buf)
        self._pending: list[str] = []  # deltas since _buf_end
        self._next_check = self._every  # the first check not yet done
        # Probes (see the module's docstring): a check outside an exact stretch is looked at
        # only at a multiple of _probe_every chars; one whose anchor occurred before makes the
        # checks up to _exact_until exact. ``feed`` calls ``_advance`` at _wake_at, the next
        # check that is looked at.
        self._probe_every = _probe_stride(config) * self._every
        self._exact_until = -1
        self._wake_at = self._next_check
        self._total = 0
        self._report: LoopReport | None = None
        # Runs measured by the last check (candidate period -> stream offset where its run
        # starts) and that check's offset: the next check re-verifies only the new chars.
        self._runs: dict[int, int] = {}
        self._runs_at = -1

    @property
    def report(self) -> LoopReport | None:
        """The loop found so far, if any (``feed`` returns it only once)."""
        return self._report

    @property
    def buffered_chars(self) -> int:
        """Characters held in memory now (window plus pending deltas)."""
        return len(self._buf) + sum(len(p) for p in self._pending)

    def feed(self, delta: str) -> LoopReport | None:
        """Add one delta; return a report the first time a loop qualifies, else ``None``."""
        self._total += len(delta)
        if self._total < self._wake_at or self._report is not None:
            if delta and self._report is None:
                self._pending.append(delta)
            return None
        return self._advance(delta)

    def _advance(self, delta: str) -> LoopReport | None:
        pending = self._pending
        pending.append(delta)
        # The window and the text since, as one string: each check's window is a slice of it,
        # ``full[start:e]``, made only for a check whose anchor occurred before. Most checks of
        # ordinary text end at that first search, and a whole answer is many checks at once.
        base = len(self._buf)
        full = self._buf + "".join(pending)
        pending.clear()
        every, window, min_covered = self._every, self._window, self._min_covered
        origin = self._buf_end - base  # the stream offset of full[0]
        total, check_at = self._total, self._next_check
        start = e = 0
        # The last check since one with a candidate that found none: what it does to the
        # carried runs (none carried on) is written once, when a check or the end reads them.
        empty_at = -1
        probe_every, exact_until = self._probe_every, self._exact_until
        reach = probe_every - every  # the checks a probe vouches for, after its own
        while check_at <= total:
            e = check_at - origin
            if e - start > window:
                if not self._keep:
                    self._keep = self._config.max_required_chars() + every
                start = e - self._keep
            end = e - start
            if check_at > exact_until:
                # Outside an exact stretch only a probe looks (the docstring's "Probes").
                if check_at % probe_every or not self._probe(full, start, e, reach):
                    empty_at = check_at  # no candidate here
                    check_at += every
                    continue
                exact_until = self._exact_until = check_at + reach
            if end >= min_covered:  # shorter cannot hold a loop
                # The scan's first search, here: most checks of ordinary text end with it
                # (the anchor did not occur before, so no distance is a candidate).
                at = self._anchor_at(full, start, e, 0)
                if at < 0:
                    empty_at = check_at  # no candidate, no run carried on
                else:
                    if empty_at >= 0:
                        self._runs, self._runs_at, empty_at = {}, empty_at, -1
                    self._buf, self._buf_end = full[start:e], check_at
                    report = self._check(at - start)
                    if report is not None:
                        self._next_check = self._wake_at = check_at + every
                        self._report = report
                        self._buf = ""
                        return report
            check_at += every
        if empty_at >= 0:
            if self._runs:
                self._runs = {}
            self._runs_at = empty_at
        self._next_check = check_at
        if check_at > exact_until:  # the next probe: the checks before it find nothing
            check_at += -check_at % probe_every
        self._wake_at = check_at
        self._buf, self._buf_end = full[start:e], self._next_check - every
        if e < len(full):
            pending.append(full[e:])
        return None

    def _probe(self, full: str, start: int, e: int, reach: int) -> bool:
        """Whether the anchor ending at ``e`` occurred before, searched as far back as any
        check it vouches for would: their windows may be longer by up to ``reach`` chars."""
        return e - start > _ANCHOR and self._anchor_at(full, start, e, reach) >= 0

    def _anchor_at(self, full: str, start: int, e: int, reach: int) -> int:
        """Where the anchor ending at ``e`` last occurred before it, no further back than a
        candidate period of the window ``full[start:e]`` (longer by ``reach``) allows; -1:
        nowhere."""
        end = e - start
        max_d = min(self._max_period, (end + reach) // self._min_repeats)
        lo = end - _ANCHOR - max_d
        return full.rfind(full[e - _ANCHOR : e], start + lo if lo > 0 else start, e - 1)

    def _check(self, at: int) -> LoopReport | None:
        """A check at the window's end, whose anchor occurred before at ``at`` (in the
        window): the runs the check before this one measured are re-verified on the new chars
        only."""
        buf = self._buf
        every = self._every
        check_at = self._buf_end
        known = self._runs if self._runs_at == check_at - every and len(buf) >= every else {}
        self._runs = {}
        self._runs_at = check_at
        return self._scan(buf, known, check_at, at)

    def _scan(self, buf: str, known: dict[int, int], check_at: int, at: int) -> LoopReport | None:
        """Candidate periods: distances back to earlier occurrences of ``needle`` (a tail
        suffix: the anchor, later maybe a longer probe), nearest first, each occurrence in
        ``[lo, hi]`` (so every distance is at least ``end - hi``); ``at``: the first."""
        config = self._config
        runs, end, every = self._runs, len(buf), config.check_every_chars
        anchor = needle = buf[end - _ANCHOR :]
        probe_len = _PROBE
        probe: str | None = None
        max_d = min(config.max_period, end // config.min_repeats)
        lo = max(0, end - _ANCHOR - max_d)
        hi = end - 1
        reps = min(config.min_repeats, config.min_short_repeats)
        rfind, startswith = buf.rfind, buf.startswith
        while hi - lo >= len(needle):
            if at < 0:
                at = rfind(needle, lo, hi)
                if at < 0:
                    return None
            d = end - len(needle) - at
            at = -1  # the next candidate is searched for
            hi = end - d - 1
            need = config.required_chars(d, d < config.min_period)
            if need is None or need > end:
                continue
            # Cheap rejections: a run that qualifies has period d over `need` chars, so the
            # tail probe recurs at distance d and the anchor at 2d. A distance shorter than
            # the anchor means the tail is already periodic over d + 64 chars: measure that
            # run at once, whatever its length, for the skips below.
            if d >= _ANCHOR:
                if probe_len + d <= need and probe is not needle:
                    if probe is None:
                        probe = buf[end - probe_len :]
                    if not startswith(probe, end - probe_len - d):
                        continue
                if _ANCHOR + 2 * d <= need and not startswith(anchor, end - _ANCHOR - 2 * d):
                    continue
            run = _run_since(buf, d, known.get(d), every, check_at)
            if run >= need:
                report = self._report_of(buf[end - run : end - run + d], run, check_at)
                if report is not None:
                    return report
            runs[d] = check_at - run
            # Any candidate d2 <= run - d lies inside this run: its own run cannot reach past
            # this one and reduces to the same primitive unit, so it cannot qualify either.
            hi = min(hi, end - run + d - 1)
            if run >= end:
                continue
            # A later candidate that qualifies must repeat this whole run and the char that
            # ended it: probe with them. When the run holds several copies of its unit (an
            # earlier copy of the run would hold as many anchor occurrences, each a useless
            # candidate) and every remaining candidate's need covers the probe
            # (need >= reps * d2 >= probe_len + d2), search for the probe itself instead.
            if run >= probe_len:
                probe_len = run + 1
                probe = None
            if run >= 2 * d + _ANCHOR and probe_len <= (reps - 1) * (end - hi):
                probe = needle = buf[end - probe_len :]
                lo = max(0, end - probe_len - max_d)
        return None

    def _report_of(self, first: str, run: int, check_at: int) -> LoopReport | None:
        """The loop a run of ``run`` chars ending at ``check_at`` is, its unit ``first``
        (``len(first)`` is the period), when it qualifies."""
        # If d is not primitive its unit's own period p < d was a candidate before d, with
        # this same run, and did not qualify: only a primitive d can fire here.
        d = len(first)
        if (first + first).find(first, 1) != d:
            return None
        config = self._config
        trivial = d < config.min_period or _ALNUM.search(first) is None
        need = config.required_chars(d, trivial)
        if need is None or run < need:
            return None
        return LoopReport(
            period=d,
            repeats=run // d,
            start_offset=check_at - run,
            unit_preview=first[:_PREVIEW],
            detected_at=self._total,
            covered_chars=run,
            trivial=trivial,
        )


def _probe_stride(config: DetectorConfig) -> int:
    """Checks from one probe to the next: one more than the checks before a firing one that
    are sure to hold a candidate too (the module's docstring, "Probes")."""
    reps = min(config.min_repeats, config.min_short_repeats)
    # Every period d needs at least max(min_covered_chars, reps * d) chars: at least this
    # many of them lie before the run's last unit, whatever d is.
    kept = config.min_covered_chars - -(-config.min_covered_chars // reps)
    return max(0, kept - _ANCHOR) // config.check_every_chars + 1


def _run_since(buf: str, d: int, start: int | None, every: int, check_at: int) -> int:
    """The run of period ``d`` ending at the buffer's end; ``start``: where the last check
    saw it start (the run goes on when the chars added since keep the period)."""
    end = len(buf)
    if (
        start is not None
        and end - every - d >= 0
        and buf.startswith(buf[end - every :], end - every - d)
    ):
        return min(end, check_at - start)  # the run still starts where it started
    return _run_length(buf, end, d)


def _run_length(buf: str, end: int, d: int) -> int:
    """Largest ``n <= end`` such that ``buf[end - n : end]`` has period ``d`` (``n >= d``)."""
    good = d
    step = max(d, _PROBE)
    while good < end:
        cand = min(end, good + step)
        # positions [end - cand, end - good) must satisfy buf[i] == buf[i + d]
        if buf.startswith(buf[end - cand + d : end - good + d], end - cand):
            good = cand
            step *= 2
            continue
        bad = cand
        while bad - good > 1:
            mid = (good + bad) // 2
            if buf.startswith(buf[end - mid + d : end - good + d], end - mid):
                good = mid
            else:
                bad = mid
        return good
    return good
