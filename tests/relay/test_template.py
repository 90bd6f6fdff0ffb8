from __future__ import annotations

import json
from typing import Any

import orjson
import pytest

from proxy.relay.template import Templates, decode, learn


def chat_chunk(delta: dict[str, Any], **choice: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None, **choice}
        ],
    }


@pytest.mark.parametrize("key", ["content", "reasoning", "reasoning_content"])
def test_a_token_chunk_gives_a_template_that_reads_other_tokens(key: str) -> None:
    chunk = chat_chunk({key: "Hel"})
    tpl = learn(chunk, orjson.dumps(chunk), chat=True)
    assert tpl is not None
    assert tpl.channel == ("content" if key == "content" else "reasoning")
    for text in ["lo", "", 'a "quote" \\ and \n', "é😀", "\x00"]:
        data = orjson.dumps(chat_chunk({key: text}))
        assert data.startswith(tpl.prefix) and data.endswith(tpl.suffix)
        assert decode([tpl.literal(data)]) == [text]


def test_duplicated_reasoning_reads_both_copies() -> None:
    def both(text: str) -> bytes:
        return orjson.dumps(chat_chunk({"reasoning": text, "reasoning_content": text}))

    tpl = learn(orjson.loads(both("a")), both("a"), chat=True)
    assert tpl is not None and tpl.middle == b',"reasoning_content":'
    assert tpl.channel == "reasoning"
    for text in ["", "bc", '"', "é😀"]:
        literal = tpl.literal(both(text))
        assert literal is not None and decode([literal]) == [text]
        event = b"data: " + both(text) + b"\n\n"  # a whole event, read as it came
        assert tpl.literal(event, event=True) == literal
    assert tpl.literal(both("ab").replace(b'"ab"}', b'"ba"}')) is None  # copies differ
    assert tpl.literal(orjson.dumps(chat_chunk({"reasoning": "a"}))) is None


def test_completions_and_python_spacing() -> None:
    chunk = {"id": "c", "choices": [{"index": 0, "text": "Hel", "finish_reason": None}]}
    tpl = learn(chunk, json.dumps(chunk).encode(), chat=False)
    assert tpl is not None and tpl.channel == "content"
    other = json.dumps({**chunk, "choices": [{**chunk["choices"][0], "text": "lo"}]}).encode()
    assert decode([tpl.literal(other)]) == ["lo"]
    assert learn(chunk, json.dumps(chunk).encode(), chat=True) is None  # no delta


@pytest.mark.parametrize(
    "chunk",
    [
        chat_chunk({"role": "assistant", "content": ""}),  # two keys
        chat_chunk({"reasoning": "a", "reasoning_content": "b"}),
        chat_chunk({"reasoning": "a", "content": "a"}),
        chat_chunk({"content": "a"}, finish_reason="stop"),
        chat_chunk({"content": "a"}, logprobs={"content": []}),
        chat_chunk({"content": "a"}, stop_reason="x"),
        chat_chunk({"content": "a"}, index=True),
        chat_chunk({"content": 5}),
        chat_chunk({"tool_calls": []}),
        {**chat_chunk({"content": "a"}), "usage": {"completion_tokens": 1}},
        {"choices": [chat_chunk({"content": "a"})["choices"][0]] * 2},
    ],
)
def test_other_shapes_give_no_template(chunk: dict[str, Any]) -> None:
    assert learn(chunk, orjson.dumps(chunk), chat=True) is None


def test_a_literal_that_is_not_the_text_is_not_trusted() -> None:
    # "content" occurs twice: the key is ambiguous.
    chunk = {"choices": [{"index": 0, "delta": {"content": "a"}}], "x": {"content": "b"}}
    assert learn(chunk, orjson.dumps(chunk), chat=True) is None
    # The key spelled with an escape: the plain one found is another field's value.
    data = b'{"m":"\\"content\\"","choices":[{"index":0,"delta":{"\\u0063ontent":"a"}}]}'
    assert learn(orjson.loads(data), data, chat=True) is None
    # Found once, in the right form, but another field: replacing it changes the wrong value.
    data = b'{"x":{"content":"a"},"choices":[{"index":0,"delta":{"\\u0063ontent":"a"}}]}'
    assert learn(orjson.loads(data), data, chat=True) is None


def test_decode_accepts_only_one_string_per_literal() -> None:
    assert decode([b'"a"', b'"b\\n"']) == ["a", "b\n"]
    assert decode([b'"a","b"']) is None
    assert decode([b"1"]) is None
    assert decode([b'"a"', b""]) is None
    assert decode([b'"a"]', b'["b"']) is None
    assert decode([b'"\x01"']) is None  # a raw control character is not JSON
    # Literals (from quote to quote, as templates cut them) that are not one string each but
    # parse as the right number of strings together.
    assert decode([b'"a","b"', b'"c\\"', b'",""']) is None
    assert decode([b'"a\\"', b'",""']) is None
    assert decode([b'"', b'"']) is None
    # Quotes inside, a backslash at the end: checked one by one, and read.
    assert decode([b'"say \\"hi\\""', b'"back\\\\"', b'"x"']) == ['say "hi"', "back\\", "x"]


def test_learning_is_budgeted() -> None:
    templates = Templates(chat=True)
    # The plain shape, but its key is spelled with an escape: found nowhere, not learned.
    data = b'{"choices":[{"index":0,"delta":{"\\u0063ontent":"a"}}]}'
    for _ in range(10):
        templates.learn(orjson.loads(data), data)
    assert templates.learned == 4 and not templates.active
    assert not templates.wants()  # the budget is spent ...
    templates.hits += 16
    good = chat_chunk({"content": "a"})
    templates.learn(good, orjson.dumps(good))  # ... until templates are of use
    assert templates.learned == 5 and templates.active
    role = chat_chunk({"role": "assistant", "content": ""})
    templates.learn(role, orjson.dumps(role))
    assert templates.learned == 5  # not the plain shape: nothing tried, nothing spent


def test_one_template_per_choice_and_channel() -> None:
    templates = Templates(chat=True)
    for chunk in (
        chat_chunk({"reasoning": "a"}),
        chat_chunk({"content": "a"}),
        {**chat_chunk({"content": "a"}), "created": 2},
    ):
        templates.learn(chunk, orjson.dumps(chunk))
    assert [(t.channel, b'"created":2' in t.prefix) for t in templates.active] == [
        ("content", True),
        ("reasoning", False),
    ]


def test_templates_that_never_match_are_dropped() -> None:
    templates = Templates(chat=True)
    for i in range(8):  # token_ids differ from chunk to chunk: no template ever matches
        chunk = {**chat_chunk({"content": "a"}), "token_ids": [i]}
        templates.learn(chunk, orjson.dumps(chunk))
    assert templates.learned == 4 and not templates.active
