"""Real parts: llama.cpp's llama-server (built from the llama-cpp-python sdist), SmolLM2-135M,
detproxy started by its own console script, and the official openai SDK as the client."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.llama_server import Engine, run_engine
from tests.helpers.processes import run_detproxy


@pytest.fixture(scope="session")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Engine]:
    # Two slots with per-slot KV (kv_unified off): batch-invariant, so the direct and the
    # proxied answer to one greedy request can be compared bit for bit.
    with run_engine(tmp_path_factory.mktemp("engine"), "-np", "2", "-c", "4096") as eng:
        yield eng


@pytest.fixture(scope="session")
def detproxy_url(engine: Engine, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with run_detproxy(tmp_path_factory.mktemp("detproxy"), engine.url) as url:
        yield url
