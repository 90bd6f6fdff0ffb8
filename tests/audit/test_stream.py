"""The stream accumulator folds SSE chunks into the same Outcome as the non-streamed answer."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

from proxy.audit.outcome import (
    StreamAccumulator,
    TokenLogprob,
    outcome_completion_tokens,
    outcome_from_response,
)
from proxy.relay.extract import Extractor
from proxy.relay.inspectors import Delta
from tests.helpers.answers import (
    CONTENT,
    REASONING,
    chat_body,
    chat_chunks,
    chat_entry,
    completion_body,
    completion_chunks,
    grouped_chat_chunks,
    tokens,
)


def _run(endpoint: str, chunks: list[dict[str, Any]], complete: bool = True) -> StreamAccumulator:
    acc = StreamAccumulator(endpoint)
    for chunk in chunks:
        acc.on_chunk(chunk)
    acc.on_end(complete)
    return acc


def test_inspector_name() -> None:
    assert StreamAccumulator("chat").name == "accumulate"


def test_chat_stream_equals_nonstream() -> None:
    expected = outcome_from_response("chat", chat_body(REASONING, CONTENT))
    for field in ("reasoning", "reasoning_content"):
        got = _run("chat", chat_chunks(REASONING, CONTENT, reasoning_field=field)).outcome()
        assert got == expected
    assert expected.choices[0].reasoning == "Let me"
    assert expected.completion_tokens == 5


def test_completions_stream_equals_nonstream() -> None:
    expected = outcome_from_response("completions", completion_body(CONTENT))
    assert _run("completions", completion_chunks(CONTENT)).outcome() == expected
    assert expected.choices[0].tokens is not None and len(expected.choices[0].tokens) == 3


def test_llama_server_stream_matches_its_nonstream_with_eos() -> None:
    body = chat_body([], CONTENT)
    eos = {"id": 2, "token": "", "bytes": [], "logprob": -0.5, "top_logprobs": []}
    body["choices"][0]["logprobs"]["content"].append(eos)
    chunks = chat_chunks([], CONTENT)
    chunks[0]["choices"][0]["delta"]["content"] = None  # llama-server's role chunk
    assert _run("chat", chunks).outcome() == outcome_from_response("chat", body)
    # and should a stream carry the EOS entry too, it is dropped there as well
    chunks[-2]["choices"][0]["logprobs"] = {"content": [eos]}
    assert _run("chat", chunks).outcome() == outcome_from_response("chat", body)


def test_logprob_on_role_chunk_is_kept() -> None:
    chunks = chat_chunks([], CONTENT[1:])
    chunks[0]["choices"][0]["delta"]["content"] = None
    chunks[0]["choices"][0]["logprobs"] = {"content": [chat_entry("\n", -0.75, [("\n", -0.75)])]}
    tokens = _run("chat", chunks).outcome().choices[0].tokens
    assert tokens is not None
    assert tokens[0] == TokenLogprob("\n", -0.75, (("\n", -0.75),))
    assert [t.token for t in tokens] == ["\n", "!", " ok"]


def test_interleaved_choices() -> None:
    a = chat_chunks([], CONTENT, index=0, finish="stop")
    b = chat_chunks(REASONING, CONTENT[:1], index=1, finish="length")
    chunks: list[dict[str, Any]] = []
    for i in range(max(len(a), len(b)) - 1):  # each list ends with the usage chunk
        chunks.extend(x[i] for x in (b, a) if i < len(x) - 1)
    got = _run("chat", chunks).outcome()
    assert [c.index for c in got.choices] == [0, 1]
    want_a = outcome_from_response("chat", chat_body([], CONTENT)).choices[0]
    want_b = outcome_from_response("chat", chat_body(REASONING, CONTENT[:1], finish="length"))
    assert got.choices[0] == want_a
    assert got.choices[1] == dataclasses.replace(want_b.choices[0], index=1)
    assert got.prompt_tokens is None


def test_duplicated_reasoning_fields_taken_once() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"reasoning": "好的", "reasoning_content": "好的"}}]},
        {"choices": [{"index": 0, "delta": {"reasoning": "!", "reasoning_content": "!"}}]},
        {"choices": [{"index": 0, "delta": {"content": "ok", "reasoning_content": None}}]},
        {"choices": [{"index": 0, "delta": {"reasoning_content": "old"}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    (choice,) = _run("chat", chunks).outcome().choices
    assert (choice.reasoning, choice.content, choice.tokens) == ("好的!old", "ok", None)


def test_usage_chunk_and_continuous_usage() -> None:
    chunks = chat_chunks([], CONTENT)
    out = _run("chat", chunks).outcome()
    assert (out.prompt_tokens, out.completion_tokens) == (7, 3)
    chunks[1]["usage"] = {"prompt_tokens": 7, "completion_tokens": 1}
    out = _run("chat", chunks[:-1]).outcome()
    assert (out.prompt_tokens, out.completion_tokens) == (7, 1)


def test_several_tokens_a_chunk_are_counted_as_tokens_not_chunks() -> None:
    """The audit's own token accounting (the shadow token budget, the shadow's estimate)
    follows usage, else the logprobs entries: right when a chunk carries several tokens."""
    content = tokens(12)
    for continuous in (False, True):
        chunks = grouped_chat_chunks(content, 4, continuous_usage=continuous)
        assert len(chunks) == 5  # role, three chunks of four tokens, usage
        out = _run("chat", chunks).outcome()
        assert out.completion_tokens == 12 and outcome_completion_tokens(out) == 12
        (choice,) = out.choices
        assert choice.tokens is not None and len(choice.tokens) == 12
    # Without a usage chunk, the logprobs entries count.
    out = _run("chat", grouped_chat_chunks(content, 4, final_usage=False)).outcome()
    assert out.completion_tokens is None and outcome_completion_tokens(out) == 12


def test_inband_error_and_incomplete() -> None:
    chunks = chat_chunks([], CONTENT)[:3]
    err = {"error": {"message": "engine died", "type": "InternalServerError", "code": 500}}
    acc = _run("chat", [*chunks, err], complete=True)
    assert acc.outcome().error == "engine died"
    assert acc.outcome().choices[0].content == "Hi!"
    acc = _run("chat", [*chunks, err], complete=False)
    assert acc.outcome().error == "engine died"  # the first error wins
    acc = _run("chat", chunks, complete=False)
    assert acc.outcome().error == "incomplete"
    assert _run("chat", chunks, complete=True).outcome().error is None
    flat = {"object": "error", "message": "old", "code": 500}
    assert _run("chat", [flat]).outcome().error == "old"


def test_malformed_logprobs_midstream_make_tokens_none() -> None:
    chunks = copy.deepcopy(chat_chunks([], CONTENT))
    chunks[2]["choices"][0]["logprobs"] = {"content": [{"token": None}]}
    (choice,) = _run("chat", chunks).outcome().choices
    assert choice.tokens is None and choice.content == "Hi! ok"


def test_no_logprobs_anywhere_gives_none_and_empty_list_gives_empty() -> None:
    chunks = [
        {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    ]
    assert _run("chat", chunks).outcome().choices[0].tokens is None
    chunks[0]["choices"][0]["logprobs"] = {"content": []}
    assert _run("chat", chunks).outcome().choices[0].tokens == ()


def test_too_large_stops_accumulating() -> None:
    acc = StreamAccumulator("completions", max_chars=10)
    for _ in range(5):
        acc.on_chunk({"choices": [{"index": 0, "text": "abcd"}]})
    acc.on_chunk({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
    acc.on_end(True)
    out = acc.outcome()
    assert out.error == "too_large"
    assert out.choices[0].content == "abcdabcd"
    assert out.choices[0].finish_reason == "length"
    # logprob entries count against the same bound
    acc = StreamAccumulator("chat", max_chars=4)
    entry = chat_entry("a", -1.0, [("a", -1.0), ("b", -2.0)])
    acc.on_chunk({"choices": [{"index": 0, "delta": {}, "logprobs": {"content": [entry] * 2}}]})
    assert acc.outcome().error == "too_large"


def test_outcome_can_be_read_twice() -> None:
    body = chat_body([], CONTENT)
    body["choices"][0]["logprobs"]["content"].append(
        {"token": "", "bytes": [], "logprob": -1.0, "top_logprobs": []}
    )
    chunks = chat_chunks([], CONTENT)
    chunks[-2]["choices"][0]["logprobs"] = {
        "content": body["choices"][0]["logprobs"]["content"][-1:]
    }
    acc = _run("chat", chunks)
    assert acc.outcome() == acc.outcome()
    assert len(acc.outcome().choices[0].tokens or ()) == 3


def test_a_delta_folds_as_the_chunk_it_was_read_from() -> None:
    """What the relay hands on as a ``Delta`` (a token chunk carrying one text) is kept as the
    parsed chunk itself would be: content, reasoning, completions' text, empty texts."""
    for endpoint, chunks in (
        ("chat", chat_chunks(REASONING, CONTENT)),
        ("chat", chat_chunks(REASONING, CONTENT, reasoning_field="reasoning_content")),
        ("completions", completion_chunks(CONTENT)),
    ):
        extractor = Extractor(endpoint == "chat", templates=False)
        as_deltas, as_chunks = StreamAccumulator(endpoint), StreamAccumulator(endpoint)
        deltas = 0
        for chunk in chunks:
            # Without logprobs, as a stream the client did not ask them for.
            if chunk["choices"]:
                chunk = {**chunk, "choices": [{**chunk["choices"][0], "logprobs": None}]}
            delta = extractor.delta_of(chunk)
            deltas += delta is not None
            as_deltas.on_delta(delta if delta is not None else chunk)
            as_chunks.on_delta(chunk)
        as_deltas.on_end(True)
        as_chunks.on_end(True)
        assert deltas == len(chunks) - (3 if endpoint == "chat" else 2)  # (role,) finish, usage
        assert as_deltas.outcome() == as_chunks.outcome()
    acc = StreamAccumulator("chat")
    acc.on_delta(Delta(3, "reasoning", "think"))
    acc.on_delta(Delta(3, "content", ""))
    acc.on_delta(Delta(3, "content", "answer"))
    (choice,) = acc.outcome().choices
    assert (choice.index, choice.reasoning, choice.content) == (3, "think", "answer")
