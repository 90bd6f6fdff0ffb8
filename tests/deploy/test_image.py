"""The image built from deploy/docker/Dockerfile (the compiled build) and run, without Docker.

``deploy/docker/build_image.sh`` builds it with buildah (chroot isolation) on a debootstrapped
stand-in for python:3.11-slim-bookworm; the containers run with ``buildah run --isolation chroot
--network host``, which applies the image's user, environment and volumes as a container
engine does. detproxy serves inside the image in front of the emulator on the host; what the
compose file and the Kubernetes manifests assume of the image (user, ports, paths, the commands
they run in it, the configuration they mount) is checked against the built image.

Marked ``integration`` (``tests/run.sh`` runs it; it needs root and buildah, which
``tests/run.sh`` installs). The build's time and the image's size are printed.
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.test_docker import DETPROXY_UID, env_of, exec_form, flag, load_compose
from tests.helpers.metrics import metric_samples
from tests.helpers.processes import free_port
from tests.helpers.waiting import Unmet, eventually_sync

ROOT = Path(__file__).resolve().parents[2]
BUILD = ROOT / "deploy" / "docker" / "build_image.sh"
K8S = ROOT / "deploy" / "k8s"
TAG = "localhost/detproxy:test-image"
VENV_BIN = ROOT / ".venv" / "bin"
GRACE_S = 30.0  # server.shutdown_grace_s's default, what the image's STOPSIGNAL comment cites

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(shutil.which("buildah") is None, reason="buildah not installed"),
    pytest.mark.skipif(os.geteuid() != 0, reason="buildah's chroot isolation needs root"),
]

Obj = dict[str, Any]


@dataclass(frozen=True)
class Image:
    ref: str
    config: Obj  # the image's Docker config (User, Env, ExposedPorts, Volumes, Healthcheck...)


def buildah(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["buildah", *argv], capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"buildah {' '.join(argv)} failed: {done.stderr[-3000:]}"
    return done


@pytest.fixture(scope="module")
def image(request: pytest.FixtureRequest) -> Image:
    started = time.monotonic()
    built = subprocess.run(
        ["bash", str(BUILD), TAG], capture_output=True, text=True, timeout=3000, check=False
    )
    assert built.returncode == 0, f"the image did not build: {built.stderr[-4000:]}"
    elapsed = time.monotonic() - started
    summary = built.stderr.strip().splitlines()[-1]
    # Printed past pytest's capture: CI's log shows what the build cost.
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    with capture.global_and_fixture_disabled():
        print(f"\n{summary} (the test measured {elapsed:.0f} s)")
    inspected = json.loads(buildah("inspect", "--type", "image", TAG).stdout)
    return Image(TAG, inspected["Docker"]["config"])


@pytest.fixture
def container(image: Image) -> Iterator[str]:
    name = buildah("from", "--pull-never", image.ref).stdout.strip()
    try:
        yield name
    finally:
        buildah("rm", name)


def run_in(
    ctr: str, *argv: str, env: dict[str, str] | None = None, volumes: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    flags = [f"--env={k}={v}" for k, v in (env or {}).items()]
    flags += [f"--volume={v}" for v in volumes]
    return subprocess.run(
        ["buildah", "run", "--isolation", "chroot", "--network", "host", *flags, ctr, "--", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def serving_process(runner: subprocess.Popen[bytes]) -> int:
    """The Python process of ``detproxy serve`` that ``buildah run`` started: the container's
    main process, the one ``docker stop`` or the kubelet sends SIGTERM to."""
    for pid in descendants(runner.pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmdline[0].endswith(b"/python") and b"serve" in cmdline:
            return pid
    raise AssertionError(f"no detproxy serve process under buildah run ({runner.pid})")


def uid_of(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Uid:"):
            return int(line.split()[1])
    raise AssertionError(f"no Uid line for {pid}")


def log_tail(tmp_path: Path) -> str:
    return (tmp_path / "serve.err").read_text(errors="replace")[-3000:]


def answers(port: int, path: str, proc: subprocess.Popen[bytes], name: str) -> int | Unmet:
    """A check for eventually_sync(): 200 once ``path`` answers it, while ``proc`` runs."""
    assert proc.poll() is None, f"{name} exited with {proc.returncode}"
    try:
        status = get(port, path)[0]
    except OSError as err:
        return Unmet(err)
    return status if status == 200 else Unmet(status)


def wait_health(port: int, runner: subprocess.Popen[bytes], timeout: float = 60) -> None:
    eventually_sync(
        lambda: answers(port, "/detproxy/health", runner, "detproxy in the image"),
        timeout_s=timeout,
        interval_s=0.2,
        what="detproxy in the image healthy",
    )


def chat(port: int, *, stream: bool, max_tokens: int) -> tuple[int, str]:
    body = {
        "model": "emulator-model",
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": stream,
        "messages": [{"role": "user", "content": "Say hi"}],
    }
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(body), headers)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


def in_flight(port: int) -> float | Unmet:
    """detproxy's requests in flight, as its metrics count them (0: not yet)."""
    status, text = get(port, "/detproxy/metrics")
    count = metric_samples(text, "detproxy_inflight_requests").get("detproxy_inflight_requests")
    return count if status == 200 and count else Unmet((status, count))


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@pytest.fixture
def emulator() -> Iterator[int]:
    """The emulator on the host: each answer loops after 8 tokens (a loop incident) and each
    token takes 30 ms (a stream is in flight long enough to be drained)."""
    port = free_port()
    proc = subprocess.Popen(
        [str(VENV_BIN / "detproxy"), "emulator", "--port", str(port), "--loop-channel",
         "content", "--loop-after-tokens", "8", "--token-latency", "0.03"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        eventually_sync(
            lambda: answers(port, "/v1/models", proc, "the emulator"),
            timeout_s=30,
            interval_s=0.1,
            what="the emulator answers",
        )
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_the_image_is_labelled_non_root_with_a_health_check(image: Image) -> None:
    config = image.config
    assert config["User"] == f"{DETPROXY_UID}:{DETPROXY_UID}", config["User"]
    labels = config["Labels"]
    for key in ("title", "version", "revision", "created", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), f"label {key} missing: {labels}"
    assert labels["org.opencontainers.image.revision"] != "unknown"
    assert config["Healthcheck"]["Test"][:3] == ["CMD", "python", "-c"], config["Healthcheck"]
    assert list(config["ExposedPorts"]) == ["8080/tcp"]
    assert list(config["Volumes"]) == ["/var/lib/detproxy"]
    assert config["Entrypoint"] == ["detproxy"]


def test_the_image_carries_the_compiled_build_and_no_build_tools(container: str) -> None:
    probe = "import proxy.forward, proxy.relay.stream; print(proxy.forward.__file__)"
    done = run_in(container, "python", "-c", probe)
    assert done.returncode == 0 and done.stdout.strip().endswith(".so"), done.stdout + done.stderr
    tools = run_in(container, "sh", "-c", "command -v gcc || ls /opt/detproxy/bin/pip")
    assert tools.returncode != 0, f"build tools in the runtime image: {tools.stdout}"


def test_serve_in_the_image_in_front_of_the_emulator(
    container: str, image: Image, emulator: int, tmp_path: Path
) -> None:
    port = free_port()
    stderr = (tmp_path / "serve.err").open("wb")
    runner = subprocess.Popen(
        ["buildah", "run", "--isolation", "chroot", "--network", "host", container, "--",
         "detproxy", "serve", "--host", "127.0.0.1", "--port", str(port), "--upstream",
         f"http://127.0.0.1:{emulator}"],
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )  # fmt: skip
    try:
        wait_health(port, runner)
        pid = serving_process(runner)
        assert uid_of(pid) == DETPROXY_UID, "detproxy runs as root in the image"

        status, body = chat(port, stream=False, max_tokens=12)
        assert status == 200, f"non-streamed chat through the image: {status} {body[:500]}"
        assert json.loads(body)["choices"][0]["message"]["content"], body[:500]
        status, body = chat(port, stream=True, max_tokens=80)
        assert status == 200, f"streamed chat through the image: {status} {body[:500]}"
        assert body.rstrip().endswith("data: [DONE]"), body[-500:]

        assert get(port, "/detproxy/health")[0] == 200
        status, metrics = get(port, "/detproxy/metrics")
        assert status == 200 and "detproxy_" in metrics, metrics[:500]

        # The image's own HEALTHCHECK command, run in the image (a second process in it).
        check = image.config["Healthcheck"]["Test"][1:]
        url = f"http://127.0.0.1:{port}/detproxy/health"
        assert run_in(container, *check, env={"DETPROXY_HEALTHCHECK_URL": url}).returncode == 0
        closed = f"http://127.0.0.1:{free_port()}/detproxy/health"
        assert run_in(container, *check, env={"DETPROXY_HEALTHCHECK_URL": closed}).returncode != 0

        # SIGTERM (docker stop, the kubelet) with a stream in flight: it finishes, then exit 0.
        drained: dict[str, Any] = {}
        client = threading.Thread(
            target=lambda: drained.update(answer=chat(port, stream=True, max_tokens=100))
        )
        client.start()
        eventually_sync(  # the stream is under way (100 tokens at 30 ms: about 3 s)
            lambda: in_flight(port), timeout_s=10, what="the streamed chat in flight"
        )
        stopped = time.monotonic()
        os.kill(pid, signal.SIGTERM)
        runner.wait(timeout=GRACE_S + 10)
        took = time.monotonic() - stopped
        client.join(timeout=30)
        assert runner.returncode == 0, (
            f"exit {runner.returncode} after SIGTERM: {log_tail(tmp_path)}"
        )
        assert took < GRACE_S, f"SIGTERM took {took:.1f} s"
        status, body = drained["answer"]
        assert status == 200 and body.rstrip().endswith("data: [DONE]"), body[-500:]
    finally:
        if runner.poll() is None:
            runner.kill()
            runner.wait()
        stderr.close()

    # The incident log, in the image's volume, written by the detproxy user.
    log = run_in(container, "sh", "-c", "stat -c '%u:%g' /var/lib/detproxy/incidents.jsonl "
                 "&& cat /var/lib/detproxy/incidents.jsonl")  # fmt: skip
    assert log.returncode == 0, f"no incident log in the volume: {log.stderr}"
    owner, *lines = log.stdout.splitlines()
    assert owner == f"{DETPROXY_UID}:{DETPROXY_UID}", owner
    kinds = {json.loads(line)["kind"] for line in lines}
    assert "loop" in kinds, lines[:3]
    report = run_in(container, "detproxy", "report")
    assert report.returncode == 0 and "loop" in report.stdout.lower(), report.stdout[-1000:]


# ---------------------------------------------------------------- what the deployments assume


def k8s_detproxy_containers() -> Iterator[tuple[str, Obj, Obj]]:
    """(layout, pod spec, the detproxy container) of each Kubernetes layout."""
    for layout in ("central", "sidecar"):
        docs = yaml.safe_load_all((K8S / layout / "deployment.yaml").read_text(encoding="utf-8"))
        for doc in docs:
            if doc and doc.get("kind") == "Deployment":
                spec = doc["spec"]["template"]["spec"]
                for ctr in [*spec.get("initContainers", []), *spec["containers"]]:
                    if ctr["name"] == "detproxy":
                        yield layout, spec, ctr


def exec_commands(ctr: Obj) -> list[list[str]]:
    found = []
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        if "exec" in ctr.get(probe, {}):
            found.append(ctr[probe]["exec"]["command"])
    for hook in ("preStop", "postStart"):
        if "exec" in ctr.get("lifecycle", {}).get(hook, {}):
            found.append(ctr["lifecycle"][hook]["exec"]["command"])
    return found


def test_kubernetes_manifests_match_the_image(container: str, image: Image) -> None:
    user, group = (int(x) for x in image.config["User"].split(":"))
    volumes = set(image.config["Volumes"])
    exposed = {int(p.split("/")[0]) for p in image.config["ExposedPorts"]}
    for layout, spec, ctr in k8s_detproxy_containers():
        security = {**spec.get("securityContext", {}), **ctr.get("securityContext", {})}
        assert security["runAsUser"] == user and security["runAsGroup"] == group, layout
        assert security.get("runAsNonRoot") is True, layout
        # What the pod mounts where the image keeps its state and reads its configuration.
        mounts = {m["mountPath"] for m in ctr["volumeMounts"]}
        assert volumes <= mounts, f"{layout}: the image's volume {volumes} is not mounted"
        env = {e["name"]: e.get("value") for e in ctr.get("env", [])}
        assert env.get("DETPROXY_STATE_DIR", "/var/lib/detproxy") in volumes, layout
        config_dir = str(Path(env["DETPROXY_CONFIG"]).parent)
        assert config_dir in mounts, f"{layout}: {env['DETPROXY_CONFIG']} is not mounted"
        # The port detproxy is told to listen on is the one the probes and Service use.
        args = ctr["args"]
        assert args[0] == "serve", f"{layout}: args replace the image's CMD: {args}"
        port = int(flag(args, "--port"))
        assert port in {p["containerPort"] for p in ctr["ports"]}, f"{layout}: port {port}"
        if layout == "central":
            assert port in exposed, f"central listens on {port}, the image exposes {exposed}"
        # Each command the kubelet runs in the container exists in the image.
        for command in exec_commands(ctr):
            found = run_in(container, "sh", "-c", f"command -v {command[0]}")
            assert found.returncode == 0, f"{layout}: {command[0]} is not in the image"
        # The ConfigMap's file and the container's environment load in the image, as its user.
        toml = K8S / layout / "detproxy.toml"
        checked = run_in(
            container,
            "detproxy", "config", "--check",
            env={k: v for k, v in env.items() if v is not None},
            volumes=(f"{toml}:{env['DETPROXY_CONFIG']}:ro",),
        )  # fmt: skip
        assert checked.returncode == 0, f"{layout}: {checked.stdout} {checked.stderr}"


def test_the_compose_service_matches_the_image(container: str, image: Image) -> None:
    compose = load_compose(ROOT / "deploy" / "docker" / "compose.yaml")
    service = compose["services"]["detproxy"]
    volumes = set(image.config["Volumes"])
    targets = {v["target"] for v in service["volumes"]}
    assert volumes <= targets, f"the image's volume {volumes} is not mounted: {targets}"
    exposed = {p.split("/")[0] for p in image.config["ExposedPorts"]}
    published = {str(p).rsplit(":", 1)[-1] for p in service["ports"]}
    assert published == exposed, f"compose publishes {published}, the image exposes {exposed}"
    # The compose health check is the image's: none overrides it.
    assert "healthcheck" not in service
    cmd = exec_form(json.dumps(image.config["Cmd"]))
    assert flag(cmd, "--port") in exposed
    env = env_of(service)
    config = next(v for v in service["volumes"] if v["target"] == env["DETPROXY_CONFIG"])
    checked = run_in(
        container,
        "detproxy", "config", "--check",
        env=env,
        volumes=(f"{config['source']}:{config['target']}:ro",),
    )  # fmt: skip
    assert checked.returncode == 0, f"compose's detproxy.toml in the image: {checked.stderr}"
