"""The Grafana dashboard and provisioning files."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.promql import DASHBOARD, GRAFANA_DIR, dashboard_panels

DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def test_dashboard_metadata(dashboard: dict[str, Any]) -> None:
    assert dashboard["uid"] == "detproxy"
    assert dashboard["title"]
    assert 36 <= dashboard["schemaVersion"] <= 41
    assert "id" not in dashboard or dashboard["id"] is None


def test_dashboard_variables(dashboard: dict[str, Any]) -> None:
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    model = variables["model"]
    assert model["type"] == "query"
    assert model["datasource"] == DATASOURCE
    assert model["query"]["query"] == "label_values(detproxy_requests_total, model)"
    assert model["multi"] and model["includeAll"] and model["allValue"] == ".*"


def test_panel_ids_are_unique(dashboard: dict[str, Any]) -> None:
    ids = [panel["id"] for panel in dashboard_panels(dashboard)]
    assert len(ids) == len(set(ids))
    assert all(isinstance(i, int) and i > 0 for i in ids)


def test_every_panel_has_a_datasource_and_targets(dashboard: dict[str, Any]) -> None:
    panels = [p for p in dashboard_panels(dashboard) if p["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        name = f"panel {panel['id']} {panel.get('title')!r}"
        assert panel.get("title"), name
        assert panel.get("datasource") == DATASOURCE, name
        targets = panel.get("targets")
        assert targets, f"{name} has no targets"
        ref_ids = [t["refId"] for t in targets]
        assert len(ref_ids) == len(set(ref_ids)), name
        for target in targets:
            assert target.get("expr", "").strip(), name
            assert target.get("datasource") == DATASOURCE, name


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], int] = {}
    for panel in dashboard_panels(dashboard):
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["id"]
        for x in range(pos["x"], pos["x"] + pos["w"]):
            for y in range(pos["y"], pos["y"] + pos["h"]):
                assert (x, y) not in cells, f"panels {cells[(x, y)]} and {panel['id']} overlap"
                cells[(x, y)] = panel["id"]


def test_dashboard_covers_the_requested_views(dashboard: dict[str, Any]) -> None:
    exprs = "\n".join(t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", []))
    for needle in (
        "detproxy_audits_total",
        "detproxy_divergence_position_tokens_bucket",
        "detproxy_logprob_delta_nats_bucket",
        "detproxy_loops_total",
        "detproxy_policy_actions_total",
        "detproxy_shadow_queue_depth",
        "detproxy_shadow_inflight",
        "detproxy_shadow_dropped_total",
        "detproxy_request_duration_seconds_bucket",
        "detproxy_time_to_first_byte_seconds_bucket",
        "detproxy_upstream_errors_total",
        "detproxy_inflight_requests",
        "detproxy_divergence_causes_total",  # triage's causes by model (SPEC 1.14)
        'model=~"$model"',
    ):
        assert needle in exprs, needle
    types = {p["type"] for p in dashboard_panels(dashboard)}
    assert {"timeseries", "heatmap", "stat"} <= types


def test_provisioning_files_point_at_the_dashboard() -> None:
    provider = (GRAFANA_DIR / "provisioning" / "dashboards" / "detproxy.yaml").read_text()
    assert "apiVersion: 1" in provider
    assert "type: file" in provider
    assert "path: /var/lib/grafana/dashboards/detproxy" in provider
    datasource = (GRAFANA_DIR / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert "apiVersion: 1" in datasource
    assert "type: prometheus" in datasource
    assert "url: http://" in datasource


# Grafana's own variables, replaced by plausible values so that promtool can parse the queries.
GRAFANA_VARIABLES = {
    "$__rate_interval": "5m",
    "$__interval": "1m",
    "$__range": "1h",
    "$model": ".*",
}


def as_rule_file(exprs: list[str]) -> str:
    lines = ["groups:", "  - name: dashboard", "    rules:"]
    for number, expr in enumerate(exprs):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert "$" not in expr, f"unhandled Grafana variable in {expr!r}"
        lines += [f"      - record: dashboard:expr_{number}:check", "        expr: |"]
        lines += [f"          {line}" for line in expr.splitlines()]
    return "\n".join(lines) + "\n"


@pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool not installed (apt-get install prometheus; CI installs it)",
)
def test_panel_queries_parse(dashboard: dict[str, Any], tmp_path: Path) -> None:
    exprs = [t["expr"] for p in dashboard_panels(dashboard) for t in p.get("targets", [])]
    rule_file = tmp_path / "dashboard-rules.yaml"
    rule_file.write_text(as_rule_file(exprs))
    promtool = shutil.which("promtool")
    assert promtool is not None
    result = subprocess.run(
        [promtool, "check", "rules", str(rule_file)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(exprs)} rules found" in result.stdout
