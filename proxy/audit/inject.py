"""Logprob injection into audited requests, and stripping before the client sees the answer.

An audited request must carry logprobs so the replay can be compared bit for bit. When the
client did not ask for them, detproxy adds them (bounded by the upstream's max_logprobs) and
removes them again from every choice of the answer, so the client sees what it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class LogprobPlan:
    body: dict[str, Any]  # what goes upstream
    injected: bool  # logprobs were added by detproxy: strip them from the answer


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def needs_injection(endpoint: str, body: dict[str, Any]) -> bool:
    """Whether an audit of this request must add logprobs the client did not ask for."""
    if endpoint == "chat":
        return body.get("logprobs") is not True
    return not _is_int(body.get("logprobs"))


def plan_logprobs(
    endpoint: str, body: dict[str, Any], top_k: int, max_logprobs: int
) -> LogprobPlan:
    k = max(0, min(top_k, max_logprobs))
    if endpoint == "chat":
        if body.get("logprobs") is True:
            return LogprobPlan(body, injected=False)
        injected = {**body, "logprobs": True}
        if k > 0:
            injected["top_logprobs"] = k
        else:
            injected.pop("top_logprobs", None)
        return LogprobPlan(injected, injected=True)
    if _is_int(body.get("logprobs")):
        return LogprobPlan(body, injected=False)
    return LogprobPlan({**body, "logprobs": k}, injected=True)
