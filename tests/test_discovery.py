"""discover() on small recorded nodes: levels with nvidia-smi's meaning, findings, JSON."""

from __future__ import annotations

import asyncio
from pathlib import Path

from fakenode import FakeNode, nvml_gpu

from topoagent.documents.schema import node_document
from topoagent.node.discovery import discover
from topoagent.node.host import Host

GPU_CLASS, IB_CLASS, NVSWITCH_CLASS = 0x030200, 0x020700, 0x068000


def two_socket(root: Path) -> FakeNode:
    node = FakeNode(root, {0: "0-3", 1: "4-7"})
    sw = "pci0000:00/0000:00:01.0/0000:01:00.0"
    node.bridge("pci0000:00/0000:00:01.0")
    node.bridge(sw)
    for port in ("02:00.0", "02:01.0", "02:02.0", "02:03.0"):
        node.bridge(f"{sw}/0000:{port}")
    node.pci(f"{sw}/0000:02:00.0/0000:03:00.0", GPU_CLASS, driver="nvidia")  # A
    node.pci(f"{sw}/0000:02:01.0/0000:04:00.0", GPU_CLASS)  # B: same switch as A
    nic0 = f"{sw}/0000:02:02.0/0000:05:00.0"
    node.pci(nic0, IB_CLASS, vendor=0x15B3, device=0x101B)
    node.hca("mlx5_0", nic0, netdev="ibp5s0")
    deep = f"{sw}/0000:02:03.0/0000:07:00.0"
    node.bridge(deep)
    node.bridge(f"{deep}/0000:08:00.0")
    node.pci(f"{deep}/0000:08:00.0/0000:09:00.0", GPU_CLASS)  # C: behind a second switch
    node.bridge("pci0000:00/0000:00:02.0")
    node.pci("pci0000:00/0000:00:02.0/0000:06:00.0", GPU_CLASS)  # D: own root port
    node.bridge("pci0000:40/0000:40:01.0")
    node.pci("pci0000:40/0000:40:01.0/0000:41:00.0", GPU_CLASS, width=(8, 16))  # E: x8
    node.bridge("pci0000:80/0000:80:01.0", numa=1)
    node.pci("pci0000:80/0000:80:01.0/0000:81:00.0", GPU_CLASS, numa=1)  # F: other socket
    node.bridge("pci0000:80/0000:80:02.0", numa=1)
    nic1 = "pci0000:80/0000:80:02.0/0000:82:00.0"
    node.pci(nic1, IB_CLASS, vendor=0x15B3, numa=1)
    node.hca("mlx5_1", nic1, state="1: DOWN")
    # NVML answers (no NVLink): with neither it nor nvidia-smi, the GPUs' levels would be
    # unknown, not their PCIe path (tests/test_witnesses.py).
    gpus = ("03:00.0", "04:00.0", "06:00.0", "09:00.0", "41:00.0", "81:00.0")
    node.nvml([nvml_gpu(i, f"0000:{a}", [], name="Tesla T4") for i, a in enumerate(gpus)])
    return node


def run(root: Path):
    with Host(root) as host:
        return asyncio.run(discover(host))


def names_by_address(topology) -> dict[str, str]:
    return {g.pci_address: g.name for g in topology.gpus}


def test_levels_follow_nvidia_smi_meaning(tmp_path: Path) -> None:
    two_socket(tmp_path)
    topo = run(tmp_path)
    n = names_by_address(topo)
    # NVML numbers them in PCI bus order here, as nvidia-smi does.
    assert [g.pci_address for g in topo.gpus] == sorted(n)
    a, b, c, d, e, f = (n[f"0000:{x}"] for x in ("03:00.0", "04:00.0", "09:00.0", "06:00.0", "41:00.0", "81:00.0"))
    assert str(topo.level(a, b)) == "PIX"
    assert str(topo.level(a, "NIC0")) == "PIX"
    assert str(topo.level(a, c)) == "PXB"
    assert str(topo.level(a, d)) == "PHB"
    assert str(topo.level(a, e)) == "NODE"
    assert str(topo.level(a, f)) == "SYS"
    assert str(topo.level(f, "NIC1")) == "PHB"
    assert all(p.source == "derived" for p in topo.pairs)


def test_health_findings_lower_expected_bandwidth(tmp_path: Path) -> None:
    two_socket(tmp_path)
    topo = run(tmp_path)
    n = names_by_address(topo)
    kinds = {(f.kind, f.subject) for f in topo.findings}
    assert ("pcie-degraded", n["0000:41:00.0"]) in kinds
    assert ("ib-port-down", "mlx5_1 port 1") in kinds
    a, d, e = n["0000:03:00.0"], n["0000:06:00.0"], n["0000:41:00.0"]
    # Same level (NODE) both ways from A; the x8 GPU halves what A can expect to reach it.
    other = n["0000:81:00.0"]
    assert topo.pair(a, e).expected_gbps < topo.pair(a, d).expected_gbps
    assert topo.pair(other, "NIC1").expected_gbps == 0.0
    assert topo.pair(a, "NIC0").expected_gbps == 25.0  # capped by the 200 Gb/s port


def test_expected_bandwidth_counts_the_links_a_pair_crosses_and_no_other(tmp_path: Path) -> None:
    """Below a shared switch its upstream link is not crossed: only the ports under it are."""
    from topoagent.node.levels import PHB, PIX, expected_gbps

    node = FakeNode(tmp_path)
    node.bridge("pci0000:00/0000:00:01.0")
    switch = "pci0000:00/0000:00:01.0/0000:01:00.0"
    node.bridge(switch, width=(4, 16))  # the switch's own link up: x4
    node.bridge(f"{switch}/0000:02:00.0")
    node.pci(f"{switch}/0000:02:00.0/0000:03:00.0", GPU_CLASS)  # A
    node.bridge(f"{switch}/0000:02:01.0", width=(8, 16))  # the port above B: x8
    node.pci(f"{switch}/0000:02:01.0/0000:04:00.0", GPU_CLASS)  # B
    node.bridge("pci0000:00/0000:00:02.0")
    node.pci("pci0000:00/0000:00:02.0/0000:05:00.0", GPU_CLASS)  # C: its own root port
    node.nvml([nvml_gpu(i, f"0000:{a}", [], name="Tesla T4") for i, a in enumerate(("03:00.0", "04:00.0", "05:00.0"))])
    topo = run(tmp_path)
    assert topo.pair("GPU0", "GPU1").expected_gbps == expected_gbps(PIX, pcie_gen=4, pcie_width=8)
    assert topo.pair("GPU0", "GPU2").expected_gbps == expected_gbps(PHB, pcie_gen=4, pcie_width=4)
    assert topo.pair("GPU1", "GPU2").expected_gbps == expected_gbps(PHB, pcie_gen=4, pcie_width=4)


def test_declared_matrix_disagreement_is_a_finding(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    node.bridge("pci0000:00/0000:00:01.0")
    node.pci("pci0000:00/0000:00:01.0/0000:01:00.0", GPU_CLASS)
    node.bridge("pci0000:00/0000:00:02.0")
    node.pci("pci0000:00/0000:00:02.0/0000:02:00.0", GPU_CLASS)
    node.command("nvidia-smi_topo_-m", "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\n"
                 "GPU0\t X \tPIX\t0-3\t0\nGPU1\tPIX\t X \t0-3\t0\n")
    topo = run(tmp_path)
    pair = topo.pair("GPU0", "GPU1")
    assert str(pair.level) == "PHB" and str(pair.declared) == "PIX"
    found = [f for f in topo.findings if f.kind == "level-disagreement"]
    assert [f.subject for f in found] == ["GPU0/GPU1"]
    assert {c.name: c.status for c in topo.collectors}["nvidia_smi"] == "ok"


def nvswitch_node(root: Path, gpu3_links_up: int, gpu2_in_fabric: bool = True) -> FakeNode:
    node = FakeNode(root)
    gpus, switches = [], []
    for k in range(4):
        node.bridge(f"pci0000:00/0000:00:0{k + 1}.0")
        gpus.append(node.pci(f"pci0000:00/0000:00:0{k + 1}.0/0000:1{k}:00.0", GPU_CLASS))
    for k in range(2):
        node.bridge(f"pci0000:00/0000:00:0{k + 5}.0")
        switches.append(node.pci(f"pci0000:00/0000:00:0{k + 5}.0/0000:2{k}:00.0", NVSWITCH_CLASS, device=0x1AF1))
    records = []
    for k, address in enumerate(gpus):
        links = [(True, switches[s], "switch") for s in (0, 0, 1, 1)]
        if k == 3:
            links = [(i < gpu3_links_up, r, t) for i, (_, r, t) in enumerate(links)]
        if k == 2 and not gpu2_in_fabric:
            links = [(False, r, t) for _, r, t in links]
        records.append(nvml_gpu(k, address, links))
    node.nvml(records)
    return node


def test_nvswitch_fabric_gives_every_pair_nv_links_per_gpu(tmp_path: Path) -> None:
    nvswitch_node(tmp_path, gpu3_links_up=3)
    topo = run(tmp_path)
    assert str(topo.level("GPU0", "GPU1")) == "NV4"
    assert str(topo.level("GPU0", "GPU3")) == "NV3"
    assert [f.subject for f in topo.findings if f.kind == "nvlink-down"] == ["GPU3"]
    matrix = topo.distance_matrix()
    assert matrix.bandwidth(0, 1) == 100.0  # A100: NVLink 3, 25 GB/s per link
    assert matrix.bandwidth(0, 3) == 75.0
    assert matrix.gpus[0].uuid == "GPU-00000000" and matrix.gpus[0].model.startswith("NVIDIA A100")


def test_gpu_missing_from_fabric_falls_back_to_pcie(tmp_path: Path) -> None:
    nvswitch_node(tmp_path, gpu3_links_up=4, gpu2_in_fabric=False)
    topo = run(tmp_path)
    assert str(topo.level("GPU0", "GPU2")) == "PHB"
    assert [f.subject for f in topo.findings if f.kind == "gpu-outside-fabric"] == ["GPU2"]
    assert {f.severity for f in topo.findings if f.kind == "gpu-outside-fabric"} == {"critical"}


def test_direct_nvlinks_count_per_pair(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    gpus = [node.pci(f"pci0000:00/0000:00:0{k + 1}.0", GPU_CLASS) for k in range(3)]
    node.nvml([
        nvml_gpu(0, gpus[0], [(True, gpus[1], "gpu"), (True, gpus[1], "gpu"), (True, gpus[2], "gpu")], "Tesla V100-SXM2-16GB"),
        nvml_gpu(1, gpus[1], [(True, gpus[0], "gpu"), (True, gpus[0], "gpu")], "Tesla V100-SXM2-16GB"),
        nvml_gpu(2, gpus[2], [(True, gpus[0], "gpu")], "Tesla V100-SXM2-16GB"),
    ])
    topo = run(tmp_path)
    assert str(topo.level("GPU0", "GPU1")) == "NV2"
    assert str(topo.level("GPU0", "GPU2")) == "NV1"
    assert str(topo.level("GPU1", "GPU2")) == "PHB"


def test_json_has_the_documented_shapes(tmp_path: Path) -> None:
    two_socket(tmp_path)
    out = node_document(run(tmp_path))
    assert out["schema_version"] == 3
    assert out["numa_nodes"][1] | {} == {"id": 1, "cpus": "4-7", "memory_bytes": 1073741824,
                                          "distances": [21, 10], "cpuless": False, "same_cpus_as": []}
    gpu = next(d for d in out["pci_devices"] if d["address"] == "0000:03:00.0")
    assert (gpu["class"], gpu["vendor"], gpu["device"], gpu["numa_node"], gpu["parent"], gpu["driver"]) == (
        "0x030200", "0x10de", "0x20b0", 0, "0000:02:00.0", "nvidia")
    assert gpu["link"]["current_width"] == 16 and gpu["link"]["max_gen"] == 4
    root_port = next(d for d in out["pci_devices"] if d["address"] == "0000:00:01.0")
    assert root_port["parent"] is None
    nic = out["nics"][0]
    assert (nic["name"], nic["device"], nic["address"], nic["netdev"]) == ("NIC0", "mlx5_0", "0000:05:00.0", "ibp5s0")
    assert nic["ports"][0]["rate_gbps"] == 200.0 and nic["ports"][0]["subnet_prefix"] == "fe80:0000:0000:0000"
    assert out["collectors"]["nvml"]["status"] == "ok"
    assert out["collectors"]["nvidia_smi"]["status"] == "no_data"
    assert out["collectors"]["pci"]["status"] == "ok"


def test_broken_files_are_named_and_do_not_stop_discovery(tmp_path: Path) -> None:
    two_socket(tmp_path)
    (tmp_path / "sys/devices/pci0000:00/0000:00:02.0/0000:06:00.0/numa_node").write_text("banana\n")
    (tmp_path / "sys/devices/system/node/node1/cpulist").unlink()
    out = node_document(run(tmp_path))
    assert out["collectors"]["numa"]["status"] == "error"
    assert "node1/cpulist" in out["collectors"]["numa"]["message"]
    assert out["collectors"]["pci"]["status"] == "ok"
    assert any("0000:06:00.0/numa_node" in w for w in out["collectors"]["pci"]["warnings"])
    assert any(f["kind"] == "collector-error" for f in out["findings"])
    # One severity vocabulary: a failed source is critical (discovery said "error" before).
    assert {f["severity"] for f in out["findings"] if f["kind"] == "collector-error"} == {"critical"}


def test_nvidia_smi_failure_is_an_error_with_the_reason(tmp_path: Path) -> None:
    FakeNode(tmp_path).command("nvidia-smi_topo_-m", "garbage\n")
    out = node_document(run(tmp_path))
    assert out["collectors"]["nvidia_smi"]["status"] == "error"
    assert "nvidia-smi topo -m" in out["collectors"]["nvidia_smi"]["message"]


def test_matrix_renders_our_derived_levels(tmp_path: Path) -> None:
    nvswitch_node(tmp_path, gpu3_links_up=4)
    from topoagent.collectors.nvidia_smi import parse_topo_matrix, render_topo_matrix

    text = render_topo_matrix(run(tmp_path).topo_matrix(), style="tabs")
    again = parse_topo_matrix(text)
    assert str(again.level("GPU0", "GPU3")) == "NV4"


def test_a_link_is_judged_once_and_a_slot_limit_is_not_a_fault(tmp_path: Path) -> None:
    node = FakeNode(tmp_path)
    # A x16 GPU in a slot wired x8: the root port itself has only x8.
    node.bridge("pci0000:00/0000:00:01.0", width=(8, 8))
    node.pci("pci0000:00/0000:00:01.0/0000:01:00.0", GPU_CLASS, width=(8, 16))
    # A Gen4 NIC trained at Gen3 under a Gen4 port: both ends could do more.
    node.bridge("pci0000:00/0000:00:02.0", speed=("8.0 GT/s PCIe", "16.0 GT/s PCIe"))
    nic = "pci0000:00/0000:00:02.0/0000:02:00.0"
    node.pci(nic, IB_CLASS, vendor=0x15B3, speed=("8.0 GT/s PCIe", "16.0 GT/s PCIe"))
    node.hca("mlx5_0", nic)
    node.nvml([nvml_gpu(0, "0000:01:00.0", [], name="Tesla T4")])
    topo = run(tmp_path)
    found = sorted((f.kind, f.severity, f.subject) for f in topo.findings)
    assert found == [("pcie-degraded", "info", "GPU0"), ("pcie-slow", "warning", "NIC0")]
    assert "has only x8" in next(f.message for f in topo.findings if f.subject == "GPU0")
