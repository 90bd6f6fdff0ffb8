from __future__ import annotations

import json
from functools import partial
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.relay.result import StreamResult
from tests.helpers.answers import grouped_chat_chunks, tokens
from tests.helpers.relay_run import relay
from tests.helpers.sse import chat_chunk, sse_event

chunk = partial(chat_chunk, chunk_id="chatcmpl-7")


def vllm_stream(texts: list[str], key: str = "content", usage: int | None = 42) -> list[bytes]:
    events = [sse_event(chunk({"role": "assistant", "content": ""}))]
    for text in texts:
        delta = {"reasoning": text, "reasoning_content": text} if key == "both" else {key: text}
        events.append(sse_event(chunk(delta)))
    events.append(sse_event(chunk({"content": ""}, "stop")))
    if usage is not None:
        usage_chunk = {"id": "chatcmpl-7", "choices": [], "usage": {"completion_tokens": usage}}
        events.append(sse_event(usage_chunk))
    return [*events, b"data: [DONE]\n\n"]


def tally(reads: list[bytes], endpoint: str = "chat", max_bytes: int = 1 << 20) -> Any:
    """The raw path's bytes, result and writes; it counts as the reference (every event parsed,
    the same reads) does, exactly."""
    run = relay(reads, endpoint=endpoint, max_event_bytes=max_bytes)
    assert run.relay.raw
    reference = relay(reads, endpoint=endpoint, max_event_bytes=max_bytes, general=True)
    assert run.client.body == reference.client.body
    assert counts(run.result) == counts(reference.result)
    return run.client.body, run.result, run, run.client.writes


def counts(result: StreamResult) -> tuple[Any, ...]:
    r = result
    return (r.events, r.first_id, r.token_events, r.tokens, r.first_tokens, r.completion_tokens)


def cut(stream: bytes, cuts: list[int]) -> list[bytes]:
    cuts = sorted(cuts)
    return [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]


TEXTS = ["Hel", "", "lo", ' "quoted" ', "\\", "é", "content", '"content":"x"']


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from(TEXTS), max_size=30),
    st.sampled_from(["content", "reasoning", "reasoning_content", "both"]),
    st.lists(st.integers(0, 4000), max_size=10),
)
def test_counts_a_vllm_stream_in_any_split(texts: list[str], key: str, cuts: list[int]) -> None:
    events = vllm_stream(texts, key)
    stream = b"".join(events)
    relayed, result, _, parts = tally(cut(stream, [c for c in cuts if c <= len(stream)]))
    assert relayed == stream
    assert all(p.endswith(b"\n\n") for p in parts if p)  # only whole events go out
    assert result.events == len(events)
    assert result.first_id == "chatcmpl-7"
    assert result.token_events == sum(1 for t in texts if t)
    assert result.completion_tokens == 42
    assert (result.first_token_s is None) == (result.token_events == 0)
    assert result.first_event_s is not None


def test_completions_and_python_spacing() -> None:
    stream = b"".join(
        b"data: " + json.dumps({"id": "cmpl-1", "choices": [{"text": t}]}).encode() + b"\n\n"
        for t in ["a", "", "b", "c"]
    )
    _, result, _, _ = tally([stream], endpoint="completions")
    assert (result.events, result.token_events, result.first_id) == (4, 3, "cmpl-1")
    spaced = b"".join(
        b"data: " + json.dumps(chunk({"content": t})).encode() + b"\n\n" for t in ["a", "", "b"]
    )
    _, result, _, _ = tally([spaced[:10], spaced[10:]])
    assert (result.events, result.token_events) == (3, 2)


def test_a_partial_event_waits_and_an_unterminated_last_one_is_counted() -> None:
    events = vllm_stream(["a", "b"], usage=None)
    stream = b"".join(events)[:-2]  # the last event lacks its blank line
    reads = [events[0][:10], events[0][10:] + events[1][:5], stream[len(events[0]) + 5 :]]
    relayed, result, _, writes = tally(reads)
    assert relayed == stream
    assert writes == [events[0], stream[len(events[0]) : -len(b"data: [DONE]")], b"data: [DONE]"]
    assert result.events == len(events) - 1  # as the decoder counts: the last had no end
    assert result.token_events == 2


def test_crlf_framing_is_decoded_exactly() -> None:
    events = vllm_stream(["a", "", "b"])
    stream = b"".join(events).replace(b"\n", b"\r\n")
    relayed, result, _, _ = tally(cut(stream, [7, 100, 101, 300]))
    assert relayed == stream
    assert (result.events, result.token_events, result.completion_tokens) == (7, 2, 42)
    assert result.first_id == "chatcmpl-7"


def test_an_oversized_event_switches_to_passing_bytes_through() -> None:
    first = vllm_stream(["a"])[0]
    stream = first + sse_event(chunk({"content": "x" * 5000})) + vllm_stream(["b"])[1]
    relayed, result, run, parts = tally(cut(stream, [len(first), 2000, 4000]), max_bytes=1000)
    assert relayed == stream
    assert parts[:2] == [first, stream[len(first) : 2000]]  # past the bound, as it comes
    assert result.events == 1  # the events before it; nothing counted after
    assert run.stopped == []  # nothing was inspected: nothing stopped


def test_what_byte_searches_used_to_approximate_is_exact() -> None:
    # Stray blank lines are no events.
    _, result, _, _ = tally([sse_event(chunk({"content": "a"})) + b"\n\n"])
    assert result.events == 1
    # A read mixing events with only reasoning and only reasoning_content counts both.
    mixed = sse_event(chunk({"reasoning": "a"})) + sse_event(chunk({"reasoning_content": "b"}))
    _, result, _, _ = tally([mixed])
    assert result.token_events == 2
    # first_id comes from the first event that has one.
    _, result, _, _ = tally([sse_event({"choices": []}) + sse_event(chunk({"content": "a"}))])
    assert result.first_id == "chatcmpl-7"
    # One event with both content and reasoning is one token event.
    both = sse_event(chunk({"reasoning": "a", "content": "b"}))
    _, result, _, _ = tally([both])
    assert result.token_events == 1


@settings(max_examples=100, deadline=None)
@given(
    st.sampled_from(["logprobs", "continuous_usage", "spaced"]),
    st.lists(st.integers(0, 6000), max_size=8),
)
def test_tokens_of_several_a_chunk_in_any_split(shape: str, cuts: list[int]) -> None:
    """Twelve tokens, four a chunk: counted from the usage growth or the logprobs entries."""
    chunks = grouped_chat_chunks(
        tokens(12), 4, logprobs=shape != "continuous_usage", final_usage=False,
        continuous_usage=shape == "continuous_usage",
    )  # fmt: skip
    if shape == "spaced":  # Python's json spacing: '"logprobs": {'
        stream = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    else:
        stream = b"".join(sse_event(c) for c in chunks)
    stream += b"data: [DONE]\n\n"
    relayed, result, _, _ = tally(cut(stream, [c for c in cuts if c <= len(stream)]))
    assert relayed == stream
    assert result.token_events == 3 and result.tokens == 12
    assert result.first_tokens == 4  # those of the first token event


def test_completions_logprobs_list_their_tokens() -> None:
    def piece(text: str, n: int) -> bytes:
        logprobs = {"tokens": [text] * n, "token_logprobs": [-0.5] * n}
        return sse_event(
            {"id": "cmpl-1", "choices": [{"index": 0, "text": text, "logprobs": logprobs}]}
        )

    reads = [piece("ab", 2), piece("cde", 3) + piece("f", 1)]
    _, result, _, _ = tally(reads, endpoint="completions")
    assert (result.token_events, result.tokens, result.first_tokens) == (3, 6, 2)
