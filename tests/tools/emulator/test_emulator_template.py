"""The emulator's chat template: /tokenize renders messages as vLLM's does (generation prompt,
continue_final_message), and --template-drops-reasoning renders assistant messages as
DeepSeek-R1's distills and QwQ do; a continued closed reasoning is recorded with the reasoning
its prompt kept, on either endpoint."""

from __future__ import annotations

from typing import Any

from proxy.tools.emulator.cli import build_parser, config_from_args
from proxy.tools.emulator.vocab import encode

from .conftest import MakeClient

CLOSED = "<think>\nTwo and two make four.\n</think>\n\n"
CONVERSATION = [
    {"role": "user", "content": "What is two and two?"},
    {"role": "assistant", "content": CLOSED},
]
STUCK = {"loop_channel": "reasoning", "reasoning_tokens": 6, "loop_escape_probability": 0.0}


def tokenize(messages: list[dict[str, Any]], **flags: Any) -> dict[str, Any]:
    return {"model": "emulator-model", "messages": messages, **flags}


def closed_records(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r["detail"] for r in records if r["kind"] == "closed_reasoning"]


async def test_tokenize_honours_the_generation_prompt_and_continue_final_message(
    make_client: MakeClient,
) -> None:
    client, _ = await make_client()
    opened = (await client.post("/tokenize", tokenize(CONVERSATION[:1]))).json()
    assert opened["tokens"] == encode("user: What is two and two?\nassistant:")
    bare = await client.post("/tokenize", tokenize(CONVERSATION[:1], add_generation_prompt=False))
    assert bare.json()["tokens"] == encode("user: What is two and two?")
    continued = await client.post(
        "/tokenize",
        tokenize(CONVERSATION, add_generation_prompt=False, continue_final_message=True),
    )
    assert continued.json()["tokens"] == encode(
        "user: What is two and two?\nassistant: " + CLOSED
    ), "a template that keeps reasoning renders the final message whole"
    both = await client.post("/tokenize", tokenize(CONVERSATION, continue_final_message=True))
    assert both.status == 400, "vLLM refuses continue_final_message with a generation prompt"
    strs = await client.post("/tokenize", {"prompt": "a b", "return_token_strs": True})
    assert strs.json()["token_strs"] == ["a", " b"]


async def test_a_template_that_drops_reasoning_renders_what_follows_the_end_marker(
    make_client: MakeClient,
) -> None:
    client, _ = await make_client(template_drops_reasoning=True)
    turn = [*CONVERSATION[:1], {"role": "assistant", "content": CLOSED + "Four."}]
    rendered = await client.post("/tokenize", tokenize(turn, add_generation_prompt=False))
    assert rendered.json()["tokens"] == encode(
        "user: What is two and two?\nassistant: \n\nFour."
    ), "the assistant message's reasoning survived a template that drops it"
    # Continuing a final message the template cut is transformers' error (vLLM's 400).
    continued = await client.post(
        "/tokenize",
        tokenize(CONVERSATION, add_generation_prompt=False, continue_final_message=True),
    )
    assert continued.status == 400
    assert "final message does not appear" in continued.json()["error"]["message"]
    opened = (await client.post("/tokenize", tokenize(CONVERSATION[:1]))).json()
    assert opened["tokens"] == encode("user: What is two and two?\nassistant:<think>\n")


async def test_a_chat_continuation_of_closed_reasoning_records_the_reasoning(
    make_client: MakeClient,
) -> None:
    body = {
        "model": "emulator-model",
        "messages": CONVERSATION,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 20,
    }
    keeps, keeping = await make_client(**STUCK)
    assert (await keeps.chat(body)).status == 200
    assert closed_records(keeping.injections()) == [
        {"endpoint": "chat", "reasoning": "Two and two make four."}
    ]
    # A template that drops it cannot continue it: vLLM refuses (transformers' error).
    drops, dropping = await make_client(template_drops_reasoning=True, **STUCK)
    reply = await drops.chat(body)
    assert reply.status == 400, "a final message the template cut was continued"
    assert not closed_records(dropping.injections())


async def test_a_prompt_of_token_ids_reads_back_as_its_text(make_client: MakeClient) -> None:
    # A rendered continuation: the conversation's ids then the closed reasoning's, as the
    # ids /tokenize handed out. The model answers it (no reasoning loop) and records it.
    client, server = await make_client(template_drops_reasoning=True, **STUCK)
    rendered = (await client.post("/tokenize", tokenize(CONVERSATION[:1]))).json()["tokens"]
    kept = await client.post(
        "/tokenize",
        {"model": "emulator-model", "prompt": "Two and two make four.\n</think>\n\n"},
    )
    prompt = rendered + kept.json()["tokens"]
    reply = await client.completion({"model": "emulator-model", "prompt": prompt, "max_tokens": 40})
    assert reply.status == 200
    answer = reply.json()
    assert answer["usage"]["prompt_tokens"] == len(prompt)
    assert " and then the model repeats itself." not in answer["choices"][0]["text"]
    assert closed_records(server.injections()) == [
        {"endpoint": "completion", "reasoning": "Two and two make four."}
    ]
    # An id never handed out reads as itself: nothing closed, the reasoning loop as before.
    plain = await client.completion({"model": "emulator-model", "prompt": [1, 2, 999_999_999]})
    assert plain.status == 200 and len(closed_records(server.injections())) == 1


async def test_an_assistant_message_reasoning_field_renders_as_the_template_does(
    make_client: MakeClient,
) -> None:
    # vLLM renders an assistant message's reasoning (reasoning_content read as it): before the
    # content, between the markers, where the template keeps it; dropped where it does not.
    turn = [*CONVERSATION[:1], {"role": "assistant", "content": "Four", "reasoning": "Sum."}]
    continued = {
        "model": "emulator-model",
        "messages": turn,
        "continue_final_message": True,
        "add_generation_prompt": False,
        "max_tokens": 20,
    }
    keeps, keeping = await make_client(reasoning_tokens=6)
    rendered = await keeps.post("/tokenize", tokenize(turn, add_generation_prompt=False))
    assert rendered.json()["tokens"] == encode(
        "user: What is two and two?\nassistant: <think>\nSum.\n</think>\n\nFour"
    ), "the assistant message's reasoning field was not rendered"
    legacy = [*turn[:1], {"role": "assistant", "content": "Four", "reasoning_content": "Sum."}]
    again = await keeps.post("/tokenize", tokenize(legacy, add_generation_prompt=False))
    assert again.json()["tokens"] == rendered.json()["tokens"]
    # Continued content after a reasoning: the model goes on with the answer (no reasoning),
    # recorded with the reasoning and content its prompt holds.
    reply = await keeps.chat(continued)
    assert reply.status == 200
    assert closed_records(keeping.injections()) == [
        {"endpoint": "chat", "reasoning": "Sum.", "content": "Four"}
    ]
    drops, dropping = await make_client(template_drops_reasoning=True, reasoning_tokens=6)
    rendered = await drops.post("/tokenize", tokenize(turn, add_generation_prompt=False))
    assert rendered.json()["tokens"] == encode("user: What is two and two?\nassistant: Four")
    assert (await drops.chat(continued)).status == 200  # the content is there to continue
    assert closed_records(dropping.injections()) == [{"endpoint": "chat", "reasoning": ""}]


def test_the_flag() -> None:
    args = build_parser().parse_args(["--template-drops-reasoning"])
    assert config_from_args(args).template_drops_reasoning is True
    assert config_from_args(build_parser().parse_args([])).template_drops_reasoning is False
