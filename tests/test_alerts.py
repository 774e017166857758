"""The alert rules shipped beside the dashboard: promtool-clean, unit-tested, real metrics."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_findings_panel_reads_zero_on_a_healthy_node_the_count_on_a_degraded_one_and_nothing_on_a_blind_one(tmp_path):
    """Evaluated by Prometheus's own engine (promtool's PromQL unit tests) on three nodes: the
    blind one serves no topology (its discovery never ran), so no healthy-looking 0."""
    (expr,) = panel_exprs("Findings")
    expr = expr.replace("$instance", ".*")
    test = tmp_path / "findings_test.yml"
    test.write_text(f"""
tests:
  - interval: 1m
    input_series:
      - series: 'topoagent_snapshot_timestamp_seconds{{instance="healthy:9477", job="topoagent"}}'
        values: '1.7e9x5'
      - series: 'topoagent_snapshot_timestamp_seconds{{instance="degraded:9477", job="topoagent"}}'
        values: '1.7e9x5'
      - series: 'topoagent_ready{{instance="blind:9477", job="topoagent"}}'
        values: '0x5'
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
    `instance` differs between the two exporters of one node), topoagent's gpu_info with its
    default labels; GPU 0 and 1 on each node, GPU 0 of both with NVLink replays rising at
    0.1/s and 0.2/s; gpu01's GPU 1 and gpu02's GPU 0 leased to pods, gpu02's GPU 1 busy with
    processes of no lease."""
    lines = []
    for (host, gpu), uuid in UUIDS.items():
        numa = "0" if gpu == "0" else "1"
        util = {"gpu01": 40, "gpu02": 80}[host] + int(gpu) * 10
        lines.append(f"""      - series: 'DCGM_FI_DEV_GPU_UTIL{{instance="{host}:9400", job="dcgm", gpu="{gpu}", UUID="{uuid}", device="nvidia{gpu}", Hostname="{host}", hostname="{host}"}}'
        values: '{util}x10'""")
        lines.append(f"""      - series: 'topoagent_gpu_info{{instance="{host}:9477", job="topoagent", gpu="{gpu}", uuid="{uuid}", numa_node="{numa}", pci_address="0000:0{gpu}:00.0", device="nvidia{gpu}", hostname="{host}"}}'
        values: '1x10'""")
        rise = {"gpu01": 6, "gpu02": 12}[host] if gpu == "0" else 0
        lines.append(f"""      - series: 'topoagent_nvlink_errors_total{{instance="{host}:9477", job="topoagent", gpu="{gpu}", counter="replay"}}'
        values: '0+{rise}x10'""")
    for host, gpu, busy in (("gpu01", "1", 'reason="lease", lease="a1", owner_kind="pod", namespace="ml", pod="trainer-0"'),
                            ("gpu02", "0", 'reason="lease", lease="b7", owner_kind="pod", namespace="ml", pod="trainer-1"'),
                            ("gpu02", "1", 'reason="processes"')):
        lines.append(f"""      - series: 'topoagent_gpu_busy{{instance="{host}:9477", job="topoagent", gpu="{gpu}", {busy}}}'
        values: '1x10'""")
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
    by_numa, by_pod, nvlink = readme_joins()
    assert "on (UUID)" in by_numa and "on (instance, gpu)" in nvlink and "group_left (namespace, pod)" in by_pod
    done = run_join(tmp_path, by_numa, """          - {labels: '{Hostname="gpu01", numa_node="0"}', value: 40}
          - {labels: '{Hostname="gpu01", numa_node="1"}', value: 50}
          - {labels: '{Hostname="gpu02", numa_node="0"}', value: 80}
          - {labels: '{Hostname="gpu02", numa_node="1"}', value: 90}""")
    assert done.returncode == 0, by_numa + "\n" + done.stdout + done.stderr
    # Each leased GPU's utilisation as dcgm-exporter reads it, with the pod the agent's lease names.
    pods = "\n".join(f"""          - {{labels: '{{instance="{host}:9400", job="dcgm", gpu="{gpu}", UUID="{UUIDS[host, gpu]}", device="nvidia{gpu}", Hostname="{host}", hostname="{host}", namespace="ml", pod="{pod}"}}', value: {util}}}"""
                      for host, gpu, pod, util in (("gpu01", "1", "trainer-0", 50), ("gpu02", "0", "trainer-1", 80)))
    done = run_join(tmp_path, by_pod, pods)
    assert done.returncode == 0, by_pod + "\n" + done.stdout + done.stderr
    samples = "\n".join(f"""          - {{labels: '{{instance="{host}:9477", gpu="{gpu}", uuid="{uuid}"}}', value: {rate}}}"""
                        for (host, gpu), uuid in UUIDS.items()
                        for rate in [{"gpu01": 0.1, "gpu02": 0.2}[host] if gpu == "0" else 0])
    done = run_join(tmp_path, nvlink, samples)
    assert done.returncode == 0, nvlink + "\n" + done.stdout + done.stderr


def test_the_nvlink_join_without_instance_fails_on_two_nodes_as_the_issue_said(tmp_path):
    """What the docs said before: Prometheus refuses it once two nodes share a GPU index."""
    old = ('sum by (gpu) (rate(topoagent_nvlink_errors_total{counter="replay"}[5m])) '
           '* on (gpu) group_left (uuid) topoagent_gpu_info')
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


# --- the pages of a real H200 node (tests/data/h200-vm-scrapes), as promtool input --------

PAGES = REPO / "tests" / "data" / "h200-vm-scrapes"
TARGET = {"instance": "h200-vm:9477", "job": "topoagent"}
# What fires on each page, once every rule's `for` has passed, and nothing else:
# (alertname, severity, the rule's own labels).
FIRES_ON = {
    # serve from a checkout: its discovery child could not import topoagent, never ready
    "discovery-never-ran": [("TopoagentNotReady", "critical", {"reason": "no_topology"}),
                            ("TopoagentDiscoveryFailing", "critical", {})],
    # the landed code: its NVML counter reader dead, its fabric call wrong (the false
    # fabric-not-ready it raised is what it said: the finding alerts as such)
    "as-landed-nvml-dead": [("TopoagentCriticalFinding", "critical", {"kind": "fabric-not-ready"}),
                            ("TopoagentNotReady", "critical", {"reason": "fabric-not-ready"}),
                            ("TopoagentSourceFailing", "warning", {"collector": "nvml_counters"}),
                            ("TopoagentGpuSeriesAbsent", "critical", {"gpu": "0"})],
    "nvml-read-right-idle": [],
    "nvml-read-right-after-load": [],
}


def page_series(page: Path, minutes: int, target: dict[str, str]) -> list[dict[str, str]]:
    """Each sample of a /metrics page as a promtool input series held for ``minutes``, with
    the labels Prometheus gives the target's series, and its `up` at 1."""
    from prometheus_client.parser import text_string_to_metric_families

    def series(name: str, labels: dict[str, str]) -> str:
        return name + "{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"

    found = [{"series": series(s.name, {**s.labels, **target}), "values": f"{s.value!r}x{minutes}"}
             for family in text_string_to_metric_families(page.read_text()) for s in family.samples]
    assert len(found) >= 30 and any(s["series"].startswith("topoagent_ready{") for s in found), page  # a whole page
    return [*found, {"series": series("up", target), "values": f"1x{minutes}"}]


def firing_test(rules: Path, series: list[dict[str, str]], at: str, fires: list[tuple[str, str, dict[str, str]]], target: dict[str, str]) -> dict:
    """A promtool test that ALERTS{alertstate="firing"} is exactly ``fires`` at ``at``."""
    samples = [{"labels": "ALERTS{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(
        {"alertname": name, "alertstate": "firing", "severity": severity, "instance": target["instance"], "job": target["job"],
         **labels}.items())) + "}", "value": 1} for name, severity, labels in fires]
    return {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series,
                       "promql_expr_test": [{"expr": 'ALERTS{alertstate="firing"}', "eval_time": at, "exp_samples": samples}]}]}


def run_test(tmp_path: Path, doc: dict) -> subprocess.CompletedProcess:
    test = tmp_path / f"test_{len(list(tmp_path.iterdir()))}.yml"
    test.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return run("test", "rules", str(test))


@pytest.mark.parametrize("page", sorted(FIRES_ON))
def test_on_each_real_page_the_right_alerts_fire_and_no_other(tmp_path, page):
    series = page_series(PAGES / f"{page}.prom", 60, TARGET)
    done = run_test(tmp_path, firing_test(RULES, series, "40m", FIRES_ON[page], TARGET))
    assert done.returncode == 0, f"{page}:\n{done.stdout}{done.stderr}"
    # Before their `for` has passed, nothing fires: a restart's first minutes page no one.
    done = run_test(tmp_path, firing_test(RULES, series, "2m", [], TARGET))
    assert done.returncode == 0, f"{page} at 2m:\n{done.stdout}{done.stderr}"


def test_every_blind_agent_alert_fires_on_some_real_page_and_every_page_is_tested():
    fired = {name for fires in FIRES_ON.values() for name, _, _ in fires}
    assert {"TopoagentNotReady", "TopoagentDiscoveryFailing", "TopoagentSourceFailing", "TopoagentGpuSeriesAbsent"} <= fired
    assert {p.stem for p in PAGES.glob("*.prom")} == set(FIRES_ON)


# --- whose `up`: install-files renders the rules with the operator's selector -------------

def kubernetes_pods_target(pod_labels: dict[str, str], namespace: str, pod: str) -> dict[str, str]:
    """The labels Prometheus's usual `kubernetes-pods` job (its example configuration and the
    prometheus-community chart: labelmap of __meta_kubernetes_pod_label_(.+), namespace, pod)
    gives a pod's series; a pod label's name sanitised as kubernetes_sd writes its meta label."""
    labels = {re.sub(r"[^a-zA-Z0-9_]", "_", name): value for name, value in pod_labels.items()}
    return {**labels, "job": "kubernetes-pods", "instance": "10.0.0.7:9477", "namespace": namespace, "pod": pod}


def daemonset_pod_template() -> dict:
    import yaml

    docs = [d for d in yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "node.yaml").read_text()) if d]
    (daemonset,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return daemonset["spec"]["template"]["metadata"]


def install_files(tmp_path: Path, *selectors: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "topoagent", "install-files", str(tmp_path / "etc"), "--force"]
    argv += [arg for s in selectors for arg in ("--alert-selector", s)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def down_test(rules: Path, targets: list[dict[str, str]], fires: list[dict[str, str]]) -> dict:
    """Each target scraped for 10 minutes, then down for 20: TopoagentDown for ``fires``."""
    def series(labels):
        return "up{" + ", ".join(f"{k}={json.dumps(v)}" for k, v in sorted(labels.items())) + "}"
    return {"rule_files": [str(rules)], "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": [{"series": series(t), "values": "1x10 0x20"} for t in targets],
                       "alert_rule_test": [
                           {"eval_time": "8m", "alertname": "TopoagentDown", "exp_alerts": []},
                           {"eval_time": "25m", "alertname": "TopoagentDown", "exp_alerts": [
                               {"exp_labels": {**t, "severity": "critical"},
                                "exp_annotations": {"summary": f"{t['instance']}: topoagent does not answer scrapes",
                                                    "description": "Prometheus could not scrape the agent for 5 minutes: no counters, placement "
                                                                   "answers or leases from this node (systemctl status topoagent)."}}
                               for t in fires]},
                           {"eval_time": "25m", "alertname": "TopoagentAbsent", "exp_alerts": []}]}]}


def test_install_files_and_the_daemonset_agree_on_whose_up_the_rules_read(tmp_path):
    """The default rules match the agent under a static job named topoagent and the shipped
    DaemonSet's pods under the usual kubernetes-pods job (its prometheus.io annotations); not
    another pod of that job."""
    meta = daemonset_pod_template()
    assert meta["annotations"]["prometheus.io/scrape"] == "true"
    done = install_files(tmp_path)
    assert done.returncode == 0, done.stderr
    rendered = tmp_path / "etc" / "topoagent-alerts.yml"
    assert rendered.read_bytes() == RULES.read_bytes()  # the default is the shipped file
    ours = kubernetes_pods_target(meta["labels"], "topoagent", "topoagent-x7k2p")
    other = kubernetes_pods_target({"app.kubernetes.io/name": "web"}, "shop", "web-0")
    static = {"job": "topoagent", "instance": "gpu01:9477"}
    done = run_test(tmp_path, down_test(rendered, [ours, other, static], [ours, static]))
    assert done.returncode == 0, done.stdout + done.stderr
    # The same real page, scraped through the annotations: the same alerts fire.
    series = page_series(PAGES / "as-landed-nvml-dead.prom", 60, ours)
    done = run_test(tmp_path, firing_test(rendered, series, "40m", FIRES_ON["as-landed-nvml-dead"], ours))
    assert done.returncode == 0, done.stdout + done.stderr


def test_install_files_writes_the_rules_with_the_operators_selector(tmp_path):
    done = install_files(tmp_path, 'job="gpu-nodes", env=~"prod|staging"')
    assert done.returncode == 0, done.stderr
    rendered = tmp_path / "etc" / "topoagent-alerts.yml"
    text = rendered.read_text()
    rules = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert 'job="topoagent"' not in rules and rules.count('up{job="gpu-nodes", env=~"prod|staging"}') == 2
    assert text.startswith("# Written by topoagent install-files --alert-selector 'job=\"gpu-nodes\", env=~\"prod|staging\"'\n")
    checked = run("check", "rules", str(rendered))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    mine = {"job": "gpu-nodes", "env": "prod", "instance": "gpu01:9100"}
    done = run_test(tmp_path, down_test(rendered, [mine, {"job": "topoagent", "instance": "gpu02:9477"}], [mine]))
    assert done.returncode == 0, done.stdout + done.stderr
    # Not label matchers: refused, nothing written.
    for bad in ('job="x"} or vector(1) or up{', "job=topoagent", "", 'job="a\nb"'):
        refused = install_files(tmp_path / "bad", bad)
        assert refused.returncode == 2 and "--alert-selector" in refused.stderr, (bad, refused.stderr)
        assert not (tmp_path / "bad" / "etc").exists()
