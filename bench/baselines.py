"""Placement policies we compare against (re-implemented from their descriptions).

* ``first_fit``: the lowest free indices.
* ``pair_score``: NVIDIA go-gpuallocator's best-effort policy.  A pair scores 100 per
  NVLink plus its PCIe relation (PIX 50, PXB 40, PHB 30, NODE 20, SYS 10); a set scores the
  sum over its pairs.  The free GPUs, padded with placeholders to a multiple of k, are
  split into every partition into groups of k (groups in order of their first member; a
  group holds either no placeholder or all of them); the partition with the highest total
  wins (the first one found on ties), and its best-scoring group is the answer.  Devices
  on a real node carry both an NVLink and a PCIe relation; an nvidia-smi matrix shows only
  the NVLink for NV pairs, so their PCIe part is taken as NODE (20) on the same NUMA node
  and SYS (10) across.  go-gpuallocator may return a group that still holds placeholders;
  we skip such groups (a caller could not use them).  Enumerating partitions explodes on
  large nodes, so a time cap returns the best found so far and says so.
* ``zone_first``: HAMi-style link-zone scheduling.  Zones are the NVLink-connected groups
  (PCIe switch groups when there is no NVLink, else NUMA nodes).  Take a whole zone's
  worth from one zone when one has k free -- the candidate with the best
  ``10 x quality - loss`` (quality 1 inside a zone; loss 1 when it breaks a whole zone),
  then the fullest-used zone; otherwise combine the zones with the most free GPUs first
  (fewest crossings).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from itertools import combinations

from topoagent.levels import LevelKind
from topoagent.matrix import DistanceMatrix

PCIE_SCORE = {
    LevelKind.PIX: 50,
    LevelKind.PXB: 40,
    LevelKind.PHB: 30,
    LevelKind.NODE: 20,
    LevelKind.SYS: 10,
}


def first_fit(matrix: DistanceMatrix, k: int, busy: set[int]) -> tuple[int, ...] | None:
    free = [g.index for g in matrix.gpus if g.index not in busy]
    return tuple(free[:k]) if len(free) >= k else None


def _same_socket(matrix: DistanceMatrix, a: int, b: int) -> bool:
    ga, gb = matrix.gpus[a], matrix.gpus[b]
    if ga.numa_node is not None and gb.numa_node is not None:
        return ga.numa_node == gb.numa_node
    return ga.cpus == gb.cpus


def pair_score(matrix: DistanceMatrix, a: int, b: int) -> int:
    level = matrix.gpu_levels[a][b]
    if level.kind is LevelKind.NV:
        return 100 * level.nvlinks + (20 if _same_socket(matrix, a, b) else 10)
    return PCIE_SCORE.get(level.kind, 0)


class PairScorePolicy:
    def __init__(self, matrix: DistanceMatrix, time_cap_s: float = 2.0):
        self.matrix = matrix
        self.time_cap_s = time_cap_s
        n = matrix.size
        self.score = [[pair_score(matrix, a, b) if a != b else 0 for b in range(n)] for a in range(n)]
        self.capped = 0  # how many answers hit the time cap

    def set_score(self, group: tuple) -> int:
        real = [g for g in group if g is not None]
        return sum(self.score[a][b] for i, a in enumerate(real) for b in real[i + 1 :])

    def _partitions(self, devices: list, k: int, padding: int) -> Iterator[list[tuple]]:
        if len(devices) == k:
            yield [tuple(devices)]
            return
        head, rest = devices[0], devices[1:]
        for others in combinations(rest, k - 1):
            group = (head,) + others
            pads = sum(1 for g in group if g is None)
            if pads not in (0, padding):
                continue
            remaining = [d for d in rest if d not in others or d is None]
            if None in others:  # remove exactly the placeholders this group took
                remaining = [d for d in rest if d is not None and d not in others]
                remaining += [None] * (rest.count(None) - others.count(None))
            for tail in self._partitions(remaining, k, padding):
                yield [group] + tail

    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        free = [p for p, g in enumerate(self.matrix.gpus) if g.index not in busy]
        if len(free) < k:
            return None
        if k == 1:
            return (self.matrix.gpus[free[0]].index,)
        devices: list = list(free)
        while len(devices) % k:
            devices.append(None)
        padding = devices.count(None)
        best, best_total = None, -1
        deadline = time.perf_counter() + self.time_cap_s
        for count, partition in enumerate(self._partitions(devices, k, padding)):
            total = sum(self.set_score(g) for g in partition)
            if total > best_total:
                best, best_total = partition, total
            if count % 256 == 0 and time.perf_counter() > deadline:
                self.capped += 1
                break
        usable = [g for g in best if None not in g]
        group = max(usable, key=self.set_score)  # first of equals, like the original
        return tuple(self.matrix.gpus[p].index for p in group)


def nv_zones(matrix: DistanceMatrix) -> list[set[int]]:
    """Link zones by position: NVLink-connected groups, else PIX groups, else NUMA."""
    n = matrix.size
    for kinds in ({LevelKind.NV}, {LevelKind.PIX, LevelKind.PXB}):
        adj = {a: {b for b in range(n) if b != a and matrix.gpu_levels[a][b].kind in kinds} for a in range(n)}
        if any(adj.values()):
            zones, seen = [], set()
            for a in range(n):
                if a in seen:
                    continue
                comp, stack = set(), [a]
                while stack:
                    v = stack.pop()
                    if v in comp:
                        continue
                    comp.add(v)
                    stack.extend(adj[v] - comp)
                seen |= comp
                zones.append(comp)
            return zones
    groups: dict = {}
    for p, g in enumerate(matrix.gpus):
        groups.setdefault((g.numa_node, g.cpus), set()).add(p)
    return list(groups.values())


class ZoneFirstPolicy:
    def __init__(self, matrix: DistanceMatrix):
        self.matrix = matrix
        self.zones = nv_zones(matrix)

    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        m = self.matrix
        free = {p for p, g in enumerate(m.gpus) if g.index not in busy}
        if len(free) < k:
            return None
        fitting = []
        for zone in self.zones:
            zfree = sorted(zone & free)
            if len(zfree) >= k:
                whole = len(zfree) == len(zone)
                loss = 1 if whole and len(zfree) > k else 0
                score = 10 * 1.0 - loss
                fitting.append((-score, len(zfree), zfree[0], zfree[:k]))
        if fitting:
            chosen = min(fitting)[3]
        else:
            chosen = []
            for zone in sorted(self.zones, key=lambda z: (-len(z & free), min(z))):
                for p in sorted(zone & free):
                    if len(chosen) < k:
                        chosen.append(p)
        return tuple(m.gpus[p].index for p in chosen)


def self_check(dgx1: DistanceMatrix, h20: DistanceMatrix, pcie_two_socket: DistanceMatrix) -> None:
    """The baselines behave as their descriptions say on the anchor nodes (run before a
    report, so the figures compare against the policies we claim to re-implement).

    ``dgx1``: the DGX-1 V100 hybrid cube mesh; ``h20``: an 8-GPU HGX H20; ``pcie_two_socket``:
    synthetic.pcie_two_socket_8().
    """
    # Where place() takes GPUs 1,2 joined by two NVLinks (tests/test_placement.py).
    got = PairScorePolicy(dgx1)(2, {3, 4, 5, 7})
    assert got is not None and set(got) == {0, 1}, f"PairScorePolicy on the DGX-1: {got}"
    # Crosses sockets though socket 0 (GPUs 0-3) holds enough free GPUs.
    got = PairScorePolicy(pcie_two_socket)(3, {5, 6, 7})
    assert got is not None and 4 in got, f"PairScorePolicy on the PCIe box: {got}"
    got = ZoneFirstPolicy(h20)(4, set())
    assert got is not None and len(got) == 4, f"ZoneFirstPolicy on the H20: {got}"
