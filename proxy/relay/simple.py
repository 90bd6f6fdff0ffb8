"""The relay's simple path: reads whose complete events are all single ``data: `` lines.

A strategy of ``StreamRelay`` (see its module docstring for the paths), which owns the per-chunk
stages this path calls (parse, observe, transform, hold) and the result. A read arrives as its
events' bytes and their data fields (``SSEDecoder.feed_data``); events that reach the client
unchanged stay slices of the read (``_Out``), never copied one by one or re-encoded. Data fields
that match a learned ``ChunkTemplate`` gather into a run: their texts are decoded in one call,
token timing counts them at once, and the loop watch gets each stretch of one choice and channel
in one ``on_run`` call, which names the chunk a trigger belongs to: the decision then stops at
that chunk, and everything before it is handled as if each chunk had been parsed. Any other
event is parsed and handled like the general path's (and may teach a template). ``relay_one``
handles a read that is exactly one template chunk, before any splitting: its text goes to
``InspectorSet.on_text``, which holds it until the loop watch would look.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

import orjson

from policies.base import Trigger
from proxy.relay.inspectors import InspectorSet
from proxy.relay.result import count_tokens
from proxy.relay.template import ChunkTemplate, Templates, decode

if TYPE_CHECKING:
    from proxy.relay.stream import StreamRelay

# Bound once: compiled, ``orjson.loads`` is an attribute lookup on the module at every call
# (260 instructions a token).
_loads: Final = orjson.loads


class _Out:
    """What one read's complete events (``src``) become: unchanged events stay slices of it."""

    __slots__ = ("parts", "src", "start")

    def __init__(self, src: bytes) -> None:
        self.src = src
        self.parts: list[bytes] = []
        self.start = 0  # src[start:] is relayed unchanged so far

    def put(self, offset: int, size: int, data: bytes | None) -> None:
        """The event at ``src[offset:offset + size]`` becomes ``data`` (size 0: inserted)."""
        if offset > self.start:
            self.parts.append(self.src[self.start : offset])
        if data:
            self.parts.append(data)
        self.start = offset + size

    def take(self, end: int) -> bytes:
        """Everything up to ``src[end]``, the changes put in."""
        if not self.parts and not self.start:
            return self.src if end == len(self.src) else self.src[:end]
        if end > self.start:
            self.parts.append(self.src[self.start : end])
        return b"".join(self.parts)


class SimpleReads:
    """The simple path of one attempt's relay, and the chunk templates it learns."""

    __slots__ = ("_relay", "reads_runs", "templates")
    __deletable__ = ["_relay"]  # for mypyc: see detach

    def __init__(self, relay: StreamRelay, templates: Templates | None) -> None:
        self._relay = relay
        self.templates = templates
        # Template hits are not parsed: only when every inspector reads runs of texts.
        self.reads_runs = not relay.inspectors or relay.inspectors.runs

    def detach(self) -> None:
        """The relay's run ended: this path is not used again, and lets go of the relay."""
        del self._relay

    def relay_one(self, read: bytes) -> bytes | None:
        """A read that is exactly one event matching a template (a token streamed on its own,
        the usual read), handled without splitting it and counted; None: take the usual way."""
        assert self.templates is not None
        for tpl in self.templates.active:
            literal = tpl.literal(read, event=True)
            if literal is not None:
                # No raw newline in it: one event. A JSON string: what the template says.
                if 10 in literal:
                    return None
                try:
                    text = _loads(literal)
                except orjson.JSONDecodeError:
                    return None
                if type(text) is not str:
                    return None
                break
        else:
            return None
        self.templates.hits += 1
        relay = self._relay
        result = relay.result
        now = relay.now()
        if result.first_event_s is None:
            result.first_event_s = now
        result.events += 1
        if text:
            count_tokens(result, 1, now)
        # Held until the watchers would look (``InspectorSet.on_text``); the first trigger
        # counts: after it the watchers are not asked again.
        trigger = relay.inspectors.on_text(tpl.index, tpl.channel, text, result.trigger is None)
        if trigger is not None and relay.decide(trigger):
            return b""
        if relay.holding:
            return relay.hold(tpl.releases if text else None, read) or b""
        return read

    def relay_simple(self, src: bytes, datas: list[bytes]) -> bytes:
        """The simple path: ``src`` is the events ``b"data: " + d + b"\n\n"`` for d in datas."""
        out = _Out(src)
        templates = self.templates if self.reads_runs else None
        offset = 0
        i = 0
        while i < len(datas):
            if not self._relay.inspecting:
                if self._relay.rewriting:  # the rest is rewritten, not inspected
                    self._rewrite_rest(out, offset, datas[i:] if i else datas)
                break  # the rest goes out as it came
            if templates is not None and templates.active:
                literals, matched = _match(datas, i, templates.active)
                if literals:
                    run = datas if len(literals) == len(datas) else datas[i : i + len(literals)]
                    stop = self._relay_run(out, offset, run, literals, matched)
                    if stop is not None:
                        return out.take(stop)
                    offset += sum(map(len, run)) + 8 * len(run)
                    i += len(run)
                    continue
            data = datas[i]
            if self._simple_event(data, offset, out):
                return out.take(offset)
            offset += len(data) + 8
            i += 1
        return out.take(len(src))

    def _simple_event(self, data: bytes, offset: int, out: _Out) -> bool:
        """One event of the simple path, parsed; True when a decision stops the relay."""
        chunk = self._relay.parse(data)
        if chunk is None:  # [DONE] or malformed: whatever was held goes first
            self._relay.holding = False
            if self._relay.held:
                out.put(offset, 0, self._relay.flush_held(b""))
            return False
        plan = self._relay.plan
        templates = self.templates
        if (
            templates is not None
            and self.reads_runs
            and (plan.id_override is None or chunk.get("id") == plan.id_override)
        ):
            templates.learn(chunk, data)
        if self._relay.observe(chunk):
            return True
        if (
            plan.strip_logprobs
            or plan.id_override is not None
            or plan.reasoning_as_content
            or self._relay.holding
        ):
            size = len(data) + 8
            raw = out.src[offset : offset + size]
            written = self._relay.transform(chunk, raw)
            if written is not raw:
                out.put(offset, size, written)
        return False

    def _rewrite_rest(self, out: _Out, offset: int, datas: list[bytes]) -> None:
        """The events from ``src[offset]`` on, after inspection stopped: rewritten alone."""
        relay = self._relay
        src = out.src
        for data in datas:
            size = len(data) + 8
            raw = src[offset : offset + size]
            written = relay.rewrite_only(data, raw)
            if written is not raw:
                out.put(offset, size, written)
            offset += size

    def _relay_run(
        self,
        out: _Out,
        offset: int,
        datas: list[bytes],
        literals: list[bytes],
        matched: list[ChunkTemplate],
    ) -> int | None:
        """Consecutive template hits from ``src[offset]``; returns where a decision stops."""
        texts = decode(literals)
        if texts is None:  # not what the templates say: parse them one by one
            for data in datas:
                if not self._relay.inspecting:
                    break
                if self._simple_event(data, offset, out):
                    return offset
                offset += len(data) + 8
            return None
        assert self.templates is not None
        self.templates.hits += len(texts)
        relay = self._relay
        inspectors = relay.inspectors
        found = None
        if inspectors.watching and relay.result.trigger is None:  # the first trigger counts
            found = _trigger_in_stretches(inspectors, texts, matched)
        if found is None:
            self._tally_run(texts, matched)
            if relay.holding:
                self._hold_run(out, offset, datas, texts, matched, 0)
            return None
        trigger, at = found
        # The triggering chunk is counted (and inspected) before the decision.
        self._tally_run(texts[: at + 1], matched[: at + 1])
        if relay.holding:
            self._hold_run(out, offset, datas[:at], texts, matched, 0)
        if relay.decide(trigger):
            return offset + sum(map(len, datas[:at])) + 8 * at
        self._tally_run(texts[at + 1 :], matched[at + 1 :])
        if relay.holding:
            self._hold_run(out, offset, datas, texts, matched, at)
        return None

    def _tally_run(self, texts: list[str], matched: list[ChunkTemplate]) -> None:
        """Token timing for template hits, and their texts to the inspectors that do not
        trigger."""
        tokens = len(texts) - texts.count("")
        if tokens:
            count_tokens(self._relay.result, tokens, self._relay.now())
        inspectors = self._relay.inspectors
        if inspectors and texts:
            _inspect_stretches(inspectors, texts, matched)

    def _hold_run(
        self,
        out: _Out,
        offset: int,
        datas: list[bytes],
        texts: list[str],
        matched: list[ChunkTemplate],
        start: int,
    ) -> None:
        """Hold or release the hits ``datas[start:]`` (the run starts at ``src[offset]``)."""
        for k, data in enumerate(datas):
            size = len(data) + 8
            if k >= start:
                if not self._relay.holding:
                    return
                raw = out.src[offset : offset + size]
                written = self._relay.hold(matched[k].releases if texts[k] else None, raw)
                if written is not raw:
                    out.put(offset, size, written)
            offset += size


def _match(
    datas: list[bytes], start: int, active: list[ChunkTemplate]
) -> tuple[list[bytes], list[ChunkTemplate]]:
    """The literals of the template hits from ``datas[start]`` on, up to the first miss."""
    literals: list[bytes] = []
    matched: list[ChunkTemplate] = []
    tpl = active[0]
    # The usual case inline: a one-literal template, checked by its prefix and suffix, and
    # the literal from quote to quote (the suffix is longer than its quote).
    inline = tpl.middle is None
    prefix, suffix = tpl.prefix, tpl.suffix
    cut, end = len(prefix) - 1, 1 - len(suffix)
    for data in datas[start:] if start else datas:
        if inline and data.startswith(prefix) and data.endswith(suffix):
            # A data field shorter than prefix + suffix yields a literal too short for decode().
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


def _stretches(matched: list[ChunkTemplate]) -> Iterator[tuple[ChunkTemplate, int, int]]:
    """The stretches of a run that belong to one choice and channel: (template, start, stop)."""
    first = matched[0]
    # One template is the usual case (list.count compares identity first).
    if len(matched) == 1 or matched.count(first) == len(matched):
        yield first, 0, len(matched)
        return
    start = 0
    while start < len(matched):
        tpl = matched[start]
        stop = start + 1
        while stop < len(matched) and (matched[stop].index, matched[stop].channel) == (
            tpl.index,
            tpl.channel,
        ):
            stop += 1
        yield tpl, start, stop
        start = stop


def _part(texts: list[str], start: int, stop: int) -> list[str]:
    return texts if start == 0 and stop == len(texts) else texts[start:stop]


def _trigger_in_stretches(
    inspectors: InspectorSet, texts: list[str], matched: list[ChunkTemplate]
) -> tuple[Trigger, int] | None:
    """Feed a run to the watchers (the loop watch), one call per stretch of one choice and
    channel, up to the first trigger: it, and the position in the run of its chunk."""
    for tpl, start, stop in _stretches(matched):
        found = inspectors.trigger_in_run(tpl.index, tpl.channel, _part(texts, start, stop))
        if found is not None:
            return found[0], start + found[1]
    return None


def _inspect_stretches(
    inspectors: InspectorSet, texts: list[str], matched: list[ChunkTemplate]
) -> None:
    """Hand a run to the inspectors that do not trigger, one call per stretch."""
    for tpl, start, stop in _stretches(matched):
        inspectors.on_run(tpl.index, tpl.channel, _part(texts, start, stop))
