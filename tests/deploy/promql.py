"""Helpers for the deploy tests: metric names in PromQL, rule files and dashboards."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest

from proxy.app import build_app
from proxy.config import load_settings

ROOT = Path(__file__).resolve().parents[2]
PROMETHEUS_DIR = ROOT / "deploy" / "prometheus"
GRAFANA_DIR = ROOT / "deploy" / "grafana"
RULES = PROMETHEUS_DIR / "detproxy-rules.yaml"
RULE_TESTS = PROMETHEUS_DIR / "detproxy-rules.test.yaml"
PROMETHEUSRULE = PROMETHEUS_DIR / "prometheusrule.yaml"
RUNBOOK = PROMETHEUS_DIR / "RUNBOOK.md"
DASHBOARD = GRAFANA_DIR / "detproxy-dashboard.json"

# Series names a metric family of each type exposes (OpenMetrics / prometheus_client).
SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "info": ("_info",),
    "stateset": ("",),
    "enum": ("",),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "unknown": ("",),
}
# Metrics that are not detproxy's but that the rules may use.
ALLOWED_FOREIGN = frozenset({"up"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_DETPROXY_NAME = re.compile(r"(?<![A-Za-z0-9_:])detproxy[_:][A-Za-z0-9_:]*")
_COLON_NAME = re.compile(r"(?<![A-Za-z0-9_:])[A-Za-z_][A-Za-z0-9_]*:[A-Za-z0-9_:]*")
_RANGE = re.compile(r"\[[^\]]*\]")


def exported_metric_names() -> set[str]:
    """Every series name detproxy's /detproxy/metrics can expose, from a freshly built app."""
    registry = CollectorRegistry()
    build_app(load_settings(), registry=registry)
    names: set[str] = set()
    for family in registry.collect():
        names.update(family.name + suffix for suffix in SUFFIXES[family.type])
    # Cross-check with the text exposition, whose TYPE lines list every family (also those
    # without a sample yet); the text format names a counter family with its _total suffix.
    exposition = generate_latest(registry).decode()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            series = name if kind == "counter" else name + SUFFIXES[kind][0]
            assert series in names, f"{name} ({kind}) is exposed but not in registry.collect()"
    return names


def metric_names(expr: str) -> set[str]:
    """Metric names a PromQL expression uses: detproxy_* and detproxy:* identifiers, and any
    identifier with a colon (a recording rule). String literals (label values) are ignored."""
    bare = _RANGE.sub("[]", _STRING.sub('""', expr))
    return set(_DETPROXY_NAME.findall(bare)) | set(_COLON_NAME.findall(bare))


def unknown_metrics(expr: str, known: set[str]) -> list[str]:
    """The names an expression uses that are not in ``known``."""
    return sorted(name for name in metric_names(expr) if name not in known)


def rules(text: str) -> list[dict[str, str]]:
    """The rules of a Prometheus rule file: kind (record/alert), name, expr and the scalar
    fields (for, severity, summary, description, runbook). A small reader for this file's style
    (block scalars with | or >-), not a YAML parser."""
    lines = text.splitlines()
    out: list[dict[str, str]] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        match = re.match(r"-\s+(record|alert):\s*(\S+)\s*$", stripped)
        if match:
            out.append({"kind": match.group(1), "name": match.group(2)})
            i += 1
            continue
        field = re.match(r"(expr|for|severity|summary|description|runbook):\s*(.*)$", stripped)
        if field and out:
            key, value = field.groups()
            indent = len(line) - len(line.lstrip())
            if value in ("|", "|-", "|+", ">", ">-", ">+"):
                block: list[str] = []
                i += 1
                while i < len(lines) and (
                    not lines[i].strip() or len(lines[i]) - len(lines[i].lstrip()) > indent
                ):
                    block.append(lines[i].strip())
                    i += 1
                joiner = "\n" if value.startswith("|") else " "
                out[-1][key] = joiner.join(part for part in block if part).strip()
                continue
            out[-1][key] = value.strip().strip("'\"")
        i += 1
    return out


def dashboard_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, including those nested in collapsed rows."""
    for panel in dashboard.get("panels", []):
        yield panel
        yield from panel.get("panels", [])


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    for panel in dashboard_panels(dashboard):
        for target in panel.get("targets", []):
            if "expr" in target:
                yield f"panel {panel.get('id')} {panel.get('title')!r}", target["expr"]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") == "query":
            query = variable.get("query")
            text = query.get("query", "") if isinstance(query, dict) else str(query or "")
            yield f"variable {variable.get('name')}", text


def dashboard_problems(dashboard: dict[str, Any], known: set[str]) -> list[str]:
    """Unknown metric names in a dashboard's expressions, as readable messages."""
    problems = []
    for where, expr in dashboard_exprs(dashboard):
        for name in unknown_metrics(expr, known):
            problems.append(f"{where}: unknown metric {name}")
    return problems
