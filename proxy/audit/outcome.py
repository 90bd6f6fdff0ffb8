"""What a response said, normalised for comparison: texts, logprobs, finish reasons, usage.

Two ways in, one shape out: ``outcome_from_response`` reads a non-streamed JSON answer and
``StreamAccumulator`` (a stream inspector) folds the SSE chunks of a streamed one. Both accept
vLLM's chat and completions shapes and llama-server's variants, and never raise on junk: a
malformed piece yields ``tokens=None`` (logprobs) or an empty choice.

Logprobs (both shapes) are parsed by ``proxy.audit.logprobs``.

llama-server quirk: its non-streamed answer ends with the end-of-sequence token as an extra
logprob entry (``"token": ""``, ``"bytes": []``) that its stream lacks. Such a trailing entry is
dropped when the choice finished with "stop", in both paths, so it never reads as divergence.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from proxy.audit.logprobs import (
    NEG_INF_LOGPROB,
    MalformedLogprobs,
    TokenLogprob,
    parse_logprobs,
)
from proxy.openai import cached_tokens_of, error_message, reasoning_of, usage_of
from proxy.relay.inspectors import Delta, Item

__all__ = [
    "NEG_INF_LOGPROB",
    "ChoiceOutcome",
    "Outcome",
    "StreamAccumulator",
    "TokenLogprob",
    "error_message",
    "outcome_from_response",
    "usage_of",
]

# Distinct choice indices one stream may open before it counts as too large.
_MAX_CHOICES: Final = 1024


@dataclass(frozen=True, slots=True)
class ChoiceOutcome:
    index: int
    content: str  # "" when null
    reasoning: str  # from `reasoning`, else `reasoning_content` ("" if none)
    tokens: tuple[TokenLogprob, ...] | None  # None when the response carried no logprobs
    finish_reason: str | None
    stop_reason: str | int | None = None

    def __init__(
        self,
        index: int,
        content: str,
        reasoning: str,
        tokens: tuple[TokenLogprob, ...] | None,
        finish_reason: str | None,
        stop_reason: str | int | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per audited choice, it pays (README).
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "content", content)
        object.__setattr__(self, "reasoning", reasoning)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "finish_reason", finish_reason)
        object.__setattr__(self, "stop_reason", stop_reason)


@dataclass(frozen=True, slots=True)
class Outcome:
    choices: tuple[ChoiceOutcome, ...]
    error: str | None = None  # the response was an error, or broke mid-stream
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    # Prompt tokens the engine said came from its prefix cache (None: not reported).
    cached_tokens: int | None = None

    def __init__(
        self,
        choices: tuple[ChoiceOutcome, ...],
        error: str | None = None,
        prompt_tokens: int | None = None,
        completion_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per audited answer, it pays (README).
        object.__setattr__(self, "choices", choices)
        object.__setattr__(self, "error", error)
        object.__setattr__(self, "prompt_tokens", prompt_tokens)
        object.__setattr__(self, "completion_tokens", completion_tokens)
        object.__setattr__(self, "cached_tokens", cached_tokens)


def _is_chat(endpoint: str) -> bool:
    return "chat" in endpoint  # "chat", "chat/completions", "/v1/chat/completions"


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _str_or_empty(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _stop_reason(value: Any) -> str | int | None:
    if isinstance(value, str):
        return value
    return _int_or_none(value)


def _as_dict(value: Any) -> dict[str, Any] | None:
    """A JSON object as a dict (a mapping that is not one copied into one), else None. Typed a
    dict: compiled, its reads are dict lookups, not ``get`` method calls."""
    if type(value) is dict:  # JSON's dicts: no ABC check
        return value
    return dict(value) if isinstance(value, Mapping) else None


def _choice_from_response(chat: bool, position: int, raw: Any) -> ChoiceOutcome:
    choice = _as_dict(raw)
    if choice is None:
        return ChoiceOutcome(position, "", "", None, None)
    index = _int_or_none(choice.get("index"))
    if index is None:
        index = position
    finish = choice.get("finish_reason")
    finish_reason = finish if isinstance(finish, str) else None
    if chat:
        message = _as_dict(choice.get("message"))
        if message is not None:
            content = _str_or_empty(message.get("content"))
            reasoning = reasoning_of(message) or ""
        else:
            content = reasoning = ""
    else:
        content = _str_or_empty(choice.get("text"))
        reasoning = ""
    tokens: tuple[TokenLogprob, ...] | None = None
    try:
        parsed = parse_logprobs(choice.get("logprobs"))
    except MalformedLogprobs:
        parsed = None
    if parsed is not None:
        entries, eos_last = parsed
        if eos_last and finish_reason == "stop":
            entries.pop()
        tokens = tuple(entries)
    return ChoiceOutcome(
        index, content, reasoning, tokens, finish_reason, _stop_reason(choice.get("stop_reason"))
    )


def outcome_from_response(endpoint: str, body: Mapping[str, Any]) -> Outcome:
    """Normalise a non-streamed answer; ``endpoint`` is "chat" or "completions"."""
    answer = _as_dict(body)
    if answer is None:
        return Outcome((), error="malformed response")
    message = error_message(answer)
    if message is not None:
        return Outcome((), error=message)
    raw_choices = answer.get("choices")
    chat = _is_chat(endpoint)
    choices = (
        tuple(_choice_from_response(chat, i, c) for i, c in enumerate(raw_choices))
        if isinstance(raw_choices, list)
        else ()
    )
    prompt_tokens, completion_tokens = usage_of(answer)
    return Outcome(choices, None, prompt_tokens, completion_tokens, cached_tokens_of(answer))


class _ChoiceState:
    __slots__ = (
        "broken",
        "content",
        "eos_last",
        "finish_reason",
        "reasoning",
        "stop_reason",
        "tokens",
    )

    def __init__(self) -> None:
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.tokens: list[TokenLogprob] | None = None  # None until a logprobs object arrives
        self.broken = False  # a logprobs object was malformed: tokens are unknown
        self.eos_last = False
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None


class StreamAccumulator:
    """Folds one streamed response into an ``Outcome`` (a ``StreamInspector``: ``on_delta``;
    ``on_chunk`` folds one parsed chunk).

    Memory is bounded by ``max_chars``: text characters plus one unit per logprob entry and per
    top-k alternative. Past it, nothing more is kept and the outcome's error is "too_large".
    """

    name = "accumulate"
    __slots__ = (
        "_budget",
        "_cached",
        "_chat",
        "_choices",
        "_error",
        "_full",
        "_last",
        "_last_index",
        "_usage",
    )

    def __init__(self, endpoint: str, max_chars: int = 4_000_000) -> None:
        self._chat = _is_chat(endpoint)
        self._budget = max_chars
        self._full = False
        self._choices: dict[int, _ChoiceState] = {}
        # The choice of the last delta and its state: a stream's tokens are nearly all one
        # choice's, and a dict lookup by int is ~120 instructions a token (callgrind).
        self._last_index = -1
        self._last: _ChoiceState | None = None
        self._error: str | None = None
        self._usage: tuple[int | None, int | None] = (None, None)
        self._cached: int | None = None

    def _overflow(self) -> None:
        self._full = True
        if self._error is None:
            self._error = "too_large"

    def _spend(self, units: int) -> bool:
        if self._full:
            return False
        self._budget -= units
        if self._budget < 0:
            self._overflow()
            return False
        return True

    def on_chunk(self, chunk: dict[str, Any]) -> None:
        if not isinstance(chunk, dict):
            return
        message = error_message(chunk)
        if message is not None:
            if self._error is None:
                self._error = message
            return
        if "usage" in chunk and isinstance(chunk["usage"], dict):
            self._usage = usage_of(chunk)
            self._cached = cached_tokens_of(chunk)
        choices = chunk.get("choices")
        if not isinstance(choices, list):
            return
        for position, raw in enumerate(choices):
            if isinstance(raw, dict):
                self._on_choice(position, raw)

    def _state(self, index: int) -> _ChoiceState | None:
        """Choice ``index``'s state, made on its first event; None past the bound on choices
        (the outcome is then too large)."""
        state = self._choices.get(index)
        if state is None:
            if len(self._choices) >= _MAX_CHOICES:
                self._overflow()
                return None
            state = self._choices[index] = _ChoiceState()
        return state

    def _on_choice(self, position: int, raw: dict[str, Any]) -> None:
        index = _int_or_none(raw.get("index"))
        if index is None:
            index = position
        state = self._state(index)
        if state is None:
            return
        finish = raw.get("finish_reason")
        if isinstance(finish, str):
            state.finish_reason = finish
        stop = _stop_reason(raw.get("stop_reason"))
        if stop is not None:
            state.stop_reason = stop
        if self._full:
            return
        if self._chat:
            delta = raw.get("delta")
            if isinstance(delta, dict):
                text = delta.get("content")
                if isinstance(text, str) and text and self._spend(len(text)):
                    state.content.append(text)
                thought = reasoning_of(delta)
                if thought is not None and self._spend(len(thought)):
                    state.reasoning.append(thought)
        else:
            text = raw.get("text")
            if isinstance(text, str) and text and self._spend(len(text)):
                state.content.append(text)
        logprobs = raw.get("logprobs")
        if logprobs is not None and not state.broken:
            self._on_logprobs(state, logprobs)

    def on_delta(self, item: Item) -> None:
        """One event of the stream: a token chunk's text, or another chunk, parsed."""
        if type(item) is not Delta:
            assert type(item) is dict
            self.on_chunk(item)
            return
        index = item.index
        state = self._last
        if index != self._last_index or state is None:
            state = self._state(index)
            if state is None:
                return
            self._last_index, self._last = index, state
        text = item.text
        if self._full or not text or not self._spend(len(text)):
            return
        if self._chat and item.channel == "reasoning":
            state.reasoning.append(text)
        else:
            state.content.append(text)

    def _on_logprobs(self, state: _ChoiceState, logprobs: Any) -> None:
        try:
            parsed = parse_logprobs(logprobs)
        except MalformedLogprobs:
            state.broken = True
            state.tokens = None
            return
        if parsed is None:
            return
        entries, eos_last = parsed
        if state.tokens is None:
            state.tokens = []
        if entries:
            if not self._spend(sum(1 + len(e.top) for e in entries)):
                return
            state.tokens.extend(entries)
            state.eos_last = eos_last

    def on_end(self, complete: bool) -> None:
        if not complete and self._error is None:
            self._error = "incomplete"

    def outcome(self) -> Outcome:
        choices: list[ChoiceOutcome] = []
        for index in sorted(self._choices):
            state = self._choices[index]
            tokens: tuple[TokenLogprob, ...] | None = None
            if state.tokens is not None and not state.broken:
                kept = state.tokens
                if state.eos_last and state.finish_reason == "stop":
                    kept = kept[:-1]
                tokens = tuple(kept)
            choices.append(
                ChoiceOutcome(
                    index,
                    "".join(state.content),
                    "".join(state.reasoning),
                    tokens,
                    state.finish_reason,
                    state.stop_reason,
                )
            )
        return Outcome(tuple(choices), self._error, *self._usage, self._cached)


def outcome_completion_tokens(outcome: Outcome) -> int:
    """The engine's count where it gave one, else one per token seen (or ~4 chars each)."""
    if outcome.completion_tokens is not None:
        return outcome.completion_tokens
    return sum(len(c.tokens) if c.tokens else len(c.content) // 4 + 1 for c in outcome.choices)


def outcome_tokens(outcome: Outcome) -> int:
    """Prompt and completion tokens: what the answer cost the engine."""
    return (outcome.prompt_tokens or 0) + outcome_completion_tokens(outcome)
