"""Placement policies we compare against, each ported from the upstream file named.

Ported as algorithms (their order, their ties, their failures), not translated line by line.
Every policy takes ``(k, busy)`` and returns GPU indices, or None for no answer; an answer
that is not k distinct free GPUs is counted as a failure by the benchmark, never repaired.
A policy whose search would be too large for this node raises ``Refused`` before starting
(a node-size cap), so no answer depends on how busy the machine is.

* ``first_fit``: the lowest free indices.
* ``random_fit``: k free GPUs drawn uniformly (seeded).
* ``BestEffortPolicy``: NVIDIA go-gpuallocator, gpuallocator/besteffort_policy.go
  (``bestEffortPolicy.Allocate``, no required devices).  Pair score: 100 per NVLink plus
  the PCIe relation (same board 60, PIX 50, PXB 40, PHB 30, NODE 20, SYS 10), as its
  ``calculateGPUPairScore`` sums every link between two GPUs; an nvidia-smi matrix shows
  only the NVLink for NV pairs, so their PCIe part is taken as NODE on the same NUMA node
  and SYS across.  The free GPUs (index order) are padded with placeholders to a multiple
  of k and split into every partition into k-sets (each set led by the first remaining
  device; a set holds no placeholder or all of them); the first partition found is kept
  unless a later one scores strictly more; its best set wins, first of equals.  That set
  may hold placeholders: upstream then hands back fewer than k devices, and so do we.
  k = 1 gives the first free GPU (every single-device partition scores 0).
* ``HamiTopologyPolicy``: Project-HAMi/HAMi, pkg/device/nvidia/device.go (topology-aware
  GPU policy: ``computeWorstSingleCard``, ``computeBestCombination``) with the pair scores
  of pkg/device/nvidia/calculate_score.go (the same table as go-gpuallocator's).  One GPU:
  the free GPU whose scores to the other free GPUs sum lowest (keeping well-linked cards
  for larger jobs), first of equals.  k GPUs: every k-subset of the free GPUs in index
  order, the highest pair-score sum, first of equals.
* ``HamiZonePolicy``: HAMi's link-zone order as issue #20 reads it (we did not locate the
  upstream file; treat this one as described, not verified): zones are the NVLink-connected
  groups (PIX/PXB groups without NVLink, else NUMA nodes); take the zone with the fewest
  free GPUs that still has k, its lowest free indices; when none has k, fill from the zones
  with the fewest free GPUs first.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from itertools import combinations

from topoagent.node.levels import LevelKind
from topoagent.node.matrix import DistanceMatrix

PCIE_SCORE = {  # go-gpuallocator's P2P link scores by nvidia-smi level (SameBoard 60 has no level)
    LevelKind.PIX: 50,
    LevelKind.PXB: 40,
    LevelKind.PHB: 30,
    LevelKind.NODE: 20,
    LevelKind.SYS: 10,
}


class Refused(Exception):
    """The policy's exhaustive search is too large for this node; it gives no answer."""


# How many candidate sets (or partitions) a Python port may walk before refusing the node.
SEARCH_CAP = 200_000


def first_fit(matrix: DistanceMatrix, k: int, busy: set[int]) -> tuple[int, ...] | None:
    free = [g.index for g in matrix.gpus if g.index not in busy]
    return tuple(free[:k]) if len(free) >= k else None


class RandomFit:
    def __init__(self, matrix: DistanceMatrix, seed: int = 7):
        self.matrix = matrix
        self.rng = random.Random(seed)

    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        free = [g.index for g in self.matrix.gpus if g.index not in busy]
        return tuple(sorted(self.rng.sample(free, k))) if len(free) >= k else None


def _same_socket(matrix: DistanceMatrix, a: int, b: int) -> bool:
    ga, gb = matrix.gpus[a], matrix.gpus[b]
    if ga.numa_node is not None and gb.numa_node is not None:
        return ga.numa_node == gb.numa_node
    return ga.cpus == gb.cpus


def pair_score(matrix: DistanceMatrix, a: int, b: int) -> int:
    level = matrix.gpu_levels[a][b]
    if level.kind is LevelKind.NV:
        return 100 * level.nvlinks + (PCIE_SCORE[LevelKind.NODE] if _same_socket(matrix, a, b) else PCIE_SCORE[LevelKind.SYS])
    return PCIE_SCORE.get(level.kind, 0)


class _Scored:
    def __init__(self, matrix: DistanceMatrix):
        self.matrix = matrix
        n = matrix.size
        self.score = [[pair_score(matrix, a, b) if a != b else 0 for b in range(n)] for a in range(n)]

    def free_positions(self, busy: set[int]) -> list[int]:
        return [p for p, g in enumerate(self.matrix.gpus) if g.index not in busy]

    def set_score(self, group: tuple) -> int:
        real = [g for g in group if g is not None]
        return sum(self.score[a][b] for i, a in enumerate(real) for b in real[i + 1 :])

    def indices(self, positions: tuple) -> tuple[int, ...]:
        return tuple(self.matrix.gpus[p].index for p in positions if p is not None)


def partition_count(n: int, k: int) -> int:
    """Upper bound on the partitions go-gpuallocator walks: n padded up, split into k-sets."""
    padded = -(-n // k) * k
    sets = padded // k
    return math.factorial(padded) // (math.factorial(k) ** sets * math.factorial(sets))


class BestEffortPolicy(_Scored):
    def _partitions(self, devices: list, k: int, padding: int) -> Iterator[list[tuple]]:
        if len(devices) == k:
            yield [tuple(devices)]
            return
        head, rest = devices[0], devices[1:]
        for others in combinations(range(len(rest)), k - 1):
            group = (head, *(rest[i] for i in others))
            if sum(1 for g in group if g is None) not in (0, padding):
                continue
            remaining = [d for i, d in enumerate(rest) if i not in others]
            for tail in self._partitions(remaining, k, padding):
                yield [group, *tail]

    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        free = self.free_positions(busy)
        if k <= 0 or len(free) < k:
            return None
        if k == 1:
            return self.indices((free[0],))
        if partition_count(len(free), k) > SEARCH_CAP:
            raise Refused(f"{partition_count(len(free), k)} partitions of {len(free)} GPUs into {k}-sets")
        devices: list = list(free)
        while len(devices) % k:
            devices.append(None)
        padding = devices.count(None)
        best: list[tuple] | None = None
        best_total = 0
        for partition in self._partitions(devices, k, padding):
            if not any(None not in group for group in partition):
                continue  # upstream needs one set without padding (with every required device)
            total = sum(self.set_score(g) for g in partition)
            if best is None or total > best_total:
                best, best_total = partition, total
        if best is None:
            return None
        chosen = best[0]
        for group in best[1:]:
            if self.set_score(group) > self.set_score(chosen):
                chosen = group
        return self.indices(chosen)  # fewer than k when the set held placeholders: a failure


class HamiTopologyPolicy(_Scored):
    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        free = self.free_positions(busy)
        if k <= 0 or len(free) < k:
            return None
        if k == 1:
            totals = [sum(self.score[a][b] for b in free if b != a) for a in free]
            return self.indices((free[totals.index(min(totals))],))
        if math.comb(len(free), k) > SEARCH_CAP:
            raise Refused(f"{math.comb(len(free), k)} {k}-subsets of {len(free)} GPUs")
        best, best_total = None, -1
        for group in combinations(free, k):
            total = self.set_score(group)
            if total > best_total:
                best, best_total = group, total
        return self.indices(best) if best is not None else None


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


class HamiZonePolicy:
    def __init__(self, matrix: DistanceMatrix):
        self.matrix = matrix
        self.zones = nv_zones(matrix)

    def __call__(self, k: int, busy: set[int]) -> tuple[int, ...] | None:
        m = self.matrix
        free = {p for p, g in enumerate(m.gpus) if g.index not in busy}
        if len(free) < k:
            return None
        by_free = sorted((sorted(zone & free) for zone in self.zones), key=lambda z: (len(z), z[:1]))
        fitting = [z for z in by_free if len(z) >= k]
        chosen = fitting[0][:k] if fitting else [p for z in by_free for p in z][:k]
        return tuple(m.gpus[p].index for p in chosen)


def self_check(dgx1: DistanceMatrix, h20: DistanceMatrix, pcie_two_socket: DistanceMatrix) -> None:
    """The baselines behave as their upstream files do on the anchor nodes (run before a
    report, so the figures compare against the policies we claim to port).

    ``dgx1``: the DGX-1 V100 hybrid cube mesh; ``h20``: an 8-GPU HGX H20; ``pcie_two_socket``:
    synthetic.pcie_two_socket_8().
    """
    # Where place() takes GPUs 1,2 joined by two NVLinks (tests/test_placement.py).
    got = BestEffortPolicy(dgx1)(2, {3, 4, 5, 7})
    assert got is not None and set(got) == {0, 1}, f"BestEffortPolicy on the DGX-1: {got}"
    # Crosses sockets though socket 0 (GPUs 0-3) holds enough free GPUs.
    got = BestEffortPolicy(pcie_two_socket)(3, {5, 6, 7})
    assert got is not None and 4 in got, f"BestEffortPolicy on the PCIe box: {got}"
    # HAMi's single-GPU rule: the worst-connected free card, not the first.
    got = HamiTopologyPolicy(pcie_two_socket)(1, {0, 1, 2})
    assert got == (3,), f"HamiTopologyPolicy(k=1) on the PCIe box: {got}"
    # HAMi's zone order: the zone with the fewest free GPUs that still fits.
    got = HamiZonePolicy(pcie_two_socket)(2, {0, 1})
    assert got == (2, 3), f"HamiZonePolicy on the PCIe box: {got}"
    got = HamiZonePolicy(h20)(4, set())
    assert got is not None and len(got) == 4, f"HamiZonePolicy on the H20: {got}"
