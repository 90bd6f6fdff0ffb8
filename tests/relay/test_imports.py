"""The relay's stages import only what they need: no relay module imports the loops or the
audit package (what they need from them comes in as plain values or callables, or lives in a
neutral module such as ``proxy.openai``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

RELAY = Path(__file__).resolve().parents[2] / "proxy" / "relay"
FORBIDDEN = ("proxy.loops", "proxy.audit")


def imported(path: Path) -> list[str]:
    """Every module ``path`` imports, at any depth (function-level imports included)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(RELAY.glob("*.py")), ids=lambda p: p.name)
def test_relay_module_imports_no_loops_or_audit(path: Path) -> None:
    bad = [
        name
        for name in imported(path)
        if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)
    ]
    assert not bad, f"proxy/relay/{path.name} imports {bad}"
