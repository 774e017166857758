"""Brute force for the placement objective: every k-subset, every order.  Slow and obvious,
so it can judge place().  It reads the matrix directly, not the placement module's tables."""

from __future__ import annotations

from itertools import combinations, permutations

from topoagent.node.levels import LATENCY_US
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, Request

_EDGES: dict[int, tuple[DistanceMatrix, list]] = {}


def edge(matrix: DistanceMatrix, i: int, j: int):
    hit = _EDGES.get(id(matrix))
    if hit is None or hit[0] is not matrix:
        n = matrix.size
        table = [
            [
                (matrix.bandwidth(a, b) or 0.0, tuple(-x for x in matrix.gpu_levels[a][b].sort_key()))
                for b in range(n)
            ]
            for a in range(n)
        ]
        hit = _EDGES[id(matrix)] = (matrix, table)
    return hit[1][i][j]


# One message between two ranks when a request names no size (alltoall, pipeline).
DEFAULT_MESSAGE_BYTES = 1 << 20


def latency_us(matrix: DistanceMatrix, i: int, j: int) -> float:
    """Alpha: the measured small-copy latency, else the level's figure."""
    m = matrix.measured_latency.get((min(i, j), max(i, j)))
    return m.us if m is not None else LATENCY_US[matrix.gpu_levels[i][j].kind]


def timed_edge(matrix: DistanceMatrix, i: int, j: int, message_bytes: int | None):
    """A latency-bound pattern's link key: (-(alpha + size / bandwidth) us, GB/s, closeness)."""
    gbps, closeness = edge(matrix, i, j)
    size = message_bytes or DEFAULT_MESSAGE_BYTES
    time_us = latency_us(matrix, i, j) + size / (1000 * gbps) if gbps > 0 else float("inf")
    return (-time_us, gbps, closeness)


def link_key(matrix: DistanceMatrix, pattern: str, message_bytes: int | None = None):
    """The key links are ranked by: bandwidth for allreduce, one message's time for
    alltoall and pipeline (latency-bound)."""
    if pattern in ("alltoall", "pipeline"):
        return lambda a, b: timed_edge(matrix, a, b, message_bytes)
    return lambda a, b: edge(matrix, a, b)


def pattern_key(matrix: DistanceMatrix, positions: tuple[int, ...], pattern: str, message_bytes: int | None = None):
    """The best achievable weakest-link key of the pattern on these GPU positions."""
    k = len(positions)
    if k < 2 or pattern == "independent":
        return None
    key = link_key(matrix, pattern, message_bytes)
    if pattern == "alltoall":
        return min(key(a, b) for a, b in combinations(positions, 2))
    if k == 2:
        return key(*positions)
    first, rest = positions[0], positions[1:]
    table = [[key(a, b) if a != b else None for b in range(matrix.size)] for a in range(matrix.size)]
    best = None
    if pattern == "allreduce":
        orders = ((first,) + p for p in permutations(rest))
    else:
        orders = permutations(positions)
    for order in orders:
        worst = min(table[order[i]][order[i + 1]] for i in range(k - 1))
        if pattern == "allreduce":
            worst = min(worst, table[order[-1]][order[0]])
        if best is None or worst > best:
            best = worst
    return best


def numa_key(matrix: DistanceMatrix, pos: int):
    g = matrix.gpus[pos]
    if g.numa_node is not None:
        return ("numa", g.numa_node)
    if g.cpus:
        return ("cpus", g.cpus)
    return ("unknown",)


def numa_distance(matrix: DistanceMatrix, positions) -> int:
    """The largest SLIT entry between the NUMA nodes of these GPUs (0 without a table for
    every node involved... of the whole node: the objective falls back to counting)."""
    nodes = {matrix.gpus[p].numa_node for p in positions}
    every = {g.numa_node for g in matrix.gpus}
    slit = matrix.numa_distances
    if None in every or any((a, b) not in slit for a in every for b in every):
        return 0
    return max(slit[(a, b)] for a in nodes for b in nodes)


def _nic_kind(level) -> int:
    return 99 if level is None else int(level.kind)


def nic_cost(matrix: DistanceMatrix, positions, wanted: int):
    """(kinds summed, -Gb/s summed) of the ``wanted`` best NICs with an active port."""
    if not wanted:
        return (0, 0.0)
    dists = sorted(
        (min(_nic_kind(matrix.gpu_nic_levels[p][j]) for p in positions), -(nic.rate_gbps or 0.0))
        for j, nic in enumerate(matrix.nics)
        if nic.active is not False
    )
    chosen = dists[:wanted]
    return (sum(k for k, _ in chosen), sum(r for _, r in chosen))


_ZONES: dict[int, tuple[DistanceMatrix, list]] = {}


def zones(matrix: DistanceMatrix) -> list[frozenset[frozenset[int]]]:
    """The node's partitions into zones, each once: the connected groups of GPUs joined by
    links at least as close as each level that occurs, then the NUMA groups; a partition
    into one zone or into single GPUs says nothing and is left out."""
    hit = _ZONES.get(id(matrix))
    if hit is None or hit[0] is not matrix:
        hit = _ZONES[id(matrix)] = (matrix, _zones(matrix))
    return hit[1]


def _zones(matrix: DistanceMatrix) -> list[frozenset[frozenset[int]]]:
    n = matrix.size
    out: list[frozenset[frozenset[int]]] = []
    closeness = {matrix.gpu_levels[a][b].sort_key() for a in range(n) for b in range(n) if a != b}
    for limit in sorted(closeness):
        groups: list[set[int]] = []
        for v in range(n):
            joined = [g for g in groups if any(matrix.gpu_levels[v][u].sort_key() <= limit for u in g)]
            merged = {v}.union(*joined)
            groups = [g for g in groups if g not in joined] + [merged]
        partition = frozenset(frozenset(g) for g in groups)
        if 1 < len(partition) < n and partition not in out:
            out.append(partition)
    by_numa: dict = {}
    for v in range(n):
        by_numa.setdefault(numa_key(matrix, v), set()).add(v)
    partition = frozenset(frozenset(g) for g in by_numa.values())
    if len(partition) > 1 and partition not in out:
        out.append(partition)
    return out


def damage(matrix: DistanceMatrix, busy, positions) -> int:
    """Term (5): over every zone, f^2 - (f - s)^2 for its f free GPUs of which s are taken."""
    busy, taken = set(busy), set(positions)
    free = {p for p, g in enumerate(matrix.gpus) if g.index not in busy}
    total = 0
    for partition in zones(matrix):
        for zone in partition:
            f, s = len(zone & free), len(zone & taken)
            total += f * f - (f - s) * (f - s)
    return total


def live_cost(matrix: DistanceMatrix, positions, live: Live | None) -> tuple[int, int]:
    """Term (6): (unverified GPUs, traffic steps of each GPU's least loaded nearest NIC)."""
    if live is None:
        return (0, 0)
    unverified = sum(1 for p in positions if matrix.gpus[p].index in live.unverified)
    usable = [j for j, nic in enumerate(matrix.nics) if nic.active is not False]
    load = 0
    for p in positions:
        kinds = {j: _nic_kind(matrix.gpu_nic_levels[p][j]) for j in usable} if matrix.gpu_nic_levels else {}
        if not kinds or min(kinds.values()) == 99:
            continue
        near = min(kinds.values())
        line = [(matrix.nics[j].rate_gbps or 100.0) * 1e9 / 8 for j in usable]
        load += min(
            int(live.nic_traffic.get(matrix.nics[j].device or matrix.nics[j].name, 0.0) / (0.1 * line[usable.index(j)]))
            for j, kind in kinds.items() if kind == near
        )
    return (unverified, load)


def satisfies(matrix: DistanceMatrix, positions, req: Request) -> bool:
    idx = {matrix.gpus[p].index for p in positions}
    if not set(req.include) <= idx:
        return False
    if req.min_level is not None:
        for a, b in combinations(positions, 2):
            if matrix.gpu_levels[a][b] > req.min_level:
                return False
    return not (req.single_numa and len({numa_key(matrix, p) for p in positions}) > 1)


def best_keys(matrix: DistanceMatrix, req: Request, busy, key_cache=None, live: Live | None = None):
    """(pattern key, numa distance, numa, nic, damage, live) of the optimum, or None when
    nothing fits.  Unhealthy GPUs are candidates only when included."""
    if req.nics > sum(1 for nic in matrix.nics if nic.active is not False):
        return None  # more NICs than have an active port
    busy = set(busy)
    free = [
        p for p, g in enumerate(matrix.gpus)
        if g.index not in busy and g.index not in req.exclude and (g.unhealthy is None or g.index in req.include)
    ]
    best = None
    for subset in combinations(free, req.gpus):
        if not satisfies(matrix, subset, req):
            continue
        if key_cache is not None:
            ck = (subset, req.pattern, req.message_bytes)
            if ck not in key_cache:
                key_cache[ck] = pattern_key(matrix, subset, req.pattern, req.message_bytes)
            pk = key_cache[ck]
        else:
            pk = pattern_key(matrix, subset, req.pattern, req.message_bytes)
        distance = numa_distance(matrix, subset)
        numa = len({numa_key(matrix, p) for p in subset})
        nic = nic_cost(matrix, subset, req.nics)
        cost5 = damage(matrix, busy, subset)
        cost = live_cost(matrix, subset, live)
        key = ((pk is not None, pk or (0.0, ())), -distance, -numa, (-nic[0], -nic[1]), -cost5, (-cost[0], -cost[1]))
        if best is None or key > best[0]:
            best = (key, pk, distance, numa, nic[0], cost5, cost)
    if best is None:
        return None
    return best[1:]
