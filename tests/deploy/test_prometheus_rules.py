"""The Prometheus rules: promtool checks and unit tests, runbook links, the generated CR."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

import pytest

from tests.deploy.promql import (
    PROMETHEUS_DIR,
    PROMETHEUSRULE,
    ROOT,
    RULE_TESTS,
    RULES,
    RUNBOOK,
    rules,
)

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool not installed (apt-get install prometheus; CI installs it)",
)


def promtool(*args: str) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run(
        [PROMTOOL, *args], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


def load_builder() -> ModuleType:
    path = PROMETHEUS_DIR / "build_prometheusrule.py"
    spec = importlib.util.spec_from_file_location("build_prometheusrule", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_promtool
def test_promtool_check_rules() -> None:
    result = promtool("check", "rules", str(RULES.relative_to(ROOT)))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    result = promtool("test", "rules", "deploy/prometheus/detproxy-rules.test.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_every_alert_has_for_severity_annotations_and_a_unit_test() -> None:
    parsed = rules(RULES.read_text(encoding="utf-8"))
    alerts = [rule for rule in parsed if rule["kind"] == "alert"]
    assert {a["name"] for a in alerts} == {
        "DetproxyNondeterminismHigh",
        "DetproxyAnswerDivergence",
        "DetproxyLoopRateHigh",
        "DetproxyShadowsDropped",
        "DetproxyInjectionSuspended",
        "DetproxyRecoveryBudgetExhausted",
        "DetproxyDown",
        "DetproxyUpstreamChanged",
        "DetproxyLogprobDriftShift",
        "DetproxyUpstreamDown",
        "DetproxyUpstreamRestarting",
        "DetproxyEngineExpectationMismatch",
        "DetproxyIntrinsicDivergence",
        "DetproxyBatchDivergenceDeclaredInvariant",
    }
    tests = (PROMETHEUS_DIR / "detproxy-rules.test.yaml").read_text(encoding="utf-8")
    for alert in alerts:
        for key in ("expr", "for", "severity", "summary", "description", "runbook"):
            assert alert.get(key), f"{alert['name']} has no {key}"
        assert alert["severity"] in ("info", "warning", "critical")
        # Fires in one case and stays quiet in another.
        assert f"alertname: {alert['name']}\n        eval_time" in tests
        assert re.search(rf"alertname: {alert['name']}\n.*\n\s+exp_alerts: \[\]", tests)
        assert re.search(rf"alertname: {alert['name']}\n.*\n\s+exp_alerts:\n", tests)


def test_nothing_pages_on_logprob_drift() -> None:
    """A page (critical) never counts logprob_drift: stock engines drift under batching."""
    alerts = [r for r in rules(RULES.read_text(encoding="utf-8")) if r["kind"] == "alert"]
    critical = [a for a in alerts if a["severity"] == "critical"]
    assert {a["name"] for a in critical} == {
        "DetproxyNondeterminismHigh",
        "DetproxyAnswerDivergence",
        "DetproxyDown",
        "DetproxyUpstreamDown",
        # Only fields the operator declared: the engine runs another recipe than certified.
        "DetproxyEngineExpectationMismatch",
        # A bug, whatever the verdict: serial cold replays at batch 1 differ.
        "DetproxyIntrinsicDivergence",
        # Batch effects only where the recipe is declared (and loaded) batch-invariant.
        "DetproxyBatchDivergenceDeclaredInvariant",
    }
    recorded = {r["name"]: r["expr"] for r in rules(RULES.read_text(encoding="utf-8"))}
    for alert in critical:
        used = alert["expr"] + "".join(
            expr for name, expr in recorded.items() if name in alert["expr"]
        )
        assert "logprob_drift" not in used, f"{alert['name']} pages on logprob drift"
    drift = next(a for a in alerts if a["name"] == "DetproxyLogprobDriftShift")
    assert drift["severity"] == "warning"


def test_the_stock_vllm_case_checks_every_alert_stays_quiet() -> None:
    """The promtool group of a stock engine (most audits drift, none diverges) expects no
    alert, for every alert of the rule file, at each of its evaluation times."""
    tests = RULE_TESTS.read_text(encoding="utf-8")
    start = tests.index("  - name: a stock vLLM that drifts in logprobs under load fires nothing")
    end = tests.index("\n  - name: ", start + 1)
    group = tests[start:end]
    assert 'verdict="text_divergence"' not in group and 'verdict="logprob_drift"' in group
    names = {r["name"] for r in rules(RULES.read_text(encoding="utf-8")) if r["kind"] == "alert"}
    checks = re.findall(r"alertname: (\w+)\n\s+eval_time: (\S+)\n\s+exp_alerts: (.*)", group)
    assert {name for name, _, _ in checks} == names
    assert {expected for _, _, expected in checks} == {"[]"}
    times = {t for _, t, _ in checks}
    assert len(times) >= 3
    assert len(checks) == len(names) * len(times)


def test_recording_rules_are_unit_tested() -> None:
    tests = (PROMETHEUS_DIR / "detproxy-rules.test.yaml").read_text(encoding="utf-8")
    records = [r["name"] for r in rules(RULES.read_text(encoding="utf-8")) if r["kind"] == "record"]
    assert "detproxy:nondeterminism_rate:5m" in records
    assert "detproxy:nondeterminism_rate:1h" in records
    for name in records:
        assert f"- expr: {name}\n" in tests, f"no promql_expr_test for {name}"


def runbook_anchors() -> set[str]:
    anchors = set()
    for line in RUNBOOK.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^a-z0-9 _-]", "", title).replace(" ", "-"))
    return anchors


def test_runbook_links_point_at_sections() -> None:
    anchors = runbook_anchors()
    for alert in rules(RULES.read_text(encoding="utf-8")):
        if alert["kind"] != "alert":
            continue
        path, _, anchor = alert["runbook"].partition("#")
        assert (ROOT / path) == RUNBOOK
        assert anchor in anchors, f"{alert['name']}: no section #{anchor} in RUNBOOK.md"


def test_prometheusrule_is_generated_from_the_rule_file() -> None:
    builder = load_builder()
    wanted = builder.render(RULES.read_text(encoding="utf-8"))
    assert PROMETHEUSRULE.read_text(encoding="utf-8") == wanted, (
        "deploy/prometheus/prometheusrule.yaml is stale: "
        "run python deploy/prometheus/build_prometheusrule.py"
    )
    assert builder.main(["--check"]) == 0


def test_prometheusrule_shape() -> None:
    text = PROMETHEUSRULE.read_text(encoding="utf-8")
    assert "\napiVersion: monitoring.coreos.com/v1\nkind: PrometheusRule\n" in text
    assert re.search(r"\nmetadata:\n  name: detproxy\n  labels:\n", text)
    assert re.search(r"\n    release: \S+", text)
    assert "\nspec:\n  groups:\n    - name: detproxy.recording\n" in text


def spec_as_rule_file(text: str) -> str:
    """The CR's spec, de-indented: a plain rule file again."""
    body = text.split("\nspec:\n", 1)[1]
    lines = body.splitlines()
    assert all(not line or line.startswith("  ") for line in lines)
    return "\n".join(line[2:] for line in lines) + "\n"


def test_prometheusrule_spec_is_the_rule_file_verbatim() -> None:
    rules_text = RULES.read_text(encoding="utf-8")
    spec = spec_as_rule_file(PROMETHEUSRULE.read_text(encoding="utf-8"))
    assert spec == rules_text[rules_text.index("\ngroups:\n") + 1 :]


@needs_promtool
def test_prometheusrule_spec_passes_promtool(tmp_path: Path) -> None:
    spec = tmp_path / "spec.yaml"
    spec.write_text(spec_as_rule_file(PROMETHEUSRULE.read_text(encoding="utf-8")))
    result = promtool("check", "rules", str(spec))
    assert result.returncode == 0, result.stdout + result.stderr


def test_builder_rejects_a_file_it_cannot_embed() -> None:
    builder = load_builder()
    with pytest.raises(ValueError, match="exactly one"):
        builder.render("# nothing here\n")
    with pytest.raises(ValueError, match="unexpected top-level key"):
        builder.render("groups:\n  - name: a\n    rules: []\nextra: 1\n")
    rendered = builder.render("# comment\ngroups:\n  - name: a\n    rules: []\n\n")
    assert rendered.endswith("spec:\n  groups:\n    - name: a\n      rules: []\n")


def test_batch_and_cache_causes_page_only_on_a_recipe_declared_invariant() -> None:
    """Batch, prefix-cache and speculative effects are the price of a recipe: no page counts
    them, but for batch on a recipe declared batch_invariant. An intrinsic cause pages."""
    parsed = rules(RULES.read_text(encoding="utf-8"))
    critical = {a["name"]: a["expr"] for a in parsed if a.get("severity") == "critical"}
    for name, expr in critical.items():
        for cause in ("prefix_cache", "speculative", "unknown", "recipe_change"):
            assert f'cause="{cause}"' not in expr, f"{name} pages on the {cause} cause"
        if 'cause="batch"' in expr:
            assert name == "DetproxyBatchDivergenceDeclaredInvariant", f"{name} pages on batch"
            assert 'field="batch_invariant"' in expr, f"{name} pages on undeclared batch effects"
    assert 'cause="intrinsic"' in critical["DetproxyIntrinsicDivergence"]
    recorded = {r["name"] for r in parsed if r["kind"] == "record"}
    assert "detproxy:divergence_causes:increase1h" in recorded
