"""Non-streamed answers normalised: shapes, reasoning fields, errors, junk, llama-server EOS."""

from __future__ import annotations

import copy
from types import MappingProxyType
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.audit.outcome import (
    ChoiceOutcome,
    Outcome,
    StreamAccumulator,
    TokenLogprob,
    outcome_from_response,
)
from tests.helpers.answers import CONTENT, REASONING, chat_body, chat_entry, completion_body


def test_chat_nonstream() -> None:
    out = outcome_from_response("chat", chat_body(REASONING, CONTENT))
    assert out == Outcome(
        (
            ChoiceOutcome(
                0,
                "Hi! ok",
                "Let me",
                (
                    TokenLogprob("Let", -0.25, (("Let", -0.25), ("Okay", -1.5))),
                    TokenLogprob(" me", -0.01, ((" me", -0.01), (" us", -4.75))),
                    TokenLogprob("Hi", -0.125, (("Hi", -0.125), ("Hello", -2.25))),
                    TokenLogprob("!", -0.5, (("!", -0.5), (".", -1.0))),
                    TokenLogprob(" ok", -9999.0, ((" ok", -9999.0), (" no", -9999.0))),
                ),
                "stop",
                None,
            ),
        ),
        None,
        7,
        5,
    )


def test_mappings_that_are_not_dicts_read_as_dicts_do() -> None:
    # The answer, its choices and their messages read-only mappings (usage and logprobs
    # are read only as JSON's dicts).
    def frozen(body: dict[str, Any]) -> Any:
        choices = [
            MappingProxyType(
                {k: MappingProxyType(v) if k == "message" else v for k, v in choice.items()}
            )
            for choice in body.get("choices", [])
        ]
        return MappingProxyType({**body, "choices": choices} if "choices" in body else body)

    bodies = [("chat", chat_body(REASONING, CONTENT)), ("completions", completion_body(CONTENT))]
    bodies.append(("chat", {"error": {"message": "boom"}}))
    for endpoint, body in bodies:
        expected = outcome_from_response(endpoint, body)
        assert outcome_from_response(endpoint, frozen(body)) == expected
    assert expected.error == "boom"


def test_chat_without_logprobs_and_null_content() -> None:
    body = {
        "choices": [
            {"index": 0, "message": {"content": None}, "logprobs": None, "finish_reason": "length"},
            {"index": 1, "message": {"content": "x"}, "finish_reason": "stop", "stop_reason": 13},
        ]
    }
    out = outcome_from_response("chat", body)
    assert out.choices == (
        ChoiceOutcome(0, "", "", None, "length"),
        ChoiceOutcome(1, "x", "", None, "stop", 13),
    )
    assert out.prompt_tokens is None and out.error is None


def test_completions_legacy_shape_with_nulls() -> None:
    body = completion_body(CONTENT)
    lp = body["choices"][0]["logprobs"]
    lp["token_logprobs"][0] = None
    lp["top_logprobs"][1] = None
    out = outcome_from_response("completions", body)
    (choice,) = out.choices
    assert (
        choice.content == "Hi! ok" and choice.reasoning == "" and choice.finish_reason == "length"
    )
    assert choice.tokens == (  # a null logprob is unknown (vLLM's NaN), not -9999.0
        TokenLogprob("Hi", None, (("Hi", -0.125), ("Hello", -2.25))),
        TokenLogprob("!", -0.5, ()),
        TokenLogprob(" ok", -9999.0, ((" ok", -9999.0), (" no", -9999.0))),
    )
    assert (out.prompt_tokens, out.completion_tokens) == (3, 3)


def test_completions_chat_style_logprobs_llama_server() -> None:
    body = {
        "choices": [
            {
                "index": 0,
                "text": "Hi!",
                "logprobs": {"content": [chat_entry(*CONTENT[0]), chat_entry(*CONTENT[1])]},
                "finish_reason": "length",
            }
        ]
    }
    (choice,) = outcome_from_response("completions", body).choices
    assert choice.tokens is not None
    assert [t.token for t in choice.tokens] == ["Hi", "!"]
    assert choice.tokens[0].top == (("Hi", -0.125), ("Hello", -2.25))


def _message(**fields: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": fields, "finish_reason": "stop"}]}


def test_reasoning_fields() -> None:
    def reasoning(**fields: Any) -> str:
        return outcome_from_response("chat", _message(**fields)).choices[0].reasoning

    assert reasoning(reasoning="new") == "new"
    assert reasoning(reasoning_content="old") == "old"
    assert reasoning(reasoning="same", reasoning_content="same") == "same"
    assert reasoning(reasoning=None, reasoning_content="old") == "old"
    assert reasoning(reasoning="new", reasoning_content=None) == "new"
    assert reasoning(content="x") == ""
    assert reasoning(reasoning=5, reasoning_content=["x"]) == ""


def test_error_bodies() -> None:
    nested = {"error": {"message": "boom", "type": "BadRequestError", "code": 400}}
    assert outcome_from_response("chat", nested) == Outcome((), error="boom")
    flat = {"object": "error", "message": "old style", "type": "x", "code": 400}
    assert outcome_from_response("chat", flat) == Outcome((), error="old style")
    assert outcome_from_response("chat", {"error": "plain"}).error == "plain"
    assert outcome_from_response("chat", {"error": {"code": 1}}).error == "error"


def test_malformed_logprobs_make_tokens_none_but_keep_text() -> None:
    for bad in (
        {"content": [{"token": 1, "logprob": -1.0}]},
        {"content": [{"token": "a", "logprob": "x"}]},
        {"content": [{"token": "a", "logprob": True}]},
        {"content": [{"token": "a", "logprob": -1.0, "top_logprobs": {"a": -1.0}}]},
        {"tokens": ["a"], "token_logprobs": []},
        {"tokens": ["a"], "token_logprobs": [-1.0], "top_logprobs": ["x"]},
        {"content": "text"},
        [1, 2],
    ):
        body = {"choices": [{"index": 0, "text": "a", "logprobs": bad, "finish_reason": "stop"}]}
        (choice,) = outcome_from_response("completions", body).choices
        assert choice.tokens is None, bad
        assert choice.content == "a"


def test_junk_choices_are_empty_not_errors() -> None:
    out = outcome_from_response("chat", {"choices": ["junk", {"index": "1", "message": 3}]})
    assert out.choices == (
        ChoiceOutcome(0, "", "", None, None),
        ChoiceOutcome(1, "", "", None, None),
    )
    assert outcome_from_response("chat", {"choices": 5}).choices == ()
    assert outcome_from_response("chat", {"usage": {"prompt_tokens": "3"}}).prompt_tokens is None
    assert outcome_from_response("chat", []).error == "malformed response"  # type: ignore[arg-type]


def _with_eos(body: dict[str, Any], raw_bytes: Any) -> dict[str, Any]:
    body = copy.deepcopy(body)
    eos = {"id": 2, "token": "", "bytes": raw_bytes, "logprob": -0.5, "top_logprobs": []}
    body["choices"][0]["logprobs"]["content"].append(eos)
    return body


def test_llama_server_trailing_eos_dropped_only_when_bytes_empty_and_stop() -> None:
    plain = outcome_from_response("chat", chat_body([], CONTENT)).choices[0].tokens
    assert plain is not None and len(plain) == 3
    dropped = outcome_from_response("chat", _with_eos(chat_body([], CONTENT), [])).choices[0]
    assert dropped.tokens == plain
    for raw_bytes in (None, [0xE2]):
        kept = outcome_from_response("chat", _with_eos(chat_body([], CONTENT), raw_bytes))
        assert kept.choices[0].tokens is not None and len(kept.choices[0].tokens) == 4
    length = outcome_from_response("chat", _with_eos(chat_body([], CONTENT, finish="length"), []))
    assert length.choices[0].tokens is not None and len(length.choices[0].tokens) == 4
    # only a trailing entry: an empty-bytes entry in the middle stays
    body = _with_eos(chat_body([], CONTENT), [])
    body["choices"][0]["logprobs"]["content"].append(chat_entry("x", -1.0, []))
    assert len(outcome_from_response("chat", body).choices[0].tokens or ()) == 5


json_leaf = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5)
)
json_like = st.recursive(
    json_leaf,
    lambda children: (
        st.lists(children, max_size=4)
        | st.dictionaries(
            st.sampled_from(
                [
                    "choices",
                    "index",
                    "message",
                    "delta",
                    "content",
                    "text",
                    "logprobs",
                    "token",
                    "logprob",
                    "bytes",
                    "top_logprobs",
                    "tokens",
                    "token_logprobs",
                    "finish_reason",
                    "stop_reason",
                    "usage",
                    "error",
                    "reasoning",
                    "reasoning_content",
                    "object",
                    "message",
                    "prompt_tokens",
                ]
            )
            | st.text(max_size=3),
            children,
            max_size=5,
        )
    ),
    max_leaves=40,
)


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["choices", "usage", "error", "object"]), json_like))
def test_random_json_never_raises(body: dict[str, Any]) -> None:
    for endpoint in ("chat", "completions"):
        assert isinstance(outcome_from_response(endpoint, body), Outcome)
        acc = StreamAccumulator(endpoint)
        acc.on_chunk(body)
        acc.on_chunk(body)
        acc.on_end(True)
        assert isinstance(acc.outcome(), Outcome)


def test_cached_prompt_tokens_are_read_where_the_engine_reports_them() -> None:
    """vLLM with --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens,
    whole and in a streamed usage chunk; absent, None (not known, not 0)."""
    body = chat_body([], [("Paris", -0.1, [])])
    assert outcome_from_response("chat", body).cached_tokens is None
    body["usage"] = {
        "prompt_tokens": 40,
        "completion_tokens": 3,
        "prompt_tokens_details": {"cached_tokens": 32},
    }
    assert outcome_from_response("chat", body).cached_tokens == 32
    acc = StreamAccumulator("chat")
    acc.on_chunk({"choices": [], "usage": body["usage"]})
    assert acc.outcome().cached_tokens == 32
    body["usage"]["prompt_tokens_details"] = None
    assert outcome_from_response("chat", body).cached_tokens is None
