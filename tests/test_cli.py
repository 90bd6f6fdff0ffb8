"""``detproxy`` as a process: the event loop ``serve`` runs on, what it says when it cannot
start, ``detproxy config``, and the help texts."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from proxy.config import Settings, load_settings
from proxy.tools.emulator import EmulatorServer
from tests.helpers.processes import EXE, bare_env, detproxy_serve, free_port

CHAT = {
    "model": "emulator-model",
    "temperature": 0,
    "max_tokens": 8,
    "messages": [{"role": "user", "content": "hello"}],
}


@pytest.mark.parametrize(
    ("flags", "env", "loop"),
    [
        ((), {}, "uvloop"),  # auto, with uvloop installed
        (("--event-loop", "uvloop"), {}, "uvloop"),
        (("--event-loop", "asyncio"), {}, "asyncio"),
        ((), {"DETPROXY_SERVER__EVENT_LOOP": "asyncio"}, "asyncio"),
    ],
)
async def test_serve_runs_on_the_configured_loop(
    flags: tuple[str, ...], env: dict[str, str], loop: str
) -> None:
    async with (
        EmulatorServer() as emu,
        detproxy_serve(emu.url, *flags, env=env) as (base, _),
        aiohttp.ClientSession() as http,
    ):
        async with http.get(base + "/detproxy/status") as resp:
            assert (await resp.json())["event_loop"] == loop
        # And it proxies on that loop: whole, streamed, and passed through.
        async with http.post(base + "/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200 and (await resp.json())["choices"]
        async with http.post(base + "/v1/chat/completions", json={**CHAT, "stream": True}) as resp:
            assert resp.status == 200 and (await resp.read()).endswith(b"data: [DONE]\n\n")
        async with http.get(base + "/v1/models") as resp:
            assert resp.status == 200


async def test_uvloop_asked_for_but_missing_stops_serve_at_start(tmp_path: Path) -> None:
    (tmp_path / "uvloop").mkdir()
    (tmp_path / "uvloop" / "__init__.py").write_text("raise ImportError('not here')\n")
    proc = await asyncio.create_subprocess_exec(
        EXE,
        "serve",
        "--event-loop",
        "uvloop",
        "--port",
        str(free_port()),
        env={**bare_env(), "PYTHONPATH": str(tmp_path)},
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 2
    assert 'server.event_loop is "uvloop" but uvloop cannot be imported' in err.decode()


# ---------------------------------------------------------------------------------------------
# Start-up errors: one line that names the cause and the fix, exit 2, never a traceback.


def run_cli(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> tuple[int, str]:
    """The console script run to its end: (exit status, stderr)."""
    done = subprocess.run(
        [EXE, *args], env={**bare_env(), **(env or {})}, capture_output=True, timeout=timeout
    )
    return done.returncode, done.stderr.decode()


def assert_one_line_error(code: int, err: str, *expected: str) -> None:
    assert code == 2, f"exit {code}, not 2; stderr:\n{err}"
    assert "Traceback" not in err, f"a traceback instead of a sentence:\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"{len(lines)} lines on stderr, not 1:\n{err}"
    assert "listening" not in err
    for part in expected:
        assert part in lines[0], f"{part!r} not in {lines[0]!r}"


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_port_in_use_is_one_line(taken_port: int, workers: str, tmp_path: Path) -> None:
    code, err = run_cli(
        "serve", "--port", str(taken_port), "--workers", workers,
        env={"DETPROXY_STATE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{taken_port}", "another --port")


def test_the_emulator_on_a_port_in_use_is_one_line(taken_port: int) -> None:
    code, err = run_cli("emulator", "--port", str(taken_port))
    assert_one_line_error(code, err, f"cannot listen on 127.0.0.1:{taken_port}", "--port")


def test_an_admin_port_in_use_is_one_line(taken_port: int, tmp_path: Path) -> None:
    code, err = run_cli(
        "serve", "--port", "0",
        env={"DETPROXY_SERVER__ADMIN_PORT": str(taken_port), "DETPROXY_STATE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_error(code, err, f":{taken_port}", "server.admin_port")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_an_unwritable_incident_path_is_one_line(tmp_path: Path, workers: str) -> None:
    (tmp_path / "a-file").write_text("")
    code, err = run_cli(
        "serve", "--port", "0", "--workers", workers,
        env={"DETPROXY_INCIDENTS__PATH": str(tmp_path / "a-file" / "incidents.jsonl")},
    )  # fmt: skip
    assert_one_line_error(code, err, "incidents.path", str(tmp_path / "a-file"))


def test_the_engine_log_on_stdin_with_several_workers_is_one_line(tmp_path: Path) -> None:
    code, err = run_cli(
        "serve", "--port", "0", "--workers", "2",
        env={"DETPROXY_UPSTREAM__ENGINE_LOG": "-", "DETPROXY_STATE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_error(code, err, "upstream.engine_log", "2 workers", "log file")


@pytest.mark.parametrize(
    ("args", "env", "expected"),
    [
        (("--config", "/nonexistent/detproxy.toml"), {}, ("cannot read config file",)),
        (("--workers", "0"), {}, ("server.workers", "(from --workers)")),
        (("--log-level", "bogus"), {}, ("--log-level", "invalid choice", "--help")),
        ((), {"DETPROXY_LOG_LEVEL": "bogus"}, ("log.level", "DETPROXY_LOG_LEVEL")),
        ((), {"DETPROXY_LOG__FORMAT": "xml"}, ("log.format", "DETPROXY_LOG__FORMAT")),
        (("--shadow-mode", "half"), {}, ("--shadow-mode", "invalid choice")),
        (("--port", "70000"), {}, ("server.port", "(from --port)")),
        (("--host", "no-such-host.invalid"), {}, ("not a known host name", "--host")),
        (("--host", "192.0.2.1"), {}, ("not an address of this machine",)),
        (("--upstream", "localhost:8000"), {}, ("upstream.url",)),
    ],
)
def test_each_start_up_mistake_is_one_line(
    args: tuple[str, ...], env: dict[str, str], expected: tuple[str, ...], tmp_path: Path
) -> None:
    code, err = run_cli(
        "serve", "--port", "0", *args, env={"DETPROXY_STATE_DIR": str(tmp_path), **env}
    )
    assert_one_line_error(code, err, *expected)


@pytest.mark.parametrize(
    ("host", "upstream_host", "workers"),
    [
        ("127.0.0.1", "127.0.0.1", "1"),
        ("0.0.0.0", "localhost", "1"),  # every local address, a name that is always loopback
        ("127.0.0.1", "127.0.0.1", "2"),  # the supervisor's check, before any worker starts
    ],
)
def test_an_upstream_that_is_detproxy_itself_is_one_line(
    host: str, upstream_host: str, workers: str, tmp_path: Path
) -> None:
    """What hung its clients with a thousand requests in flight (each forwarded to itself)."""
    port = free_port()
    code, err = run_cli(
        "serve", "--host", host, "--port", str(port), "--workers", workers,
        "--upstream", f"http://{upstream_host}:{port}",
        env={"DETPROXY_STATE_DIR": str(tmp_path)},
    )  # fmt: skip
    assert_one_line_error(
        code, err, f"upstream.url http://{upstream_host}:{port}", "detproxy's own address",
        f"listens on {host}:{port}", "point upstream.url at the engine",
    )  # fmt: skip


@pytest.mark.parametrize("command", [("serve", "--port", "0"), ("config", "--check")])
def test_a_misspelt_variable_stops_serve_and_config_check_naming_it(
    command: tuple[str, ...], tmp_path: Path
) -> None:
    for name, closest in (
        ("DETPROXY_UPSTREM", "DETPROXY_UPSTREAM"),
        ("DETPROXY_AUDTI__SAMPLE_RATE", "DETPROXY_AUDIT__SAMPLE_RATE"),
    ):
        code, err = run_cli(*command, env={name: "0.5", "DETPROXY_STATE_DIR": str(tmp_path)})
        assert_one_line_error(code, err, name, f"did you mean {closest}?")
        assert "from defaults" not in err


def test_a_config_file_that_is_not_toml_is_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "detproxy.toml"
    bad.write_text("[server\nport = 1\n")
    code, err = run_cli("serve", "--config", str(bad))
    assert_one_line_error(code, err, f"config file {bad} is not valid TOML")


# ---------------------------------------------------------------------------------------------
# detproxy config


def test_config_prints_toml_that_loads_back_into_the_same_settings(tmp_path: Path) -> None:
    file = tmp_path / "detproxy.toml"
    file.write_text(
        '[audit]\nsample_rate = 0.3\nmodel_rates = {"qwen3-*" = 0.5}\n'
        '[[loops.ladders]]\nmodels = "llama*"\naction = "retry"\n'
        'attempts = [{temperature = 0.6, strategy = "continue"}]\n'
    )
    env = {
        "DETPROXY_UPSTREAM__READ_TIMEOUT_S": "60",
        "DETPROXY_INCIDENTS__PATH": str(tmp_path / "incidents.jsonl"),
    }
    env = {**bare_env(), **env}  # what the child reads, read here too
    done = subprocess.run(
        [EXE, "config", "--config", str(file), "--port", "9999", "--log-format", "json"],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr.decode()
    printed = Settings.model_validate(tomllib.loads(done.stdout.decode()))
    expected = load_settings(file, env, {"port": 9999, "log_format": "json"})
    assert printed == expected
    assert printed.audit.model_rates == {"qwen3-*": 0.5} and printed.server.port == 9999


def test_config_masks_secrets(tmp_path: Path) -> None:
    env = {
        "DETPROXY_SERVER__ADMIN_TOKEN": "a-long-admin-token-0123456789",
        "DETPROXY_AUDIT__SERVICE_API_KEY": "sk-secret-key",
        "DETPROXY_UPSTREAM": "http://user:hunter2@engine:8000",
    }
    done = subprocess.run(
        [EXE, "config"], env={**bare_env(), **env}, capture_output=True, timeout=60
    )
    out = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    for secret in env.values():
        assert secret not in out.replace("http://user:********@engine:8000", ""), secret
    assert 'admin_token = "********"' in out and "user:********@engine:8000" in out


def test_config_check_is_silent_when_valid_and_one_line_when_not(tmp_path: Path) -> None:
    code, err = run_cli("config", "--check")
    assert (code, err) == (0, "")
    code, err = run_cli("config", "--check", env={"DETPROXY_AUDIT__SAMPLE_RATE": "2"})
    assert_one_line_error(code, err, "audit.sample_rate", "DETPROXY_AUDIT__SAMPLE_RATE")


# ---------------------------------------------------------------------------------------------
# Help, as a newcomer reads it


def options_without_help(text: str) -> list[str]:
    """The options of a --help text that have no help text: alone on their line, and the
    next line is not their help (indented deeper)."""
    section = text.split("options:", 1)[1].split("\n\n", 1)[0].splitlines()[1:]
    missing = []
    for i, line in enumerate(section):
        option = line.strip()
        if not line.startswith("  -") or "  " in option or option.startswith("-h, --help"):
            continue
        following = section[i + 1] if i + 1 < len(section) else ""
        if not (following.startswith("    ") and not following.strip().startswith("-")):
            missing.append(option)
    return missing


@pytest.mark.parametrize(
    "command", [(), ("serve",), ("config",), ("probe",), ("sweep",), ("emulator",)]
)
def test_help_is_plain_text_and_every_option_says_what_it_does(command: tuple[str, ...]) -> None:
    done = subprocess.run([EXE, *command, "--help"], capture_output=True, timeout=60)
    text = done.stdout.decode()
    assert done.returncode == 0, done.stderr.decode()
    assert "``" not in text and "%%" not in text, f"markup in the help:\n{text}"
    assert not options_without_help(text), f"options without help: {options_without_help(text)}"


def test_top_level_help_lists_every_command() -> None:
    text = subprocess.run([EXE, "--help"], capture_output=True, timeout=60).stdout.decode()
    for command in ("serve", "config", "probe", "report", "demo", "sweep", "emulator"):
        assert f"    {command} " in text, f"{command} missing from:\n{text}"
