"""From an event's data field to what the inspectors see: a ``Delta`` or another chunk.

Every engine streams a token as a chunk that carries one text and nothing else an inspector
reads: one choice, its ``content`` or its reasoning (``reasoning``, ``reasoning_content``, or
both with the same text, as vLLM 0.11.1-0.15 sends them; completions: its ``text``), no finish
reason, no logprobs, no usage. Such a chunk becomes a ``Delta`` (choice, channel, text); any
other chunk (the role, a finish, tool calls, logprobs, usage, an error) is handed on parsed, as
the dict it is.

Parsing every token chunk costs most of the relay's time, so the ``Extractor`` learns, from the
chunks it parses, what their bytes look like around the text (``proxy.relay.template``): a later
data field of the same form is read without parsing it, a run of them with one ``orjson.loads``.
A hit means exactly what the parsed chunk means (the template's docstring says why), so the
same stream gives the same deltas whether or not a template read them; nothing downstream knows
which did (``templates=False`` is the reference the tests compare with).
"""

from __future__ import annotations

from typing import Any, Final

import orjson

from proxy.openai import move_reasoning_to_content
from proxy.relay.inspectors import Delta
from proxy.relay.template import Templates, decode, plain_shape

# Bound once: compiled, ``orjson.loads`` would be looked up on the module at every call.
_loads: Final = orjson.loads
_CONTENT_KEYS: Final = ("content", "text")
_LF: Final = 10  # ``10 in data``: a memchr


class Extractor:
    """Reads one attempt's data fields; learns its templates as it goes."""

    __slots__ = ("_chat", "_id", "_move", "templates")

    def __init__(
        self,
        chat: bool,
        *,
        templates: bool = True,
        id_override: str | None = None,
        reasoning_as_content: bool = False,
    ) -> None:
        self._chat = chat
        self._move = reasoning_as_content  # reasoning deltas are the answer's content
        self._id = id_override  # chunks under another id are rewritten: none is a template
        self.templates = Templates(chat) if templates and not reasoning_as_content else None

    @property
    def hits(self) -> int:
        """Chunks read through a template, not parsed."""
        return 0 if self.templates is None else self.templates.hits

    def delta(self, data: bytes, event: bool = False) -> Delta | None:
        """The delta of one data field that a template reads (None: it must be parsed);
        ``event``: ``data`` is a whole read, read as one event if it is one."""
        templates = self.templates
        if templates is None:
            return None
        for tpl in templates.active:
            literal = tpl.literal(data, event)
            if literal is not None:
                break
        else:
            return None
        if event and _LF in literal:
            return None  # not one event of one line
        try:
            text = _loads(literal)  # it starts and ends with a quote: one string, or junk
        except orjson.JSONDecodeError:
            return None
        if type(text) is not str:
            return None
        templates.hits += 1
        return Delta(tpl.index, tpl.channel, text)

    def deltas(self, datas: list[bytes | None], start: int) -> list[Delta]:
        """The deltas of the data fields from ``datas[start]`` on that templates read, up to the
        first they do not (an empty list: ``datas[start]`` must be parsed)."""
        templates = self.templates
        if templates is None or not templates.active:
            return []
        literals, matched = templates.match(datas, start)
        if not literals:
            return []
        texts = decode(literals)
        if texts is None:  # not what the templates say: each is parsed
            return []
        templates.hits += len(texts)
        return [Delta(tpl.index, tpl.channel, t) for tpl, t in zip(matched, texts, strict=True)]

    def parse(self, data: bytes) -> dict[str, Any] | None:
        """A data field as a JSON object (None: it is not one), its reasoning moved to content
        where the attempt says so; a chunk of the plain shape may teach a template."""
        try:
            chunk = _loads(data)
        except orjson.JSONDecodeError:
            return None
        if type(chunk) is not dict:
            return None
        if self._move:
            move_reasoning_to_content(chunk)  # seen, counted and relayed as content
        templates = self.templates
        if templates is not None and (self._id is None or chunk.get("id") == self._id):
            templates.learn(chunk, data)
        return chunk

    def delta_of(self, chunk: dict[str, Any]) -> Delta | None:
        """The delta a parsed chunk is, when it carries one text and nothing else (the shape a
        template is learned from: the same rule, so a hit and a parse give the same)."""
        shape = plain_shape(chunk, self._chat)
        if shape is None:
            return None
        _, index, keys, text = shape
        return Delta(index, "content" if keys[0] in _CONTENT_KEYS else "reasoning", text)
