"""/metrics passes Prometheus' own linter and says what an operator looks for."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path

import pytest

from service_helpers import TOPO_FIXTURE, metric_value, start_agent
from topoagent.agent import Agent, discover_facts
from topoagent.config import Config
from topoagent.exporters.prometheus import MetricsPage
from topoagent.matrix import Measurement
from topoagent.served import CollectorStatus, Finding, IbPort, NodeFacts, NvLink, PcieLink


def promtool_check(text: bytes) -> subprocess.CompletedProcess:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool not found: install the Debian package 'prometheus' (scripts/test does)")
    return subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)


def rich_facts(root: Path) -> NodeFacts:
    """Facts as full discovery reports them: PCIe, NVLink and IB state, findings, probes."""
    base = asyncio.run(discover_facts(root))
    matrix = base.matrix.with_measurements({(0, 1): Measurement(gbps=389.5, taken_at=1_700_000_000.0)})
    return NodeFacts(
        topology=base.topology,
        matrix=matrix,
        matrix_text=base.matrix_text,
        collectors=(
            CollectorStatus("nvidia_smi", True, 0.012, 1_700_000_000.0),
            CollectorStatus("infiniband", False, 0.003, None, "ibstat missing"),
        ),
        findings=(Finding("degraded_link", "GPU3 x8 of x16"), Finding("degraded_link", "NIC2 Gen4 of Gen5"), Finding("level_disagreement", "GPU0/GPU4")),
        pcie_links=(PcieLink("0000:18:00.0", "gpu", 16.0, 32.0, 8, 16),),
        nvlinks=(NvLink(0, 0, True), NvLink(0, 1, False)),
        ib_ports=(IbPort("mlx5_0", 1, "ACTIVE", 400.0), IbPort("mlx5_1", 1, "DOWN", None)),
    )


@pytest.fixture
def page(tmp_path) -> bytes:
    (tmp_path / "commands").mkdir()
    (tmp_path / "commands" / "nvidia-smi_topo_-m.out").write_text(TOPO_FIXTURE.read_text())

    async def build() -> bytes:
        agent = Agent(Config(root=str(tmp_path), state_dir=str(tmp_path / "state"), udev=False))
        agent._root = tmp_path
        agent._discover = lambda root: asyncio.to_thread(rich_facts, root)
        await agent._refresh_once("test")
        agent.placement_requests["placed"] += 3
        return MetricsPage(agent).render()

    return asyncio.run(build())


def test_promtool_finds_nothing_to_complain_about(page):
    result = promtool_check(page)
    assert result.returncode == 0 and result.stdout == b"" and result.stderr == b"", result.stdout + result.stderr


def test_every_fact_family_is_exposed_in_base_units(page):
    text = page.decode()
    assert metric_value(text, "topoagent_pcie_link_speed_transfers_per_second", {"state": "current"}) == 16e9
    assert metric_value(text, "topoagent_pcie_link_width_lanes", {"state": "max"}) == 16
    assert metric_value(text, "topoagent_nvlink_up", {"gpu": "0", "link": "1"}) == 0
    assert metric_value(text, "topoagent_infiniband_port_active", {"device": "mlx5_1", "state": "DOWN"}) == 0
    assert metric_value(text, "topoagent_infiniband_port_rate_bytes_per_second", {"device": "mlx5_0"}) == 50e9
    assert metric_value(text, "topoagent_findings", {"kind": "degraded_link"}) == 2
    assert metric_value(text, "topoagent_gpu_pair_measured_bandwidth_bytes_per_second", {"gpu_a": "0", "gpu_b": "1"}) == 389.5e9
    assert metric_value(text, "topoagent_collector_success", {"collector": "infiniband"}) == 0
    assert metric_value(text, "topoagent_collector_last_success_timestamp_seconds", {"collector": "nvidia_smi"}) == 1.7e9
    assert metric_value(text, "topoagent_placement_requests_total", {"outcome": "placed"}) == 3
    assert metric_value(text, "topoagent_build_info") == 1
    # one namespace, counters alone end in _total
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            assert name.startswith("topoagent_")
            assert name.endswith("_total") == (kind == "counter"), line


def test_promtool_on_the_live_service(tmp_path):
    agent = start_agent(tmp_path)
    try:
        agent.post("/place", {"gpus": 2})
        result = promtool_check(agent.get("/metrics").body)
        assert result.returncode == 0 and not result.stdout and not result.stderr, result.stdout + result.stderr
    finally:
        agent.stop()
