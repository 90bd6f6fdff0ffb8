"""What an inspected event becomes on its way to the client: the relay's last stage.

The rewrites change a parsed chunk's bytes: logprobs detproxy injected are stripped (the client
did not ask for them), a restarted attempt's chunks keep the first attempt's ``id``, and after
a closed reasoning its reasoning is content (``Extractor.parse`` moved it; the chunk is encoded
again). The holds keep events back: ``hold_reasoning`` holds reasoning until it ends (within a
bound), so an attempt abandoned for a loop is never shown; ``hold_back_chars`` keeps the last
chars of text back, released as more come. A decision that stops the attempt drops what is
held (``drop``); anything else releases it, ahead of the event that ends it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import orjson

from proxy.http.sse import encode_event
from proxy.openai import REASONING_KEYS, reasoning_of, strip_logprobs
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


class Transforms:
    """One attempt's rewrites and holds (what ``StreamPlan`` asks for)."""

    __slots__ = (
        "_hold_back",
        "_hold_max",
        "_id",
        "_move",
        "_on_overflow",
        "_strip",
        "held",
        "heldbytes_",
        "holding",
        "holds",
        "tail",
        "tail_chars",
    )

    def __init__(
        self,
        *,
        strip_logprobs: bool,
        id_override: str | None,
        reasoning_as_content: bool,
        hold_reasoning: bool,
        hold_max_bytes: int,
        hold_back_chars: int,
        on_overflow: Callable[[], None],
    ) -> None:
        self._strip = strip_logprobs
        self._id = id_override
        self._move = reasoning_as_content
        self._hold_max = hold_max_bytes
        self._hold_back = hold_back_chars
        self._on_overflow = on_overflow  # the held reasoning went past its bound
        # Whether an event may be held (none is rewritten without being parsed first).
        self.holds = hold_reasoning or hold_back_chars > 0
        self.holding = hold_reasoning
        self.held: list[bytes] = []
        self.heldbytes_ = 0
        # The held-back tail: each chunk's bytes and its text's chars (content, reasoning).
        self.tail: list[tuple[bytes, int, int]] = []
        self.tail_chars = 0

    def rewrite(self, chunk: dict[str, Any], raw: bytes) -> bytes:
        """The bytes of one parsed chunk as the client gets them."""
        changed = False
        if self._strip and strip_logprobs(chunk):
            changed = True  # logprobs detproxy injected: the client did not ask
        if self._id is not None and chunk.get("id") != self._id:
            chunk["id"] = self._id
            changed = True
        if self._move:
            changed = True  # the extractor moved its reasoning
        return encode_event(orjson.dumps(chunk)) if changed else raw

    def hold(self, item: Item, raw: bytes) -> bytes | None:
        """The bytes an inspected event lets out now (None: it is held)."""
        if self.holding:
            return self._hold_reasoning(_releases_hold(item), raw)
        if self._hold_back > 0:
            return self._hold_tail(item, raw)
        return raw

    def _hold_reasoning(self, release: bool | None, raw: bytes) -> bytes | None:
        if release is True:
            self.holding = False
            return self.release(raw)
        if release is False or self.held:
            self.held.append(raw)
            self.heldbytes_ += len(raw)
            if self.heldbytes_ > self._hold_max:
                self.holding = False  # past the bound: show what was held, stop holding
                self._on_overflow()
                return self.release(b"")
            return None
        return raw

    def _hold_tail(self, item: Item, raw: bytes) -> bytes | None:
        """Hold a text chunk in the tail; release what the tail holds past its bound. Any
        other chunk (a finish, usage, tool calls) releases the whole tail before it."""
        texts = _texts(item)
        if texts is None:
            return self.release(raw)
        content, reasoning = texts
        self.tail.append((raw, content, reasoning))
        self.tail_chars += content + reasoning
        released: list[bytes] = []
        while self.tail and self.tail_chars > self._hold_back:
            out, c, r = self.tail.pop(0)
            self.tail_chars -= c + r
            released.append(out)
        return b"".join(released) if released else None

    def release(self, raw: bytes) -> bytes:
        """Whatever is held, then ``raw``."""
        if self.tail:
            raw = b"".join([t[0] for t in self.tail]) + raw
            self.tail.clear()
            self.tail_chars = 0
        if not self.held:
            return raw
        held = b"".join(self.held) + raw
        self.held.clear()
        return held

    def end_hold(self, raw: bytes) -> bytes:
        """``[DONE]``, a comment, or an event that stops inspection: no more holding."""
        self.holding = False
        return self.release(raw)

    def drop(self) -> tuple[tuple[str, ...], tuple[int, int]]:
        """A decision stopped the attempt: what was held is never shown. The fields held
        reasoning came in (none held: ``()``), and the chars (content, reasoning) of the
        held-back tail."""
        hidden: tuple[str, ...] = ()
        if self.held:
            held = b"".join(self.held)
            hidden = (
                tuple(k for k in REASONING_KEYS if b'"' + k.encode() + b'":"' in held)
                or REASONING_KEYS[:1]
            )
            self.held.clear()
        unshown = (0, 0)
        if self.tail:
            unshown = (sum(c for _, c, _ in self.tail), sum(r for _, _, r in self.tail))
            self.tail.clear()
            self.tail_chars = 0
        return hidden, unshown
