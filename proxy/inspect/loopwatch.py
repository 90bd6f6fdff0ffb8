"""Loop triggers for one response: proxy-side detectors per choice and channel, plus what the
engine says (finish_reason ``repetition``) and runaways (``length`` with no content after
reasoning). Reads ``reasoning`` or, on older vLLM, ``reasoning_content`` (one of them when a
delta carries both: they are duplicates).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policies.base import Trigger
from proxy.inspect.loops import LoopConfig, LoopDetector, LoopReport

MAX_CHOICES = 128  # n is client-controlled: bound the detectors kept per response


def _reasoning(obj: Mapping[str, Any]) -> str | None:
    value = obj.get("reasoning")
    if not value:
        value = obj.get("reasoning_content")
    return value if isinstance(value, str) and value else None


class _ChoiceWatch:
    __slots__ = ("content", "reasoning", "saw_content", "saw_reasoning")

    def __init__(self, config: LoopConfig) -> None:
        self.reasoning = LoopDetector(config)
        self.content = LoopDetector(config)
        self.saw_reasoning = False
        self.saw_content = False


def _trigger(source: str, channel: str, choice: int, report: LoopReport | None = None) -> Trigger:
    if report is None:
        return Trigger(source, channel, choice)
    return Trigger(
        source,
        channel,
        choice,
        report.period,
        report.repeats,
        report.start_offset,
        report.unit_preview,
    )


class LoopWatch:
    """Feed it the parsed chunks of one attempt; it returns the first trigger of each kind."""

    def __init__(self, endpoint: str, config: LoopConfig, runaway: bool = True) -> None:
        self._chat = endpoint == "chat"
        self._config = config
        self._runaway = runaway
        self._choices: dict[int, _ChoiceWatch] = {}

    def _watch(self, index: Any) -> _ChoiceWatch | None:
        if not isinstance(index, int):
            index = 0
        watch = self._choices.get(index)
        if watch is None and len(self._choices) < MAX_CHOICES:
            watch = self._choices[index] = _ChoiceWatch(self._config)
        return watch

    def on_chunk(self, chunk: Mapping[str, Any]) -> Trigger | None:
        """One parsed SSE chunk of a stream."""
        return self._choices_of(chunk, "delta")

    def on_answer(self, answer: Mapping[str, Any]) -> Trigger | None:
        """A whole non-streamed answer: the same checks, all at once."""
        return self._choices_of(answer, "message")

    def _choices_of(self, body: Mapping[str, Any], part: str) -> Trigger | None:
        choices = body.get("choices")
        if not isinstance(choices, list):
            return None
        for raw in choices:
            if not isinstance(raw, dict):
                continue
            index = raw.get("index", 0)
            watch = self._watch(index)
            if watch is None:
                continue
            if self._chat:
                message = raw.get(part)
                message = message if isinstance(message, dict) else {}
                trigger = self._feed(watch, index, _reasoning(message), message.get("content"))
            else:
                trigger = self._feed(watch, index, None, raw.get("text"))
            finish = raw.get("finish_reason")
            if trigger is None and finish is not None:
                trigger = self._finished(watch, index, finish, raw.get("stop_reason"))
            if trigger is not None:
                return trigger
        return None

    def _feed(
        self, watch: _ChoiceWatch, index: int, reasoning: str | None, content: Any
    ) -> Trigger | None:
        if reasoning:
            watch.saw_reasoning = True
            report = watch.reasoning.feed(reasoning)
            if report is not None:
                return _trigger("proxy", "reasoning", index, report)
        if isinstance(content, str) and content:
            watch.saw_content = True
            report = watch.content.feed(content)
            if report is not None:
                return _trigger("proxy", "content", index, report)
        return None

    def _finished(
        self, watch: _ChoiceWatch, index: int, finish: Any, stop_reason: Any
    ) -> Trigger | None:
        channel = "content" if watch.saw_content or not watch.saw_reasoning else "reasoning"
        if finish == "repetition" or stop_reason == "repetition_detected":
            return _trigger("engine", channel, index)
        if self._runaway and finish == "length" and watch.saw_reasoning and not watch.saw_content:
            return _trigger("runaway", "reasoning", index)
        return None
