"""Each port's neighbour (smpquery, lldpctl), the rails they make, and every door that shows
them: /topology and its schema, NFD labels, /metrics, each rank's rail in a placement."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from fabric_cluster import FABRIC, build_node, host_port, parse_ibnetdiscover, write_command
from schema_check import validate
from service_helpers import promtool_complaints

from topoagent.collectors.ib_neighbours import parse_nodedesc, parse_nodeinfo, smpquery
from topoagent.collectors.lldp import LLDPCTL, LldpParseError, parse_lldpctl_json
from topoagent.documents.schema import node_document
from topoagent.exporters.nfd import nfd_features
from topoagent.node.discovery import discover_sync
from topoagent.node.host import Host
from topoagent.node.model import NodeTopology
from topoagent.placement import place
from topoagent.placement.request import parse_request

FAT_TREE = parse_ibnetdiscover((FABRIC / "ibnetdiscover-edr-fat-tree.txt").read_text())
RAILS = parse_ibnetdiscover((FABRIC / "ibnetdiscover-rail-optimised-synthetic.txt").read_text())


def discover(root: Path) -> NodeTopology:
    with Host(root) as host:
        return discover_sync(host)


def rail_node(tmp_path: Path, name: str = "h100-003") -> Path:
    cabling = {f"mlx5_{k}": host_port(RAILS, f"{name} mlx5_{k}") for k in range(8)}
    return build_node("hgx-h100", tmp_path / name, name, cabling)


# --- the parsers, on outputs others recorded ---------------------------------------------


def test_smpquery_nodeinfo_of_a_real_switch_and_a_real_hca() -> None:
    assert parse_nodeinfo((FABRIC / "smpquery-nodeinfo-switch.txt").read_text()) == ("0xe41d2d03004bef70", "switch", 17)
    # A back-to-back cable: the peer is another host's HCA, no leaf.
    assert parse_nodeinfo((FABRIC / "smpquery-nodeinfo-ca.txt").read_text()) == ("0x0002c90300336fe0", "host", 1)
    assert parse_nodedesc((FABRIC / "smpquery-nodedesc.txt").read_text()) == "b1nstcx02 HCA-1"


def test_lldpctl_json_of_one_neighbour_and_of_several() -> None:
    (one,) = parse_lldpctl_json((FABRIC / "lldpctl-json-one-neighbour.json").read_text())
    # lldpd's own test peer is a station (a host), not a switch: it makes no rail.
    assert (one.interface, one.switch_id, one.switch_name, one.switch_port, one.switch_kind) == (
        "eth0", "00:00:00:00:00:02", "ns-2.example.com", "eth1", "host")
    three = parse_lldpctl_json((FABRIC / "lldpctl-json-roce-two-rails.json").read_text())
    assert [(n.interface, n.switch_name, n.switch_port, n.switch_kind) for n in three] == [
        ("enp33s0f0np0", "leaf-r07-a", "swp12", "switch"), ("enp33s0f1np1", "leaf-r07-b", "swp12", "switch"),
        ("enp20s0f0", "mgmt-r07", "swp7", "switch")]


def test_a_switch_whose_system_name_is_id_is_read_by_its_name() -> None:
    """Only a named chassis nests its fields one level down, so {"id": {"id": ...}} is a
    switch called "id", not a nameless one whose id is an object of fields."""
    fields = {"id": {"type": "mac", "value": "aa:bb:cc:00:00:01"}, "capability": [{"type": "Bridge", "enabled": True}]}
    named = {"lldp": {"interface": {"eth0": {"chassis": {"id": fields}, "port": {"id": {"type": "ifname", "value": "swp1"}}}}}}
    nameless = {"lldp": {"interface": {"eth0": {"chassis": fields, "port": {"id": {"type": "ifname", "value": "swp1"}}}}}}
    (a,) = parse_lldpctl_json(json.dumps(named))
    (b,) = parse_lldpctl_json(json.dumps(nameless))
    assert (a.switch_id, a.switch_name, a.switch_kind) == ("aa:bb:cc:00:00:01", "id", "switch")
    assert (b.switch_id, b.switch_name, b.switch_kind) == ("aa:bb:cc:00:00:01", None, "switch")


@pytest.mark.parametrize("text, says", [
    ((FABRIC / "lldpctl-json0-one-neighbour.json").read_text(), "-f json0"),
    ("lldpd is not running", "not JSON"),
    ('{"lldp": {"interface": {"eth0": {"chassis": {"sw": {"descr": "no id"}}}}}}', "no chassis id"),
    ('{"lldp": {"interface": [1, 2]}}', "not an object"),
    ("[" * 100_000, "not JSON"),
    ('{"lldp": {"interface": {"eth0": {"chassis": {"id": {"value": ["x"]}}}}}}', "expected text"),
])
def test_malformed_lldpctl_output_is_one_clear_error(text: str, says: str) -> None:
    with pytest.raises(LldpParseError, match=says.replace("-", r"\-")):
        parse_lldpctl_json(text)


# --- discovery: rails, and the optional collectors failing soft ---------------------------


def test_a_rail_optimised_node_has_eight_rails_one_per_leaf_and_each_gpu_uses_its_own(tmp_path: Path) -> None:
    node = discover(rail_node(tmp_path))
    rails = node.fabric.rails
    assert [r.index for r in rails] == list(range(8))
    # Rail k is NIC k's, on leaf k of the recorded wiring, at the port numbered after the node.
    for k, rail in enumerate(rails):
        leaf, port = host_port(RAILS, f"h100-003 mlx5_{k}")
        assert (rail.leaf, rail.leaf_name, rail.nics) == (leaf.guid, f"MF0;rail{k}-leaf:MQM9700/U1", (f"NIC{k}",))
        assert port == 3
    # On the HGX H100 every GPU sits under a PCIe switch with its own NIC: its own rail.
    assert [r.gpus for r in rails] == [(f"GPU{k}",) for k in range(8)]
    assert node.fabric.leaf is not None and node.fabric.leaf.startswith("rails-")
    assert node.collectors[[c.name for c in node.collectors].index("ib_neighbours")].status == "ok"


def test_a_node_on_one_leaf_has_one_rail_for_all_its_gpus(tmp_path: Path) -> None:
    root = build_node("dgx1-v100", tmp_path / "gpu021", "gpu021", {"mlx5_0": host_port(FAT_TREE, "gpu021 HCA-1")})
    node = discover(root)
    (rail,) = node.fabric.rails
    assert rail.leaf == "0xec0d9a0300f548e0" == node.fabric.leaf
    assert rail.gpus == tuple(g.name for g in node.gpus)
    (neighbour,) = node.fabric.neighbours
    assert (neighbour.device, neighbour.port, neighbour.switch_port) == ("mlx5_0", 1, "17")


def test_roce_ports_get_their_switches_from_lldp(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "ws"
    shutil.copytree(FABRIC.parent / "snapshots" / "workstation-2gpu", root, symlinks=True)
    write_command(root, LLDPCTL, (FABRIC / "lldpctl-json-roce-two-rails.json").read_text())
    node = discover(root)
    assert [(r.index, r.leaf_name, r.nics) for r in node.fabric.rails] == [(0, "leaf-r07-a", ("NIC0",)), (1, "leaf-r07-b", ("NIC1",))]
    # The management port's switch is a neighbour, not a rail: GPU traffic rides the RDMA NICs.
    assert [n.switch_name for n in node.fabric.neighbours if n.interface == "enp20s0f0"] == ["mgmt-r07"]
    statuses = {c.name: c.status for c in node.collectors}
    assert statuses["lldp"] == "ok" and statuses["ib_neighbours"] == "no_data"  # RoCE ports only


@pytest.mark.parametrize("rc, stderr", [
    (255, "ibwarn: [4242] mad_rpc_open_port: can't open UMAD port ((null):1)\nsmpquery: iberror: failed: Failed to open 'mlx5_0' port '1'\n"),
    (1, "ibwarn: [4242] _do_madrpc: recv failed: Connection timed out\nsmpquery: iberror: failed: operation NodeInfo: node info query failed\n"),
])
def test_no_permission_or_no_answer_is_a_warning_never_a_failed_discovery(tmp_path: Path, rc: int, stderr: str) -> None:
    root = build_node("dgx1-v100", tmp_path / "gpu021", "gpu021", {})
    write_command(root, smpquery("mlx5_0", 1, "nodeinfo"), "", stderr=stderr, rc=rc)
    node = discover(root)
    status = next(c for c in node.collectors if c.name == "ib_neighbours")
    assert status.status == "error" and stderr.splitlines()[-1] in (status.message or "")
    (finding,) = [f for f in node.findings if f.subject == "ib_neighbours"]
    assert (finding.kind, finding.severity) == ("collector-error", "warning")
    assert node.gpus and node.fabric.rails == ()  # the rest of the node is all there


def test_garbage_from_smpquery_is_named_and_costs_only_that_port(tmp_path: Path) -> None:
    cabling = {f"mlx5_{k}": host_port(RAILS, f"h100-001 mlx5_{k}") for k in range(8)}
    root = build_node("hgx-h100", tmp_path / "n", "h100-001", cabling)
    write_command(root, smpquery("mlx5_5", 1, "nodeinfo"), "NodeType:......Switch\nGuid:.....0xzz\n" + "x" * 100_000)
    node = discover(root)
    status = next(c for c in node.collectors if c.name == "ib_neighbours")
    assert status.status == "ok"
    assert [w for w in status.warnings if w.startswith("mlx5_5 port 1:") and "no node GUID" in w]
    assert len(node.fabric.rails) == 7 and "NIC5" not in {n for r in node.fabric.rails for n in r.nics}


# --- the doors ---------------------------------------------------------------------------


def test_topology_json_carries_neighbours_and_rails_and_matches_its_schema(tmp_path: Path) -> None:
    document = node_document(discover(rail_node(tmp_path)))
    validate(document, "Node")
    fabric = document["fabric"]
    assert fabric["leaf"].startswith("rails-") and len(fabric["rails"]) == 8
    assert fabric["rails"][2] == {"rail": 2, "leaf": "0xfc6a1c0300a20000", "leaf_name": "MF0;rail2-leaf:MQM9700/U1",
                                  "nics": ["NIC2"], "interfaces": [], "gpus": ["GPU2"]}
    assert fabric["neighbours"][0] == {"source": "infiniband", "device": "mlx5_0", "port": 1, "interface": None,
                                       "switch_id": "0xfc6a1c0300a00000", "switch_name": "MF0;rail0-leaf:MQM9700/U1",
                                       "switch_port": "3", "switch_kind": "switch"}


def test_each_rank_of_a_placement_names_the_rail_of_its_nic(tmp_path: Path) -> None:
    node = discover(rail_node(tmp_path))
    answer = place(node.distance_matrix(), parse_request({"gpus": 4, "detail": ["bindings"]}))
    assert answer.fit
    for gpu in answer.gpus:
        assert gpu.nic == f"mlx5_{gpu.index}" and gpu.rail == gpu.index
    document = json.loads(json.dumps(answer_json(answer)))
    validate(document, "Placement")
    assert [g["rail"] for g in document["gpus"]] == [g.index for g in answer.gpus]


def answer_json(answer: object) -> dict:
    from topoagent.documents.agent import answer_document

    return answer_document(answer)


def test_nfd_labels_say_the_leaf_the_rails_and_topographs_names_on_request(tmp_path: Path) -> None:
    node = discover(rail_node(tmp_path))
    ours = nfd_features(node)
    assert ours["topoagent.io/fabric.rails"] == "8"
    assert [ours[f"topoagent.io/fabric.rail{k}.leaf"] for k in range(8)] == [f"0xfc6a1c0300a{k}0000" for k in range(8)]
    assert ours["topoagent.io/fabric.leaf"] == node.fabric.leaf
    assert "network.topology.nvidia.com/leaf" not in ours
    with_topograph = nfd_features(node, topograph=True)
    assert with_topograph["network.topology.nvidia.com/leaf"] == ours["topoagent.io/fabric.leaf"]


def test_metrics_name_each_ports_switch_and_rail_and_pass_promtool(tmp_path: Path) -> None:
    import asyncio

    from prometheus_client.parser import text_string_to_metric_families

    from topoagent.config import Config
    from topoagent.exporters.prometheus import MetricsPage
    from topoagent.service.agent import Agent

    root = rail_node(tmp_path)

    async def render() -> bytes:
        agent = Agent(Config(root=str(root), state_dir=str(tmp_path / "state"), udev=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            return MetricsPage(agent).render()
        finally:
            await agent.stop()

    text = asyncio.run(render())
    assert promtool_complaints(text) == []
    series = [dict(s.labels) for f in text_string_to_metric_families(text.decode()) for s in f.samples
              if s.name == "topoagent_port_neighbour_info"]
    assert len(series) == 8
    assert {"device": "mlx5_7", "port": "1", "interface": "", "switch_id": "0xfc6a1c0300a70000",
            "switch_name": "MF0;rail7-leaf:MQM9700/U1", "switch_port": "3", "source": "infiniband", "rail": "7"} in series


def test_a_snapshot_keeps_the_neighbour_answers_and_replays_the_same_rails(tmp_path: Path) -> None:
    from topoagent.cli import main

    recorded = rail_node(tmp_path)
    assert main(["snapshot", "--root", str(recorded), str(tmp_path / "again")]) == 0
    kept = sorted(p.name for p in (tmp_path / "again" / "commands").iterdir() if p.name.startswith("smpquery"))
    assert len(kept) == 16 and "smpquery_-C_mlx5_3_-P_1_-D_nodeinfo_0-1.out" in kept
    assert discover(tmp_path / "again").fabric == discover(recorded).fabric


def test_place_in_words_names_each_ranks_rail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from topoagent.cli import main

    assert main(["place", "--root", str(rail_node(tmp_path)), "--gpus", "2"]) == 0
    ranks = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("rank ")]
    assert len(ranks) == 2 and all(re.search(r"NIC mlx5_(\d) \(PIX\) rail \1$", line) for line in ranks), ranks


def test_no_lldpd_is_a_warning_that_says_what_to_check(tmp_path: Path) -> None:
    import shutil

    root = tmp_path / "ws"
    shutil.copytree(FABRIC.parent / "snapshots" / "workstation-2gpu", root, symlinks=True)
    write_command(root, LLDPCTL, "", stderr="lldpctl: unable to connect to socket /run/lldpd.socket\n", rc=1)
    node = discover(root)
    status = next(c for c in node.collectors if c.name == "lldp")
    assert status.status == "error"
    assert "unable to connect to socket /run/lldpd.socket" in (status.message or "") and "is lldpd running" in (status.message or "")
    assert [(f.kind, f.severity) for f in node.findings if f.subject == "lldp"] == [("collector-error", "warning")]
    assert node.gpus and node.fabric.rails == ()
