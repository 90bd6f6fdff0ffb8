"""Per-token logprobs as engines send them, parsed into one shape (pure, tolerant).

Two shapes exist: chat-style ``{"content": [{token, logprob, bytes, top_logprobs}]}`` (chat
everywhere, and llama-server's /v1/completions) and the legacy completions shape
``{tokens, token_logprobs, top_logprobs: [{tok: lp} | null], text_offset}``. A null logprob
reads as -9999.0, vLLM's stand-in for minus infinity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

NEG_INF_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token: str
    logprob: float  # as the engine sent it (-9999.0 kept)
    top: tuple[tuple[str, float], ...]  # top-k alternatives (token, logprob) in the engine's order


class MalformedLogprobs(Exception):
    """A logprobs object that fits neither known shape."""


def _logprob(value: Any) -> float:
    if value is None:
        return NEG_INF_LOGPROB
    if isinstance(value, float):
        return value
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
        top: tuple[tuple[str, float], ...] = ()
        if raw_top:
            if not isinstance(raw_top, list):
                raise MalformedLogprobs
            pairs: list[tuple[str, float]] = []
            for alt in raw_top:
                if not isinstance(alt, dict):
                    raise MalformedLogprobs
                alt_token = alt.get("token")
                value = alt.get("logprob")
                if not isinstance(alt_token, str):
                    raise MalformedLogprobs
                pairs.append((alt_token, value if type(value) is float else _logprob(value)))
            top = tuple(pairs)
        elif raw_top is not None and not isinstance(raw_top, list):
            raise MalformedLogprobs
        value = entry.get("logprob")
        out.append(TokenLogprob(token, value if type(value) is float else _logprob(value), top))
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
        top: tuple[tuple[str, float], ...] = ()
        if isinstance(alts, dict):
            pairs: list[tuple[str, float]] = []
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
