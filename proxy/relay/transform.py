"""What an inspected event becomes on its way to the client: the relay's last stage, a chain
of small transforms with one job each (``Transforms``; ``transforms`` builds it from the plan).

The rewrites change a parsed chunk, each one thing, in place: ``strip_logprobs`` (logprobs
detproxy injected: the client did not ask for them), ``KeepId`` (a restarted attempt's chunks
keep the first attempt's ``id``) and ``reasoning_moved`` (after a closed reasoning its reasoning
is content: ``Extractor.parse`` moved it, the chunk is encoded again). A chunk no rewrite
changed keeps its bytes. The holds keep events back: ``HoldReasoning`` holds reasoning until it
ends (within a bound), so an attempt abandoned for a loop is never shown; ``HoldTail`` keeps
the last chars of text back, released as more come. An event goes to the first hold that is
holding. A decision that stops the attempt drops what is held (``drop``); anything else
releases it, ahead of the event that ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Final

import orjson

from proxy.http.sse import encode_event
from proxy.openai import REASONING_KEYS, reasoning_of
from proxy.openai import strip_logprobs as _strip_logprobs
from proxy.relay.inspectors import Delta, Item


def _releases_hold(item: Item) -> bool | None:
    """True: reasoning is over; False: a reasoning delta; None: neither (e.g. the role chunk)."""
    if type(item) is Delta:
        return (item.channel == "content") if item.text else None
    assert type(item) is dict
    choices = item.get("choices")
    if not isinstance(choices, list) or not choices:
        return True  # usage or error chunks end the hold
    reasoning = False
    for choice in choices:
        if not isinstance(choice, dict):
            continue
        if choice.get("finish_reason") is not None or choice.get("text"):
            return True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            if delta.get("content") or delta.get("tool_calls"):
                return True
            if reasoning_of(delta) is not None:
                reasoning = True
    return False if reasoning else None


def _texts(item: Item) -> tuple[int, int] | None:
    """The chars (content, reasoning) of an event that carries text deltas only; None for any
    other (no choices, a finish, tool calls)."""
    if type(item) is Delta:
        return (len(item.text), 0) if item.channel == "content" else (0, len(item.text))
    assert type(item) is dict
    return _chunk_texts(item)


def _chunk_texts(chunk: Mapping[str, Any]) -> tuple[int, int] | None:
    choices = chunk.get("choices")
    if type(choices) is not list or not choices:
        return None
    content = reasoning = 0
    for choice in choices:
        if type(choice) is not dict or choice.get("finish_reason") is not None:
            return None
        text = choice.get("text")
        if type(text) is str:
            content += len(text)
        delta = choice.get("delta")
        if type(delta) is dict:
            if delta.get("tool_calls"):
                return None
            own = delta.get("content")
            if type(own) is str:
                content += len(own)
            thought = reasoning_of(delta)
            if thought:
                reasoning += len(thought)
    return content, reasoning


# A rewrite: changes a parsed chunk in place; returns whether it changed it.
Rewrite = Callable[[dict[str, Any]], bool]


class KeepId:
    """A restarted attempt's chunks keep the first attempt's ``id``."""

    __slots__ = ("id",)

    def __init__(self, chunk_id: str) -> None:
        self.id = chunk_id

    def __call__(self, chunk: dict[str, Any]) -> bool:
        if chunk.get("id") == self.id:
            return False
        chunk["id"] = self.id
        return True


def reasoning_moved(chunk: dict[str, Any]) -> bool:
    """After a closed reasoning: the extractor moved the chunk's reasoning to content, so its
    bytes are the chunk encoded again."""
    return True


class HoldReasoning:
    """Reasoning held until it ends, within ``max_bytes`` (past it: shown, ``on_overflow``)."""

    __slots__ = ("_max", "_on_overflow", "held", "heldbytes_", "holding")

    def __init__(self, max_bytes: int, on_overflow: Callable[[], None]) -> None:
        self._max = max_bytes
        self._on_overflow = on_overflow  # the held reasoning went past its bound
        self.holding = True
        self.held: list[bytes] = []
        self.heldbytes_ = 0

    def hold(self, item: Item, raw: bytes) -> bytes | None:
        release = _releases_hold(item)
        if release is True:
            self.holding = False
            return self.release(raw)
        if release is False or self.held:
            self.held.append(raw)
            self.heldbytes_ += len(raw)
            if self.heldbytes_ > self._max:
                self.holding = False  # past the bound: show what was held, stop holding
                self._on_overflow()
                return self.release(b"")
            return None
        return raw

    def release(self, raw: bytes) -> bytes:
        if not self.held:
            return raw
        held = b"".join(self.held) + raw
        self.held.clear()
        return held

    def stop(self) -> None:
        self.holding = False

    def drop(self) -> tuple[str, ...]:
        """The fields the dropped reasoning came in (none held: ``()``)."""
        if not self.held:
            return ()
        held = b"".join(self.held)
        self.held.clear()
        return (
            tuple(k for k in REASONING_KEYS if b'"' + k.encode() + b'":"' in held)
            or REASONING_KEYS[:1]
        )


class HoldTail:
    """The last ``chars`` chars of text held back, released as more come."""

    __slots__ = ("_chars", "holding", "tail", "tail_chars")

    def __init__(self, chars: int) -> None:
        self._chars = chars
        self.holding = True  # until the stream ends
        # Each held chunk's bytes and its text's chars (content, reasoning).
        self.tail: list[tuple[bytes, int, int]] = []
        self.tail_chars = 0

    def hold(self, item: Item, raw: bytes) -> bytes | None:
        """Hold a text chunk; release what is held past the bound. Any other chunk (a finish,
        usage, tool calls) releases the whole tail before it."""
        texts = _texts(item)
        if texts is None:
            return self.release(raw)
        content, reasoning = texts
        self.tail.append((raw, content, reasoning))
        self.tail_chars += content + reasoning
        released: list[bytes] = []
        while self.tail and self.tail_chars > self._chars:
            out, c, r = self.tail.pop(0)
            self.tail_chars -= c + r
            released.append(out)
        return b"".join(released) if released else None

    def release(self, raw: bytes) -> bytes:
        if not self.tail:
            return raw
        raw = b"".join([t[0] for t in self.tail]) + raw
        self.tail.clear()
        self.tail_chars = 0
        return raw

    def stop(self) -> None:
        pass  # text after the end is not held: there is none

    def drop(self) -> tuple[int, int]:
        """The chars (content, reasoning) of the dropped tail."""
        if not self.tail:
            return (0, 0)
        unshown = (sum(c for _, c, _ in self.tail), sum(r for _, _, r in self.tail))
        self.tail.clear()
        self.tail_chars = 0
        return unshown


_NO_REWRITES: Final[tuple[Rewrite, ...]] = ()


class Transforms:
    """One attempt's chain: its rewrites, then its holds (what ``StreamPlan`` asks for)."""

    __slots__ = ("holds", "reasoning", "rewrites", "tail")

    def __init__(
        self,
        rewrites: tuple[Rewrite, ...] = _NO_REWRITES,
        reasoning: HoldReasoning | None = None,
        tail: HoldTail | None = None,
    ) -> None:
        self.rewrites = rewrites
        self.reasoning = reasoning
        self.tail = tail
        # Whether an event may be held (none is rewritten without being parsed first).
        self.holds = reasoning is not None or tail is not None

    def rewrite(self, chunk: dict[str, Any], raw: bytes) -> bytes:
        """The bytes of one parsed chunk as the client gets them."""
        changed = False
        for rewrite in self.rewrites:
            if rewrite(chunk):
                changed = True
        return encode_event(orjson.dumps(chunk)) if changed else raw

    def hold(self, item: Item, raw: bytes) -> bytes | None:
        """The bytes an inspected event lets out now (None: it is held): the first hold that
        is holding takes it."""
        reasoning = self.reasoning
        if reasoning is not None and reasoning.holding:
            return reasoning.hold(item, raw)
        tail = self.tail
        if tail is not None:
            return tail.hold(item, raw)
        return raw

    def release(self, raw: bytes) -> bytes:
        """Whatever is held, then ``raw``."""
        if self.tail is not None:
            raw = self.tail.release(raw)
        if self.reasoning is not None:
            raw = self.reasoning.release(raw)
        return raw

    def end_hold(self, raw: bytes) -> bytes:
        """``[DONE]``, a comment, or an event that stops inspection: no more holding."""
        if self.reasoning is not None:
            self.reasoning.stop()
        return self.release(raw)

    def drop(self) -> tuple[tuple[str, ...], tuple[int, int]]:
        """A decision stopped the attempt: what was held is never shown. The fields held
        reasoning came in (none held: ``()``), and the chars (content, reasoning) of the
        held-back tail."""
        hidden = self.reasoning.drop() if self.reasoning is not None else ()
        unshown = self.tail.drop() if self.tail is not None else (0, 0)
        return hidden, unshown


def transforms(
    *,
    strip_logprobs: bool,
    id_override: str | None,
    reasoning_as_content: bool,
    hold_reasoning: bool,
    hold_max_bytes: int,
    hold_back_chars: int,
    on_overflow: Callable[[], None],
) -> Transforms:
    """The chain a plan asks for: only the transforms it needs, in their order."""
    rewrites: list[Rewrite] = []
    if strip_logprobs:
        rewrites.append(_strip_logprobs)
    if id_override is not None:
        rewrites.append(KeepId(id_override))
    if reasoning_as_content:
        rewrites.append(reasoning_moved)
    return Transforms(
        tuple(rewrites),
        HoldReasoning(hold_max_bytes, on_overflow) if hold_reasoning else None,
        HoldTail(hold_back_chars) if hold_back_chars > 0 else None,
    )
