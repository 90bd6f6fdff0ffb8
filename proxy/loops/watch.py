"""Loop triggers for one response: proxy-side detectors per choice and channel, plus what the
engine says (finish_reason ``repetition``) and runaways (``length`` with no content after
reasoning). Reasoning is read by ``proxy.openai.reasoning_of``.

``on_chunk`` takes a fast path for the shape nearly every chunk has (one choice whose delta is a
dict, for a choice already seen) and walks the general way otherwise. ``on_run`` feeds the text
deltas of consecutive chunks at once: the detector is split-invariant, so the trigger is the one
the chunks fed one by one would have given, and the chunk that would have fired it is located
from the report's check offset.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from policies.base import Trigger
from proxy.loops.detector import DetectorConfig, LoopDetector, LoopReport
from proxy.openai import reasoning_of

MAX_CHOICES = 128  # n is client-controlled: bound the detectors kept per response


# The most content kept per choice for a continuation (chars); past it, a loop restarts.
MAX_KEPT_CHARS = 4 * 1024 * 1024

# The source of the trigger an answer that ends ``stop`` with nothing in it makes (a retry's:
# recovered means an answer, and the ladder goes on). No loop is counted for it.
EMPTY = "empty"


class _ChoiceWatch:
    __slots__ = (
        "_config",
        "_reasoning",
        "answered",
        "content",
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
    """Feed it the parsed chunks of one attempt; it returns the first trigger of each kind.

    A ``RunInspector`` (``proxy.relay.inspectors``) whose answers are triggers: the relay runs
    it first among a response's inspectors, isolated like them."""

    name = "loop_watch"
    triggers = True

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

    def on_chunk(self, chunk: Mapping[str, Any]) -> Trigger | None:
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

    def on_run(self, index: int, channel: str, texts: Sequence[str]) -> tuple[Trigger, int] | None:
        """Text deltas of one ``channel`` of choice ``index``, from consecutive chunks that
        carry nothing else this watch looks at (no other text, no finish_reason).

        Returns the trigger ``on_chunk`` would have returned for one of those chunks, with that
        chunk's position in ``texts``; ``None`` when none would have triggered.
        """
        watch = self._watch(index)
        if watch is None:
            return None
        text = "".join(texts)
        if not text:
            return None
        if channel == "reasoning":
            watch.saw_reasoning = True
            if watch.kept_reasoning is not None:
                watch.keep(text, reasoning=True)
            detector = watch.reasoning
        else:
            watch.saw_content = True
            if self._empty_stop and not watch.answered and text.strip():
                watch.answered = True
            if watch.kept is not None:
                watch.keep(text)
            detector = watch.content
        at = detector.total_chars
        report = detector.feed(text)
        if report is None:
            return None
        # The detector fires at the check at offset start_offset + covered_chars, during the
        # feed of the first delta that reaches it.
        check = report.start_offset + report.covered_chars
        position = len(texts) - 1
        for i, delta in enumerate(texts):
            at += len(delta)
            if at >= check:
                position = i
                break
        # The chunks after the triggering one are never relayed: not kept either.
        excess = len(text) - sum(len(t) for t in texts[: position + 1])
        kept = watch.kept_reasoning if channel == "reasoning" else watch.kept
        if kept and excess:
            kept[-1] = kept[-1][: len(kept[-1]) - excess]
        watch.unshown = len(texts[position])
        return _trigger("proxy", channel, index, report), position

    def quiet_chars(self, index: int, channel: str) -> int:
        """How many chars of texts of choice ``index`` in ``channel`` ``on_run`` takes from here
        without a trigger (it only keeps them): up to its detector's next check. 0 for a choice
        or channel not watched yet (its first text makes its detector)."""
        watch = self._choices.get(index)
        if watch is None:
            return 0
        detector = watch._reasoning if channel == "reasoning" else watch.content
        return 0 if detector is None else detector.quiet_chars()

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
        channel = "content" if watch.saw_content or not watch.saw_reasoning else "reasoning"
        if finish == "repetition" or stop_reason == "repetition_detected":
            return _trigger("engine", channel, index)
        if self._runaway and finish == "length" and watch.saw_reasoning and not watch.saw_content:
            return _trigger("runaway", "reasoning", index)
        if self._empty_stop and finish == "stop" and not watch.answered:
            return _trigger(EMPTY, "content", index)
        return None
