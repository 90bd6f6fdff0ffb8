"""The incident list's query parameters: parsed strictly, so a typo says what is wrong instead
of silently showing everything."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from proxy.audit.verdict import VERDICTS
from proxy.observe.kinds import AUDIT, INCIDENT_KINDS
from proxy.observe.ui.incident import IncidentRow

# An audit's verdict, or the kind of any other incident (as the list's verdict column has it).
VERDICT_CHOICES = (*VERDICTS, *(k for k in INCIDENT_KINDS if k != AUDIT))
MODES = ("full", "prefill", "n_choices", "duplicate")
DEFAULT_LIMIT = 100
MAX_LIMIT = 10_000
MAX_MODEL_CHARS = 256
_HEX = re.compile(r"[0-9a-f]{1,64}")
PARAMS = ("model", "verdict", "mode", "fingerprint", "limit")


class FilterError(ValueError):
    """A query parameter the list cannot use; the message names it and says why."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class IncidentFilter:
    model: str | None = None
    verdict: str | None = None
    mode: str | None = None
    fingerprint: str | None = None  # a prefix of the upstream fingerprint (hex)
    limit: int = DEFAULT_LIMIT

    def matches(self, row: IncidentRow) -> bool:
        if self.model is not None and row.model != self.model:
            return False
        if self.verdict is not None and row.verdict != self.verdict:
            return False
        if self.mode is not None and row.mode != self.mode:
            return False
        return self.fingerprint is None or row.fingerprint.startswith(self.fingerprint)

    def query(self, **changes: str | None) -> dict[str, str]:
        """These filters as query parameters, with ``changes`` applied (None removes one)."""
        current: dict[str, str | None] = {
            "model": self.model,
            "verdict": self.verdict,
            "mode": self.mode,
            "fingerprint": self.fingerprint,
            "limit": None if self.limit == DEFAULT_LIMIT else str(self.limit),
        }
        current.update(changes)
        return {k: v for k, v in current.items() if v is not None}


def _choice(param: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise FilterError(param, f"{param} must be one of {', '.join(allowed)}; got {value!r}")
    return value


def parse_filter(pairs: Iterable[tuple[str, str]]) -> IncidentFilter:
    """From query parameters (repeats and unknown names refused; empty values mean unset)."""
    seen: dict[str, str] = {}
    for name, value in pairs:
        if name not in PARAMS:
            raise FilterError(name, f"unknown query parameter {name!r}; known: {', '.join(PARAMS)}")
        if name in seen:
            raise FilterError(name, f"{name} given more than once")
        seen[name] = value
    values = {k: v for k, v in seen.items() if v != ""}
    model = values.get("model")
    if model is not None and (len(model) > MAX_MODEL_CHARS or not model.isprintable()):
        raise FilterError("model", f"model must be printable and at most {MAX_MODEL_CHARS} chars")
    verdict = values.get("verdict")
    mode = values.get("mode")
    fingerprint = values.get("fingerprint")
    if fingerprint is not None and not _HEX.fullmatch(fingerprint):
        raise FilterError(
            "fingerprint", f"fingerprint must be 1 to 64 lowercase hex digits; got {fingerprint!r}"
        )
    raw_limit = values.get("limit")
    limit = DEFAULT_LIMIT
    if raw_limit is not None:
        digits = raw_limit.isascii() and raw_limit.isdigit() and len(raw_limit) <= 6
        if not digits or not 1 <= int(raw_limit) <= MAX_LIMIT:
            raise FilterError(
                "limit", f"limit must be an integer from 1 to {MAX_LIMIT}; got {raw_limit!r}"
            )
        limit = int(raw_limit)
    return IncidentFilter(
        model=model,
        verdict=_choice("verdict", verdict, VERDICT_CHOICES) if verdict is not None else None,
        mode=_choice("mode", mode, MODES) if mode is not None else None,
        fingerprint=fingerprint,
        limit=limit,
    )
