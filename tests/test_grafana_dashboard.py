"""The Grafana dashboard's queries name only metrics the exporter really emits."""

from __future__ import annotations

import asyncio
import json
import re

from conftest import FIXTURES, REPO

DASHBOARD = REPO / "systemd" / "grafana-dashboard.json"
METRIC = re.compile(r"\btopoagent_[a-z0-9_]+\b")


def dashboard_metrics() -> set[str]:
    board = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in board["templating"]["list"] if v.get("definition")]
    return {m for e in exprs for m in METRIC.findall(e)}


def test_dashboard_is_grafana_json_with_unique_panels():
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)) and board["uid"] and board["schemaVersion"] >= 36
    assert all(p["targets"] and p["datasource"]["uid"] == "${datasource}" for p in board["panels"])
    assert len(dashboard_metrics()) >= 15


def test_every_metric_the_dashboard_queries_is_in_a_real_scrape(tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from topoagent import agent as agent_mod
    from topoagent.config import Config
    from topoagent.exporters.prometheus import MetricsPage
    from topoagent.matrix import Measurement

    async def scrape() -> bytes:
        agent = agent_mod.Agent(Config(root=str(FIXTURES / "snapshots" / "degraded"),
                                       state_dir=str(tmp_path / "state"), udev=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            snap = agent.snapshot  # a probe result, so the measured series exist too
            matrix = snap.matrix.with_measurements({(0, 1): Measurement(gbps=300.0, taken_at=1.7e9)})
            agent.snapshot = snap.with_probes(snap.version + 1, matrix, snap.probe_figures, snap.probe_findings)
            return MetricsPage(agent).render()
        finally:
            await agent.stop()

    text = asyncio.run(scrape()).decode()
    emitted = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    missing = dashboard_metrics() - emitted
    assert not missing, f"dashboard queries metrics the exporter does not emit: {sorted(missing)}"
