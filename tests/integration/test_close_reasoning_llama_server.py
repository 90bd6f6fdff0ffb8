"""A reasoning loop closed on the real engine: llama-server with a thinking chat template.

``think.jinja`` opens ``<think>`` in the generation prompt, as DeepSeek-R1's and
Qwen3-thinking's templates do, and llama-server (``--reasoning-format deepseek``) streams what
follows as ``reasoning_content``. SmolLM2 never writes ``</think>`` itself, so its answer is all
reasoning, and on open-ended prompts it loops there (tests/bench/bench_close_reasoning.py).
``close_reasoning`` keeps the reasoning up to the loop, closes it and lets the engine answer:
the client gets the kept reasoning as reasoning and the engine's answer as content, streamed
without any text twice, and that answer is what the engine writes from the closed reasoning.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from policies.base import Trigger
from proxy.loops.continuation import closed_reasoning, prefix_of
from proxy.loops.detector import DetectorConfig, LoopDetector
from tests.helpers.llama_server import Engine, run_engine
from tests.helpers.metrics import scrape
from tests.helpers.processes import run_detproxy

pytestmark = pytest.mark.integration

TEMPLATE = Path(__file__).with_name("think.jinja")
THINKING = ("--jinja", "--chat-template-file", str(TEMPLATE), "--reasoning-format", "deepseek")
PROMPT = "Write a poem about the ocean."  # loops in its reasoning after about 150 tokens
MAX_TOKENS = 1024
COLD = {"cache_prompt": False}
# The ladder's default first attempt, as close_reasoning; a continuation that loops again is
# relayed as it is (the test is about what the client gets, not the ladder's second rung).
CONFIG = (
    '[[loops.ladders]]\nmodels = "*"\n'
    'attempts = [{ strategy = "close_reasoning", temperature = 0.7, top_p = 0.95,'
    " presence_penalty = 1.5, seed = 1 }]\n"
    'on_exhausted = "observe"\n'
)
OVERRIDES = {"temperature": 0.7, "top_p": 0.95, "presence_penalty": 1.5, "seed": 1}


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    with run_engine(tmp_path_factory.mktemp("thinking"), "-np", "2", "-c", "4096", *THINKING) as e:
        yield e


def post(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        engine.url + "/v1/chat/completions",
        data=orjson.dumps({"model": engine.model, **COLD, **body}),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as resp:
        answer: dict[str, Any] = orjson.loads(resp.read())
    return answer


def looping_reasoning(engine: Engine, stream: bool) -> tuple[str, str]:
    """The engine's own greedy reasoning for PROMPT, and the part detproxy keeps of it: its
    detector fed as detproxy's watch feeds it (a whole answer at once; a stream delta by
    delta), so the loop's onset is the one detproxy finds."""
    body = {
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "messages": [{"role": "user", "content": PROMPT}],
    }
    if stream:
        deltas = [d.get("reasoning_content") or "" for d in stream_deltas(engine, body)]
    else:
        message = post(engine, body)["choices"][0]["message"]
        deltas = [message.get("reasoning_content") or ""]
    detector = LoopDetector(DetectorConfig())
    reasoning = ""
    for delta in deltas:
        reasoning += delta
        report = detector.feed(delta) if delta else None
        if report is not None:
            trigger = Trigger("proxy", "reasoning", 0, report.period, report.repeats,
                              report.start_offset)  # fmt: skip
            kept = prefix_of(reasoning, trigger)
            assert kept
            return "".join(deltas), kept
    raise AssertionError(f"no loop in the reasoning: {reasoning[:300]!r}")


def stream_deltas(engine: Engine, body: dict[str, Any]) -> list[dict[str, Any]]:
    request = urllib.request.Request(
        engine.url + "/v1/chat/completions",
        data=orjson.dumps({"model": engine.model, **COLD, **body, "stream": True}),
        headers={"Content-Type": "application/json"},
    )
    deltas = []
    with urllib.request.urlopen(request, timeout=600) as resp:
        for line in resp:
            if line.startswith(b"data: {"):
                for choice in orjson.loads(line[6:]).get("choices") or []:
                    deltas.append(choice.get("delta") or {})
    return deltas


def direct_answer(engine: Engine, kept: str, kept_tokens: int) -> str:
    """What the engine writes after the closed reasoning, asked directly, with the limit
    detproxy asked for (the request's, less the tokens kept)."""
    closed = closed_reasoning(kept, "<think>", "</think>")
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": closed}]
    body = {
        "temperature": 0,
        **OVERRIDES,
        "max_tokens": MAX_TOKENS - kept_tokens,
        "messages": messages,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    content = post(engine, body)["choices"][0]["message"]["content"] or ""
    # llama-server answers a non-streamed continuation with the final assistant message in
    # front (the markers in the content): what it wrote is after it.
    assert content.startswith(closed), content[:300]
    return content[len(closed) :]


def kept_tokens(proxy: str) -> int:
    counts = scrape(proxy + "/detproxy/metrics", "detproxy_recovery_tokens_total")
    kept = [v for k, v in counts.items() if 'kind="kept"' in k and "close_reasoning" in k]
    assert kept and kept[0] > 0, counts
    return int(kept[0])


def test_a_reasoning_loop_is_closed_and_answered(thinking: Engine, tmp_path: Path) -> None:
    _, kept = looping_reasoning(thinking, stream=False)
    with run_detproxy(tmp_path, thinking.url, CONFIG) as proxy:
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=600)
        raw = client.chat.completions.with_raw_response.create(
            model=thinking.model,
            temperature=0,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body=COLD,
        )
        answer = raw.parse()
        tokens = kept_tokens(proxy)
    assert raw.headers["X-Detproxy-Strategy"] == "close_reasoning"
    message = answer.choices[0].message
    # The reasoning up to the loop, as the engine's own field; the answer as the content,
    # without the closed reasoning llama-server put in front of it.
    assert (message.model_extra or {}).get("reasoning_content") == kept
    content = message.content or ""
    assert content.strip() and not content.startswith("<think>")
    assert content == direct_answer(thinking, kept, tokens)
    assert answer.choices[0].finish_reason in ("stop", "length")


def test_a_streamed_reasoning_loop_goes_on_with_the_answer(
    thinking: Engine, tmp_path: Path
) -> None:
    reasoning, kept = looping_reasoning(thinking, stream=True)
    with run_detproxy(tmp_path, thinking.url, CONFIG) as proxy:
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=600)
        stream = client.chat.completions.create(
            model=thinking.model,
            temperature=0,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": PROMPT}],
            extra_body=COLD,
            stream=True,
        )
        chunks = list(stream)
        tokens = kept_tokens(proxy)
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    seen = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    content = "".join(d.content or "" for d in deltas)
    # The client saw the reasoning once, as the engine wrote it until detproxy cut the loop
    # (no restart: it does not start again), then the answer as content.
    assert seen.startswith(kept) and reasoning.startswith(seen)
    assert content.strip()
    assert content == direct_answer(thinking, kept, tokens)
    ids = {c.id for c in chunks}
    assert len(ids) == 1  # one answer, under the first attempt's id
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] in ("stop", "length")
