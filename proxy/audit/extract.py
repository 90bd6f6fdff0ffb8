"""Answer extractors: pull the part of an output that matters (a date, an amount) out of it.

Two primary and shadow outputs whose texts differ may still give the same answer; an
``answer_divergence`` is a text divergence whose extracted answers differ. Specs come from
config as ``"json:$.answer.date"`` or ``"regex:PATTERN"``; ``build_extractor`` validates them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any, Final, Protocol

import orjson

from proxy.config import answer_extractor_spec, json_path_segments


class AnswerExtractor(Protocol):
    def extract(self, content: str) -> str | None:
        """The answer in ``content``, or None when there is none."""


_MISSING: Final = object()
_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[^\n`]*\n?(.*?)```", re.DOTALL)
_OPENER = re.compile(r"[\[{]")
_MAX_SPAN_ATTEMPTS = 16  # openers tried when looking for an embedded JSON value
_DECODER = json.JSONDecoder()  # stateless: raw_decode finds a value and where it ends


def _loads(text: str) -> Any:
    # The stdlib, not orjson: it keeps integers beyond 64 bits exact (orjson rounds them to
    # floats, which could make two different answers look equal).
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return _MISSING


def _embedded(content: str) -> Iterator[Any]:
    """The ``{...}`` / ``[...]`` spans of ``content`` that parse as JSON, first to last (a span
    inside one already found is not tried again); at most a bounded number of attempts."""
    pos = 0
    for _ in range(_MAX_SPAN_ATTEMPTS):
        match = _OPENER.search(content, pos)
        if match is None:
            return
        try:
            value, end = _DECODER.raw_decode(content, match.start())
        except (ValueError, RecursionError):
            pos = match.start() + 1
            continue
        yield value
        pos = end


def json_candidates(content: str) -> Iterator[Any]:
    """The JSON values an output may hold, most likely first: the whole text, a fenced
    block, then embedded spans. Parse failures are skipped (JSON null is a value)."""
    value = _loads(content.strip())
    if value is not _MISSING:
        yield value
        return
    fence = _FENCE.search(content)
    if fence is not None:
        body = fence.group(1)
        value = _loads(body.strip())
        if value is not _MISSING:
            yield value
        else:
            yield from _embedded(body)
    yield from _embedded(content)


def canonical_json(value: Any) -> str | None:
    try:
        return orjson.dumps(value, option=orjson.OPT_SORT_KEYS).decode()
    except (orjson.JSONEncodeError, TypeError):
        try:  # integers beyond 64 bits, odd floats: the stdlib still writes them
            return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        except (TypeError, ValueError, RecursionError):
            return None


def _resolve(value: Any, segments: tuple[str | int, ...]) -> Any:
    for segment in segments:
        if isinstance(segment, int):
            if not isinstance(value, list) or not -len(value) <= segment < len(value):
                return _MISSING
        elif not isinstance(value, dict) or segment not in value:
            return _MISSING
        value = value[segment]
    return value


class JsonPathExtractor:
    """``$.answer.date``, ``$.items[0].amount``, ``$['a key']``: the value, canonical JSON.

    The first JSON value in the output where the path resolves wins (usually the only one)."""

    __slots__ = ("_segments", "path")

    def __init__(self, path: str) -> None:
        self.path = path
        self._segments = json_path_segments(path)

    def __repr__(self) -> str:
        return f"JsonPathExtractor({self.path!r})"

    def extract(self, content: str) -> str | None:
        for candidate in json_candidates(content):
            value = _resolve(candidate, self._segments)
            if value is not _MISSING:
                return canonical_json(value)
        return None


class RegexExtractor:
    """The first match's ``group`` (the whole match when the pattern has no groups), stripped."""

    __slots__ = ("_group", "_regex", "group", "pattern")

    def __init__(self, pattern: str, group: int | str = 1) -> None:
        self.pattern = pattern
        self.group = group
        try:
            self._regex = re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"regex {pattern!r} does not compile: {exc}") from None
        if self._regex.groups == 0:
            self._group: int | str = 0
        elif isinstance(group, str):
            if group not in self._regex.groupindex:
                raise ValueError(f"regex {pattern!r} has no group named {group!r}")
            self._group = group
        elif isinstance(group, bool) or not 0 <= group <= self._regex.groups:
            raise ValueError(
                f"regex {pattern!r} has {self._regex.groups} group(s); group {group!r} is not one"
            )
        else:
            self._group = group

    def __repr__(self) -> str:
        return f"RegexExtractor({self.pattern!r}, group={self.group!r})"

    def extract(self, content: str) -> str | None:
        match = self._regex.search(content)
        if match is None:
            return None
        text = match.group(self._group)
        return text.strip() if isinstance(text, str) else None


def build_extractor(spec: str) -> AnswerExtractor:
    """``"json:$.path"`` or ``"regex:PATTERN"``; a bad spec raises ValueError saying why
    (``proxy.config.answer_extractor_spec``, which the configuration checks too)."""
    kind, argument = answer_extractor_spec(spec)
    if kind == "json":
        return JsonPathExtractor(argument)
    return RegexExtractor(argument)
