"""One retry rung at a time, through detproxy, on the loop corpus: how often a continuation
under that rung's overrides loops again.

Run: ``.venv/bin/python tests/bench/bench_rung.py [RUNG ...] [--prompts N]`` (~20 min per rung
for the 33 looping prompts on 2 idle cores). Figures only, no assertions. llama-server and
SmolLM2-135M start as the integration tests start them (``-np 2 -c 4096``, 127.0.0.1 only);
then, for each rung, ``detproxy serve`` with ``[loops] policy = "retry"``, ``max_attempts = 2``
and a ladder of that one rung (``on_exhausted = "observe"``: a continuation that loops again
runs on to its limit), and the corpus's looping prompts (``tests/integration/loop_corpus.json``),
non-streamed, greedy, max_tokens 1024, two at a time (the engine's two slots). Printed per rung:
``detproxy_recoveries_total`` by outcome (recovered, length, looped_again) and the finish,
attempts and recovered header of each answer. The default continue strategy applies (the
continuation goes on from the loop's onset and one unit), so a rung is tried as the first retry
of each loop.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.llama_server import run_engine
from tests.helpers.processes import run_detproxy
from tests.integration.test_loop_recovery_llama_server import (
    CORPUS,
    ask,
    metrics,
)

RUNGS = {
    # the default's first rung until 2026-12-07, its second now
    "first": "{temperature = 0.7, top_p = 0.95, presence_penalty = 1.5}",
    "greedy-frequency": "{frequency_penalty = 1.0}",  # the default's second until 2026-12-07
    # the default's first rung now
    "hot": "{temperature = 1.0, top_p = 0.95, presence_penalty = 1.5, frequency_penalty = 1.0}",
}


def config(rung: str) -> str:
    return (
        '[loops]\npolicy = "retry"\nmax_attempts = 2\n[[loops.ladders]]\nmodels = "*"\n'
        f'on_exhausted = "observe"\nattempts = [{RUNGS[rung]}]\n'
    )


async def burst(proxy: str, model: str, prompts: list[str]) -> list[dict[str, Any]]:
    sdk = openai.AsyncOpenAI(base_url=proxy + "/v1", api_key="none", max_retries=0, timeout=1800)
    slots = asyncio.Semaphore(2)

    async def one(prompt: str) -> dict[str, Any]:
        async with slots:
            return await ask(sdk, model, prompt, stream=False)

    try:
        return list(await asyncio.gather(*[one(p) for p in prompts]))
    finally:
        await sdk.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("rungs", nargs="*", help=f"of {', '.join(RUNGS)} (default: all)")
    parser.add_argument("--prompts", type=int, default=0, help="the first N looping prompts")
    args = parser.parse_args()
    unknown = [r for r in args.rungs if r not in RUNGS]
    if unknown:
        parser.error(f"no rung {', '.join(unknown)}: one of {', '.join(RUNGS)}")
    prompts = [p["prompt"] for p in CORPUS if p["looping"]]
    if args.prompts:
        prompts = prompts[: args.prompts]
    with (
        tempfile.TemporaryDirectory() as tmp,
        run_engine(Path(tmp), "-np", "2", "-c", "4096") as engine,
    ):
        for rung in args.rungs or RUNGS:
            logs = Path(tmp) / rung
            logs.mkdir()
            with run_detproxy(logs, engine.url, config(rung)) as proxy:
                started = time.monotonic()
                answers = asyncio.run(burst(proxy, engine.model, prompts))
                counts = metrics(proxy)
            outcomes = {
                k.split('outcome="')[1].split('"')[0]: int(v)
                for k, v in counts.items()
                if k.startswith("detproxy_recoveries_total{")
            }
            ends = collections.Counter(
                (a["finish"], a["attempts"], a["recovered"]) for a in answers
            )
            took = time.monotonic() - started
            print(f"{rung} ({RUNGS[rung]}), {len(prompts)} prompts, {took:.0f} s")
            print(f"  recoveries by outcome: {outcomes}")
            print(f"  answers (finish, attempts, recovered): {dict(ends)}", flush=True)


if __name__ == "__main__":
    main()
