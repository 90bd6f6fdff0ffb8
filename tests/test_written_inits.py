"""The dataclasses whose ``__init__`` is written out (one or more per request: mypyc compiles a
written one, while the generated one runs interpreted) set exactly their fields, as the
generated one would: the same arguments in the same order, with the same defaults."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from proxy.attempts import AttemptEnd
from proxy.audit.auditor import AuditTicket
from proxy.audit.logprobs import TokenLogprob
from proxy.audit.outcome import ChoiceOutcome, Outcome
from proxy.audit.store import ChoiceDigest
from proxy.classify import RequestView
from proxy.events import (
    RecoveryBudgetUsed,
    RequestClassified,
    RequestFinished,
    RequestStarted,
    StreamTimed,
)
from proxy.relay.result import StreamResult, StreamSpeed
from proxy.relay.stream import StreamPlan
from proxy.relay.template import ChunkTemplate

WRITTEN = [
    AttemptEnd,
    AuditTicket,
    ChoiceOutcome,
    Outcome,
    ChoiceDigest,
    RequestView,
    StreamPlan,
    RequestStarted,
    RequestClassified,
    RequestFinished,
    StreamTimed,
    RecoveryBudgetUsed,
    TokenLogprob,
    StreamSpeed,
    ChunkTemplate,
]


def _signature(cls: type) -> inspect.Signature:
    if not inspect.isfunction(cls.__init__):  # compiled: its signature reads (*args, **kwargs)
        pytest.skip(f"{cls.__name__}.__init__ is compiled: the source tree's run checks it")
    return inspect.signature(cls.__init__)


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__name__)
def test_the_arguments_are_the_fields_in_order_with_their_defaults(cls: type) -> None:
    params = list(_signature(cls).parameters.values())[1:]  # less self
    fields = dataclasses.fields(cls)
    assert [p.name for p in params] == [f.name for f in fields]
    for param, field in zip(params, fields, strict=True):
        missing = field.default is dataclasses.MISSING
        assert param.default == (inspect.Parameter.empty if missing else field.default), field.name


@pytest.mark.parametrize("cls", WRITTEN, ids=lambda c: c.__name__)
def test_every_field_is_set_from_its_argument(cls: type) -> None:
    params = list(_signature(cls).parameters.values())[1:]
    values: dict[str, Any] = {p.name: object() for p in params}
    made = cls(**values)
    for name, value in values.items():
        assert getattr(made, name) is value, name
    assert made == cls(**values)  # the generated __eq__ still compares the fields
    if cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(made, params[0].name, None)


def test_a_stream_result_starts_at_every_default() -> None:
    result = StreamResult()
    for field in dataclasses.fields(StreamResult):
        assert getattr(result, field.name) == field.default, field.name
