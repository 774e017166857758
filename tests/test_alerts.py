"""The alert rules shipped beside the dashboard: promtool-clean, unit-tested, real metrics."""

from __future__ import annotations

import shutil
import subprocess

from conftest import REPO
from test_grafana_dashboard import DASHBOARD, METRIC, panel_exprs, real_scrape_names

RULES = REPO / "systemd" / "topoagent-alerts.yml"
UNIT_TESTS = REPO / "tests" / "alerts_test.yml"


def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        raise AssertionError("promtool not found: install the Debian package 'prometheus' (scripts/test does)")
    return found


def run(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120, cwd=cwd)


def test_rules_file_is_clean_for_promtool():
    done = run("check", "rules", str(RULES))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "SUCCESS: 9 rules found" in done.stdout


def test_promtool_unit_tests_of_every_alert_pass():
    done = run("test", "rules", UNIT_TESTS.name, cwd=UNIT_TESTS.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    tested = UNIT_TESTS.read_text()
    alerts = [line.split("alert:")[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("- alert:")]
    # Each alert is shown both firing and quiet.
    for name in alerts:
        assert tested.count(f"alertname: {name}") >= 2, name


def test_every_metric_an_alert_reads_is_in_a_real_scrape(tmp_path):
    names = set(METRIC.findall(RULES.read_text()))
    assert {"topoagent_findings", "topoagent_infiniband_port_errors_total", "topoagent_nvlink_errors_total", "topoagent_pcie_aer_errors_total",
            "topoagent_leases_recovered_from_corrupt_state", "topoagent_snapshot_stale", "topoagent_probe_consecutive_failures"} <= names
    missing = names - real_scrape_names(tmp_path)
    assert not missing, f"alerts read metrics the exporter does not emit: {sorted(missing)}"


def test_findings_panel_reads_zero_on_a_healthy_node_and_the_count_on_a_degraded_one(tmp_path):
    """Evaluated by Prometheus's own engine (promtool's PromQL unit tests) on two nodes."""
    (expr,) = panel_exprs("Findings")
    expr = expr.replace("$instance", ".*")
    test = tmp_path / "findings_test.yml"
    test.write_text(f"""
tests:
  - interval: 1m
    input_series:
      - series: 'topoagent_ready{{instance="healthy:9477", job="topoagent"}}'
        values: '1x5'
      - series: 'topoagent_ready{{instance="degraded:9477", job="topoagent"}}'
        values: '1x5'
      - series: 'topoagent_findings{{instance="degraded:9477", job="topoagent", kind="nvlink-down", severity="warning"}}'
        values: '2x5'
      - series: 'topoagent_findings{{instance="degraded:9477", job="topoagent", kind="gpu-xid", severity="critical"}}'
        values: '1x5'
    promql_expr_test:
      - expr: '{expr}'
        eval_time: 3m
        exp_samples:
          - labels: '{{instance="degraded:9477"}}'
            value: 3
          - labels: '{{instance="healthy:9477"}}'
            value: 0
""")
    done = run("test", "rules", str(test))
    assert done.returncode == 0, f"{DASHBOARD.name} Findings query {expr!r}:\n{done.stdout}{done.stderr}"
