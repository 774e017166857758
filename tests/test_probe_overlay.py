"""Measured figures on the matrix, and the findings they raise, on real recorded nodes.

Figures come from NVIDIA's p2pBandwidthLatencyTest outputs kept in
shared/corpus/bandwidth/, paired with the same machines' `nvidia-smi topo -m`.
"""

import re
from dataclasses import replace
from pathlib import Path

import pytest
from p2p_test_output import matrix_cells

from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.documents.schema import FINDING
from topoagent.node.matrix import DistanceMatrix
from topoagent.probes.figures import ProbeFigure, ProbeKind
from topoagent.probes.overlay import findings_for, overlay

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
TOPO = SHARED / "corpus/nvidia-smi-topo"
BANDWIDTH = SHARED / "corpus/bandwidth"


# nvidia-smi does not print PCIe generations; these machines' GPUs run at these.
PCIE_GEN = {
    "stas00-8xH100-2socket-52c-ht.txt": 5,  # H100 SXM5
    "autodl-container-2xRTX2080Ti-PIX-numa1.txt": 3,
    "lmdeploy-4863-4xRTX2080Ti-PIX-tabs.txt": 3,
    "asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt": 4,
    "puget-wrx90-2xRTX6000Ada-PHB-2nic.txt": 4,
}


def matrix_of(name: str) -> DistanceMatrix:
    topo = parse_topo_matrix((TOPO / name).read_text())
    return DistanceMatrix.from_topo_matrix(topo, pcie_gen=PCIE_GEN[name], pcie_width=16)


def p2p(src: int, dst: int, gbps: float, received_at: float) -> ProbeFigure:
    return ProbeFigure(measurement_id=0, kind=ProbeKind.P2P, src=src, dst=dst, direction=f"{src}->{dst}",
                       median=gbps, received_at=received_at)


def figures_from_p2p_test(name: str) -> list[ProbeFigure]:
    """Our figure shape from a p2pBandwidthLatencyTest output (P2P=Enabled, unidirectional)."""
    text = (BANDWIDTH / name).read_text()
    figures = []
    for src, verdict, dst in re.findall(r"Device=(\d+) (CAN|CANNOT) Access Peer Device=(\d+)", text):
        figures.append(ProbeFigure(measurement_id=len(figures), kind=ProbeKind.PEER_ACCESS, src=int(src), dst=int(dst),
                                   available=verdict == "CAN"))
    cells = matrix_cells(text, "Unidirectional P2P=Enabled Bandwidth (P2P Writes) Matrix (GB/s)")
    figures += [p2p(src, dst, gbps, 1700000000.0) for (src, dst), gbps in cells.items()]
    return figures


def kinds(findings):
    return sorted((f.kind, f.subject) for f in findings)


def test_healthy_h100_nvlink_node_raises_nothing_and_placement_sees_measurements():
    matrix = matrix_of("stas00-8xH100-2socket-52c-ht.txt")
    figures = figures_from_p2p_test("stas00-p2pBandwidthLatencyTest-8xH100-unidir.txt")
    measured = overlay(matrix, figures)
    assert findings_for(measured, figures) == []
    # Slower direction wins: GPU0->GPU1 364.13, GPU1->GPU0 375.18.
    assert measured.measured[(0, 1)].gbps == 364.13
    assert measured.measured[(0, 1)].taken_at == 1700000000.0
    # 364 GB/s is what NV18 achieves (0.81 of 450): the pair is the level's own, so it
    # ranks exactly like an unmeasured NV18 pair (issue 11: measured figures were
    # compared with peak ones and lost to unprobed pairs).
    assert measured.measured_degraded(0, 1) is False
    assert measured.bandwidth(0, 1) == measured.bandwidth(1, 0) == 450.0
    assert matrix.bandwidth(0, 1) == 450.0  # the original is untouched


def test_one_nvlink_pair_at_pcie_speed_is_degraded_and_contradicts_nvlink():
    matrix = matrix_of("stas00-8xH100-2socket-52c-ht.txt")
    figures = figures_from_p2p_test("stas00-p2pBandwidthLatencyTest-8xH100-unidir.txt")
    figures = [
        replace(f, median=52.0) if f.kind == "p2p" and {f.src, f.dst} == {2, 5} else f  # what a PCIe Gen5 x16 copy delivers
        for f in figures
    ]
    findings = findings_for(overlay(matrix, figures), figures)
    assert kinds(findings) == [("degraded_link", "GPU2-GPU5"), ("level_contradiction", "GPU2-GPU5")]
    degraded = findings[0]
    assert degraded.severity == "critical"
    assert (degraded.expected_gbps, degraded.measured_gbps) == (450.0, 52.0)
    assert "not using NVLink" in findings[1].message
    assert FINDING.dump(findings[1])["kind"] == "level_contradiction"


def test_pix_pair_without_peer_access_staged_through_host():
    # AutoDL container: two RTX 2080 Ti behind one switch, P2P unavailable, 5.7 GB/s.
    matrix = matrix_of("autodl-container-2xRTX2080Ti-PIX-numa1.txt")
    figures = figures_from_p2p_test("autodl-container-p2pBandwidthLatencyTest-2xRTX2080Ti-noP2P.txt")
    findings = findings_for(overlay(matrix, figures), figures)
    assert kinds(findings) == [
        ("degraded_link", "GPU0-GPU1"), ("no_peer_access", "GPU0->GPU1"), ("no_peer_access", "GPU1->GPU0")
    ]
    # 5.72 of the ~13 GB/s a Gen3 x16 PIX pair achieves
    assert (findings[0].severity, findings[0].measured_gbps) == ("warning", 5.72)


@pytest.mark.parametrize(
    "topo, p2p",
    [
        ("puget-wrx90-2xRTX6000Ada-PHB-2nic.txt", "puget-wrx90-p2pBandwidthLatencyTest-2xRTX6000Ada-PHB-full.txt"),
        ("asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt",
         "asus-esc8000a-e12-p2pBandwidthLatencyTest-4xRTX6000Ada-pcie-full.txt"),
    ],
)
def test_pcie_nodes_running_faster_than_their_level_raise_nothing(topo, p2p):
    # PHB, NODE and SYS pairs on AMD EPYC/Threadripper reach the full 26.3 GB/s.
    matrix = matrix_of(topo)
    figures = figures_from_p2p_test(p2p)
    assert findings_for(overlay(matrix, figures), figures) == []


def test_pix_declared_but_copying_at_host_bridge_speed():
    matrix = matrix_of("lmdeploy-4863-4xRTX2080Ti-PIX-tabs.txt")
    a, b = next((i, j) for i in range(4) for j in range(4) if str(matrix.level(i, j)) == "PIX")
    ga, gb = matrix.gpus[a].index, matrix.gpus[b].index
    figures = [p2p(ga, gb, 10.3, 1.0), p2p(gb, ga, 10.6, 1.0)]
    findings = findings_for(overlay(matrix, figures), figures)
    assert kinds(findings) == [("level_contradiction", f"GPU{ga}-GPU{gb}")]
    assert "declared PIX" in findings[0].message and "PHB" in findings[0].message


def host(device, node, gbps):
    return ProbeFigure(measurement_id=0, kind=ProbeKind.H2D, device=device, numa_node=node, median=gbps)


def test_host_copies_find_the_real_numa_affinity_and_weak_host_links():
    matrix = matrix_of("asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt")  # GPU0,1 on node 0
    figures = [
        host(0, 0, 26.0), host(0, 1, 19.0),  # as declared
        host(1, 0, 17.0), host(1, 1, 25.5),  # faster from node 1: the declaration is wrong
        host(2, 0, 6.0), host(2, 1, 9.0),  # GPU2's link trained narrow
    ]
    findings = findings_for(matrix, figures)
    assert kinds(findings) == [
        ("host_link_degraded", "GPU2 host link"),
        ("numa_affinity_mismatch", "GPU1 host link"),
    ]
    mismatch = next(f for f in findings if f.kind == "numa_affinity_mismatch")
    assert (mismatch.expected_gbps, mismatch.measured_gbps) == (25.5, 17.0)
    assert "declared on NUMA node 0" in mismatch.message and "node 1" in mismatch.message


def test_figures_for_gpus_the_matrix_lacks_are_ignored():
    matrix = matrix_of("puget-wrx90-2xRTX6000Ada-PHB-2nic.txt")
    figures = [p2p(0, 9, 1.0, 1.0)]
    assert overlay(matrix, figures).measured == {}
    assert findings_for(matrix, figures) == []
