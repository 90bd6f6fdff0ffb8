"""The transform chain: only what the plan asks for, each link one job, in order."""

from __future__ import annotations

from typing import Any

import orjson

from proxy.http.sse import encode_event
from proxy.relay.inspectors import Delta
from proxy.relay.transform import HoldReasoning, HoldTail, KeepId, Transforms, transforms


def chain(**overrides: Any) -> Transforms:
    plan: dict[str, Any] = {
        "strip_logprobs": False,
        "id_override": None,
        "reasoning_as_content": False,
        "hold_reasoning": False,
        "hold_max_bytes": 1024,
        "hold_back_chars": 0,
        "on_overflow": lambda: None,
    }
    return transforms(**{**plan, **overrides})


def test_an_empty_plan_is_an_empty_chain_and_keeps_the_bytes() -> None:
    t = chain()
    assert (t.rewrites, t.reasoning, t.tail, t.holds) == ((), None, None, False)
    raw = b'data: {"id":"a"}\n\n'
    assert t.rewrite({"id": "a"}, raw) is raw
    assert t.hold(Delta(0, "content", "x"), raw) is raw


def test_each_rewrite_is_one_link_and_an_unchanged_chunk_keeps_its_bytes() -> None:
    t = chain(strip_logprobs=True, id_override="first")
    assert len(t.rewrites) == 2 and type(t.rewrites[1]) is KeepId
    raw = b"data: same\n\n"
    assert t.rewrite({"id": "first", "choices": [{"logprobs": None}]}, raw) is raw
    chunk = {"id": "second", "choices": [{"index": 0, "logprobs": {"content": []}}]}
    expected = {"id": "first", "choices": [{"index": 0, "logprobs": None}]}
    assert t.rewrite(chunk, raw) == encode_event(orjson.dumps(expected))


def test_reasoning_hold_comes_first_then_the_tail_holds() -> None:
    t = chain(hold_reasoning=True, hold_back_chars=2)
    assert type(t.reasoning) is HoldReasoning and type(t.tail) is HoldTail
    assert t.hold(Delta(0, "reasoning", "think"), b"r") is None  # reasoning held
    # Content ends the reasoning hold: what was held goes out ahead of it; then the tail
    # holds the last two chars.
    assert t.hold(Delta(0, "content", "ab"), b"c1") == b"rc1"
    assert t.hold(Delta(0, "content", "cd"), b"c2") is None
    assert t.hold(Delta(0, "content", "ef"), b"c3") == b"c2"
    assert t.drop() == ((), (2, 0))
