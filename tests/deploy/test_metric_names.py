"""Every metric the rules and the dashboard query is one detproxy exports."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from tests.deploy.promql import (
    ALLOWED_FOREIGN,
    DASHBOARD,
    RULES,
    dashboard_exprs,
    dashboard_problems,
    exported_metric_names,
    metric_names,
    rules,
    unknown_metrics,
)


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return exported_metric_names()


@pytest.fixture(scope="module")
def parsed_rules() -> list[dict[str, str]]:
    return rules(RULES.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def recorded(parsed_rules: list[dict[str, str]]) -> set[str]:
    return {rule["name"] for rule in parsed_rules if rule["kind"] == "record"}


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    return loaded


def test_exported_names_cover_the_documented_families(exported: set[str]) -> None:
    for name in (
        "detproxy_requests_total",
        "detproxy_audits_total",
        "detproxy_loops_total",
        "detproxy_policy_actions_total",
        "detproxy_shadow_dropped_total",
        "detproxy_shadow_queue_depth",
        "detproxy_shadow_inflight",
        "detproxy_inflight_requests",
        "detproxy_divergence_position_tokens_bucket",
        "detproxy_logprob_delta_nats_bucket",
        "detproxy_request_duration_seconds_bucket",
        "detproxy_time_to_first_byte_seconds_bucket",
        "detproxy_upstream_errors_total",
    ):
        assert name in exported
    # A counter is only exposed with its suffix; a histogram only as its series.
    assert "detproxy_audits" not in exported
    assert "detproxy_divergence_position_tokens" not in exported


def test_recording_rule_names_follow_the_convention(recorded: set[str]) -> None:
    for name in recorded:
        level, _, rest = name.partition(":")
        assert level == "detproxy" and rest.count(":") == 1, name


def test_rules_use_only_exported_metrics(
    parsed_rules: list[dict[str, str]], exported: set[str], recorded: set[str]
) -> None:
    known = exported | recorded | ALLOWED_FOREIGN
    seen: set[str] = set()
    for rule in parsed_rules:
        assert rule.get("expr"), f"{rule['name']} has no expr"
        assert not unknown_metrics(rule["expr"], known), rule["name"]
        seen |= metric_names(rule["expr"])
    assert "detproxy_audits_total" in seen
    assert "detproxy_shadow_dropped_total" in seen


def test_dashboard_uses_only_exported_metrics(
    dashboard: dict[str, Any], exported: set[str], recorded: set[str]
) -> None:
    exprs = list(dashboard_exprs(dashboard))
    assert len(exprs) > 20
    assert dashboard_problems(dashboard, exported | recorded) == []


def test_extractor_finds_detproxy_and_recorded_names() -> None:
    expr = (
        'sum by (model) (rate(detproxy_audits_total{model=~"$model",job="detproxy_x"}[5m]))'
        " / ignoring (verdict) group_left detproxy:loop_rate:5m"
        " and histogram_quantile(0.9, rate(detproxy_logprob_delta_nats_bucket[$__rate_interval]))"
        ' or up{job=~".*detproxy.*"} offset 15m'
    )
    assert metric_names(expr) == {
        "detproxy_audits_total",
        "detproxy:loop_rate:5m",
        "detproxy_logprob_delta_nats_bucket",
    }
    # Subquery ranges are not names.
    assert metric_names("max_over_time(detproxy_inflight_requests[1h:5m])") == {
        "detproxy_inflight_requests"
    }


def test_extractor_flags_a_misspelled_metric(exported: set[str]) -> None:
    assert unknown_metrics("sum(rate(detproxy_audit_total[5m]))", exported) == [
        "detproxy_audit_total"
    ]
    assert unknown_metrics("detproxy_divergence_position_tokens", exported) == [
        "detproxy_divergence_position_tokens"
    ]
    assert unknown_metrics("detproxy:nondeterminism_rate:15m", exported) == [
        "detproxy:nondeterminism_rate:15m"
    ]
    assert unknown_metrics("sum(rate(detproxy_audits_total[5m]))", exported) == []


def test_a_misspelled_panel_metric_fails_the_dashboard_check(
    dashboard: dict[str, Any], exported: set[str], recorded: set[str]
) -> None:
    broken = copy.deepcopy(dashboard)
    panel = next(p for p in broken["panels"] if p.get("targets"))
    panel["targets"][0]["expr"] = 'sum(rate(detproxy_loop_total{model=~"$model"}[5m]))'
    problems = dashboard_problems(broken, exported | recorded)
    assert problems == [
        f"panel {panel['id']} {panel['title']!r}: unknown metric detproxy_loop_total"
    ]

    broken = copy.deepcopy(dashboard)
    variable = next(v for v in broken["templating"]["list"] if v["name"] == "model")
    variable["query"]["query"] = "label_values(detproxy_request_total, model)"
    assert dashboard_problems(broken, exported | recorded) == [
        "variable model: unknown metric detproxy_request_total"
    ]
