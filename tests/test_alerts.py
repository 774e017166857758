"""The alert rules shipped beside the dashboard: promtool-clean, unit-tested, real metrics."""

from __future__ import annotations

import re
import shutil
import subprocess

from conftest import REPO
from test_grafana_dashboard import DASHBOARD, METRIC, alert_names, grafana_to_promql, panel_exprs, real_scrape_names

from topoagent.collectors import ib_counters, nvml

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
    assert f"SUCCESS: {len(alert_names())} rules found" in done.stdout
    assert {"TopoagentDown", "TopoagentAbsent", "TopoagentGpuXid", "TopoagentGpuXidApplication"} <= set(alert_names())


def rule_expr(name: str) -> str:
    text = RULES.read_text()
    block = text[text.index(f"- alert: {name}\n"):]
    return block[block.index("expr:"):block.index("labels:")]


def thresholds_in(expr: str, metric: str) -> dict[str, float]:
    """counter -> per-second threshold, from `rate(METRIC{counter="X"}[...]) > N` clauses."""
    found = re.findall(rf'rate\({metric}\{{counter="([a-z_]+)"\}}\[\w+\]\) > ([0-9.]+)', expr)
    assert found and len(found) == expr.count("rate("), expr  # every rate() has its counter and threshold
    return {counter: float(limit) for counter, limit in found}


def test_error_alerts_use_the_agents_own_counters_and_default_thresholds():
    """The rules' thresholds are the ones the agent's findings use (collectors' THRESHOLDS):
    one list, so an error the agent does not judge (out_of_sequence, NVLink CRC) never pages."""
    for alert, source, metric in (("TopoagentInfinibandErrorsRising", ib_counters, "topoagent_infiniband_port_errors_total"),
                                  ("TopoagentNvlinkErrorsRising", nvml, "topoagent_nvlink_errors_total")):
        agent = {value: rule.per_s for rule in source.THRESHOLDS if rule.metric == metric.removeprefix("topoagent_")
                 for value in rule.match["counter"]}
        assert agent and thresholds_in(rule_expr(alert), metric) == agent, alert


def test_xid_alerts_tell_actionable_from_application_xids_by_the_agents_own_class():
    """The rules read the class the agent sorts each Xid into by its one list (ACTIONABLE_XIDS),
    never a list of Xids of their own."""
    for alert, kind in (("TopoagentGpuXid", "actionable"), ("TopoagentGpuXidApplication", "application")):
        expr = rule_expr(alert)
        assert expr.count("topoagent_gpu_xid_events_total") == expr.count(f'{{class="{kind}"}}') == 3, expr
        assert "xid" not in expr.replace("topoagent_gpu_xid_events_total", ""), expr
    for xid in sorted(nvml.ACTIONABLE_XIDS) + ["13", "31", "43", "45"]:
        raw = {"gpus": [{"index": 0, "counters": {"xid_errors": {xid: 2}, "xid_last": int(xid)}}]}
        by_class = {dict(labels)["class"]: value for metric, labels, value in nvml.parse_counters(raw) if metric == "gpu_xid_events_total"}
        if xid in nvml.ACTIONABLE_XIDS:
            assert by_class == {"actionable": 2}, xid
        else:  # the actionable class is served from 0 all the same: its first event is a rise
            assert by_class == {"actionable": 0, "application": 2}, xid


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


# --- the telemetry page's joins, run by Prometheus's engine on two nodes ------------------

TELEMETRY_PAGE = (REPO / "docs" / "telemetry.md").read_text()
UUIDS = {("gpu01", "0"): "GPU-0a0a0a0a-0000-0000-0000-000000000001", ("gpu01", "1"): "GPU-0a0a0a0a-0000-0000-0000-000000000002",
         ("gpu02", "0"): "GPU-0b0b0b0b-0000-0000-0000-000000000001", ("gpu02", "1"): "GPU-0b0b0b0b-0000-0000-0000-000000000002"}


def readme_joins() -> list[str]:
    blocks = re.findall(r"```promql\n(.*?)```", TELEMETRY_PAGE, re.S)
    return [" ".join(line.strip() for line in block.splitlines() if line.strip() and not line.startswith("#")) for block in blocks]


def two_nodes() -> str:
    """Each node as its exporters write it: dcgm-exporter on :9400, topoagent on :9477 (so
    `instance` differs between the two exporters of one node); GPU 0 and 1 on each node,
    GPU 0 of both with NVLink replays rising at 0.1/s and 0.2/s."""
    lines = []
    for (host, gpu), uuid in UUIDS.items():
        numa = "0" if gpu == "0" else "1"
        util = {"gpu01": 40, "gpu02": 80}[host] + int(gpu) * 10
        lines.append(f"""      - series: 'DCGM_FI_DEV_GPU_UTIL{{instance="{host}:9400", job="dcgm", gpu="{gpu}", UUID="{uuid}", device="nvidia{gpu}", Hostname="{host}", hostname="{host}"}}'
        values: '{util}x10'""")
        lines.append(f"""      - series: 'topoagent_gpu_info{{instance="{host}:9477", job="topoagent", gpu="{gpu}", uuid="{uuid}", UUID="{uuid}", numa_node="{numa}", pci_address="0000:0{gpu}:00.0", device="nvidia{gpu}", Hostname="{host}", hostname="{host}"}}'
        values: '1x10'""")
        rise = {"gpu01": 6, "gpu02": 12}[host] if gpu == "0" else 0
        lines.append(f"""      - series: 'topoagent_nvlink_errors_total{{instance="{host}:9477", job="topoagent", gpu="{gpu}", counter="replay"}}'
        values: '0+{rise}x10'""")
    return "\n".join(lines)


def run_join(tmp_path, expr: str, samples: str) -> subprocess.CompletedProcess:
    test = tmp_path / "joins_test.yml"
    test.write_text(f"""
tests:
  - interval: 1m
    input_series:
{two_nodes()}
    promql_expr_test:
      - expr: '{expr}'
        eval_time: 8m
        exp_samples:
{samples}
""")
    return run("test", "rules", str(test))


def test_the_readme_joins_answer_per_gpu_on_two_nodes(tmp_path):
    by_numa, nvlink = readme_joins()
    assert "on (UUID)" in by_numa and "on (instance, gpu)" in nvlink
    done = run_join(tmp_path, by_numa, """          - {labels: '{Hostname="gpu01", numa_node="0"}', value: 40}
          - {labels: '{Hostname="gpu01", numa_node="1"}', value: 50}
          - {labels: '{Hostname="gpu02", numa_node="0"}', value: 80}
          - {labels: '{Hostname="gpu02", numa_node="1"}', value: 90}""")
    assert done.returncode == 0, by_numa + "\n" + done.stdout + done.stderr
    samples = "\n".join(f"""          - {{labels: '{{instance="{host}:9477", gpu="{gpu}", UUID="{uuid}"}}', value: {rate}}}"""
                        for (host, gpu), uuid in UUIDS.items()
                        for rate in [{"gpu01": 0.1, "gpu02": 0.2}[host] if gpu == "0" else 0])
    done = run_join(tmp_path, nvlink, samples)
    assert done.returncode == 0, nvlink + "\n" + done.stdout + done.stderr


def test_the_nvlink_join_without_instance_fails_on_two_nodes_as_the_issue_said(tmp_path):
    """What the docs said before: Prometheus refuses it once two nodes share a GPU index."""
    old = ('sum by (gpu) (rate(topoagent_nvlink_errors_total{counter="replay"}[5m])) '
           '* on (gpu) group_left (UUID) topoagent_gpu_info')
    done = run_join(tmp_path, old, "          - {labels: '{gpu=\"0\"}', value: 0.3}")
    assert done.returncode != 0 and "many-to-many matching not allowed" in done.stdout + done.stderr


def test_the_xid_panel_counts_the_first_event_of_a_series_born_at_it_and_of_one_served_from_0(tmp_path):
    """gpu01's application class appears at its first Xid (value 1, minute 10); gpu02's
    actionable class is served from 0 and rises at minute 10; its agent restarts at minute 20
    and an actionable Xid comes again at 25."""
    (expr,) = panel_exprs("GPU Xid events")
    expr = grafana_to_promql(expr, rate_interval="5m")
    test = tmp_path / "xid_panel_test.yml"

    def at(minute: int, gpu01: int, gpu02: int) -> str:
        samples = [f"""          - labels: '{{instance="{host}:9477", gpu="{gpu}", class="{kind}"}}'
            value: {value}""" for host, gpu, kind, value in (("gpu01", "2", "application", gpu01), ("gpu02", "6", "actionable", gpu02))
                   if value is not None]
        return f"""      - expr: '{expr}'
        eval_time: {minute}m
        exp_samples:
{chr(10).join(samples) if samples else "          []"}
"""
    test.write_text(f"""
tests:
  - interval: 1m
    input_series:
      - series: 'topoagent_gpu_xid_events_total{{instance="gpu01:9477", job="topoagent", gpu="2", class="application"}}'
        values: '_x10 1x30'
      - series: 'topoagent_gpu_xid_events_total{{instance="gpu02:9477", job="topoagent", gpu="6", class="actionable"}}'
        values: '0x9 1x9 _ 0x4 1x15'
    promql_expr_test:
{at(9, None, 0)}{at(11, 1, 1)}{at(18, 0, 0)}{at(26, 0, 1)}""")
    done = run("test", "rules", str(test))
    assert done.returncode == 0, f"{DASHBOARD.name} Xid query {expr!r}:\n{done.stdout}{done.stderr}"
