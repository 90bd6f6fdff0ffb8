"""A dataclass of a compiled module whose ``__init__`` is written out (mypyc compiles a written
one, while the generated one runs interpreted: README, "The compiled build") sets exactly its
fields, as the generated one would: the same arguments in the same order, with the same
defaults. The classes are found, not listed: every dataclass of ``[tool.detproxy] compiled``
whose ``__init__`` was not made by ``dataclasses``."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import tomllib
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _written() -> list[type]:
    compiled = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["detproxy"]
    found: list[type] = []
    for path in compiled["compiled"]:
        module = importlib.import_module(path.removesuffix(".py").replace("/", "."))
        for cls in vars(module).values():
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
                continue
            if cls.__module__ != module.__name__:
                continue  # imported from another module: checked there
            # dataclasses makes its methods from source text: their file is "<string>"; a
            # compiled __init__ has no code object (the source tree's run checks it)
            code = getattr(cls.__dict__.get("__init__"), "__code__", None)
            if code is not None and code.co_filename != "<string>":
                found.append(cls)
    return found


WRITTEN = _written()


def test_written_inits_are_found() -> None:
    from proxy.classify import RequestView

    if not inspect.isfunction(RequestView.__init__):
        pytest.skip("compiled: the source tree's run checks the written inits")
    assert RequestView in WRITTEN, "RequestView's written __init__ was not found"


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__qualname__)
def test_the_arguments_are_the_fields_in_order_with_their_defaults(cls: type) -> None:
    params = list(inspect.signature(cls).parameters.values())
    fields = dataclasses.fields(cls)
    if not params:  # takes none: every field starts at its default
        made = cls()
        for field in fields:
            assert getattr(made, field.name) == field.default, f"{field.name} not its default"
        return
    assert [p.name for p in params] == [f.name for f in fields], "arguments are not the fields"
    for param, field in zip(params, fields, strict=True):
        missing = field.default is dataclasses.MISSING
        assert param.default == (inspect.Parameter.empty if missing else field.default), field.name


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__qualname__)
def test_every_field_is_set_from_its_argument(cls: type) -> None:
    params = list(inspect.signature(cls).parameters.values())
    values: dict[str, Any] = {p.name: object() for p in params}
    made = cls(**values)
    for name, value in values.items():
        assert getattr(made, name) is value, f"field {name} is not set from its argument"
    assert made == cls(**values)  # the generated __eq__ still compares the fields
    if params and cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, params[0].name, None)
