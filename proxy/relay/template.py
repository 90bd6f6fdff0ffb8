"""Chunk templates: read a token chunk's text without parsing the whole chunk.

Within one stream, vLLM's token chunks differ only in their text: ``{"id":"X",...,"choices":
[{"index":0,"delta":{"content":"<text>"},"logprobs":null,"finish_reason":null}]}``. A
``ChunkTemplate`` is such a chunk cut around the JSON string literal of its text: ``prefix``
runs up to its opening quote and ``suffix`` from its closing quote, both quotes included,
learned from a chunk the relay parsed. A later data field that starts with the prefix and ends
with the suffix is the same chunk with another text if what lies from one quote to the other
is one JSON string literal. ``decode`` checks that for a whole run of them at once: every
literal has only its two quotes (a count over the run), none after a backslash, and
``[lit,lit,...]`` parses to as many strings in one ``orjson.loads``; a run that fails the
quote checks (texts with quotes or ending in a backslash) has each literal checked on its own;
a run that fails to parse is not trusted, and the caller parses each chunk as usual. So a hit
has exactly the meaning of the parsed chunk.

A template is learned only from the plain shape: one choice with an int index, no finish
reason, no logprobs, no usage, and (chat) a delta whose only key is ``content``, ``reasoning``
or ``reasoning_content`` (completions: a ``text`` and no delta), holding a string, or whose only
keys are ``reasoning`` and ``reasoning_content`` holding the same string (vLLM 0.11.1-0.15
sends both): its two literals must then be the same bytes in every chunk (``middle`` is what
lies between them). Each literal is located by its key, which must occur once in the data, and
verified: the data with another literal there must parse to the chunk with that other text and
nothing else changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from proxy.openai import REASONING_KEYS

MAX_TEMPLATES = 4  # e.g. reasoning and content chunks, and a new "created" second
_CHAT_KEYS = ("content", *REASONING_KEYS)
_BOTH = REASONING_KEYS
_WHITESPACE = b" \t"


@dataclass(frozen=True, slots=True)
class ChunkTemplate:
    prefix: bytes  # the data field up to the text's opening quote, included
    suffix: bytes  # the data field from the text's closing quote, included
    index: int  # the choice index
    channel: str  # "content" or "reasoning" (``Delta``'s names)
    event_prefix: bytes  # b"data: " + prefix, and suffix + b"\n\n": a whole event's ends
    event_suffix: bytes
    middle: bytes | None = None  # between the text's two copies, when it has two

    def __init__(
        self,
        prefix: bytes,
        suffix: bytes,
        index: int,
        channel: str,
        event_prefix: bytes,
        event_suffix: bytes,
        middle: bytes | None = None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per template, it pays (README).
        object.__setattr__(self, "prefix", prefix)
        object.__setattr__(self, "suffix", suffix)
        object.__setattr__(self, "index", index)
        object.__setattr__(self, "channel", channel)
        object.__setattr__(self, "event_prefix", event_prefix)
        object.__setattr__(self, "event_suffix", event_suffix)
        object.__setattr__(self, "middle", middle)

    def literal(self, data: bytes, event: bool = False) -> bytes | None:
        """The text's literal in a data field (``event``: a whole event, ``data: `` line and
        blank line) of this template's form; not checked to be one JSON string (``decode``
        does), nor, for an event, to hold no line feed."""
        if event:
            prefix, suffix = self.event_prefix, self.event_suffix
        else:
            prefix, suffix = self.prefix, self.suffix
        if not (data.startswith(prefix) and data.endswith(suffix)):
            return None
        inner = data[len(prefix) - 1 : len(data) - len(suffix) + 1]  # from quote to quote
        middle = self.middle
        if middle is None:
            return inner
        size, odd = divmod(len(inner) - len(middle), 2)
        if odd or size < 2 or not inner.startswith(middle, size):
            return None
        literal = inner[:size]
        return literal if inner.endswith(literal) else None


def _literal_end(data: bytes, start: int) -> int:
    """Index of the closing quote of the JSON string literal opening at ``start``, or -1."""
    pos = start + 1
    while True:
        pos = data.find(b'"', pos)
        if pos < 0:
            return -1
        back = pos - 1
        while data[back] == 0x5C:  # a quote after an odd number of backslashes is escaped
            back -= 1
        if (pos - 1 - back) % 2 == 0:
            return pos
        pos += 1


def plain_shape(
    chunk: dict[str, Any], chat: bool
) -> tuple[dict[str, Any], int, tuple[str, ...], str] | None:
    """(choice, index, keys, text) when the chunk has the plain shape."""
    if isinstance(chunk.get("usage"), dict):
        return None
    choices = chunk.get("choices")
    if type(choices) is not list or len(choices) != 1:
        return None
    choice = choices[0]
    if type(choice) is not dict or choice.get("finish_reason") is not None:
        return None
    if choice.get("logprobs") is not None:
        return None  # they differ from token to token: no later chunk would match
    if choice.get("stop_reason") is not None:
        return None
    index = choice.get("index", 0)
    if type(index) is not int:
        return None
    if chat:
        delta = choice.get("delta")
        if type(delta) is not dict or "text" in choice:
            return None
        if len(delta) == 1:
            ((key, value),) = delta.items()
            if key not in _CHAT_KEYS:
                return None
            keys: tuple[str, ...] = (key,)
        elif len(delta) == 2 and delta.get(_BOTH[0], 0) == delta.get(_BOTH[1], 1):
            keys, value = _BOTH, delta.get("reasoning")
        else:
            return None
    else:
        if "delta" in choice:
            return None
        keys, value = ("text",), choice.get("text")
    if type(value) is not str:
        return None
    return choice, index, keys, value


def _span(data: bytes, key: str) -> tuple[int, int] | None:
    """Where the string literal of ``key`` (its only occurrence) opens and closes."""
    needle = b'"' + key.encode() + b'"'
    at = data.find(needle)
    if at < 0 or data.find(needle, at + 1) >= 0:
        return None
    pos = at + len(needle)
    while pos < len(data) and data[pos] in _WHITESPACE:
        pos += 1
    if data[pos : pos + 1] != b":":
        return None
    pos += 1
    while pos < len(data) and data[pos] in _WHITESPACE:
        pos += 1
    if data[pos : pos + 1] != b'"':
        return None
    end = _literal_end(data, pos)
    return None if end < 0 else (pos, end + 1)


def learn(chunk: dict[str, Any], data: bytes, chat: bool) -> ChunkTemplate | None:
    """A template from one parsed chunk and its data field, when it has the plain shape."""
    shape = plain_shape(chunk, chat)
    return None if shape is None else _locate(chunk, data, chat, *shape)


def _locate(
    chunk: dict[str, Any],
    data: bytes,
    chat: bool,
    choice: dict[str, Any],
    index: int,
    keys: tuple[str, ...],
    value: str,
) -> ChunkTemplate | None:
    spans = []
    for key in keys:
        span = _span(data, key)
        if span is None:
            return None
        spans.append(span)
    spans.sort()
    (start, end), middle = spans[0], None
    if len(spans) == 2:
        (start2, end2) = spans[1]
        if data[start:end] != data[start2:end2]:
            return None  # the two copies must read the same in every chunk
        middle = data[end:start2]
        end = end2
    prefix, suffix = data[: start + 1], data[end - 1 :]
    probe = "\x00" if value != "\x00" else "\x01"
    literal = orjson.dumps(probe)
    if chat:
        expected = {**chunk, "choices": [{**choice, "delta": dict.fromkeys(keys, probe)}]}
    else:
        expected = {**chunk, "choices": [{**choice, "text": probe}]}
    inner = literal if middle is None else literal + middle + literal
    try:
        if orjson.loads(prefix[:-1] + inner + suffix[1:]) != expected:
            return None
    except orjson.JSONDecodeError:
        return None
    channel = "content" if keys[0] in ("content", "text") else "reasoning"
    return ChunkTemplate(
        prefix, suffix, index, channel, b"data: " + prefix, suffix + b"\n\n", middle
    )


def decode(literals: list[bytes]) -> list[str] | None:
    """The texts of a run of template hits, or ``None`` unless each literal is one JSON string.

    Each literal must start and end with a quote, as ``ChunkTemplate`` cuts them (its prefix
    and suffix end and start with one); so when the run holds two quotes per literal and no
    quote after a backslash, every literal is one string token, and the parse checks what is
    inside."""
    if min(map(len, literals)) < 2:  # the quotes at both ends are not one and the same
        return None
    joined = b",".join(literals)
    if joined.count(b'"') != 2 * len(literals) or b'\\"' in joined:
        for literal in literals:  # texts with quotes, or ending in a backslash
            if _literal_end(literal, 0) != len(literal) - 1:
                return None
    try:
        texts = orjson.loads(b"[" + joined + b"]")
    except orjson.JSONDecodeError:
        return None
    if type(texts) is not list or len(texts) != len(literals):
        return None
    for text in texts:
        if type(text) is not str:
            return None
    return texts


class Templates:
    """The templates of one attempt, most recently learned first, and a learning budget: a
    stream whose chunks never match stops paying for learning after a few tries."""

    __slots__ = ("_chat", "active", "hits", "learned")

    def __init__(self, chat: bool) -> None:
        self._chat = chat
        self.active: list[ChunkTemplate] = []
        self.hits = 0
        self.learned = 0  # learning attempts

    def wants(self) -> bool:
        return self.learned < 4 + self.hits // 16

    def learn(self, chunk: dict[str, Any], data: bytes) -> None:
        """Learn from a parsed chunk of the plain shape (other chunks cost no budget)."""
        shape = plain_shape(chunk, self._chat)
        if shape is None:
            return
        if not self.wants():
            if not self.hits:
                self.active = []  # never of use (e.g. token_ids in every chunk): stop matching
            return
        self.learned += 1
        found = _locate(chunk, data, self._chat, *shape)
        if found is not None:
            kept = [t for t in self.active if (t.index, t.channel) != (found.index, found.channel)]
            self.active = [found, *kept][:MAX_TEMPLATES]

    def match(
        self, datas: list[bytes | None], start: int
    ) -> tuple[list[bytes], list[ChunkTemplate]]:
        """The literals of the template hits from ``datas[start]`` on, up to the first miss,
        and the template each matched."""
        literals: list[bytes] = []
        matched: list[ChunkTemplate] = []
        active = self.active
        if not active:
            return literals, matched
        tpl = active[0]
        # The usual case inline: a one-literal template, checked by its prefix and suffix, and
        # the literal from quote to quote (the suffix is longer than its quote).
        inline = tpl.middle is None
        prefix, suffix = tpl.prefix, tpl.suffix
        cut, end = len(prefix) - 1, 1 - len(suffix)
        for i in range(start, len(datas)):
            data = datas[i]
            if data is None:
                break
            if inline and data.startswith(prefix) and data.endswith(suffix):
                # A data field shorter than prefix + suffix yields a literal too short for
                # decode().
                literals.append(data[cut:end])
                matched.append(tpl)
                continue
            for other in active:
                literal = other.literal(data)
                if literal is not None:
                    literals.append(literal)
                    matched.append(other)
                    tpl = other
                    inline = tpl.middle is None
                    prefix, suffix = tpl.prefix, tpl.suffix
                    cut, end = len(prefix) - 1, 1 - len(suffix)
                    break
            else:
                break
        return literals, matched
