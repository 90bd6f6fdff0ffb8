"""proxy.openai: where each server puts a reasoning text, a usage and an error message."""

from __future__ import annotations

from proxy.openai import (
    choice_text,
    completion_tokens_of,
    error_detail,
    error_message,
    first_choice,
    reasoning_of,
    usage_of,
)


def test_reasoning_under_either_name_and_once_when_both() -> None:
    assert reasoning_of({"reasoning": "think"}) == "think"  # vLLM >= 0.16
    assert reasoning_of({"reasoning_content": "think"}) == "think"  # vLLM < 0.11.1
    both = {"reasoning": "好的", "reasoning_content": "好的"}  # 0.11.1 to 0.15: duplicates
    assert reasoning_of(both) == "好的"
    assert reasoning_of({"reasoning": "", "reasoning_content": "old"}) == "old"
    assert reasoning_of({"reasoning": None, "reasoning_content": None}) is None
    assert reasoning_of({"reasoning": 3, "content": "x"}) is None
    assert reasoning_of({}) is None


def test_the_text_of_a_streamed_choice() -> None:
    assert choice_text({"delta": {"content": "a", "reasoning": "r"}}) == "a"
    assert choice_text({"delta": {"content": "", "reasoning_content": "r"}}) == "r"
    assert choice_text({"delta": {"role": "assistant", "content": ""}}) is None
    assert choice_text({"text": "t"}) == "t"  # completions
    assert choice_text({"text": None, "finish_reason": "stop"}) is None


def test_first_choice_of_junk_is_none() -> None:
    assert first_choice({"choices": [{"index": 0}, {"index": 1}]}) == {"index": 0}
    for body in ({}, {"choices": []}, {"choices": "x"}, {"choices": [None]}):
        assert first_choice(body) is None


def test_usage() -> None:
    body = {"usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}
    assert usage_of(body) == (9, 5) and completion_tokens_of(body) == 5
    assert usage_of({"usage": {"prompt_tokens": True, "completion_tokens": "5"}}) == (None, None)
    assert usage_of({"usage": None}) == (None, None) and completion_tokens_of({}) is None


def test_error_messages_of_every_shape() -> None:
    nested = {"error": {"message": "bad", "type": "BadRequestError", "code": 400}}
    assert error_message(nested) == error_detail(nested) == "bad"
    flat = {"object": "error", "message": "flat", "code": 400}  # vLLM < 0.10.1
    assert error_message(flat) == "flat"
    assert error_message({"error": "Unauthorized"}) == "Unauthorized"
    assert error_message({"error": {"code": 500}}) == "error"  # an error without a message
    assert error_message({"error": None, "choices": []}) is None
    assert error_message({"message": "not an error", "choices": []}) is None
    assert error_detail({"detail": "Not Found"}) == "Not Found"  # FastAPI
    assert error_detail({"choices": []}) is None
