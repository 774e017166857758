"""GET /capacity: what a cluster scheduler reads to compare nodes, on the pure function
and on a real `topoagent serve`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from schema_check import validate
from service_helpers import Agent, metric_value, promtool_complaints, start_agent, wait_counters_read

from topoagent.commands.discover import discover_root
from topoagent.documents.agent import capacity_document
from topoagent.placement import Request, place
from topoagent.placement.synthetic import pcie_two_socket_8, tree_node
from topoagent.service.capacity import capacity

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


def test_two_nvlink_islands_fragment_as_their_gpus_are_taken():
    node = tree_node(sockets=2, switches_per_socket=1, gpus_per_switch=4, nv_zone=4)  # NVLink 0-3 and 4-7
    whole = capacity(node, leased=(), running=())
    assert whole.free == tuple(range(8)) and whole.largest_free_zone == (0, 1, 2, 3)
    assert whole.fragmentation == pytest.approx(0.5)
    # Two GPUs of each island gone: 4 free, in two zones of 2.
    taken = capacity(node, leased=(0, 1), running=(4, 5))
    assert taken.free == (2, 3, 6, 7) and taken.leased == (0, 1) and taken.running == (4, 5)
    assert len(taken.largest_free_zone) == 2 and taken.fragmentation == pytest.approx(0.5)
    assert [f.fits for f in taken.fits] == [True] * 4 + [False] * 4
    # Each k's figures are /place's own best answer for k GPUs with the same GPUs busy.
    for fit in taken.fits[:4]:
        best = place(node, Request(gpus=fit.gpus), (0, 1, 4, 5))
        assert fit.indices == best.indices and fit.score == best.score
        assert fit.bandwidth_gbps == best.bandwidth_gbps and fit.affinity == best.affinity
        assert fit.numa_distance == best.objective.numa_distance and fit.satisfaction == best.satisfaction
    assert taken.fits[4].score is None and taken.fits[4].indices == ()
    validate(capacity_document(7, taken), "Capacity")


def test_unhealthy_gpus_are_not_free_and_nothing_free_is_no_fragmentation():
    node = pcie_two_socket_8()
    sick = replace(node, gpus=tuple(replace(g, unhealthy="Xid 79") if g.index == 3 else g for g in node.gpus))
    figures = capacity(sick, leased=(), running=())
    assert 3 not in figures.free and figures.unhealthy == (3,)
    assert len(figures.free) == 7 and not figures.fits[7].fits
    # No NVLink: the zones are the PCIe-switch pairs (0,1) (4,5) (6,7), and 2 alone beside sick 3.
    assert figures.largest_free_zone == (0, 1) and figures.fragmentation == pytest.approx(1 - 2 / 7)
    full = capacity(node, leased=range(8), running=())
    assert full.free == () and full.fragmentation == 0 and not any(f.fits for f in full.fits)


@pytest.mark.parametrize("name,zone,fragmentation", [
    ("pcie-2socket", (0, 1, 2, 3), 0.5),  # two PCIe switches of four GPUs, one per socket (was [0], 0.875)
    ("workstation-2gpu", (0,), 0.5),  # PHB: through the host bridge, no switch shared
    ("dgx-a100", tuple(range(8)), 0.0),
])
def test_an_idle_recorded_node_counts_pcie_switch_groups_as_zones(name, zone, fragmentation):
    matrix = discover_root(str(SNAPSHOTS / name)).distance_matrix()
    idle = capacity(matrix, leased=(), running=())
    assert idle.largest_free_zone == zone and idle.fragmentation == pytest.approx(fragmentation)
    # Taking one GPU of a switch group leaves the rest of it a zone.
    if name == "pcie-2socket":
        taken = capacity(matrix, leased=(0,), running=())
        assert taken.largest_free_zone == (4, 5, 6, 7) and taken.fragmentation == pytest.approx(1 - 4 / 7, abs=1e-6)


@pytest.fixture
def served(tmp_path) -> Agent:
    agent = start_agent(tmp_path, config='[metrics]\ndetail = ["capacity"]\n')
    yield agent
    assert agent.stop() == 0


def test_capacity_endpoint_etag_and_metrics_follow_leases(served):
    wait_counters_read(served)  # the counters' first read swaps in a snapshot: the figures stand after it
    first = served.get("/capacity")
    assert first.status == 200, first.body
    doc = first.json()
    validate(doc, "Capacity")
    assert doc["free"] == list(range(8)) and doc["largest_free_zone_gpus"] == 8 and doc["fragmentation"] == 0
    assert [f["gpus"] for f in doc["fits"]] == list(range(1, 9)) and all(f["fits"] for f in doc["fits"])
    assert doc["fits"][1]["bandwidth_gbps"] == 300 and doc["fits"][1]["affinity"] == "best"  # NVSwitch, NV12
    etag = first.headers["etag"]
    assert served.get("/capacity", headers={"If-None-Match": etag}).status == 304
    granted = served.post("/place", {"gpus": 3, "reserve": {"owner": "job-1", "ttl_s": 600}}, token=served.token)
    assert granted.status == 200, granted.body
    held = [g["index"] for g in granted.json()["gpus"]]
    after = served.get("/capacity", headers={"If-None-Match": etag})
    assert after.status == 200 and after.headers["etag"] != etag
    changed = after.json()
    assert changed["leased"] == sorted(held) and changed["free_gpus"] == 5
    assert [f["fits"] for f in changed["fits"]] == [True] * 5 + [False] * 3
    text = served.get("/metrics").body
    assert promtool_complaints(text) == []
    page = text.decode()
    assert metric_value(page, "topoagent_capacity_free_gpus") == 5
    assert metric_value(page, "topoagent_capacity_largest_free_zone_gpus") == 5
    assert metric_value(page, "topoagent_capacity_fragmentation") == 0
    # Per job size with [metrics] detail "capacity" (by default the budget leaves it out).
    assert metric_value(page, "topoagent_capacity_fits", {"k": "5"}) == 1
    assert metric_value(page, "topoagent_capacity_fits", {"k": "6"}) == 0
