"""Passive duplicate detection: the same deterministic request seen twice in a window.

Only digests are stored (hashes and counts, never prompt or output text), so a shared
implementation (Redis) can hold the same records.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import orjson
import xxhash

from proxy.audit.outcome import ChoiceOutcome, Outcome


@dataclass(frozen=True, slots=True)
class ChoiceDigest:
    text_hash: str  # reasoning and content
    token_hash: str | None  # token strings, None without logprobs
    logprob_hash: str | None  # chosen and top-k logprob values, bit for bit
    tokens: int | None
    finish_reason: str | None

    def __init__(
        self,
        text_hash: str,
        token_hash: str | None,
        logprob_hash: str | None,
        tokens: int | None,
        finish_reason: str | None,
    ) -> None:
        # Written out: compiled, unlike a generated one; made per request, it pays (README).
        object.__setattr__(self, "text_hash", text_hash)
        object.__setattr__(self, "token_hash", token_hash)
        object.__setattr__(self, "logprob_hash", logprob_hash)
        object.__setattr__(self, "tokens", tokens)
        object.__setattr__(self, "finish_reason", finish_reason)


@dataclass(frozen=True, slots=True)
class Answered:
    """How a stored answer ran, kept beside its digests by the in-process store only (a shared
    one holds digests alone): for triage of a duplicate that differs from it."""

    at: float  # wall clock, when the request started
    inflight: int  # detproxy's client requests in flight as it started or ended (itself too)
    cache: str  # cold | warm | unknown: its prefill, as detproxy knows it


def digest_choice(choice: ChoiceOutcome) -> ChoiceDigest:
    text = xxhash.xxh3_128_hexdigest(f"{choice.reasoning}\x00{choice.content}".encode())
    if choice.tokens is None:
        return ChoiceDigest(text, None, None, None, choice.finish_reason)
    th = xxhash.xxh3_128()
    lh = xxhash.xxh3_128()
    unknown = False  # a null (NaN) logprob: the logprobs cannot be compared, only the tokens
    for tok in choice.tokens:
        th.update(tok.token.encode() + b"\x00")
        unknown = unknown or tok.logprob is None
        lh.update(repr(tok.logprob).encode() + b"|")
        for alt, lp in tok.top:
            unknown = unknown or lp is None
            lh.update(alt.encode() + b"\x00" + repr(lp).encode() + b",")
        lh.update(b";")
    logprobs = None if unknown else lh.hexdigest()
    return ChoiceDigest(text, th.hexdigest(), logprobs, len(choice.tokens), choice.finish_reason)


def digest_outcome(outcome: Outcome) -> tuple[ChoiceDigest, ...]:
    return tuple(digest_choice(c) for c in outcome.choices)


class DuplicateStore(Protocol):
    async def check_and_put(
        self, key: str, digests: tuple[ChoiceDigest, ...]
    ) -> tuple[ChoiceDigest, ...] | None:
        """Return the digests stored for ``key`` within the window (if any), then store these."""

    async def close(self) -> None: ...


class MemoryDuplicateStore:
    """An LRU of digests with a time window; bounded in entries."""

    def __init__(
        self, window_s: float, max_entries: int, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._window = window_s
        self._max = max_entries
        self._clock = clock
        self._entries: OrderedDict[str, tuple[float, tuple[ChoiceDigest, ...], Answered | None]] = (
            OrderedDict()
        )

    def __len__(self) -> int:
        return len(self._entries)

    async def check_and_put(
        self, key: str, digests: tuple[ChoiceDigest, ...]
    ) -> tuple[ChoiceDigest, ...] | None:
        return self.swap(key, digests)

    def swap(self, key: str, digests: tuple[ChoiceDigest, ...]) -> tuple[ChoiceDigest, ...] | None:
        """``check_and_put`` at once: an in-process store need not be awaited."""
        found = self.swap_answered(key, digests, None)
        return found[0] if found is not None else None

    def swap_answered(
        self, key: str, digests: tuple[ChoiceDigest, ...], answered: Answered | None
    ) -> tuple[tuple[ChoiceDigest, ...], Answered | None] | None:
        """``swap``, keeping how this answer ran and giving back how the previous one did."""
        now = self._clock()
        previous = self._entries.pop(key, None)
        self._entries[key] = (now, digests, answered)
        while len(self._entries) > self._max:
            self._entries.popitem(last=False)
        if previous is None or now - previous[0] > self._window:
            return None
        return previous[1], previous[2]

    async def close(self) -> None:
        self._entries.clear()


def encode_digests(digests: tuple[ChoiceDigest, ...]) -> bytes:
    return orjson.dumps(
        [[d.text_hash, d.token_hash, d.logprob_hash, d.tokens, d.finish_reason] for d in digests]
    )


def decode_digests(raw: bytes) -> tuple[ChoiceDigest, ...] | None:
    try:
        items = orjson.loads(raw)
        return tuple(ChoiceDigest(*item) for item in items)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
