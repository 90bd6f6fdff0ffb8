"""Day one: ``detproxy serve --upstream URL`` and nothing else, in front of llama-server, with
only greedy traffic from the openai SDK. The defaults audit it within a minute and keep the
incidents on disk in the state directory (issue 36, "Done when")."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import openai
import orjson
import pytest

from tests.helpers.llama_server import Engine
from tests.helpers.metrics import scrape
from tests.helpers.processes import EXE, free_port, stop, wait_http

pytestmark = pytest.mark.integration

# The same prompt again and again: hash sampling never picks it (unless its hash does): only
# the floor (one audit a minute per model) can.
PROMPT = "Name three colours of the rainbow."


def audits(url: str) -> float:
    """Shadow audits completed, from /detproxy/metrics."""
    found = scrape(url + "/detproxy/metrics", "detproxy_audits_total")
    return sum(v for k, v in found.items() if 'mode="full"' in k or 'mode="prefill"' in k)


def test_the_defaults_audit_greedy_traffic_within_a_minute_and_keep_incidents_on_disk(
    engine: Engine, tmp_path: Path
) -> None:
    state = tmp_path / "state" / "not-created-yet"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DETPROXY_")}
    env["DETPROXY_STATE_DIR"] = str(state)
    argv = [EXE, "serve", "--upstream", engine.url, "--port", str(port)]
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "detproxy.log", "wb") as log:
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_http(url + "/detproxy/health", proc, timeout=30)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            started = time.monotonic()
            sent = 0
            while audits(url) == 0 and time.monotonic() - started < 60:
                answer = client.chat.completions.create(
                    model=engine.model,
                    temperature=0,
                    max_tokens=16,
                    messages=[{"role": "user", "content": PROMPT}],
                )
                assert answer.choices[0].message.content, "an empty answer through detproxy"
                assert answer.choices[0].logprobs is None, "the audit's logprobs reached the client"
                sent += 1
            took = time.monotonic() - started
            assert audits(url) > 0, (
                f"no audit in /detproxy/metrics after {took:.0f} s, {sent} requests"
            )
            assert (state / "incidents.jsonl").is_file(), f"no incident file in {state}"
        finally:
            stop(proc)  # SIGTERM: the last tally line goes to the file
    lines = [orjson.loads(x) for x in (state / "incidents.jsonl").read_bytes().splitlines()]
    tallies = [x for x in lines if x.get("kind") == "tally"]
    assert tallies, f"no tally line in the incident file: {lines}"
    full = tallies[-1]["audits"].get(engine.model, {}).get("full", {})
    assert sum(full.values()) >= 1, f"the last tally counts no full audit: {tallies[-1]}"
