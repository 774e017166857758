"""Every network interface, RDMA or not, placed in the PCIe tree; NCCL's socket fallback."""

from __future__ import annotations

import os
from pathlib import Path

from fakenode import FakeNode

from topoagent.collectors.netdev import parse_speed
from topoagent.documents.schema import node_document
from topoagent.node.discovery import discover_sync
from topoagent.node.host import Host
from topoagent.placement import Placement, Request, place


def plain_netdev(node: FakeNode, name: str, pci_path: str, speed: str = "25000", state: str = "up") -> None:
    dev = node.root / "sys/devices" / pci_path
    net = dev / "net" / name
    net.mkdir(parents=True)
    (net / "speed").write_text(speed + "\n")
    (net / "operstate").write_text(state + "\n")
    os.symlink(os.path.relpath(dev, net), net / "device")
    cls = node.root / "sys/class/net"
    cls.mkdir(parents=True, exist_ok=True)
    os.symlink(f"../../devices/{pci_path}/net/{name}", cls / name)


def two_socket_node(root: Path, *, eth1_state: str = "up") -> FakeNode:
    """Per socket: a PCIe switch with one GPU and one Ethernet NIC below it; plus ``lo``."""
    node = FakeNode(root, numa={0: "0-3", 1: "4-7"})
    for numa, bus in enumerate((0x00, 0x80)):
        root_port = f"pci0000:{bus:02x}/0000:{bus:02x}:01.0"
        switch = f"{root_port}/0000:{bus + 1:02x}:00.0"
        node.bridge(root_port, numa=numa)
        node.bridge(switch, numa=numa)
        for k, cls in enumerate((0x030200, 0x020000)):
            down = f"{switch}/0000:{bus + 2:02x}:0{k}.0"
            node.bridge(down, numa=numa)
            end = f"{down}/0000:{bus + 3 + k:02x}:00.0"
            node.pci(end, cls, vendor=0x10DE if cls == 0x030200 else 0x8086, numa=numa)
            if cls == 0x020000:
                plain_netdev(node, f"eth{numa}", end, state=eth1_state if numa else "up")
    lo = root / "sys/devices/virtual/net/lo"
    lo.mkdir(parents=True)
    (lo / "speed").write_text("-1\n")  # what the kernel says for no link speed
    (lo / "operstate").write_text("unknown\n")
    os.symlink("../../devices/virtual/net/lo", root / "sys/class/net/lo")
    return node


def test_speed_file_minus_one_or_junk_is_unknown():
    assert parse_speed("25000\n") == 25000
    assert parse_speed("-1") is None
    assert parse_speed("fast") is None
    assert parse_speed(None) is None


def test_every_interface_is_reported_with_its_pci_device_speed_state_and_nearest_gpus(tmp_path):
    two_socket_node(tmp_path)
    with Host(tmp_path) as host:
        doc = node_document(discover_sync(host))
    by_name = {i["name"]: i for i in doc["interfaces"]}
    assert set(by_name) == {"eth0", "eth1", "lo"}
    assert by_name["eth0"]["address"] == "0000:04:00.0"
    assert by_name["eth0"]["speed_mbps"] == 25000
    assert by_name["eth0"]["operstate"] == "up"
    assert by_name["eth0"]["nearest_gpus"] == ["GPU0"]
    assert by_name["eth1"]["numa_node"] == 1
    assert by_name["eth1"]["nearest_gpus"] == ["GPU1"]
    assert by_name["lo"] == {"name": "lo", "address": None, "numa_node": None, "speed_mbps": None,
                             "operstate": "unknown", "rdma_device": None, "nearest_gpus": []}
    assert doc["collectors"]["interfaces"]["status"] == "ok"


def test_without_rdma_nics_the_answer_names_the_interfaces_nearest_the_ranks_gpus(tmp_path):
    two_socket_node(tmp_path)
    with Host(tmp_path) as host:
        matrix = discover_sync(host).distance_matrix()
    one = place(matrix, Request(gpus=1, include=(1,)))
    assert isinstance(one, Placement)
    assert one.env["NCCL_SOCKET_IFNAME"] == "=eth1"
    both = place(matrix, Request(gpus=2))
    assert isinstance(both, Placement)
    assert both.env["NCCL_SOCKET_IFNAME"] == "=" + ",".join(f"eth{i}" for i in both.indices)
    assert "NCCL_IB_HCA" not in both.env


def test_an_interface_that_is_down_is_not_offered_to_nccl(tmp_path):
    two_socket_node(tmp_path, eth1_state="down")
    with Host(tmp_path) as host:
        matrix = discover_sync(host).distance_matrix()
    answer = place(matrix, Request(gpus=1, include=(1,)))
    assert isinstance(answer, Placement)
    assert answer.env["NCCL_SOCKET_IFNAME"] == "=eth0"  # the only one up, a socket away


def test_an_rdma_nic_serving_the_ranks_keeps_nccl_on_ib(tmp_path):
    node = two_socket_node(tmp_path)
    node.pci("pci0000:00/0000:00:02.0", 0x020700, vendor=0x15B3)
    node.hca("mlx5_0", "pci0000:00/0000:00:02.0", netdev="ib0")
    with Host(tmp_path) as host:
        topo = discover_sync(host)
    assert {i.name: i.rdma_device for i in topo.interfaces}["ib0"] == "mlx5_0"
    answer = place(topo.distance_matrix(), Request(gpus=1, include=(0,)))
    assert isinstance(answer, Placement)
    assert answer.env["NCCL_IB_HCA"] == "=mlx5_0"
    assert "NCCL_SOCKET_IFNAME" not in answer.env
