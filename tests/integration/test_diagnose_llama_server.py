"""`detproxy diagnose` on llama-server: the stock server (several slots, one unified KV cache)
against per-slot KV (the session engine: -np 2, kv_unified off), each checked by hand-made
requests straight to the engine."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.helpers.llama_server import Engine, run_engine, wait_engine_idle
from tests.helpers.processes import EXE

pytestmark = pytest.mark.integration

PROMPT = "List the first ten prime numbers, separated by commas."
# Small budget: two cores shared with other work.
BUDGET = ("--runs", "5", "--max-tokens", "12", "--concurrency", "1,4", "--top-logprobs", "5")


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    """llama-server as started without -np: slots chosen by the server, kv_unified on."""
    with run_engine(tmp_path_factory.mktemp("stock"), "-c", "4096") as eng:
        yield eng


def diagnose(engine: Engine, prompts: Path) -> tuple[int, dict[str, Any]]:
    wait_engine_idle(engine)
    done = subprocess.run(
        [
            EXE,
            "diagnose",
            "--upstream",
            engine.url,
            "--model",
            engine.model,
            "--prompts",
            str(prompts),
            "--json",
            "--quiet",
            *BUDGET,
        ],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )
    assert done.returncode in (0, 1), done.stderr
    return done.returncode, orjson.loads(done.stdout)


def post(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    import urllib.request

    full = {
        "model": engine.model,
        "temperature": 0,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": PROMPT}],
        "logprobs": True,
        "top_logprobs": 5,
    } | body
    req = urllib.request.Request(
        engine.url + "/v1/chat/completions",
        orjson.dumps(full),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        answer: dict[str, Any] = orjson.loads(resp.read())
    return answer


def logprobs(answer: dict[str, Any]) -> Any:
    return answer["choices"][0]["logprobs"]["content"]


def beside_load(engine: Engine, fillers: int) -> dict[str, Any]:
    """One cold request while ``fillers`` cold requests are in flight (a hand-made batch)."""
    stop = threading.Event()

    def fill(i: int) -> None:
        while not stop.is_set():
            post(
                engine,
                {
                    "cache_prompt": False,
                    "max_tokens": 24,
                    "messages": [{"role": "user", "content": f"Tell story {i}."}],
                },
            )

    threads = [threading.Thread(target=fill, args=(i,)) for i in range(fillers)]
    for t in threads:
        t.start()
    try:
        return post(engine, {"cache_prompt": False})
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def cause_status(report: dict[str, Any]) -> dict[str, str]:
    return {c["cause"]: c["status"] for c in report["checks"]}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("prompts") / "prompts.txt"
    path.write_text(PROMPT + "\n")
    return path


def test_stock_server(stock: Engine, prompts: Path) -> None:
    code, report = diagnose(stock, prompts)
    got = cause_status(report)
    print("stock:", orjson.dumps(report["causes"]).decode())
    assert got["intrinsic"] == "not_found", report["checks"][0]
    # The hand-made ablation: cold serial replays agree; warm differs from cold exactly when
    # diagnose says prefix_cache.
    cold = [logprobs(post(stock, {"cache_prompt": False})) for _ in range(3)]
    assert cold[0] == cold[1] == cold[2], "serial cold replays differ on the stock server"
    post(stock, {"cache_prompt": True})
    warm = logprobs(post(stock, {"cache_prompt": True}))
    assert (got["prefix_cache"] == "found") == (warm != cold[0]), got
    assert got["batch"] == "found", report["checks"][1]
    loaded = [logprobs(beside_load(stock, 3)) for _ in range(3)]
    assert any(x != cold[0] for x in loaded), "no hand-made replay beside load differed"
    assert code == (1 if report["causes"] else 0)


def test_per_slot_server(engine: Engine, prompts: Path) -> None:
    _, report = diagnose(engine, prompts)
    got = cause_status(report)
    print("per-slot:", orjson.dumps(report["causes"]).decode())
    assert (got["intrinsic"], got["batch"]) == ("not_found", "not_found"), report["causes"]
    cold = logprobs(post(engine, {"cache_prompt": False}))
    assert logprobs(beside_load(engine, 1)) == cold, "per-slot KV changed under load by hand"
