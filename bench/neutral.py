"""Measures that grade a GPU set without anybody's objective, ours included.

The job-stream simulation used to grade every policy with topoagent's own objective, so
topoagent won by construction.  These measures read only the node's description:

* ``ring_gbps``: the ring bottleneck of the set, over its best ring order, with each
  pair's bandwidth taken from the level table (``levels.expected_gbps`` of the pair's
  ``nvidia-smi`` level, default PCIe Gen3 x16) -- not from the matrix the placement core
  ranks by, which may carry discovered link widths or probe figures.
* ``numa_nodes``: how many NUMA nodes the set's GPUs sit on (a GPU's ``numa_node``, or
  its CPU affinity list where the node is unknown, as nvidia-smi matrices give it).
* ``slit_distance``: the largest SLIT distance between those NUMA nodes (None without a
  SLIT table).
* ``largest_free_nvlink_zone``: the most free GPUs that NVLink joins into one connected
  group (None on a node without NVLink).
"""

from __future__ import annotations

from functools import cache

from topoagent.node.levels import LevelKind, expected_gbps
from topoagent.node.matrix import DistanceMatrix


class Grader:
    """The neutral measures of GPU sets on one node (sets are GPU indices, as policies answer)."""

    def __init__(self, m: DistanceMatrix):
        self.m = m
        n = m.size
        self.pos = {g.index: p for p, g in enumerate(m.gpus)}
        self.gbps = [[expected_gbps(m.gpu_levels[a][b]) or 0.0 for b in range(n)] for a in range(n)]
        self.nvlink = [{b for b in range(n) if b != a and m.gpu_levels[a][b].kind is LevelKind.NV} for a in range(n)]
        self.has_nvlink = any(self.nvlink)
        self.numa = [g.numa_node if g.numa_node is not None else g.cpus for g in m.gpus]
        self.ring_gbps = cache(self._ring_gbps)

    def positions(self, indices) -> frozenset[int]:
        return frozenset(self.pos[i] for i in indices)

    def _ring_gbps(self, subset: frozenset[int]) -> float:
        """Best ring bottleneck over every order of ``subset`` (positions)."""
        verts = sorted(subset)
        if len(verts) < 2:
            return 0.0
        if len(verts) == 2:
            return self.gbps[verts[0]][verts[1]]
        for threshold in sorted({self.gbps[a][b] for a in verts for b in verts if a != b}, reverse=True):
            if self._has_cycle(verts, threshold):
                return threshold
        return 0.0

    def _has_cycle(self, verts: list[int], threshold: float) -> bool:
        """A Hamiltonian cycle using only pairs of at least ``threshold`` GB/s (bitmask DP)."""
        k = len(verts)
        ok = [[self.gbps[verts[i]][verts[j]] >= threshold for j in range(k)] for i in range(k)]
        # reach[mask] = the set of ends j such that a path from vertex 0 covers mask and ends at j
        reach = [0] * (1 << k)
        reach[1] = 1
        for mask in range(1, 1 << k):
            ends = reach[mask]
            if not ends or not mask & 1:
                continue
            for j in range(k):
                if ends >> j & 1:
                    for nxt in range(k):
                        if not mask >> nxt & 1 and ok[j][nxt]:
                            reach[mask | 1 << nxt] |= 1 << nxt
        full = (1 << k) - 1
        return any(reach[full] >> j & 1 and ok[j][0] for j in range(1, k))

    def numa_nodes(self, subset: frozenset[int]) -> int:
        return len({self.numa[p] for p in subset})

    def slit_distance(self, subset: frozenset[int]) -> int | None:
        nodes = {self.m.gpus[p].numa_node for p in subset}
        if None in nodes or not self.m.numa_distances:
            return None
        distances = [self.m.numa_distance(a, b) for a in nodes for b in nodes]
        return None if None in distances else max(d for d in distances if d is not None)

    def largest_free_nvlink_zone(self, free: frozenset[int]) -> int | None:
        if not self.has_nvlink:
            return None
        best, seen = 0, set()
        for start in free:
            if start in seen:
                continue
            zone, stack = set(), [start]
            while stack:
                v = stack.pop()
                if v not in zone:
                    zone.add(v)
                    stack.extend((self.nvlink[v] & free) - zone)
            seen |= zone
            best = max(best, len(zone))
        return best
