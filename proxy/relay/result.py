"""What one streamed attempt came to: events, the first id, tokens, usage and their timing.

``StreamResult`` is what the relay reports (``proxy.relay.stream``), on its raw path and its
inspected one alike: each data event, as the extractor gives it (``proxy.relay.extract``: a
``Delta`` or a parsed chunk), is counted by ``tally``, here, once. Tokens are counted as tokens,
not events: a chunk can carry several (vLLM's stream interval, speculative decoding), told by
usage growth, else by logprobs entries, else one an event.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from policies.base import Abort, Retry, Trigger
from proxy.openai import choice_text, completion_tokens_of
from proxy.relay.inspectors import Delta, Item


@dataclass(slots=True)
class StreamResult:
    complete: bool = False  # the upstream stream ended normally
    first_event_s: float | None = None  # since the start of the request
    events: int = 0
    first_id: str | None = None
    trigger: Trigger | None = None
    decision: Retry | Abort | None = None  # the relay stopped early on this
    # Speed as the client sees it: token events (chunks carrying text), seconds since t0.
    token_events: int = 0
    first_token_s: float | None = None
    last_token_s: float | None = None
    completion_tokens: int | None = None  # from a usage chunk, when the upstream sends one
    # The tokens the token events carried (a chunk can carry several: vLLM's stream interval,
    # speculative decoding), from usage growth, else logprobs entries, else one an event.
    tokens: int = 0
    first_tokens: int = 0  # those of the first token event
    # A decision dropped held reasoning the client never saw: the fields it came in.
    hidden_reasoning_keys: tuple[str, ...] = ()

    def __init__(self) -> None:
        # Written out: compiled, unlike a generated one; made per stream, it pays (README).
        # Every field starts at its default above.
        self.complete = False
        self.first_event_s = None
        self.events = 0
        self.first_id = None
        self.trigger = None
        self.decision = None
        self.token_events = 0
        self.first_token_s = None
        self.last_token_s = None
        self.completion_tokens = None
        self.tokens = 0
        self.first_tokens = 0
        self.hidden_reasoning_keys = ()

    def add_events(self, n: int, at: float) -> None:
        """``n`` whole events arrived, ``at`` seconds since the start of the request."""
        if self.first_event_s is None:
            self.first_event_s = at
        self.events += n

    def speed(self) -> StreamSpeed | None:
        """The stream's speed in tokens; None when no token came."""
        first, last = self.first_token_s, self.last_token_s
        if first is None or last is None:
            return None
        total = self.completion_tokens or self.tokens
        after = total - self.first_tokens  # the tokens that came after the first token event
        decode_s = last - first
        return StreamSpeed(
            ttft_s=first,
            tokens=total,
            inter_token_s=decode_s / after if after > 0 else None,
            tokens_per_s=after / decode_s if after > 0 and decode_s > 0 else None,
        )


@dataclass(frozen=True, slots=True)
class StreamSpeed:
    ttft_s: float
    tokens: int  # the usage's completion_tokens when the upstream sent it
    inter_token_s: float | None  # mean time between the tokens after the first token event
    tokens_per_s: float | None  # decode rate between the first and the last token event

    def __init__(
        self,
        ttft_s: float,
        tokens: int,
        inter_token_s: float | None,
        tokens_per_s: float | None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per stream, it pays (README).
        object.__setattr__(self, "ttft_s", ttft_s)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "inter_token_s", inter_token_s)
        object.__setattr__(self, "tokens_per_s", tokens_per_s)


def _listed(logprobs: Any) -> int:
    """The tokens a chunk's logprobs list: chat's ``content``, completions' ``tokens``."""
    if type(logprobs) is not dict:
        return 0
    entries = logprobs.get("content")
    if type(entries) is not list:
        entries = logprobs.get("tokens")
    return len(entries) if type(entries) is list else 0


def text_tokens(chunk: dict[str, Any]) -> tuple[bool, int]:
    """Whether a parsed chunk carries text, and the logprobs entries of its choices with text."""
    choices = chunk.get("choices")
    found, listed = False, 0
    if type(choices) is list:
        for choice in choices:
            if type(choice) is not dict:
                continue
            if choice_text(choice) is not None:
                found = True
                listed += _listed(choice.get("logprobs"))
    return found, listed


def tally(result: StreamResult, item: Item, at: float) -> None:
    """Token timing and usage of one data event, ``at`` seconds since the start."""
    if type(item) is Delta:
        if item.text:  # one token event, one token: count_tokens(result, 1, at), inline
            if result.first_token_s is None:
                result.first_token_s = at
                result.first_tokens = 1
            result.last_token_s = at
            result.token_events += 1
            result.tokens += 1
        return
    assert type(item) is dict
    found, listed = text_tokens(item)
    before = result.completion_tokens
    usage = completion_tokens_of(item)
    if usage is not None:
        result.completion_tokens = usage
    if found:
        grown = usage - (before or 0) if usage is not None else 0
        count_tokens(result, 1, at, grown if grown > 0 else listed or 1)


def count_tokens(result: StreamResult, events: int, at: float, tokens: int | None = None) -> None:
    """``events`` token events at ``at``, carrying ``tokens`` tokens (one each unless known)."""
    n = events if tokens is None else tokens
    if result.first_token_s is None:
        result.first_token_s = at
        result.first_tokens = n
    result.last_token_s = at
    result.token_events += events
    result.tokens += n
