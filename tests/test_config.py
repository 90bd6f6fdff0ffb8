from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from proxy.config import (
    OTHER_ENV,
    ConfigError,
    Settings,
    default_incident_path,
    default_state_dir,
    env_names,
    env_path,
    load_settings,
)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "detproxy.toml"
    path.write_text(text)
    return path


def test_defaults() -> None:
    s = load_settings()
    assert s.server.port == 8080
    assert s.upstream.url == "http://127.0.0.1:8000"
    assert s.classify.default_temperature is None


def test_precedence_file_then_env_then_flags(tmp_path: Path) -> None:
    path = write(
        tmp_path, '[upstream]\nurl = "http://file:1"\nread_timeout_s = 5\n[server]\nport = 9001\n'
    )
    s = load_settings(path)
    assert (s.upstream.url, s.server.port, s.upstream.read_timeout_s) == ("http://file:1", 9001, 5)
    env = {
        "DETPROXY_UPSTREAM": "http://env:2/",
        "DETPROXY_UPSTREAM__READ_TIMEOUT_S": "7",
        "DETPROXY_PORT": "9002",
        "OTHER": "x",
    }
    s = load_settings(path, env)
    assert (s.upstream.url, s.server.port, s.upstream.read_timeout_s) == ("http://env:2", 9002, 7)
    s = load_settings(path, env, {"upstream": "http://flag:3", "port": 9003, "host": None})
    assert (s.upstream.url, s.server.port) == ("http://flag:3", 9003)


def test_spec_flags_are_validated() -> None:
    s = load_settings(flags={"sample_rate": 0.25, "shadow_mode": "prefill", "loop_policy": "retry"})
    assert (s.audit.sample_rate, s.audit.shadow_mode, s.loops.policy) == (0.25, "prefill", "retry")
    with pytest.raises(ConfigError, match=r"audit\.sample_rate.*--sample-rate"):
        load_settings(flags={"sample_rate": 1.5})


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ('[upstream]\nurl = "ftp://x"\n', "upstream.url"),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nprot = 1\n", "server.prot"),
        ('[upstream]\nread_timeout_s = "soon"\n', "upstream.read_timeout_s"),
        ("[nonsense]\nx = 1\n", "nonsense"),
    ],
)
def test_bad_file_names_the_field(tmp_path: Path, text: str, field: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as exc:
        load_settings(path)
    assert field in str(exc.value)
    assert str(path) in str(exc.value)


def test_bad_env_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"server\.port.*DETPROXY_SERVER__PORT"):
        load_settings(env={"DETPROXY_SERVER__PORT": "eighty"})


def test_unreadable_and_invalid_toml(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_settings(write(tmp_path, "[server\n"))


def test_event_loop_from_file_environment_and_flag(tmp_path: Path) -> None:
    assert load_settings().server.event_loop == "auto"
    path = write(tmp_path, '[server]\nevent_loop = "asyncio"\n')
    assert load_settings(path).server.event_loop == "asyncio"
    env = {"DETPROXY_SERVER__EVENT_LOOP": "uvloop"}
    assert load_settings(path, env).server.event_loop == "uvloop"
    assert load_settings(env={"DETPROXY_EVENT_LOOP": "asyncio"}).server.event_loop == "asyncio"
    assert load_settings(path, env, {"event_loop": "auto"}).server.event_loop == "auto"


def test_a_bad_event_loop_names_the_field_and_its_origin(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server\.event_loop.*DETPROXY_SERVER__EVENT_LOOP"):
        load_settings(env={"DETPROXY_SERVER__EVENT_LOOP": "tokio"})
    path = write(tmp_path, '[server]\nevent_loop = "trio"\n')
    with pytest.raises(ConfigError, match=r"server\.event_loop") as exc:
        load_settings(path)
    assert "'auto', 'uvloop' or 'asyncio'" in str(exc.value) and str(path) in str(exc.value)


def test_the_configuration_imports_nothing_else_of_detproxy() -> None:
    code = (
        "import sys, proxy.config\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('proxy', 'policies')))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root
    ).stdout
    assert out.strip() == "['proxy', 'proxy.config']"


def test_what_other_modules_define_is_checked_at_load(tmp_path: Path) -> None:
    """The ladder's sampling fields and strategies, the detector's thresholds, the answer
    extractor's syntax: each bad value names its field and where it came from."""
    cases = [
        (
            "[[loops.ladders]]\nattempts = [{temprature = 1}]\n",
            "loops.ladders.0.attempts",
            "temprature",
        ),
        (
            '[[loops.ladders]]\nattempts = [{strategy = "jump"}]\n',
            "loops.ladders.0.attempts",
            "jump",
        ),
        ("[loops.detector]\nmin_period = 0\n", "loops.detector", "min_period must be >= 1"),
        ("[loops.detector]\nwindow_chars = 100\n", "loops.detector", "window_chars must be >="),
        ("[loops.detector]\nperiod = 3\n", "loops.detector", "period"),
        (
            '[audit]\nanswer_extractor = "json:answer"\n',
            "audit.answer_extractor",
            "must start with '$'",
        ),
        ('[audit]\nanswer_extractor = "regex:(("\n', "audit.answer_extractor", "does not compile"),
    ]
    for text, field, why in cases:
        path = write(tmp_path, text)
        with pytest.raises(ConfigError) as exc:
            load_settings(path)
        assert field in str(exc.value) and why in str(exc.value) and str(path) in str(exc.value)


def test_the_state_directory_follows_the_environment_then_xdg_then_home(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert default_state_dir({"DETPROXY_STATE_DIR": "/srv/dp", "XDG_STATE_HOME": "/x"}) == Path(
        "/srv/dp"
    )
    assert default_state_dir({"XDG_STATE_HOME": "/x"}) == Path("/x/detproxy")
    monkeypatch.setenv("HOME", str(tmp_path))
    home = tmp_path / ".local" / "state" / "detproxy"
    assert default_state_dir({"XDG_STATE_HOME": "relative/ignored"}) == home
    assert default_state_dir({"DETPROXY_STATE_DIR": ""}) == home  # empty: unset
    assert default_incident_path({"XDG_STATE_HOME": "/x"}) == "/x/detproxy/incidents.jsonl"


def test_the_incident_path_defaults_to_the_state_dir_read_when_settings_are_built(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(tmp_path / "one"))
    first = load_settings()
    monkeypatch.setenv("DETPROXY_STATE_DIR", str(tmp_path / "two"))
    assert first.incidents.path == str(tmp_path / "one" / "incidents.jsonl")
    assert load_settings().incidents.path == str(tmp_path / "two" / "incidents.jsonl")
    assert Settings().incidents.path == str(tmp_path / "two" / "incidents.jsonl")
    assert "path" not in load_settings().incidents.model_fields_set  # the default, not chosen
    memory_only = load_settings(env={"DETPROXY_INCIDENTS__PATH": ""})
    assert memory_only.incidents.path == "" and "path" in memory_only.incidents.model_fields_set
    explicit = load_settings(write(tmp_path, '[incidents]\npath = "/srv/i.jsonl"\n'))
    assert explicit.incidents.path == "/srv/i.jsonl"


@pytest.mark.parametrize(
    ("given", "fix"),
    [
        ("http://127.0.0.1:8000/v1", "http://127.0.0.1:8000"),
        ("http://127.0.0.1:8000/v1/", "http://127.0.0.1:8000"),
        ("https://user:secret@gw.example/vllm/v1", "https://gw.example/vllm"),
    ],
)
def test_an_openai_base_url_is_refused_with_the_fix(given: str, fix: str) -> None:
    """The openai SDK's base URL (``.../v1``): detproxy adds /v1/... itself, so every request
    would go to /v1/v1/... and answer 404. Refused at start, for the reference too."""
    expected = f"ends in /v1: detproxy adds /v1/... itself; use {fix}"
    with pytest.raises(ConfigError, match=r"upstream\.url: .*--upstream") as exc:
        load_settings(flags={"upstream": given})
    assert expected in str(exc.value) and "secret" not in str(exc.value), str(exc.value)
    with pytest.raises(ConfigError, match=r"audit\.reference_url") as exc:
        load_settings(env={"DETPROXY_AUDIT__REFERENCE_URL": given})
    assert expected in str(exc.value), str(exc.value)


def test_a_gateway_path_is_kept() -> None:
    settings = load_settings(flags={"upstream": "http://gw:8080/vllm/"})
    assert settings.upstream.url == "http://gw:8080/vllm"
    assert load_settings(flags={"upstream": "http://h/v1beta"}).upstream.url == "http://h/v1beta"


def test_serve_with_an_openai_base_url_says_the_fix_and_exits_2() -> None:
    exe = str(Path(sys.executable).with_name("detproxy"))
    proc = subprocess.run(
        [exe, "serve", "--upstream", "http://127.0.0.1:1/v1", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "ends in /v1: detproxy adds /v1/... itself; use http://127.0.0.1:1" in proc.stderr


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"DETPROXY_SERVER__HTTP": "aiohttp"}, "server.http was removed"),
        ({"DETPROXY_SERVER__HTTP": "lean"}, "server.http was removed"),
        ({"DETPROXY_UPSTREAM__CLIENT": "aiohttp"}, "upstream.client was removed"),
    ],
)
def test_a_removed_http_stack_key_is_an_error_that_says_so(env: dict[str, str], says: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env=env)
    name = next(iter(env))
    assert says in str(exc.value) and "delete this setting" in str(exc.value), str(exc.value)
    assert f"(from {name})" in str(exc.value), f"the error does not say where: {exc.value}"


def test_a_removed_key_in_a_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "detproxy.toml"
    path.write_text('[server]\nhttp = "aiohttp"\n[upstream]\nclient = "native"\n')
    with pytest.raises(ConfigError) as exc:
        load_settings(path)
    said = str(exc.value)
    assert "server.http was removed" in said and "upstream.client was removed" in said, said
    assert str(path) in said
    assert "http" not in load_settings().model_dump()["server"]  # nor shown in status


# ---------------------------------------------------------------------------------------------
# DETPROXY_* variables that are nothing detproxy reads


@pytest.mark.parametrize(
    ("name", "closest"),
    [
        ("DETPROXY_UPSTREM", "DETPROXY_UPSTREAM"),
        ("DETPROXY_AUDTI__SAMPLE_RATE", "DETPROXY_AUDIT__SAMPLE_RATE"),
        ("DETPROXY_AUDIT_SAMPLE_RATE", "DETPROXY_AUDIT__SAMPLE_RATE"),  # one underscore
        ("DETPROXY_UPSTREAM__EXPECT__DTYP", "DETPROXY_UPSTREAM__EXPECT__DTYPE"),
        ("DETPROXY_STATEDIR", "DETPROXY_STATE_DIR"),
        ("DETPROXY_LOOPS__LADDERS__MODELS", "DETPROXY_LOOPS__LADDERS"),  # a list: set whole
        ("DETPROXY_AUDIT__", None),
    ],
)
def test_a_misspelt_variable_is_named_with_the_closest_known_one(
    name: str, closest: str | None
) -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env={name: "0.5"})
    said = str(exc.value)
    assert "\n" not in said and f"environment variable {name} is not a detproxy setting" in said
    if closest is not None:
        assert f"did you mean {closest}?" in said, said
    assert "from defaults" not in said


def test_every_name_detproxy_reads_is_accepted(tmp_path: Path) -> None:
    env = dict.fromkeys(OTHER_ENV, "x") | {
        "DETPROXY_CONFIG": str(tmp_path / "unread.toml"),  # read by the CLI, not here
        "DETPROXY_STATE_DIR": str(tmp_path),
        "DETPROXY_LOOPS__DETECTOR__CHECK_EVERY_CHARS": "16",  # a key of a table
        "DETPROXY_UPSTREAM__EXPECT__DTYPE": "bfloat16",  # a field of a section's section
        "DETPROXY_LOOPS__ENGINE_DETECTION__MIN_COUNT": "9",  # of an optional one
        "DETPROXY_log_level": "debug",  # flat names in any case, as before
        "NOT_DETPROXY_ANYTHING": "x",
    }
    s = load_settings(env=env)
    assert s.loops.detector == {"check_every_chars": 16} and s.upstream.expect.dtype == "bfloat16"
    assert s.loops.engine_detection is not None and s.loops.engine_detection.min_count == 9
    assert s.log.level == "debug"


BINARY = {".pyc", ".so", ".gz", ".png", ".ico", ".woff2"}


def test_every_name_in_the_repository_is_a_setting_or_known() -> None:
    """Each DETPROXY_* variable the code, deploy files, scripts, benchmarks and docs use is one
    detproxy accepts: a new one goes into ``OTHER_ENV``, or it would stop detproxy at start.
    (Test modules are left out: some misspell names on purpose, and a test whose variable is
    refused fails by itself.)"""
    root = Path(__file__).resolve().parents[1]
    # A benchmark's constant, and README's example of the message: no variables.
    not_variables = {"DETPROXY_CONFIGS", "DETPROXY_UPSTREM"}
    paths = [root / "README.md", root / "setup.py", root / "pyproject.toml"]
    for folder in ("proxy", "policies", "tests", "deploy", "docs"):
        paths += (root / folder).rglob("*")
    found: dict[str, Path] = {}
    for path in paths:
        if path.is_file() and path.suffix not in BINARY and not path.name.startswith("test_"):
            for name in re.findall(r"\bDETPROXY_[A-Z0-9_]*[A-Z0-9]\b", path.read_text("latin-1")):
                found.setdefault(name, path)
    assert len(found) > 30, sorted(found)  # the search found them
    known = set(env_names())
    unknown = {
        name: str(path.relative_to(root))
        for name, path in found.items()
        if name not in known and env_path(name) is None and name not in not_variables
    }
    assert not unknown, f"DETPROXY_* names detproxy would refuse: {unknown}"


def test_a_bad_key_in_a_table_given_as_json_names_its_variable() -> None:
    with pytest.raises(ConfigError) as exc:
        load_settings(env={"DETPROXY_UPSTREAM__EXPECT": '{"dtpye": "bfloat16"}'})
    assert "upstream.expect.dtpye" in str(exc.value), str(exc.value)
    assert "(from DETPROXY_UPSTREAM__EXPECT)" in str(exc.value), str(exc.value)
