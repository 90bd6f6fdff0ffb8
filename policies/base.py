"""The policy seam: a trigger comes in, a decision goes out.

Policies are small objects with one hook, ``decide``. ``PolicyChain`` asks them in order;
the first decision that is not ``Continue`` wins. A policy that raises is isolated and
counted, and the chain goes on as if it had said ``Continue``.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """A finished non-streamed attempt, as a policy sees it."""

    endpoint: str
    model: str
    attempt: int  # 1 for the client's own request
    status: int
    body: Mapping[str, Any] | None  # the parsed JSON answer, None when it was not JSON


@dataclass(frozen=True, slots=True)
class Continue:
    """Relay the response as it is."""


@dataclass(frozen=True, slots=True)
class Retry:
    """Send the request again with these fields overridden."""

    reason: str
    overrides: Mapping[str, Any] = field(default_factory=dict)


Decision = Continue | Retry


class Policy(Protocol):
    name: str

    def decide(self, ctx: ResponseContext) -> Decision: ...


class PolicyChain:
    def __init__(self, policies: Sequence[Policy] = ()) -> None:
        self._policies = list(policies)
        self.failures: Counter[str] = Counter()

    def __bool__(self) -> bool:
        return bool(self._policies)

    def decide(self, ctx: ResponseContext) -> Decision:
        for policy in self._policies:
            try:
                decision = policy.decide(ctx)
            except Exception:
                self.failures[policy.name] += 1
                log.exception("policy %s failed; treated as continue", policy.name)
                continue
            if not isinstance(decision, Continue):
                return decision
        return Continue()
