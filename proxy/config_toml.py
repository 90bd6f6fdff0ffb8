"""The configuration written back as TOML (``detproxy config``): what ``tomllib`` reads into
the same ``Settings``, secrets masked.

A small emitter for the values a configuration holds (tables, arrays, strings, numbers,
booleans): Python's standard library reads TOML but does not write it. A value that is not
set (None) has no TOML form: it is written as a comment (``# key = (none)``), and leaving it
out gives it back. Secrets are masked by ``proxy.redact``, as everywhere else.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from proxy.config import Settings
from proxy.redact import MASK, mask_secrets

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f"}
_ESCAPES["\r"] = "\\r"


def string(value: str) -> str:
    """A TOML basic string."""
    out = []
    for ch in value:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def key(name: str) -> str:
    return name if _BARE_KEY.fullmatch(name) else string(name)


def value(v: Any) -> str:
    """An inline TOML value (None has none: the caller leaves it out)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        if math.isinf(v):
            return "inf" if v > 0 else "-inf"
        return repr(v)
    if isinstance(v, str):
        return string(v)
    if isinstance(v, Mapping):
        items = [f"{key(k)} = {value(x)}" for k, x in v.items() if x is not None]
        return "{" + ", ".join(items) + "}" if items else "{}"
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__}")


def _is_table_array(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(isinstance(x, Mapping) for x in v)


def _table(lines: list[str], path: tuple[str, ...], table: Mapping[str, Any], array: bool) -> None:
    if path:
        if lines:
            lines.append("")
        header = ".".join(key(p) for p in path)
        lines.append(f"[[{header}]]" if array else f"[{header}]")
    nested: list[tuple[str, Any]] = []
    for name, v in table.items():
        if v is None:
            lines.append(f"# {key(name)} = (none)")
        elif (isinstance(v, Mapping) and v) or _is_table_array(v):
            nested.append((name, v))  # after this table's own keys: a header ends them
        else:
            lines.append(f"{key(name)} = {value(v)}")
    for name, v in nested:
        if isinstance(v, Mapping):
            _table(lines, (*path, name), v, array=False)
        else:
            for item in v:
                _table(lines, (*path, name), item, array=True)


def dumps(tree: Mapping[str, Any]) -> str:
    """``tree`` (tables of JSON-like values) as a TOML document."""
    lines: list[str] = []
    _table(lines, (), tree, array=False)
    return "\n".join(lines) + "\n"


def effective_toml(settings: Settings, masked: bool = True) -> str:
    """``settings`` as the TOML file that gives them (its secrets masked unless not
    ``masked``)."""
    # Replaced settings, accepted only to say so at start, are left out.
    tree = settings.model_dump(mode="json", exclude={"loops": {"retry_budget", "retry_budget_min"}})
    header = (
        "# detproxy's effective configuration: defaults, the file, DETPROXY_* environment\n"
        "# variables and flags, merged."
    )
    if masked:
        tree = mask_secrets(tree)
        header += f' Secrets are masked ("{MASK}").'
    return header + "\n\n" + dumps(tree)
