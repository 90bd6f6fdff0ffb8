"""Per-token logprobs as engines send them, parsed into one shape (pure, tolerant).

Two shapes exist: chat-style ``{"content": [{token, logprob, bytes, top_logprobs}]}`` (chat
everywhere, and llama-server's /v1/completions) and the legacy completions shape
``{tokens, token_logprobs, top_logprobs: [{tok: lp} | null], text_offset}``.

A value is None when it is unknown: vLLM streams a NaN logprob as ``null`` (its non-streamed
answer refuses to serialise it), and a non-finite float from any parser reads the same. vLLM's
own stand-in for minus infinity is -9999.0, a known value, kept as sent.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEG_INF_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float | None  # as the engine sent it (-9999.0 kept); None when unknown
    top: tuple[tuple[str, float | None], ...]  # top-k (token, logprob) in the engine's order

    def __init__(
        self, token: str, logprob: float | None, top: tuple[tuple[str, float | None], ...]
    ) -> None:
        # Written out: compiled, unlike a generated one; made per audited token, it pays (README).
        object.__setattr__(self, "token", token)
        object.__setattr__(self, "logprob", logprob)
        object.__setattr__(self, "top", top)


class MalformedLogprobs(Exception):
    """A logprobs object that fits neither known shape."""


def known(value: float | None) -> bool:
    """A finite logprob (None, NaN and infinities are unknown)."""
    return value is not None and value - value == 0.0


def _logprob(value: Any) -> float | None:
    if value is None:
        return None
    if isinstance(value, float):
        return value if value - value == 0.0 else None
    if isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise MalformedLogprobs


def _chat_entries(items: list[Any]) -> tuple[list[TokenLogprob], bool]:
    # Hot path (every streamed chunk of an audited request): plain dict checks, floats inline.
    out: list[TokenLogprob] = []
    eos_last = False
    for entry in items:
        if not isinstance(entry, dict):
            raise MalformedLogprobs
        token = entry.get("token")
        if not isinstance(token, str):
            raise MalformedLogprobs
        raw_top = entry.get("top_logprobs")
        top: tuple[tuple[str, float | None], ...] = ()
        if raw_top:
            if not isinstance(raw_top, list):
                raise MalformedLogprobs
            pairs: list[tuple[str, float | None]] = []
            for alt in raw_top:
                if not isinstance(alt, dict):
                    raise MalformedLogprobs
                alt_token = alt.get("token")
                value = alt.get("logprob")
                if not isinstance(alt_token, str):
                    raise MalformedLogprobs
                # floats inline (the common case); finite when value - value is 0.0
                if type(value) is not float or value - value != 0.0:
                    value = _logprob(value)
                pairs.append((alt_token, value))
            top = tuple(pairs)
        elif raw_top is not None and not isinstance(raw_top, list):
            raise MalformedLogprobs
        value = entry.get("logprob")
        if type(value) is not float or value - value != 0.0:
            value = _logprob(value)
        out.append(TokenLogprob(token, value, top))
        if token:
            eos_last = False
        else:
            raw_bytes = entry.get("bytes")
            eos_last = isinstance(raw_bytes, list) and not raw_bytes
    return out, eos_last


def _legacy_entries(obj: dict[str, Any]) -> list[TokenLogprob]:
    tokens = obj.get("tokens")
    values = obj.get("token_logprobs")
    tops = obj.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(values, list) or len(values) != len(tokens):
        raise MalformedLogprobs
    if tops is None:
        tops = [None] * len(tokens)
    elif not isinstance(tops, list) or len(tops) != len(tokens):
        raise MalformedLogprobs
    out: list[TokenLogprob] = []
    for token, value, alts in zip(tokens, values, tops, strict=True):
        if not isinstance(token, str):
            raise MalformedLogprobs
        top: tuple[tuple[str, float | None], ...] = ()
        if isinstance(alts, dict):
            pairs: list[tuple[str, float | None]] = []
            for alt_token, alt_value in alts.items():
                if not isinstance(alt_token, str):
                    raise MalformedLogprobs
                pairs.append((alt_token, _logprob(alt_value)))
            top = tuple(pairs)
        elif alts is not None:
            raise MalformedLogprobs
        out.append(TokenLogprob(token, _logprob(value), top))
    return out


def parse_logprobs(obj: Any) -> tuple[list[TokenLogprob], bool] | None:
    """The entries of one ``choices[i].logprobs`` object, and whether the last one looks like
    llama-server's end-of-sequence entry (token "", bytes []). None when there are none
    (null, ``{}``, ``{"content": null}``); raises MalformedLogprobs on anything else."""
    if obj is None:
        return None
    if not isinstance(obj, dict):
        raise MalformedLogprobs
    content = obj.get("content")
    if isinstance(content, list):
        return _chat_entries(content)
    if "tokens" in obj:
        return _legacy_entries(obj), False
    if content is None:
        return None
    raise MalformedLogprobs
