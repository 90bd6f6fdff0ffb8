"""Loop triggers for one response: proxy-side detectors per choice and channel, plus what the
engine says (finish_reason ``repetition``) and runaways (``length`` with no content after
reasoning). Reasoning is read by ``proxy.openai.reasoning_of``.

A stream inspector (``proxy.relay.inspectors``) that watches: ``on_delta`` takes a token
chunk's text (a ``Delta``) straight to its choice's detector for that channel, and walks any
other chunk's choices. Per token that is a few attribute reads and the detector's ``feed``,
which only keeps the text until its next check is due (``LoopDetector``): a trigger comes with
the delta whose text reaches the check that finds the loop.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from policies.base import Trigger
from proxy.loops.detector import DetectorConfig, LoopDetector, LoopReport
from proxy.openai import reasoning_of
from proxy.relay.inspectors import Delta, Item

MAX_CHOICES: Final = 128  # n is client-controlled: bound the detectors kept per response


# The most content kept per choice for a continuation (chars); past it, a loop restarts.
MAX_KEPT_CHARS: Final = 4 * 1024 * 1024

# The source of the trigger an answer that ends ``stop`` with nothing in it makes (a retry's:
# recovered means an answer, and the ladder goes on). No loop is counted for it.
EMPTY = "empty"


class _ChoiceWatch:
    __slots__ = (
        "_config",
        "_reasoning",
        "answered",
        "content",
        "finish",
        "kept",
        "kept_chars",
        "kept_reasoning",
        "saw_content",
        "saw_reasoning",
        "unshown",
    )

    def __init__(self, config: DetectorConfig, keep: bool) -> None:
        self._config = config
        self._reasoning: LoopDetector | None = None  # most answers have no reasoning
        self.content = LoopDetector(config)
        self.saw_reasoning = False
        self.saw_content = False
        self.answered = False  # content other than whitespace, or tool calls (empty_stop only)
        self.finish: Any = None  # its finish reason, once it came
        # The content and the reasoning seen, when a recovery may continue from them.
        self.kept: list[str] | None = [] if keep else None
        self.kept_reasoning: list[str] | None = [] if keep else None
        self.kept_chars = 0
        # Chars at the end of the kept text of a trigger's channel that the client was not
        # shown: the triggering chunk's (a decision stops the relay before it).
        self.unshown = 0

    @property
    def reasoning(self) -> LoopDetector:
        if self._reasoning is None:
            self._reasoning = LoopDetector(self._config)
        return self._reasoning

    def keep(self, text: str, reasoning: bool = False) -> None:
        kept = self.kept_reasoning if reasoning else self.kept
        if kept is not None:
            self.kept_chars += len(text)
            if self.kept_chars > MAX_KEPT_CHARS:
                self.kept = self.kept_reasoning = None
            else:
                kept.append(text)


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
    """Feed it the events of one attempt; it returns the first trigger of each kind.

    A watcher (``proxy.relay.inspectors.InspectorSet``): its answers are triggers, which the
    relay hands to the policies; it is isolated like any inspector."""

    name = "loop_watch"

    def __init__(
        self,
        endpoint: str,
        config: DetectorConfig,
        runaway: bool = True,
        keep: bool = False,
        empty_stop: bool = False,
    ) -> None:
        self._chat = endpoint == "chat"
        self._config = config
        self._runaway = runaway
        self._keep = keep  # keep the first choice's texts, for a continuation
        # A choice that ends ``stop`` with no answer is a trigger (``EMPTY``): a retry's
        # attempt, where an empty answer is no recovery.
        self._empty_stop = empty_stop
        self._choices: dict[int, _ChoiceWatch] = {}
        # The choice of the last delta and its watch: a stream's tokens are nearly all one
        # choice's, and a dict lookup by int is ~120 instructions a token (callgrind).
        self._last_index = -1
        self._last: _ChoiceWatch | None = None

    def _watch(self, index: int) -> _ChoiceWatch | None:
        watch = self._choices.get(index)
        if watch is None and len(self._choices) < MAX_CHOICES:
            watch = self._choices[index] = _ChoiceWatch(self._config, self._keep and index == 0)
        return watch

    def kept(self, index: int = 0, channel: str = "content") -> str | None:
        """What choice ``index`` streamed so far in ``channel``, when it was kept."""
        watch = self._choices.get(index)
        if watch is None:
            return None
        kept = watch.kept_reasoning if channel == "reasoning" else watch.kept
        return None if kept is None else "".join(kept)

    def shown(self, index: int = 0, channel: str = "content") -> str | None:
        """What choice ``index`` showed the client in ``channel`` before this watch's trigger
        stopped the stream: the kept text but the triggering chunk's (None: not kept)."""
        watch = self._choices.get(index)
        kept = self.kept(index, channel)
        if watch is None or kept is None:
            return kept
        return kept[: len(kept) - watch.unshown] if watch.unshown else kept

    def ended(self, index: int = 0) -> tuple[Any, bool]:
        """Choice ``index``'s finish reason (None: none came) and whether it answered (content
        other than whitespace, or tool calls: known where empty answers are triggers)."""
        watch = self._choices.get(index)
        return (None, False) if watch is None else (watch.finish, watch.answered)

    def on_delta(self, item: Item) -> Trigger | None:
        """One event of a stream: a token chunk's text, or another chunk, parsed."""
        if type(item) is Delta:
            index, text = item.index, item.text
            watch = self._last
            if index != self._last_index or watch is None:
                watch = self._choices.get(index)
                if watch is None:
                    watch = self._watch(index)
                    if watch is None:
                        return None
                self._last_index, self._last = index, watch
            if not text:
                return None
            if item.channel == "reasoning":
                return self._feed(watch, index, text, None)
            # Content, the usual token: what _feed does with it, inline.
            watch.saw_content = True
            if self._empty_stop and not watch.answered and text.strip():
                watch.answered = True
            if watch.kept is not None:
                watch.keep(text)
            report = watch.content.feed(text)
            if report is None:
                return None
            watch.unshown = len(text)
            return _trigger("proxy", "content", index, report)
        assert type(item) is dict
        return self._chunk(item)

    def _chunk(self, chunk: Mapping[str, Any]) -> Trigger | None:
        """One parsed SSE chunk of a stream."""
        choices = chunk.get("choices")
        if self._chat and type(choices) is list and len(choices) == 1:
            raw = choices[0]
            if type(raw) is dict:
                delta = raw.get("delta")
                index = raw.get("index", 0)
                # The common shape, for a choice already watched: what _choices_of does, inline.
                if type(delta) is dict and type(index) is int:
                    watch = self._choices.get(index)
                    if watch is not None:
                        return self._delta(watch, index, raw, delta)
        return self._choices_of(chunk, "delta")

    def _delta(
        self, watch: _ChoiceWatch, index: int, raw: dict[str, Any], delta: dict[str, Any]
    ) -> Trigger | None:
        trigger = self._feed(watch, index, reasoning_of(delta), delta.get("content"))
        if self._empty_stop and not watch.answered and delta.get("tool_calls"):
            watch.answered = True
        finish = raw.get("finish_reason")
        if trigger is None and finish is not None:
            return self._finished(watch, index, finish, raw.get("stop_reason"))
        return trigger

    def on_end(self, complete: bool) -> None:
        """Nothing to finish: a loop is a trigger while the stream runs, or nothing."""

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
            if not isinstance(index, int):
                index = 0  # as the streamed path reads a malformed index
            watch = self._watch(index)
            if watch is None:
                continue
            if self._chat:
                message = raw.get(part)
                message = message if isinstance(message, dict) else {}
                trigger = self._feed(watch, index, reasoning_of(message), message.get("content"))
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
            if watch.kept_reasoning is not None:
                watch.keep(reasoning, reasoning=True)
            report = watch.reasoning.feed(reasoning)
            if report is not None:
                watch.unshown = len(reasoning)
                return _trigger("proxy", "reasoning", index, report)
        if isinstance(content, str) and content:
            watch.saw_content = True
            if self._empty_stop and not watch.answered and content.strip():
                watch.answered = True
            if watch.kept is not None:
                watch.keep(content)
            report = watch.content.feed(content)
            if report is not None:
                watch.unshown = len(content)
                return _trigger("proxy", "content", index, report)
        return None

    def _finished(
        self, watch: _ChoiceWatch, index: int, finish: Any, stop_reason: Any
    ) -> Trigger | None:
        watch.finish = finish
        channel = "content" if watch.saw_content or not watch.saw_reasoning else "reasoning"
        if finish == "repetition" or stop_reason == "repetition_detected":
            return _trigger("engine", channel, index)
        if self._runaway and finish == "length" and watch.saw_reasoning and not watch.saw_content:
            return _trigger("runaway", "reasoning", index)
        if self._empty_stop and finish == "stop" and not watch.answered:
            return _trigger(EMPTY, "content", index)
        return None
