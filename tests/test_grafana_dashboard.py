"""The Grafana dashboard: every query run by a real Prometheus against a real agent's scrape.

A `topoagent serve` child on the degraded recorded node (telemetry on a short interval, the
cpu probe backend, one lease) is scraped by Prometheus from Debian's `prometheus` package,
which also loads the alert rules; each panel's query must answer with series."""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO
from service_helpers import CPU_PROBES, Agent, metric_value, start_agent, wait_for

from topoagent.collectors.registry import FAMILIES
from topoagent.exporters.prometheus import SERVED_WITH_DETAIL

DASHBOARD = REPO / "systemd" / "grafana-dashboard.json"
RULES = REPO / "systemd" / "topoagent-alerts.yml"
METRIC = re.compile(r"\btopoagent_[a-z0-9_]+\b")
# pairwise: the panels that plot the pairwise topology say they need it (see below).
AGENT_CONFIG = """
[telemetry]
interval_s = 0.2
[metrics]
pairwise = true
""" + CPU_PROBES
PAIRWISE = ("topoagent_gpu_pair_link_level", "topoagent_gpu_pair_expected_bandwidth_bytes_per_second", "topoagent_gpu_nic_link_level")
# Families a default agent serves none of: [metrics] detail brings them back.
DETAIL_ONLY = {f"topoagent_{f.name}" for f in FAMILIES if f.detail and not f.default} | {f"topoagent_{name}" for name in SERVED_WITH_DETAIL}
WAIT_S = 90


def alert_names() -> list[str]:
    return [line.split("alert:")[1].strip() for line in RULES.read_text().splitlines() if line.strip().startswith("- alert:")]


def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def panel_exprs(title: str | None = None) -> list[str]:
    return [t["expr"] for p in board()["panels"] if title in (None, p["title"]) for t in p["targets"]]


def dashboard_metrics() -> set[str]:
    exprs = panel_exprs() + [v["definition"] for v in board()["templating"]["list"] if v.get("definition")]
    return {m for e in exprs for m in METRIC.findall(e)}



# Panels of GPU pairs' measured bandwidth: the suite's probes run on the cpu stand-in backend,
# whose figures measure no GPU link (probes/overlay.py), so no pair is measured here.
NO_GPU_PAIR_MEASURED = {"Measured GPU pair bandwidth", "Measured / expected GPU pair bandwidth"}


def start_busy_agent(tmp: Path) -> Agent:
    """The degraded node with telemetry read, a probe round's figures served and a GPU leased."""
    agent = start_agent(tmp, root=FIXTURES / "snapshots" / "degraded", config=AGENT_CONFIG)
    try:
        assert agent.post("/place", {"gpus": 2, "reserve": {"owner": "dash", "ttl_s": 600}}, token=agent.token).status == 200

        def complete() -> str | None:
            text = agent.get("/metrics").body.decode()
            done = 'collector="pcie_aer"' in text and metric_value(text, "topoagent_probe_bandwidth_bytes_per_second") is not None
            return text if done else None

        wait_for("telemetry and probe figures in /metrics", complete, agent, WAIT_S, 0.2)
    except BaseException:
        agent.stop()
        raise
    return agent


def real_scrape_names(tmp: Path) -> set[str]:
    from prometheus_client.parser import text_string_to_metric_families

    agent = start_busy_agent(tmp)
    try:
        text = agent.get("/metrics").body.decode()
    finally:
        agent.stop()
    families = list(text_string_to_metric_families(text))
    # A gauge family served empty counts too: topoagent_not_ready_reason has series only while not ready.
    return {s.name for family in families for s in family.samples} | {f.name for f in families if f.type == "gauge"}


def test_dashboard_is_grafana_json_with_unique_panels():
    doc = board()
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)) and doc["uid"]
    assert doc["schemaVersion"] >= 39  # what Grafana 11 writes
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in doc["panels"])
    assert len(dashboard_metrics()) >= 30
    titles = {p["title"] for p in doc["panels"]}
    for wanted in ("Findings", "Busy GPUs", "Lease state recovered from corruption", "Probe rounds", "Probe failures in a row",
                   "InfiniBand/RoCE traffic", "NVLink traffic per GPU", "InfiniBand/RoCE port errors", "NVLink errors",
                   "PCIe AER errors and replays", "GPU Xid events", "GPU temperature", "GPU power", "GPU utilisation", "GPU clocks"):
        assert wanted in titles, wanted
    variables = {v["name"]: v for v in doc["templating"]["list"]}
    assert {"instance", "gpu"} <= set(variables) and variables["gpu"]["includeAll"] and variables["gpu"]["multi"]
    # Every panel of a GPU's own series follows both pickers.
    for p in doc["panels"]:
        for t in p["targets"]:
            if re.search(r"topoagent_gpu_(temperature|memory_temperature|power|utilization|memory_utilization|sm_clock|memory_clock|xid|ecc)", t["expr"]):
                assert 'gpu=~"$gpu"' in t["expr"] and 'instance=~"$instance"' in t["expr"], (p["title"], t["expr"])


def test_a_panel_on_a_family_served_only_on_request_says_which_setting_serves_it():
    """/metrics serves the pairwise topology only with [metrics] pairwise = true: a panel
    plotting it would be empty on a default agent without saying why."""
    for p in board()["panels"]:
        uses = any(name in t["expr"] for t in p["targets"] for name in PAIRWISE)
        assert uses == ("[metrics] pairwise = true" in p.get("description", "")), p["title"]
        # Likewise the series [metrics] detail brings back (none is on the board today).
        detail = [name for t in p["targets"] for name in DETAIL_ONLY if re.search(rf"\b{name}\b", t["expr"])]
        assert not detail or "[metrics] detail" in p.get("description", ""), (p["title"], detail)


def test_panels_never_overlap():
    cells: set[tuple[int, int]] = set()
    for p in board()["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, p["title"]
        cells |= mine


STATES = re.compile(r"topoagent_(ready|snapshot_stale|infiniband_port_active|collector_success|leases_recovered_from_corrupt_state|probes_enabled)\b")


def test_a_panel_plotting_a_state_plots_nothing_else_and_has_a_0_to_1_axis():
    for p in board()["panels"]:
        exprs = [t["expr"] for t in p["targets"]]
        states = [e for e in exprs if STATES.search(e) and " or on (instance)" not in e]
        if not states:
            continue
        assert states == exprs, f"{p['title']}: a 0/1 state shares an axis with {exprs}"
        defaults = p["fieldConfig"]["defaults"]
        assert (defaults.get("min"), defaults.get("max"), defaults.get("unit")) == (0, 1, None), p["title"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Prometheus:
    def __init__(self, tmp: Path, target: str | list[str]) -> None:
        targets = [target] if isinstance(target, str) else target
        binary = shutil.which("prometheus")
        if binary is None:
            raise AssertionError("prometheus not found: install the Debian package 'prometheus' (scripts/test does)")
        config = tmp / "prometheus.yml"
        config.write_text(f"""
global: {{scrape_interval: 1s, evaluation_interval: 1s}}
rule_files: ["{RULES}"]
scrape_configs:
  - job_name: topoagent
    static_configs: [{{targets: {json.dumps(targets)}}}]
""")
        self.port = free_port()
        self.log = tmp / "prometheus.log"
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen([binary, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'tsdb'}",
                                          f"--web.listen-address=127.0.0.1:{self.port}"], stdout=log, stderr=log)

    def api(self, path: str, **params: str) -> dict:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as reply:
                return json.loads(reply.read())
        except urllib.error.HTTPError as e:
            body = e.read()
            try:
                return json.loads(body)
            except ValueError:  # 503 "Service Unavailable" in plain text while it starts up
                return {"status": "down", "error": body.decode(errors="replace")}
        except OSError:
            return {"status": "down"}

    def query(self, expr: str) -> dict:
        return self.api("query", query=expr)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dashboard")
    agent = start_busy_agent(tmp)
    prom = Prometheus(tmp, f"127.0.0.1:{agent.port}")
    try:
        # Three scrapes at least, so rate() over them has two samples and a slope.
        wait_for("three scrapes of the agent", lambda: (prom.query("count_over_time(topoagent_ready[1m]) >= 3").get("data") or {}).get("result"),
                 timeout=WAIT_S, interval=0.2, log=lambda: prom.log.read_text())
        yield prom
    finally:
        prom.stop()
        agent.stop()


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    return expr.replace("$instance", ".*").replace("$gpu", ".*").replace("$__rate_interval", rate_interval).replace("$__range", rate_interval)


def test_every_panel_query_answers_with_series_from_a_real_scrape(prometheus):
    silent = {}
    for p in board()["panels"]:
        for t in p["targets"]:
            expr = grafana_to_promql(t["expr"])
            # Error panels keep only rising series (`> 0`); the recorded counters rose before
            # Prometheus's first scrape, so here the query is asked without that filter.
            asked = expr.removesuffix(" > 0")
            answer = prometheus.query(asked)
            assert answer["status"] == "success", f"{p['title']}: {asked}: {answer}"
            if not answer["data"]["result"]:
                silent[p["title"]] = asked
    # The agent is ready: no reason it is not (the real pages below have them).
    assert prometheus.query("topoagent_ready == 1")["data"]["result"] and silent.pop("Not ready because", None)
    for title in NO_GPU_PAIR_MEASURED:  # each says why it is empty here
        assert silent.pop(title, None) and "cpu stand-in" in next(p["description"] for p in board()["panels"] if p["title"] == title)
    assert not silent, f"panels with no data on a real scrape: {silent}"


def test_findings_panel_shows_the_degraded_nodes_count_once(prometheus):
    (expr,) = panel_exprs("Findings")
    (series,) = prometheus.query(grafana_to_promql(expr))["data"]["result"]
    total = prometheus.query("sum(topoagent_findings)")["data"]["result"][0]["value"][1]
    assert series["value"][1] == total and float(total) >= 3


def test_the_alert_rules_load_and_the_degraded_node_raises_its_critical_findings(prometheus):
    groups = prometheus.api("rules")["data"]["groups"]
    rules = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(rules) == set(alert_names()) and all(r["health"] == "ok" for r in rules.values()), rules
    alerts = wait_for("TopoagentCriticalFinding pending", lambda: [a for a in prometheus.api("alerts")["data"]["alerts"]
                                                                   if a["labels"]["alertname"] == "TopoagentCriticalFinding"],
                      timeout=WAIT_S, interval=0.2)
    assert {a["labels"]["kind"] for a in alerts} >= {"gpu-xid", "ib-errors-rising", "nvlink-errors-rising"}
    assert all(a["state"] in ("pending", "firing") for a in alerts)
    # The recorded Xid 79 on GPU 6 is the first event of its GPU's actionable class as
    # Prometheus sees it: it fires at once, and the class the agent serves at 0 on every
    # other GPU does not.
    xids = wait_for("TopoagentGpuXid firing", lambda: [a for a in prometheus.api("alerts")["data"]["alerts"]
                                                      if a["labels"]["alertname"] == "TopoagentGpuXid" and a["state"] == "firing"],
                    timeout=WAIT_S, interval=0.2)
    assert [(a["labels"]["gpu"], a["labels"]["severity"]) for a in xids] == [("6", "critical")]
    served_at_zero = prometheus.query('count(topoagent_gpu_xid_events_total{class="actionable"} == 0)')["data"]["result"]
    assert served_at_zero and float(served_at_zero[0]["value"][1]) >= 7
    (last,) = prometheus.query("topoagent_gpu_xid_last")["data"]["result"]  # which Xid it was, as dcgm-exporter says it
    assert last["metric"]["gpu"] == "6" and last["value"][1] == "79"


# --- the pages of a real H200 node (tests/data/h200-vm-scrapes), scraped by a real Prometheus --

PAGES = REPO / "tests" / "data" / "h200-vm-scrapes"


class PageServer:
    """One recorded /metrics page, served as the agent served it, on its own port."""

    def __init__(self, page: Path) -> None:
        import http.server
        import threading

        body = page.read_bytes()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server's name
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.target = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def real_pages(tmp_path_factory):
    """Prometheus scraping the four pages, each its own target: (prometheus, page -> instance)."""
    tmp = tmp_path_factory.mktemp("real-pages")
    servers = {page.stem: PageServer(page) for page in sorted(PAGES.glob("*.prom"))}
    prom = Prometheus(tmp, [s.target for s in servers.values()])
    try:
        wait_for("three scrapes of each page", lambda: len((prom.query("count_over_time(topoagent_build_info[1m]) >= 3").get("data") or {}).get("result") or []) == len(servers),
                 timeout=WAIT_S, interval=0.2, log=lambda: prom.log.read_text())
        yield prom, {name: server.target for name, server in servers.items()}
    finally:
        prom.stop()
        for server in servers.values():
            server.stop()


def answers_by_instance(prom: Prometheus, expr: str) -> dict[str, list[dict]]:
    answer = prom.query(grafana_to_promql(expr))
    assert answer["status"] == "success", (expr, answer)
    found: dict[str, list[dict]] = {}
    for series in answer["data"]["result"]:
        found.setdefault(series["metric"].get("instance", ""), []).append(series)
    return found


def test_no_healthy_zero_where_the_agent_knows_nothing(real_pages):
    """discovery-never-ran.prom: no topology, so Findings, Critical findings and Busy GPUs
    show no data (they showed 0, a healthy node's look); the healthy page shows its 0."""
    prom, instance = real_pages
    for title in ("Findings", "Critical findings", "Busy GPUs"):
        (expr,) = [t["expr"] for p in board()["panels"] if p["title"] == title and p["type"] == "stat" for t in p["targets"]]
        found = answers_by_instance(prom, expr)
        assert instance["discovery-never-ran"] not in found, (title, found)
        assert float(found[instance["nvml-read-right-after-load"]][0]["value"][1]) == {"Findings": 1, "Critical findings": 0, "Busy GPUs": 1}[title]
        assert float(found[instance["as-landed-nvml-dead"]][0]["value"][1]) == {"Findings": 1, "Critical findings": 1, "Busy GPUs": 0}[title]
    (ready,) = panel_exprs("Ready for placement")
    assert float(answers_by_instance(prom, ready)[instance["discovery-never-ran"]][0]["value"][1]) == 0


def test_a_panel_empty_on_a_real_page_says_why(real_pages):
    """On the real single-GPU PCIe node (no NVLink, no InfiniBand, no pairwise series) and
    on its broken agents, every panel without data says in its description when it has none."""
    prom, instance = real_pages
    unexplained = {}
    for p in board()["panels"]:
        answered = set()
        for t in p["targets"]:
            answered |= set(answers_by_instance(prom, t["expr"]))
        for page, target in instance.items():
            if target not in answered and "No data" not in p.get("description", ""):
                unexplained.setdefault(page, []).append(p["title"])
    assert not unexplained, unexplained
    # The healthy page leaves the NVLink, InfiniBand and pairwise rows empty: each says so.
    for title, why in (("Active NVLinks per GPU", "no GPU with NVLinks"), ("InfiniBand ports active", "no InfiniBand or RoCE port"),
                       ("GPU pair link levels", "[metrics] pairwise = false")):
        (p,) = [p for p in board()["panels"] if p["title"] == title]
        assert not answers_by_instance(prom, p["targets"][0]["expr"]).get(instance["nvml-read-right-idle"]) and why in p["description"], title


def test_probe_bandwidth_memory_energy_and_throttle_panels_show_the_real_h200(real_pages):
    prom, instance = real_pages
    loaded = instance["nvml-read-right-after-load"]

    def values(title: str) -> dict[str, float]:
        (p,) = [p for p in board()["panels"] if p["title"] == title]
        got = {}
        for t in p["targets"]:
            for series in answers_by_instance(prom, t["expr"]).get(loaded, []):
                legend = re.sub(r"\{\{(\w+)\}\}", lambda m: series["metric"].get(m.group(1), ""), t["legendFormat"])
                got[legend.removeprefix(f"{loaded} ")] = float(series["value"][1])
        return got

    probe = values("Probe bandwidth")  # probe-cuda.json: device-local 2,096 GB/s, h2d 51.5-55 GB/s
    assert probe["local_copy 0"] == pytest.approx(2.09e12, rel=0.01) and probe["h2d node0->0"] == pytest.approx(54.6e9, rel=0.01)
    memory = values("GPU memory")  # nvidia-smi said 1139 MiB used
    assert memory["GPU0 used"] == 1_194_131_456 and memory["GPU0 used"] + memory["GPU0 free"] + memory["GPU0 reserved"] == pytest.approx(143_771 * 2**20, rel=0.01)
    assert set(values("GPU energy over the time range")) == {"GPU0"}
    throttle = values("GPU clocks held down, by reason")  # nvidia-smi: 0x4, the software power cap under full load
    assert {reason for reason, held in throttle.items() if held} == {"GPU0 sw_power_cap"} and len(throttle) == 9
    # The idle page's GPU is not probed since the agent started: no bandwidth, said so.
    (p,) = [p for p in board()["panels"] if p["title"] == "Probe bandwidth"]
    assert instance["nvml-read-right-idle"] not in answers_by_instance(prom, p["targets"][0]["expr"])


def test_the_not_ready_panel_says_why_as_the_alert_does(real_pages):
    """Its query is TopoagentNotReady's (the dashboard's pickers aside), and on the real pages
    it names no topology for the agent whose discovery never ran and the finding that blocked
    the landed one; nothing for the healthy ones."""
    import yaml

    (p,) = [p for p in board()["panels"] if p["title"] == "Not ready because"]
    (alert,) = [r["expr"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if r.get("alert") == "TopoagentNotReady"]
    ours = p["targets"][0]["expr"].replace('{instance=~"$instance"}', "").replace('instance=~"$instance", ', "")
    assert " ".join(ours.replace("( ", "(").split()) == " ".join(alert.split()).replace("(instance, job, reason)", "(instance, reason)").replace("( ", "(")
    prom, instance = real_pages
    found = {i: sorted(s["metric"]["reason"] for s in series) for i, series in answers_by_instance(prom, p["targets"][0]["expr"]).items()}
    assert found == {instance["discovery-never-ran"]: ["no_topology"], instance["as-landed-nvml-dead"]: ["fabric-not-ready"]}
