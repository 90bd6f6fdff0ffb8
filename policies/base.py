"""The policy seam: a context comes in, a decision goes out.

Policies are small objects with one hook, ``decide``. ``PolicyChain`` asks them in order;
the first decision that is not ``Continue`` wins. A policy that raises is isolated and
counted, and the chain goes on as if it had said ``Continue``.

When a decision is still actionable: for a non-streamed answer, always (nothing has reached
the client yet). For a stream, ``Retry`` restarts the stream (or, with reasoning held back,
replaces an attempt the client never saw) and ``Abort`` ends it cleanly.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Trigger:
    """Why a policy is asked: a loop the proxy saw, one the engine reported, or a runaway."""

    source: str  # proxy | engine | runaway
    channel: str  # reasoning | content
    choice: int
    period: int | None = None
    repeats: int | None = None
    start_offset: int | None = None
    preview: str | None = None


@dataclass(frozen=True, slots=True)
class PolicyContext:
    endpoint: str
    model: str
    stream: bool
    attempt: int  # 1 for the client's own request
    status: int
    trigger: Trigger | None  # None: the attempt ended without a trigger
    body: Mapping[str, Any] | None = None  # the parsed non-streamed answer, when there is one
    max_tokens: int | None = None  # the client request's limit, when it set one
    # The request's attempt cap ([loops] max_attempts): no retry is sent past it, whatever a
    # policy decides (None: not known, as in a policy's own tests).
    max_attempts: int | None = None


@dataclass(frozen=True, slots=True)
class Continue:
    """Let the response go on as it is (``observe`` when a trigger was seen)."""

    reason: str = ""


@dataclass(frozen=True, slots=True)
class Retry:
    """Send the request again with these fields overridden."""

    reason: str
    overrides: Mapping[str, Any] = field(default_factory=dict)
    reserved_tokens: int = 0  # taken from the recovery budget; settled when the attempt ends
    # restart: the request again from scratch; continue: the output up to the loop's onset (and
    # one unit) given back to the engine to go on from, so the work before the loop is kept.
    strategy: str = "restart"


@dataclass(frozen=True, slots=True)
class Abort:
    """End the response cleanly now."""

    reason: str


Decision = Continue | Retry | Abort


class Policy(Protocol):
    """A policy may also say, with a class attribute ``triggers_only = True``, that it always
    answers ``Continue`` when there is no trigger: it is then not asked about clean answers."""

    name: str

    def decide(self, ctx: PolicyContext) -> Decision: ...


CONTINUE = Continue()


class PolicyChain:
    def __init__(self, policies: Sequence[Policy] = ()) -> None:
        self._policies = list(policies)
        self.failures: Counter[str] = Counter()
        # Those asked about an answer that ended without a trigger.
        self._clean = [p for p in self._policies if not getattr(p, "triggers_only", False)]
        self.reads_clean_answers = bool(self._clean)

    def __bool__(self) -> bool:
        return bool(self._policies)

    def decide(self, ctx: PolicyContext) -> Decision:
        for policy in self._policies if ctx.trigger is not None else self._clean:
            try:
                decision = policy.decide(ctx)
            except Exception:
                self.failures[policy.name] += 1
                log.exception("policy %s failed; treated as continue", policy.name)
                continue
            if not isinstance(decision, Continue):
                return decision
        return CONTINUE
