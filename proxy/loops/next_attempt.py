"""The next attempt after a loop, as a pure function of plain values.

``next_attempt(asked, trigger, decision, generated)``: what the client asked (``Asked``), the
loop (``Trigger``), the policy's retry (``Retry``: its overrides and strategy) and what the
looping answer generated and showed (``Generated``) give the body of the next attempt and what
it goes on from (``NextAttempt``). Nothing here reads configuration, publishes, or keeps state;
``proxy.attempts.Attempts`` calls it.

One path (``[loops] stream_mode = "continue"``, the default): streamed or not, a retry goes on
from the same point, the looping channel's text up to the loop's onset and one unit (a loop the
engine reported, a runaway: the run the detector finds at the text's end, else all of it), under
the same overrides and seed; a loop in the reasoning channel closes the reasoning there. A
stream's client holds what it was shown: the continuation follows that (the repeats shown before
the loop was caught stay), and what makes that one text is written first (``missing``): the
part of the kept prefix it was not shown (held back), or, shown into the loop, the rest of the
unit it was shown part of (``periodic_completion``).
Otherwise (``restart`` and ``hold_reasoning``) the ladder's strategy says: a
restart, or a continuation (``continue``, ``close_reasoning``) from the onset where that keeps
the answer whole (``proxy.loops.continuation``).

Where a retry's upstream refuses it, what goes in its place is decided here too, with it
(``NextAttempt.fallbacks``, in order): the client's own request under its own sampling, going on
from the same kept text where the client holds a part of the answer already (so that it still
reads one answer), then the client's own request as it came. A whole answer has the answer it
had instead (``proxy.answer``); a stream walks the list (``proxy.streaming``).

The retry's limit is the client's ``max_tokens`` less the kept text's tokens, estimated from
that text alone (``estimate_tokens``): the same limit for the same loop, streamed or not.

The retry's seed: the client's own ``seed`` when it sent one, else the ladder's, else one
derived from the request (``request_seed``: a stable hash of its canonical body), so that the
same request recovers the same way each time, streamed or not.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash

from policies.base import Retry, Trigger
from proxy.loops.continuation import (
    Continued,
    can_close_reasoning,
    can_continue,
    can_continue_shown,
    closed_reasoning,
    continuation_body,
    estimate_tokens,
    periodic_completion,
    prefix_of,
    word_end,
)
from proxy.loops.detector import DetectorConfig
from proxy.loops.verdict import tail_loop

# Fields that change how an answer is delivered, not what it says: left out of the seed.
_DELIVERY_FIELDS = frozenset({"stream", "stream_options", "request_id", "user"})
SEED_RANGE = 2**31  # a seed every engine takes (vLLM, llama.cpp's server: a signed int)


@dataclass(frozen=True, slots=True)
class Asked:
    """What the client asked, as a retry needs it."""

    endpoint: str
    body: Mapping[str, Any]  # the client's request, which a retry's overrides apply to
    markers: tuple[str, str] = ("<think>", "</think>")  # the model's reasoning markers
    one_path: bool = True  # stream_mode "continue": streamed or not, one continuation
    # The loop detector's thresholds: a loop the engine reported (no onset known) is looked for
    # at the end of the text with them (None: not looked for).
    detector: DetectorConfig | None = None


@dataclass(frozen=True, slots=True)
class Generated:
    """What the looping answer generated, for the next attempt to go on from."""

    # The trigger's channel as the model wrote it so far (a continued answer's prefix
    # included); None: not kept.
    text: str | None
    reasoning: str | None = None  # its reasoning (a chat answer's, where kept)
    # A stream's: how much of ``text`` its client was shown (the rest held back or in the
    # triggering chunk), as that text; None: not streamed.
    shown: str | None = None
    # The chars of ``text`` before the looping attempt's own (a continued stream's prefix):
    # the trigger's offsets count from there.
    offset: int = 0
    # A continued stream's: the text of the channel its client held before this attempt.
    held: str = ""


@dataclass(frozen=True, slots=True)
class Fallback:
    """An attempt sent in a refused retry's place: the client's own request, its own sampling."""

    body: dict[str, Any] | None  # None: the client's own request as it came (its own bytes)
    continued: Continued | None = None  # what it goes on from (None: the answer's start)


ORIGINAL = Fallback(None)  # the client's own request as it came


@dataclass(frozen=True, slots=True)
class NextAttempt:
    """The attempt a retry sends, and what goes in its place when it is refused."""

    body: dict[str, Any]
    strategy: str  # restart | continue | close_reasoning
    continued: Continued | None = None  # what it goes on from (None: a restart)
    kept_tokens: int = 0  # the tokens of the kept prefix (0: a restart)
    # Sent in its place, in order, when its upstream refuses it (each tried once): the last is
    # the client's own request as it came.
    fallbacks: tuple[Fallback, ...] = (ORIGINAL,)


def request_seed(body: Mapping[str, Any]) -> int:
    """The seed of a request's retries: its own ``seed``, else a stable hash of its canonical
    body (sorted keys, delivery-only fields such as ``stream`` left out)."""
    own = body.get("seed")
    if isinstance(own, int) and not isinstance(own, bool):
        return own
    core = {k: v for k, v in body.items() if k not in _DELIVERY_FIELDS}
    try:
        data = orjson.dumps(core, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # integers beyond 64 bits and the like: fall back to repr
        data = repr(sorted(core.items())).encode()
    return int(xxhash.xxh3_64_intdigest(data)) % SEED_RANGE


def seeded(body: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A retry's overrides with its seed: the client's own wins, then the ladder's, then the
    request's (``request_seed``)."""
    own = body.get("seed")
    if own is not None:
        return {**overrides, "seed": own}
    if "seed" in overrides:
        return dict(overrides)
    return {**overrides, "seed": request_seed(body)}


def _onset_prefix(
    text: str, trigger: Trigger, detector: DetectorConfig | None
) -> tuple[str, tuple[int, int] | None]:
    """``text`` up to the loop's onset and one unit: the trigger's, else (a loop the engine
    reported, a runaway) the run the detector finds at its end; all of it where neither is.
    With the loop's (onset, period) where one is known."""
    prefix = prefix_of(text, trigger)
    if prefix is not None and trigger.start_offset is not None and trigger.period is not None:
        return prefix, (trigger.start_offset, trigger.period)
    run = tail_loop(text, detector) if detector is not None else None
    if run is None:
        return text, None
    start, period = run
    return text[: word_end(text, start + period)], run


def next_attempt(
    asked: Asked, trigger: Trigger | None, decision: Retry, generated: Generated
) -> NextAttempt:
    """The attempt ``decision`` sends after the answer that looped on ``trigger``."""
    base = asked.body
    overrides = seeded(base, decision.overrides)
    restart = NextAttempt({**base, **overrides}, "restart")
    text = generated.text
    if trigger is None or not text:
        return restart
    endpoint = asked.endpoint
    # A continued content goes on after the reasoning the answer had before it.
    carried = ""
    if generated.reasoning and endpoint == "chat" and trigger.channel == "content":
        carried = generated.reasoning
    streamed = generated.shown is not None
    loop: tuple[int, int] | None = None  # the loop's (onset, period) in ``text``, where known
    if asked.one_path:
        if not can_continue_shown(endpoint, base, trigger) or (
            not streamed and base.get("logprobs")  # the prefix's own would be missing
        ):
            return restart
        closes = trigger.channel == "reasoning"
        at = generated.offset
        looping, run = _onset_prefix(text[at:], trigger, asked.detector)
        prefix = text[:at] + looping
        loop = (at + run[0], run[1]) if run is not None else None
    else:
        closes = decision.strategy == "close_reasoning"
        if decision.strategy not in ("continue", "close_reasoning") or not (
            can_close_reasoning(endpoint, base, trigger)
            if closes
            else can_continue(endpoint, base, trigger)
        ):
            return restart
        at = generated.offset
        found = prefix_of(text[at:], trigger)
        found = text[:at] + found if found else None
        if not found:
            return restart
        prefix = found
    # The retry's limit: the client's max_tokens less the kept text's tokens, one estimate
    # from the kept text alone (the same streamed or not).
    kept = estimate_tokens(carried + prefix)
    message = closed_reasoning(prefix, *asked.markers) if closes else prefix
    body = continuation_body(endpoint, base, overrides, message, kept, carried)
    if body is None:
        return restart
    missing = ""
    shown = generated.shown
    if shown is not None and not closes and len(prefix) > len(shown) and prefix.startswith(shown):
        missing = prefix[len(shown) :]  # held back, never shown: written before what follows
    elif shown is not None and not closes and loop is not None and shown.startswith(prefix):
        # shown past the kept text, into the loop: whole units, the last one completed
        missing = periodic_completion(shown, len(prefix), *loop)
    if closes:
        held = ""  # the answer's content starts with the continuation
    elif shown is None:
        held = prefix  # the answer is the prefix, then the continuation
    else:
        held = generated.held + shown[generated.offset :] + missing
    continued = Continued(prefix, closes, message, carried, missing, held)
    fallbacks: tuple[Fallback, ...] = (ORIGINAL,)
    if not closes:
        # The client's own request going on from the same text (the client may hold a part of
        # it): a closed reasoning is not what its own request would do.
        own = continuation_body(endpoint, base, {}, message, kept, carried)
        if own is not None:
            fallbacks = (Fallback(own, continued), ORIGINAL)
    strategy = "close_reasoning" if closes else "continue"
    return NextAttempt(body, strategy, continued, kept, fallbacks)
