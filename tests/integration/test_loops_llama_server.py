"""Loops on a real engine: SmolLM2-135M at temperature 0 falls into exact repetition loops on
some prompts. detproxy detects them and a retry ladder ends them with a normal finish."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import openai
import pytest

from tests.helpers.llama_server import Engine, reasoning_template, run_engine
from tests.helpers.metrics import scrape
from tests.helpers.processes import run_detproxy
from tests.helpers.waiting import Unmet, eventually_sync

pytestmark = pytest.mark.integration

# Found by running open-ended prompts at temperature 0 with 384 tokens (see the closing note
# of the loops issue): each loops with a unit of 26 to 101 characters.
LOOPING = [
    "Write a poem about the ocean.",
    "Write a poem about love.",
    "Write a letter to a friend.",
]
# The prompt cache makes an answer depend on earlier traffic: ask cold, for a repeatable test.
COLD = {"cache_prompt": False}
LADDER = """
[loops]
stream_mode = "restart"
[[loops.ladders]]
models = "*"
action = "retry"
attempts = [{ presence_penalty = 1.5 },
            { temperature = 0.7, top_p = 0.95, presence_penalty = 1.5, seed = 1 }]
"""


def loop_counts(counts: dict[str, float]) -> tuple[float, dict[str, float]]:
    loops = sum(
        v
        for k, v in counts.items()
        if k.startswith("detproxy_loops_total") and 'source="proxy"' in k
    )
    retries = {
        o: sum(v for k, v in counts.items() if f'outcome="{o}"' in k)
        for o in ("recovered", "looped_again", "error")
    }
    return loops, retries


def metrics(url: str) -> dict[str, float]:
    return scrape(
        url + "/detproxy/metrics", ("detproxy_loops_total", "detproxy_policy_actions_total")
    )


def test_loops_are_detected_and_recovered(engine: Engine, tmp_path: Path) -> None:
    with run_detproxy(tmp_path, engine.url, LADDER) as proxy:
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model=engine.model,
            temperature=0,
            max_tokens=384,
            messages=[{"role": "user", "content": LOOPING[0]}],
            extra_body=COLD,
        )
        answer = raw.parse()
        assert raw.headers["X-Detproxy-Recovered"] == "true"
        assert answer.choices[0].finish_reason in ("stop", "length")
        for prompt in LOOPING[1:]:
            stream = client.chat.completions.create(
                model=engine.model,
                temperature=0,
                max_tokens=384,
                stream=True,
                messages=[{"role": "user", "content": prompt}],
                extra_body=COLD,
            )
            chunks = list(stream)
            assert len({c.id for c in chunks}) == 1
            # Recovered: the last attempt ended without a loop (not cut by detproxy).
            finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
            assert finishes[-1] in ("stop", "length"), prompt
            # A stream a policy acted on says so on its last chunk (SPEC section 5).
            info = (chunks[-1].model_extra or {}).get("detproxy")
            assert info is None or (info["recovered"], info["strategy"]) == (True, "restart"), info
        # A retry's outcome is counted when the upstream's response has ended, which can be
        # a moment after the client read data: [DONE]: wait for the counts to settle.

        def settled() -> tuple[dict[str, float], float, dict[str, float]] | Unmet:
            counts = metrics(proxy)
            loops, retries = loop_counts(counts)
            done = retries["recovered"] + retries["looped_again"] >= loops
            return (counts, loops, retries) if done else Unmet(counts)

        counts, loops, retries = eventually_sync(
            settled, interval_s=0.05, what="an outcome counted for every loop's retry"
        )
    # Every loop led to a retry, and every looping request ended recovered (nothing aborted).
    assert loops >= 2 and retries["recovered"] >= 2, counts
    assert retries["recovered"] + retries["looped_again"] == loops, counts
    assert retries["error"] == 0, counts
    assert not any('action="abort"' in k for k in counts)


def test_reasoning_channel_and_runaway_on_a_real_engine(tmp_path: Path) -> None:
    """llama-server with QwQ's template streams SmolLM2's output as reasoning_content and
    never closes the thinking: a loop there is caught, and so is a runaway."""
    config = '[loops]\npolicy = "observe"\nstream_mode = "hold_reasoning"\n'
    with (
        run_engine(
            tmp_path,
            "-np",
            "1",
            "-c",
            "4096",
            "--chat-template-file",
            reasoning_template(),
            "--reasoning-format",
            "deepseek",
        ) as engine,
        run_detproxy(tmp_path, engine.url, config) as proxy,
    ):
        client = openai.OpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0)

        def reasoning_of(prompt: str, max_tokens: int) -> tuple[str, Any]:
            stream = client.chat.completions.create(
                model=engine.model,
                temperature=0,
                max_tokens=max_tokens,
                stream=True,
                messages=[{"role": "user", "content": prompt}],
            )
            chunks = [c for c in stream if c.choices]
            text = "".join(
                getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks
            )
            return text, chunks[-1].choices[0].finish_reason

        looped, finish = reasoning_of(LOOPING[0], 384)
        assert looped and finish == "length"  # observe: the stream is left as it was
        short, finish = reasoning_of("Explain how computers work.", 64)
        assert short and finish == "length"
        counts = metrics(proxy)
    assert counts['detproxy_loops_total{channel="reasoning",model="smollm2",source="proxy"}'] == 1
    assert counts['detproxy_loops_total{channel="reasoning",model="smollm2",source="runaway"}'] == 1
