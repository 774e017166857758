"""The neutral measures bench/placement.py grades every policy by (bench/neutral.py)."""

from __future__ import annotations

from bench.neutral import Grader
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.node.levels import LinkLevel, expected_gbps
from topoagent.node.matrix import DistanceMatrix

# A ring of NVLink pairs 0-1-2-3-0 (NV2), the diagonals across sockets (SYS).
RING_NODE = (
    "\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\tNUMA Affinity\n"
    "GPU0\t X \tNV2\tSYS\tNV2\t0-7\t0\n"
    "GPU1\tNV2\t X \tNV2\tSYS\t0-7\t0\n"
    "GPU2\tSYS\tNV2\t X \tNV2\t8-15\t1\n"
    "GPU3\tNV2\tSYS\tNV2\t X \t8-15\t1\n"
)


def grader() -> Grader:
    return Grader(DistanceMatrix.from_topo_matrix(parse_topo_matrix(RING_NODE)))


def test_ring_bandwidth_is_the_best_ring_order_from_the_level_table():
    g = grader()
    nv2, sys_ = expected_gbps(LinkLevel.parse("NV2")), expected_gbps(LinkLevel.parse("SYS"))
    # Index order 0-1-2-3 is a ring of NV2 pairs; 0-2-1-3 would cross SYS twice.
    assert g.ring_gbps(g.positions([0, 1, 2, 3])) == nv2
    assert g.ring_gbps(g.positions([0, 2])) == sys_
    assert g.ring_gbps(g.positions([0, 1, 2])) == sys_  # 0-2 closes any ring of three


def test_numa_nodes_come_from_the_gpus_cpu_affinity():
    g = grader()
    assert g.numa_nodes(g.positions([0, 1])) == 1
    assert g.numa_nodes(g.positions([1, 2])) == 2
    assert g.slit_distance(g.positions([1, 2])) is None  # nvidia-smi gives no SLIT table


def test_largest_free_nvlink_zone_counts_gpus_nvlink_joins():
    g = grader()
    assert g.largest_free_nvlink_zone(g.positions([0, 1, 2, 3])) == 4
    assert g.largest_free_nvlink_zone(g.positions([0, 2])) == 1  # joined only through busy GPUs
    assert g.largest_free_nvlink_zone(g.positions([0, 1, 2])) == 3
