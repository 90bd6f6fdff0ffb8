"""`detproxy probe` against the emulator, started as a user starts it."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

from proxy.config import api_root
from proxy.http.errors import UpstreamFailure
from proxy.testing import MockUpstream, Received, Reply, answers
from proxy.tools.probe import ProbeError, Prober, main, parse_args
from tests.helpers.processes import EXE, free_port, wait_http


@pytest.fixture
def start_emulator() -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(*flags: str) -> str:
        port = free_port()
        proc = subprocess.Popen(
            [EXE, "emulator", "--port", str(port), *flags],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        procs.append(proc)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", proc, timeout=15)
        return url

    yield start
    for proc in procs:
        proc.terminate()
        proc.wait(timeout=10)


def probe(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, Any]:
    code = main(["--model", "emulator-model", "--runs", "5", "--json", *args])
    out = capsys.readouterr().out
    return code, orjson.loads(out) if out.strip() else None


def test_stable_upstream_exits_0(start_emulator: Any, capsys: pytest.CaptureFixture[str]) -> None:
    url = start_emulator()
    code, report = probe(capsys, "--upstream", url, "--prompt", "Hello there")
    assert code == 0 and report["stable"]
    (result,) = report["results"]
    assert (result["distinct_vectors"], result["first_token_flips"], result["max_abs_delta"]) == (
        1,
        False,
        0.0,
    )
    code, report = probe(
        capsys,
        "--upstream",
        url,
        "--prompt",
        "Hello",
        "--endpoint",
        "completions",
        "--top-logprobs",
        "5",
    )
    assert code == 0 and report["results"][0]["distinct_vectors"] == 1


def test_intrinsic_nondeterminism_exits_1(
    start_emulator: Any, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    url = start_emulator("--logprob-jitter", "0.5", "--seed", "3")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("first prompt\n\nsecond prompt\n")
    code, report = probe(capsys, "--upstream", url, "--prompts", str(prompts), "--runs", "12")
    assert code == 1 and not report["stable"]
    assert [r["prompt"] for r in report["results"]] == ["first prompt", "second prompt"]
    assert all(r["distinct_vectors"] >= 2 for r in report["results"])
    # Drift at GPU magnitudes (tenths of a nat to a few nats), not a rounding nudge.
    assert all(0.05 < r["max_abs_delta"] < 3.5 for r in report["results"])
    assert not any(r["first_token_flips"] for r in report["results"])


def test_concurrency_separates_batch_effects(
    start_emulator: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    # With 3 in flight a request is hit with p = min(1, 0.5 * 2) = 1; alone, never.
    url = start_emulator("--batch-divergence-slope", "0.5", "--token-latency", "0.01")
    code = main(
        [
            "--upstream",
            url,
            "--model",
            "emulator-model",
            "--prompt",
            "batch me",
            "--runs",
            "4",
            "--concurrency",
            "1,3",
        ]
    )
    out = capsys.readouterr().out
    assert code == 1
    assert "batch effects" in out
    lines = out.splitlines()
    alone = next(line for line in lines if line.strip().startswith("1 "))
    loaded = next(line for line in lines if line.strip().startswith("3 "))
    assert alone.split()[2] == "1" and int(loaded.split()[2]) >= 2


def test_usage_and_connection_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["--upstream", f"http://127.0.0.1:{free_port()}", "--model", "m", "--prompt", "x"])
        == 2
    )
    assert "cannot reach" in capsys.readouterr().err
    assert main(["--model", "m", "--prompt", "x"]) == 2  # --upstream missing
    assert (
        main(["--upstream", "http://x", "--model", "m", "--prompt", "x", "--concurrency", "0"]) == 2
    )


def test_an_openai_base_url_gets_the_hint_serve_gives(capsys: pytest.CaptureFixture[str]) -> None:
    """Not ".../v1/v1/chat/completions answered 404": what serve says of the same URL."""
    port = free_port()
    url = f"http://user:pw@127.0.0.1:{port}/v1"
    assert main(["--upstream", url, "--model", "m", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    with pytest.raises(ValueError) as serve_says:
        api_root(url)  # what serve's configuration says of it
    assert f"--upstream: {serve_says.value}" in err and "v1/v1" not in err, err
    assert "ends in /v1" in err and f"127.0.0.1:{port}" in err and "pw@" not in err


def test_a_server_started_with_an_api_key_is_probed_with_it(
    start_emulator: Any, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DETPROXY_API_KEY", "OPENAI_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    url = start_emulator("--api-key", "sk-probe-key")
    code = main(["--model", "emulator-model", "--runs", "2", "--upstream", url, "--prompt", "Hi"])
    err = capsys.readouterr().err
    assert code == 2 and "answered 401 (no API key)" in err and "--api-key" in err, err
    code, report = probe(
        capsys, "--upstream", url, "--prompt", "Hello", "--api-key", "sk-probe-key"
    )
    assert code == 0 and report["stable"]
    code = main(
        ["--model", "emulator-model", "--upstream", url, "--prompt", "Hi", "--api-key", "x"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "answered 401 (the API key given was refused)" in err, err
    monkeypatch.setenv("OPENAI_API_KEY", "sk-probe-key")
    code, report = probe(capsys, "--upstream", url, "--prompt", "Hello")
    assert code == 0 and report["stable"], "OPENAI_API_KEY was not used"
    monkeypatch.setenv("DETPROXY_API_KEY", "wrong")  # before OPENAI_API_KEY
    code, _ = probe(capsys, "--upstream", url, "--prompt", "Hello")
    assert code == 2


# -- the prober through the upstream seam, in process ----------------------------------------


async def test_the_prober_asks_through_the_seam_with_its_key() -> None:
    mock = MockUpstream(answers("yes", model="m"))
    args = parse_args(
        ["--upstream", "http://engine:8000", "--model", "m", "--prompt", "hi", "--api-key", "sk-1"]
    )
    token, top = await Prober(mock, args).vector("hi")
    assert token == "yes" and top, "the first token and its top-k"
    [sent] = mock.received("/v1/chat/completions")
    assert sent.headers["Authorization"] == "Bearer sk-1"
    assert sent.json()["top_logprobs"] == args.top_logprobs and sent.json()["max_tokens"] == 1


async def test_a_fault_of_the_seam_is_one_probe_error() -> None:
    """Refused, or no answer within the timeout: ``cannot reach``, never a traceback."""

    def refuse(request: Received) -> Reply:
        raise UpstreamFailure(502, "upstream refused the connection: nothing there", "refused")

    args = parse_args(["--upstream", "http://engine:8000", "--model", "m", "--prompt", "hi"])
    with pytest.raises(ProbeError, match="cannot reach http://engine:8000/v1/chat/completions"):
        await Prober(MockUpstream(refuse), args).vector("hi")
