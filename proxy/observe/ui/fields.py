"""Typed reads of untrusted JSON objects (incident lines come from files anyone could edit)."""

from __future__ import annotations

import math
from typing import Any


def text(obj: Any, key: str) -> str | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, str) else None


def number(obj: Any, key: str) -> float | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def integer(obj: Any, key: str) -> int | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def flag(obj: Any, key: str) -> bool | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, bool) else None


def mapping(obj: Any, key: str) -> dict[str, Any] | None:
    value = obj.get(key) if isinstance(obj, dict) else None
    return value if isinstance(value, dict) else None
