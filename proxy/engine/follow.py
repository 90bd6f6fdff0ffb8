"""What the engine says it loaded, kept current: its log followed, its endpoints' facts merged,
both held against ``[upstream.expect]``.

``EngineTruth`` holds the two accounts (the log's, from ``EngineLogFollower``; the endpoints',
from ``FingerprintPoller``) and publishes ``EngineFactsRead`` whenever their merge or its
verdict moves. Merge rule: the endpoints win where both say (they report the resolved config
of the running process, while a log may hold an older start), except for what only the log can
tell: what was chosen at run time (the automatic attention and MoE backends, fallbacks), the
unknown and deprecated variables, and a failed start; for those the log's account is kept and
an endpoint's value fills in only where the log is silent.

``EngineLogFollower`` follows a file (or stdin, path ``-``) from its beginning: the start-up
log is what matters. It waits for the file to appear (a sidecar's engine starts later),
reopens on rotation (another inode) and truncation (the size shrank), reads bounded chunks
with a bounded partial line (a longer line is cut and counted), and polls (no inotify).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Protocol

from proxy.engine.engine_log import EngineLogReader
from proxy.engine.expect import check, mismatch_record, norm_text
from proxy.engine.facts import CHECKED, RECIPE, EngineFacts
from proxy.events import EngineFactsRead, EventBus

log = logging.getLogger(__name__)

CHUNK = 65536  # bytes read at once
MAX_LINE = 65536  # characters of one line kept; the rest is cut (and counted)
POLL_S = 0.25  # how often a quiet file is looked at
# Facts only the log can tell (what was chosen at run time); an endpoint fills in only where
# the log is silent.
LOG_FIRST = frozenset({"attention_backend", "flash_attn_version", "moe_backend", "linear_backend"})


def _empty() -> EngineFacts:
    return EngineFacts({}, {}, (), (), (), False)


def merge(log_facts: EngineFacts, endpoint: EngineFacts) -> EngineFacts:
    """The log's and the endpoints' accounts in one (see the module's docstring)."""
    values = dict(log_facts.values)
    sources = dict(log_facts.sources)
    for key, value in endpoint.values.items():
        if value is None or (key in LOG_FIRST and values.get(key) is not None):
            continue
        values[key] = value
        if key in endpoint.sources:
            sources[key] = endpoint.sources[key]

    def union(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(dict.fromkeys((*a, *b)))

    return EngineFacts(
        values,
        sources,
        union(log_facts.unknown_env, endpoint.unknown_env),
        union(log_facts.deprecated, endpoint.deprecated),
        union(log_facts.fallbacks, endpoint.fallbacks),
        log_facts.start_failed or endpoint.start_failed,
    )


def with_checks(said: EngineFacts, checked: Mapping[str, bool]) -> EngineFacts:
    """What the engine said, with what detproxy measured of it (source ``CHECKED``): a
    failed check wins over what the engine said (it does not do what it says); a passed one
    fills in only where the engine said nothing."""
    if not checked:
        return said
    values, sources = dict(said.values), dict(said.sources)
    for key, value in checked.items():
        if value is False or values.get(key) is None:
            values[key] = value
            sources[key] = CHECKED
    return replace(said, values=values, sources=sources)


def _differ(a: Any, b: Any) -> bool:
    """Two known values that say different things (``torch.bfloat16`` and ``bfloat16`` do
    not; a method and ``True`` for speculative decoding do not)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) != bool(b)
    return norm_text(a) != norm_text(b)


def moved(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    """The recipe's facts that went from one known value to another known value (a fact
    learnt later, or one no longer said, is not a move; nor are a load-dependent count or the
    operator's arguments: only ``RECIPE``)."""
    return sorted(
        k
        for k in before.keys() & after.keys() & set(RECIPE)
        if before[k] is not None and after[k] is not None and _differ(before[k], after[k])
    )


class EngineTruth:
    """The engine's two accounts of itself, merged and checked; see the module's docstring.
    ``said`` is what the engine says (the recipe, part of the upstream's identity); ``facts``
    adds what detproxy measured (``check_read``: an active check, ``proxy.engine.invariance``),
    held against ``[upstream.expect]`` like the rest."""

    def __init__(self, bus: EventBus, expect: Mapping[str, Any], engine_log: str | None) -> None:
        self._bus = bus
        self.expect = dict(expect)
        self.engine_log = engine_log
        self.from_log = _empty()
        self.from_endpoints = _empty()
        self.said = _empty()
        self.facts = _empty()
        # field -> (value, evidence): what an active check measured on the current upstream
        self.checked: dict[str, tuple[bool, Mapping[str, Any] | None]] = {}
        self.checks: dict[str, Any] = {}  # field -> the check (its ``status()``), where one runs
        self.mismatches: tuple[Any, ...] = ()
        self.unknown: tuple[str, ...] = ()
        self.follower: EngineLogFollower | None = None
        self._published: tuple[str, tuple[Any, ...], tuple[str, ...]] | None = None

    @property
    def known(self) -> bool:
        return bool(self.said.values) or self.said.start_failed or bool(self.said.unknown_env)

    def log_read(self, facts: EngineFacts) -> None:
        self.from_log = facts
        self._update()

    def endpoints_read(self, facts: EngineFacts) -> None:
        self.from_endpoints = facts
        self._update()

    def check_read(
        self, field: str, value: bool | None, evidence: Mapping[str, Any] | None = None
    ) -> None:
        """An active check's result for ``field`` (None: not measured on this upstream)."""
        if value is None:
            if self.checked.pop(field, None) is None:
                return
        else:
            self.checked[field] = (value, evidence)
        self._update()

    def _update(self) -> None:
        self.said = merge(self.from_log, self.from_endpoints)
        self.facts = with_checks(self.said, {k: v for k, (v, _) in self.checked.items()})
        mismatches, self.unknown = check(self.expect, self.facts)
        self.mismatches = tuple(
            replace(m, evidence=self.checked[m.field][1])
            if self.facts.sources.get(m.field) == CHECKED and m.field in self.checked
            else m
            for m in mismatches
        )
        key = (self.facts.digest(), self.mismatches, self.unknown)
        if key == self._published:
            return
        self._published = key
        self._bus.publish(
            EngineFactsRead(
                self.facts, self.mismatches, self.unknown, tuple(self.expect), time.time()
            )
        )

    def digest(self) -> str | None:
        """The recipe's digest, None while nothing is known of it."""
        return self.said.digest() if self.known else None

    def status(self) -> dict[str, Any]:
        """``/detproxy/status``'s ``engine`` object."""
        follower = self.follower
        return {
            "loaded": self.facts.as_dict(),
            "recipe": self.digest(),
            "expect": self.expect,
            "mismatches": [mismatch_record(m) for m in self.mismatches],
            "unknown": list(self.unknown),
            "engine_log": None if follower is None else follower.state(),
            "checks": {name: c.status() for name, c in self.checks.items()},
        }


class LogReader(Protocol):
    """What the follower feeds (``EngineLogReader``)."""

    read_lines: int
    ignored_lines: int

    def feed(self, line: str) -> bool: ...

    @property
    def facts(self) -> EngineFacts: ...


class EngineLogFollower:
    """Follows the engine's log into an ``EngineLogReader``; hands its facts to ``truth``."""

    def __init__(
        self,
        path: str,
        truth: EngineTruth,
        poll_s: float = POLL_S,
        chunk: int = CHUNK,
        max_line: int = MAX_LINE,
        reader: LogReader | None = None,
    ) -> None:
        self.path = path
        self._truth = truth
        self._poll_s = poll_s
        self._chunk = chunk
        self._max_line = max_line
        self.reader: LogReader = reader or EngineLogReader(max_line_chars=max_line)
        self.cut_lines = 0  # lines longer than max_line, cut
        self.reopened = 0  # rotations and truncations followed
        self.polls = 0  # times the file was looked at (opened, or read from)
        self._partial = ""
        self._cutting = False  # inside a line already cut: drop until its end
        self._said_waiting = False
        self._said_error = False
        truth.follower = self

    def state(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "read_lines": self.reader.read_lines,
            "ignored_lines": self.reader.ignored_lines,
            "cut_lines": self.cut_lines,
            "reopened": self.reopened,
        }

    def _feed_text(self, text: str) -> None:
        """Whole lines to the reader; the last partial one kept, at most ``max_line``
        characters: a longer one is fed cut, and the rest of it, to its end, dropped."""
        changed = False
        if self._cutting:
            end = text.find("\n")
            if end < 0:
                return  # still inside the line already cut and fed
            text, self._cutting = text[end + 1 :], False
        parts = (self._partial + text).split("\n")
        self._partial = parts.pop()
        for line in parts:
            changed |= self._line(line[: self._max_line])
            if len(line) > self._max_line:
                self.cut_lines += 1
        if len(self._partial) > self._max_line:
            changed |= self._line(self._partial[: self._max_line])
            self.cut_lines += 1
            self._partial, self._cutting = "", True
        if changed:
            self._truth.log_read(self.reader.facts)

    def _line(self, line: str) -> bool:
        return self.reader.feed(line.rstrip("\r"))

    def _restart(self) -> None:
        """The file was replaced or truncated: read the new one from its beginning. The facts
        read so far stay: a rotated log (logrotate, copytruncate) goes on with the same
        engine, whose start-up lines are in the old file. A new engine start in the text is
        what replaces them (the reader resets itself on it)."""
        self.reopened += 1
        self._partial, self._cutting = "", False

    async def run(self) -> None:
        if self.path == "-":
            await self._follow_stdin()
        else:
            await self._follow_file()

    async def _follow_stdin(self) -> None:
        """The engine piped into detproxy (``vllm serve ... 2>&1 | detproxy serve``): read
        without a thread, so that detproxy stops while the engine still writes."""
        loop = asyncio.get_running_loop()
        stream = asyncio.StreamReader(limit=self._chunk)
        try:
            transport, _ = await loop.connect_read_pipe(
                lambda: asyncio.StreamReaderProtocol(stream), sys.stdin
            )
        except (ValueError, OSError) as exc:  # a regular file or a closed stdin
            log.warning("engine log: stdin cannot be followed (%s); name the file instead", exc)
            return
        try:
            while data := await stream.read(self._chunk):
                self._feed_text(data.decode("utf-8", "replace"))
            log.info("engine log: stdin closed after %d lines", self.reader.read_lines)
        finally:
            transport.close()

    def _open(self) -> tuple[Any, int] | None:
        try:
            handle = open(self.path, "rb")  # noqa: SIM115 (kept while the file is followed)
        except FileNotFoundError:
            if not self._said_waiting:
                self._said_waiting = True
                log.info("waiting for engine log %s", self.path)
            return None
        except OSError as exc:
            if not self._said_error:
                self._said_error = True
                log.warning("engine log %s cannot be read: %s", self.path, exc.strerror or exc)
            return None
        self._said_waiting = self._said_error = False
        return handle, os.fstat(handle.fileno()).st_ino

    async def _follow_file(self) -> None:
        handle = None
        inode = 0
        position = 0
        try:
            while True:
                self.polls += 1
                if handle is None:
                    opened = self._open()
                    if opened is None:
                        await asyncio.sleep(self._poll_s)
                        continue
                    handle, inode = opened
                    position = 0
                    log.info("engine log: following %s", self.path)
                data = handle.read(self._chunk)
                if data:
                    position += len(data)
                    self._feed_text(data.decode("utf-8", "replace"))
                    if len(data) == self._chunk:
                        await asyncio.sleep(0)  # more to read: let the loop breathe
                        continue
                try:
                    now = os.stat(self.path)
                    replaced, shrank = now.st_ino != inode, now.st_size < position
                except FileNotFoundError:
                    replaced, shrank = False, False  # renamed away; its successor may come
                if shrank or replaced:
                    if replaced:
                        # What the old file got after our last read, then the new one.
                        rest = handle.read()
                        if rest:
                            self._feed_text(rest.decode("utf-8", "replace"))
                    handle.close()
                    handle = None
                    self._restart()
                    log.info(
                        "engine log %s %s: reading it from its start",
                        self.path,
                        "rotated" if replaced else "truncated",
                    )
                    continue
                if not data:
                    await asyncio.sleep(self._poll_s)
        finally:
            if handle is not None:
                handle.close()
