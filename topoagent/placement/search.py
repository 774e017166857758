"""The search: per-matrix tables, bandwidth thresholds, interchangeable-GPU classes,
branch and bound, and the Hamiltonian ring/path search.  See the package docstring for
the objective it is exact for.

Everything here works on GPU *positions* (rows of the DistanceMatrix, bits of a mask);
nvidia-smi indices appear only where a request or an answer is read or written.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from itertools import accumulate, combinations, pairwise
from math import comb
from time import monotonic
from typing import TYPE_CHECKING, Any

from topoagent.cpulist import format_cpulist, parse_cpulist
from topoagent.levels import LinkLevel
from topoagent.matrix import DistanceMatrix
from topoagent.placement.latency import time_key
from topoagent.placement.request import Request
from topoagent.vocabulary import Pattern

if TYPE_CHECKING:
    from topoagent.placement.answer import AnswerParts, PatternLink, PlacedGpu
    from topoagent.placement.live import LiveCosts

# --- per-matrix preparation (cached; independent of the request and of busy GPUs) ---------


def bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def connected_components(verts: int, adjacency: list[int]) -> list[int]:
    """The connected components (as GPU bitmasks) of the graph restricted to ``verts``."""
    comps = []
    remaining = verts
    while remaining:
        comp = frontier = remaining & -remaining
        while frontier:
            reach = 0
            for v in bits(frontier):
                reach |= adjacency[v]
            frontier = reach & verts & ~comp
            comp |= frontier
        comps.append(comp)
        remaining &= ~comp
    return comps


NO_NIC = 99


class DeadlineReached(Exception):
    """The search's time is up: the caller answers with the best set found so far."""


class Deadline:
    """A point on the monotonic clock a search stops at.  The clock is read every
    CHECK_EVERY steps (a step is one branch or one Hamiltonian extension, a few
    microseconds): cheap next to the search, and far finer than a millisecond."""

    CHECK_EVERY = 16
    # The search stops this much before the deadline (a quarter of it at most): building
    # the answer from the set takes a fraction of a millisecond, more on a loaded machine.
    ANSWER_RESERVE_S = 0.002

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.at = monotonic() + seconds - min(self.ANSWER_RESERVE_S, seconds / 4)
        self.left = self.CHECK_EVERY
        self.reached = False
        self.suspended = False  # while a search finds its first, cheap answer
        self.bound_gbps: float | None = None  # what the stopped search could still prove

    def tick(self) -> None:
        self.left -= 1
        if self.left <= 0:
            self.left = self.CHECK_EVERY
            if self.suspended:
                return
            if self.reached or monotonic() >= self.at:
                self.reached = True
                raise DeadlineReached


def tick(deadline: Deadline | None) -> None:
    if deadline is not None:
        deadline.tick()


SMALL_TABLE_SETS = 128  # most k-sets a node may have for place() to scan a table of them
# Caps on the per-matrix memos, so a node's tables stay a few MB at 128 GPUs (bench/placement.py
# measures them): past a cap a memo starts again empty, costing time, never answers.
HAM_MEMO_MAX = 50_000
WARM_RANKS_MAX = 64  # thresholds whose adjacency warm() builds ahead (n masks each)
NIC_COST_MAX = 50_000


class Prepared:
    """Everything about a matrix the search reads, as bitmasks over GPU positions."""

    def __init__(self, matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None):
        n = matrix.size
        self.n = n
        self.matrix = matrix
        self.now = now
        self.all_mask = (1 << n) - 1
        levels = matrix.gpu_levels
        bw = [[matrix.bandwidth(i, j, now) or 0.0 for j in range(n)] for i in range(n)]
        self.bw = bw
        self.alpha = [[matrix.latency_us(i, j, now) for j in range(n)] for i in range(n)]  # placement.latency
        # Edge key: bandwidth first, then closeness of the level (NV18 > NV2 > PIX > PXB ...);
        # with ``message_bytes`` (latency-bound patterns) one message's time first (placement.latency).
        self.message_bytes = message_bytes
        closeness = [[tuple(-x for x in levels[i][j].sort_key()) for j in range(n)] for i in range(n)]
        edge = [
            [
                (bw[i][j], closeness[i][j]) if message_bytes is None
                else time_key(self.alpha[i][j], bw[i][j], closeness[i][j], message_bytes)
                for j in range(n)
            ]
            for i in range(n)
        ]
        ordered = sorted({edge[i][j] for i in range(n) for j in range(n) if i != j})
        index_of = {key: r for r, key in enumerate(ordered)}
        self.rank = [[index_of[edge[i][j]] if i != j else -1 for j in range(n)] for i in range(n)]
        self.n_ranks = len(ordered)
        # A threshold's bound on bandwidth: the widest link ranked at or below it.
        self.rank_gbps = list(accumulate((key[0] if message_bytes is None else key[1] for key in ordered), max))
        # Distinct (alpha, GB/s, closeness) of the links: what a message size's order is of.
        self.edge_classes = {(self.alpha[i][j], bw[i][j], closeness[i][j]) for i in range(n) for j in range(n) if i != j}
        self._timed: dict[tuple, Prepared] = {}
        self.live_costs: dict[tuple, LiveCosts] = {}  # the last request's (placement.live)
        # Per rank, per GPU: the GPUs joined to it by a link of exactly that rank.
        self.rank_exact = [[0] * n for _ in ordered]
        for i in range(n):
            for j in range(n):
                if i != j:
                    self.rank_exact[self.rank[i][j]][i] |= 1 << j
        self._adj: dict[int, list[int]] = {}
        self._level_adj: dict[tuple[int, int], list[int]] = {}
        self.ham_memo: dict[tuple[int, int, bool], tuple[int, ...] | None] = {}

        # NUMA groups: the NUMA node when known, else the CPU list, else one group.
        keys_numa: list[Any] = []
        for g in matrix.gpus:
            if g.numa_node is not None:
                keys_numa.append(("numa", g.numa_node))
            elif g.cpus:
                keys_numa.append(("cpus", format_cpulist(parse_cpulist(g.cpus))))
            else:
                keys_numa.append(("unknown", None))
        seen: dict[Any, int] = {}
        self.numa_of = []
        for key in keys_numa:
            self.numa_of.append(seen.setdefault(key, len(seen)))
        self.numa_keys = list(seen)
        self.numa_masks = [0] * len(seen)
        for i, gi in enumerate(self.numa_of):
            self.numa_masks[gi] |= 1 << i
        self.numa_bit = [1 << gi for gi in self.numa_of]
        # NUMA distance (term 2): the SLIT entry between two groups, when every group is a
        # NUMA node the matrix has distances for; else None and the term is 0 for every set.
        slit = matrix.numa_distances
        ids = [value for kind, value in self.numa_keys if kind == "numa"]
        self.numa_dist: list[list[int]] | None = None
        if slit and len(ids) == len(self.numa_keys) and all((a, b) in slit for a in ids for b in ids):
            self.numa_dist = [[slit[(a, b)] for b in ids] for a in ids]
        self._span: dict[int, int] = {0: 0}
        # GPUs placement keeps off unless named (a critical finding), and GPUs whose links
        # are unknown (taken only after every GPU whose links are known).
        self.unhealthy = sum(1 << i for i, g in enumerate(matrix.gpus) if g.unhealthy is not None)
        self.links_unknown = sum(1 << i for i, g in enumerate(matrix.gpus) if not g.links_known)

        # GPU -> NIC distance as a LevelKind number; per NIC, the GPUs within each kind.
        # A NIC with no ACTIVE port carries no traffic: it is as far as no NIC at all
        # (NO_NIC) and has no steps, so it never counts in term (3) nor is listed.
        self.nic_usable = [nic.active is not False for nic in matrix.nics]
        self.nic_rate = [nic.rate_gbps or 0.0 for nic in matrix.nics]
        self.nic_kind = [
            [
                int(lv.kind) if lv is not None and self.nic_usable[j] else NO_NIC
                for j, lv in enumerate(matrix.gpu_nic_levels[i] if matrix.gpu_nic_levels else ())
            ]
            for i in range(n)
        ]
        n_nics = len(matrix.nics) if matrix.gpu_nic_levels else 0
        self.n_nics = sum(self.nic_usable) if n_nics else 0  # the NICs a job can be given
        self.nic_steps: list[list[tuple[int, int]]] = []
        for j in range(n_nics):
            kinds = sorted({self.nic_kind[i][j] for i in range(n)} - {NO_NIC})
            steps = []
            for kv in kinds:
                mask = sum(1 << i for i in range(n) if self.nic_kind[i][j] <= kv)
                steps.append((kv, mask))
            self.nic_steps.append(steps)

        # Zones: connected groups at each distinct link level, plus NUMA nodes.
        self.zone_levels: list[tuple[str, list[int]]] = []  # (name, gpu -> zone mask)
        seen_partitions: set[tuple[int, ...]] = set()
        distinct_levels = sorted({levels[i][j] for i in range(n) for j in range(n) if i != j})
        for level in distinct_levels:
            zone_of = self._components_at_level(level)
            partition = tuple(sorted(set(zone_of)))
            if len(partition) in (1, n) or partition in seen_partitions:
                continue
            seen_partitions.add(partition)
            self.zone_levels.append((f"{level} zone", zone_of))
        if len(self.numa_masks) > 1:
            zone_of = [self.numa_masks[self.numa_of[i]] for i in range(n)]
            partition = tuple(sorted(set(zone_of)))
            if partition not in seen_partitions:
                self.zone_levels.append(("NUMA node", zone_of))
        # Coarse zones first, so the hierarchy key groups GPUs like the machine does.
        self.zone_levels.sort(key=lambda item: len(set(item[1])))
        self.hier_key = [
            tuple(min(bits(zone_of[i])) for _, zone_of in self.zone_levels) + (i,)
            for i in range(n)
        ]
        # Rank of each GPU in hierarchy order: a cheap sort key.
        self.hier_pos = [0] * n
        for pos, v in enumerate(sorted(range(n), key=lambda i: self.hier_key[i])):
            self.hier_pos[v] = pos
        self.no_limit = [self.all_mask] * n  # "any GPU may join", shared, never mutated
        self._small_tables: dict[tuple[Pattern, int], list[tuple[int, int, int, int, tuple[int, ...]]] | None] = {}
        self.links_cache: dict[tuple[int, int], PatternLink] = {}  # see answer.py
        self.placed_cache: dict[tuple[int, int, str | None, int | None], PlacedGpu] = {}  # see answer.placed_gpu
        self.nic_names = [nic.device or nic.name for nic in matrix.nics]
        # NICs known only by nvidia-smi's label (NIC0..., no NIC Legend): NCCL cannot use those.
        self.nics_without_device = frozenset(nic.name for nic in matrix.nics if nic.device is None)
        self._nic_cost: dict[tuple[int, int], tuple[int, float]] = {}
        self._classes: dict[bool, list[tuple[int, tuple[int, ...]]]] = {}
        self.gpu_cpus = [parse_cpulist(g.cpus) if g.cpus else None for g in matrix.gpus]
        distinct: dict[str | None, int] = {}
        self.cpu_list_bit = [1 << distinct.setdefault(g.cpus, len(distinct)) for g in matrix.gpus]
        self._cpus_of: dict[int, str | None] = {}
        self.pos_of = {g.index: pos for pos, g in enumerate(matrix.gpus)}
        self.idle_feasible: dict[tuple[Pattern, int, int], bool] = {}  # see Search
        self.zones_by_level = [sorted(set(zone_of)) for _, zone_of in self.zone_levels]
        # For damage from scratch: zones of several GPUs (a zone per level it is one at),
        # and per level the GPUs that are a zone of their own.
        self.multi_zones = [z for zones in self.zones_by_level for z in zones if z.bit_count() > 1]
        self.single_zones = [
            sum(z for z in zones if z.bit_count() == 1) for zones in self.zones_by_level
        ]
        # Whole zones by name, for "breaks whole free zones" in the answer.
        self.named_zones = [
            (z, self._zone_label(name, z))
            for (name, _), zones in zip(self.zone_levels, self.zones_by_level)
            for z in zones
            if z.bit_count() > 1
        ]
        # The parts of an answer that depend only on the chosen order (see _build).
        self.answer_parts: dict[tuple[tuple[int, ...], Pattern, int, tuple[int, ...] | None], AnswerParts] = {}

    def timed(self, message_bytes: int) -> Prepared:
        """The tables for a latency-bound pattern at ``message_bytes`` (placement.latency):
        these when one message's time orders the links as bandwidth does -- every pair of a
        bandwidth key with one alpha, in the same order, as with no latency measured --
        else ones built for that order, shared by every size giving it."""
        order = sorted(self.edge_classes, key=lambda c: time_key(c[0], c[1], c[2], message_bytes))
        alphas: dict[tuple, set[float]] = {}
        for alpha, gbps, near in self.edge_classes:
            alphas.setdefault((gbps, near), set()).add(alpha)
        if all(len(a) == 1 for a in alphas.values()) and [c[1:] for c in order] == sorted(alphas):
            return self
        signature = tuple(order)
        got = self._timed.get(signature)
        if got is None:
            if len(self._timed) > 8:
                self._timed.clear()
            got = self._timed[signature] = Prepared(self.matrix, self.now, message_bytes)
        return got

    def _zone_label(self, name: str, zone: int) -> str:
        """'GPUs 0,1 (one NV8 zone)' or 'GPUs 0,1 (all of NUMA node 3)': GPU indices
        first, so they cannot be read as NUMA node ids."""
        gpus = "GPUs " + ",".join(str(self.matrix.gpus[v].index) for v in bits(zone))
        if name != "NUMA node":
            return f"{gpus} (one {name})"
        label = numa_label(self, self.numa_of[min(bits(zone))])
        if isinstance(label, int):
            return f"{gpus} (all of NUMA node {label})"
        if label.startswith("cpus:"):
            return f"{gpus} (all sharing CPUs {label[5:]})"
        return f"{gpus} (all of one NUMA node)"

    def cpus_of(self, mask: int) -> str | None:
        """The CPU list close to these GPUs (None when any GPU's is unknown)."""
        # GPUs share few distinct CPU lists (one per socket): key by which ones are in play.
        lists = 0
        for v in bits(mask):
            lists |= self.cpu_list_bit[v]
        got = self._cpus_of.get(lists, "")
        if got == "":
            sets = [self.gpu_cpus[v] for v in bits(mask)]
            known = [c for c in sets if c is not None]
            got = None if len(known) < len(sets) else format_cpulist(set().union(*known))
            self._cpus_of[lists] = got
        return got

    def _components_at_level(self, level: LinkLevel) -> list[int]:
        n = self.n
        limit = level.sort_key()
        adj = [
            sum(1 << j for j in range(n) if j != i and self.matrix.gpu_levels[i][j].sort_key() <= limit)
            for i in range(n)
        ]
        zone_of = [0] * n
        for comp in connected_components(self.all_mask, adj):
            for v in bits(comp):
                zone_of[v] = comp
        return zone_of

    def adj(self, r: int) -> list[int]:
        """Per GPU, the GPUs joined to it by a link whose key ranks at least ``r``."""
        got = self._adj.get(r)
        if got is None:
            got = [
                sum(1 << j for j, rk in enumerate(row) if rk >= r) for row in self.rank
            ]
            self._adj[r] = got
        return got

    def level_adj(self, level: LinkLevel) -> list[int]:
        """Per GPU, the GPUs at least as close as ``level``."""
        key = level.sort_key()
        got = self._level_adj.get(key)
        if got is None:
            got = [
                sum(
                    1 << j
                    for j in range(self.n)
                    if j != i and self.matrix.gpu_levels[i][j].sort_key() <= key
                )
                for i in range(self.n)
            ]
            self._level_adj[key] = got
        return got

    def classes(self, with_nics: bool) -> list[tuple[int, tuple[int, ...]]]:
        """Interchangeable GPUs in hierarchy order, each as (mask, its zone per level).

        Members of a class share their zone at every level, except where each of them is
        a zone of its own (then the level's entry is 0): GPUs with identical rows are
        joined by the same links to everyone else.
        """
        got = self._classes.get(with_nics)
        if got is not None:
            return got
        n = self.n
        assigned = [-1] * n
        classes: list[int] = []
        for u in sorted(range(n), key=lambda i: self.hier_key[i]):
            if assigned[u] >= 0:
                continue
            mask = 1 << u
            for v in range(n):
                if v == u or assigned[v] >= 0 or self.numa_of[u] != self.numa_of[v]:
                    continue
                if with_nics and self.nic_kind[u] != self.nic_kind[v]:
                    continue
                if all(
                    self.rank[u][w] == self.rank[v][w] for w in range(n) if w != u and w != v
                ):
                    mask |= 1 << v
                    assigned[v] = len(classes)
            assigned[u] = len(classes)
            classes.append(mask)
        with_zones = []
        for mask in classes:
            first = (mask & -mask).bit_length() - 1
            zones = tuple(
                zone_of[first] if mask & ~zone_of[first] == 0 else 0 for _, zone_of in self.zone_levels
            )
            for z, (_, zone_of) in zip(zones, self.zone_levels):  # the claim above
                assert z or all(zone_of[v] == 1 << v for v in bits(mask))
            with_zones.append((mask, zones))
        self._classes[with_nics] = with_zones
        return with_zones

    def numa_span(self, groups: int) -> int:
        """Term (2) for a set touching these NUMA groups (a bitmask of group numbers): the
        largest distance between two of them, a group with itself included; 0 when the
        node has no distances (or no group is touched)."""
        got = self._span.get(groups)
        if got is None:
            dist = self.numa_dist
            got = 0
            if dist is not None:
                touched = list(bits(groups))
                got = max(dist[a][b] for a in touched for b in touched)
            self._span[groups] = got
        return got

    def groups_of(self, mask: int) -> int:
        groups = 0
        for v in bits(mask):
            groups |= self.numa_bit[v]
        return groups

    def has_small_table(self, pattern: Pattern, k: int) -> bool:
        return comb(self.n, k) <= SMALL_TABLE_SETS

    def small_table_if_built(self, pattern: Pattern, k: int) -> list[tuple[int, int, int, int, tuple[int, ...]]] | None:
        return self._small_tables.get((pattern, k))

    def built_small_tables(self) -> list[tuple[Pattern, list[tuple[int, int, int, int, tuple[int, ...]]]]]:
        """(pattern, rows) of every small table built so far."""
        return [(pattern, rows) for (pattern, _k), rows in self._small_tables.items() if rows is not None]

    def small_table(
        self, pattern: Pattern, k: int, deadline: Deadline | None = None
    ) -> list[tuple[int, int, int, int, tuple[int, ...]]] | None:
        """Every k-set of the node with its best pattern rank, NUMA distance, NUMA count
        and order, best first -- only where there are at most SMALL_TABLE_SETS of them (8-GPU nodes, and
        k near 1 or n elsewhere).  Built once per (pattern, k); a query then scans it
        instead of searching, which on such nodes is several times faster.  A build the
        deadline stops is not kept."""
        if comb(self.n, k) > SMALL_TABLE_SETS:
            return None
        key = (pattern, k)
        if key in self._small_tables:
            return self._small_tables[key]
        links = k >= 2 and pattern is not Pattern.INDEPENDENT
        by_hier = sorted(range(self.n), key=self.hier_pos.__getitem__)
        rows = []
        for verts in combinations(by_hier, k):
            mask = sum(1 << v for v in verts)
            groups = self.groups_of(mask)
            order: tuple[int, ...] | None
            rank, order = -1, verts
            if links:
                rank, order = self._best_rank(mask, verts, pattern, deadline)
                if order is None:
                    continue
            rows.append((mask, rank, self.numa_span(groups), groups.bit_count(), order))
        rows.sort(key=lambda row: (-row[1], row[2], row[3]))  # stable: hierarchy order on ties
        self._small_tables[key] = rows
        return rows

    def _best_rank(
        self, mask: int, verts: tuple[int, ...], pattern: Pattern, deadline: Deadline | None
    ) -> tuple[int, tuple[int, ...] | None]:
        rank = self.rank
        pairs = [rank[a][b] for i, a in enumerate(verts) for b in verts[i + 1 :]]
        if pattern is Pattern.ALLTOALL:
            return min(pairs), verts
        if len(verts) == 2:
            return pairs[0], tuple(sorted(verts))
        for r in sorted(set(pairs), reverse=True):
            order = self.ham(mask, r, pattern is Pattern.ALLREDUCE, deadline)
            if order is not None:
                return r, order
        return -1, None

    def nic_cost(self, mask: int, wanted: int) -> tuple[int, float]:
        """Term (4): the link kinds of the ``wanted`` NICs closest to these GPUs, summed,
        then (at equal closeness) the most port rate: (kinds, -Gb/s).  NICs are taken
        closest first, faster first at equal closeness.  Only falls as GPUs are added
        (each NIC's kind can only fall), which the branch and bound's bound relies on."""
        key = (mask, wanted)
        got = self._nic_cost.get(key)
        if got is None:
            if len(self._nic_cost) > NIC_COST_MAX:
                self._nic_cost.clear()
            got = self._nic_cost[key] = self._nic_cost_of(mask, wanted)
        return got

    def _nic_cost_of(self, mask: int, wanted: int) -> tuple[int, float]:
        dists = []
        for j, steps in enumerate(self.nic_steps):
            for kv, m in steps:
                if m & mask:
                    dists.append((kv, -self.nic_rate[j]))
                    break
            else:
                if self.nic_usable[j]:
                    dists.append((NO_NIC, -self.nic_rate[j]))
        dists.sort()
        chosen = dists[:wanted]
        return sum(kv for kv, _ in chosen), sum(rate for _, rate in chosen)

    def ham(self, mask: int, r: int, cycle: bool, deadline: Deadline | None = None) -> tuple[int, ...] | None:
        """An order of the GPUs in ``mask`` whose consecutive links all rank >= r, or None."""
        key = (mask, r, cycle)
        if key in self.ham_memo:
            return self.ham_memo[key]
        if len(self.ham_memo) > HAM_MEMO_MAX:
            self.ham_memo.clear()
        result = self._ham_search(mask, self.adj(r), cycle, deadline)
        self.ham_memo[key] = result
        return result

    def _ham_search(self, mask: int, adj: list[int], cycle: bool, deadline: Deadline | None) -> tuple[int, ...] | None:
        verts = sorted(bits(mask), key=self.hier_pos.__getitem__)
        k = len(verts)
        if k == 1:
            return tuple(verts)
        if all((adj[v] & mask) == mask & ~(1 << v) for v in verts):
            return tuple(verts)  # a clique: any order; hierarchy order keeps neighbours close
        if k == 2:
            return None
        degree = {v: (adj[v] & mask).bit_count() for v in verts}
        if min(degree.values()) < (2 if cycle else 1):
            return None
        if not cycle and sum(1 for d in degree.values() if d == 1) > 2:
            return None
        starts = verts[:1] if cycle else sorted(verts, key=lambda v: degree[v])
        rank = self.rank
        for start in starts:
            path = [start]

            def extend(last: int, visited: int) -> bool:
                if deadline is not None:
                    deadline.tick()
                if len(path) == k:
                    return not cycle or bool(adj[last] & (1 << start))
                left = mask & ~visited
                if cycle and not (adj[start] & left):
                    return False
                options = list(bits(adj[last] & left))
                # Fewest onward options first (finds Hamiltonian paths fast), best link first.
                options.sort(key=lambda v: ((adj[v] & left).bit_count(), -rank[last][v]))
                for v in options:
                    path.append(v)
                    if extend(v, visited | (1 << v)):
                        return True
                    path.pop()
                return False

            if extend(start, 1 << start):
                return tuple(path)
        return None


def prepare(matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None) -> Prepared:
    """The matrix's tables, built once per matrix and set of fresh measurements; with
    ``message_bytes``, for a latency-bound pattern at that size (Prepared.timed)."""
    fresh: frozenset = frozenset()
    if matrix.measured or matrix.measured_latency:
        fresh = frozenset(
            key
            for key, m in matrix.measured.items()
            if now is None or now - m.taken_at <= matrix.measurement_max_age_s
        ) | frozenset(
            ("latency", key)
            for key, lat in matrix.measured_latency.items()
            if now is None or now - lat.taken_at <= matrix.measurement_max_age_s
        )
    cache = matrix.derived_cache.setdefault("placement", {})
    prepared = cache.get(fresh)
    if prepared is None:
        if len(cache) > 8:  # measurements aging out one by one: keep a few, not all
            cache.clear()
        prepared = cache[fresh] = Prepared(matrix, now)
    return prepared if message_bytes is None else prepared.timed(message_bytes)


def warm(matrix: DistanceMatrix, budget_s: float = 2.0) -> Prepared:
    """Build the matrix's tables before any request needs them (the agent does this when
    it builds a snapshot, off its event loop): the per-matrix bitmasks, the adjacency at
    every threshold, the classes and the small tables of k-sets.  A small table that does
    not finish within ``budget_s`` is left for requests to build under their deadlines."""
    prep = prepare(matrix, None)
    if prep.n_ranks <= WARM_RANKS_MAX:
        for r in range(prep.n_ranks):
            prep.adj(r)
    prep.classes(False)
    prep.classes(True)
    deadline = Deadline(budget_s)
    try:
        for pattern in Pattern:
            for k in range(1, prep.n + 1):
                if prep.has_small_table(pattern, k):
                    prep.small_table(pattern, k, deadline)
    except DeadlineReached:
        pass
    return prep


# --- the search -----------------------------------------------------------------------


NO_NICS = (0, 0.0)  # term (4) when no NICs are asked for
NO_LIVE_COST = (0, 0)  # term (6) without live signals (placement.live)


@dataclass(slots=True)
class Found:
    mask: int
    order: tuple[int, ...]
    rank: int | None
    key: tuple[int, int, tuple[int, float], int, tuple[int, int]]  # terms (2)-(6): distance, nodes, NICs, damage, live
    loss: int | None = None  # partner loss, computed when a tie needs it

    @property
    def numa_distance(self) -> int:
        return self.key[0]

    @property
    def numa_nodes(self) -> int:
        return self.key[1]

    @property
    def nic_cost(self) -> int:
        return self.key[2][0]

    @property
    def damage(self) -> int:
        return self.key[3]


class Search:
    """Branch and bound over interchangeable-GPU classes at one bandwidth threshold."""

    def __init__(
        self,
        prep: Prepared,
        req: Request,
        free_all: int,
        candidates: int,
        include: int,
        deadline: Deadline | None = None,
        live: LiveCosts | None = None,
    ):
        self.prep = prep
        self.deadline = deadline
        self.live = live  # term (6): unverified GPUs, NIC traffic now (placement.live)
        # What run() leaves when the deadline stopped it: proven False, the best set found
        # at any threshold, and the best threshold not ruled out (its bandwidth bounds
        # every set's; None when links do not matter or nothing was ruled in).
        self.proven = True
        self.best_so_far: Found | None = None
        self.best_value = -2
        self.bound_rank: int | None = None
        self.req = req
        self.k = req.gpus
        self.nics = req.nics
        self.free_all = free_all  # not busy: what damage is measured against
        self.candidates = candidates  # not busy, not excluded
        self.include = include
        self.h_adj = prep.level_adj(req.min_level) if req.min_level else None
        self.zone_free_count: dict[int, int] = {}  # zone mask -> its free GPUs
        self.zone_f2: list[tuple[int, int]] | None = None  # (zone, 2 x its free GPUs)
        self.partner: tuple[dict[int, int], dict[int, int], dict[int, int]] | None = None

    def links_needed(self) -> bool:
        return self.k >= 2 and self.req.pattern is not Pattern.INDEPENDENT

    @property
    def bandwidth_bound_gbps(self) -> float | None:
        return None if self.bound_rank is None else self.prep.rank_gbps[self.bound_rank]

    def run(self) -> Found | None:
        """The best set; when the deadline stops the search first, the best set found so
        far (``proven`` False), or None when none was found in time."""
        self.best: Found | None = None
        try:
            return self._run()
        except DeadlineReached:
            self.proven = False
            self._offer(self.best)  # the threshold being searched when time ran out
            if self.best_so_far is not None and self.deadline is not None:
                self.deadline.bound_gbps = self.bandwidth_bound_gbps
            return self.best_so_far

    def _run(self) -> Found | None:
        prep = self.prep
        pattern = self.req.pattern
        if prep.has_small_table(pattern, self.k):
            built = prep.small_table_if_built(pattern, self.k)
            if built is None:
                # Not warmed (or dropped): have an answer before building it under the deadline.
                if self._seed() is None:
                    return None  # none at the lowest threshold: the table would hold none
                built = prep.small_table(pattern, self.k, self.deadline)
            assert built is not None  # has_small_table said so
            return self._scan(built)
        if not self.links_needed():
            self._seed()
            return self._search_at(None, stop_at_first=False)
        present = self._ranks_present()
        if not present:
            return None
        # A first answer at the lowest threshold (every link qualifies): a best-fit descent.
        # No set there means no set at all (feasibility only falls as the threshold rises).
        if self._seed(present) is None:
            return None
        # Feasibility falls as the threshold rises: find the best feasible one.
        if len(present) <= 8:
            for r in reversed(present):
                self.bound_rank = r  # every better threshold is ruled out
                if not self._feasible_on_idle_node(r):
                    continue
                found = self._search_at(r, stop_at_first=False)
                if found is not None:
                    return found
            return None
        lo, hi = 0, len(present) - 1  # present ascending; find the highest feasible
        self.bound_rank = present[hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._feasible_on_idle_node(present[mid]) and (
                self._offer(self._search_at(present[mid], stop_at_first=True)) is not None
            ):
                lo = mid
            else:
                hi = mid - 1
                self.bound_rank = present[hi]
        return self._search_at(present[lo], stop_at_first=False)

    def _seed(self, present: list[int] | None = None) -> Found | None:
        """A first answer, found before the deadline is looked at: the first leaf of a
        best-fit descent at the lowest threshold, which every link meets, so it needs no
        backtracking.  With a ``min_level`` a set is a clique of close pairs and finding one
        may take long: that descent keeps to the deadline."""
        if self.links_needed():
            present = present if present is not None else self._ranks_present()
            if not present:
                return None
            self.bound_rank = present[-1]  # no set beats its best link
        r = present[0] if present else None
        deadline = self.deadline
        cheap = deadline is not None and self.h_adj is None
        if cheap:
            assert deadline is not None
            deadline.suspended = True
        try:
            return self._offer(self._search_at(r, stop_at_first=True))
        finally:
            if cheap:
                assert deadline is not None
                deadline.suspended = False

    def _offer(self, found: Found | None) -> Found | None:
        """Keep ``found`` as the best so far when its own order's bandwidth is higher, or
        equal with better later terms."""
        if found is not None:
            value = self._order_rank(found.order)
            best = self.best_so_far
            if best is None or value > self.best_value or (value == self.best_value and found.key < best.key):
                self.best_so_far, self.best_value = found, value
        return found

    def _order_rank(self, order: tuple[int, ...]) -> int:
        """The rank of the weakest link the pattern uses in this order (-1: no links)."""
        if not self.links_needed() or len(order) < 2:
            return -1
        rank = self.prep.rank
        pattern = self.req.pattern
        if pattern is Pattern.ALLTOALL:
            return min(rank[a][b] for i, a in enumerate(order) for b in order[i + 1 :])
        steps = list(pairwise(order))
        if pattern is Pattern.ALLREDUCE and len(order) >= 3:
            steps.append((order[-1], order[0]))
        return min(rank[a][b] for a, b in steps)

    def _scan(self, table: list[tuple[int, int, int, int, tuple[int, ...]]]) -> Found | None:
        """The best set from the node's table of all k-sets (see Prepared.small_table)."""
        cand = self.candidates | self.include
        include = self.include
        single_numa = self.req.single_numa
        h = self.h_adj
        nics = self.nics
        best: Found | None = None
        group = None
        for mask, rank, span, numa, order in table:
            if mask & ~cand or include & ~mask or (single_numa and numa > 1):
                continue
            if h is not None and any((h[v] | 1 << v) & mask != mask for v in order):
                continue
            if best is not None and (rank, span, numa) != group:
                break  # sorted by (bandwidth, NUMA distance, NUMA nodes): the rest are worse
            nic = self.prep.nic_cost(mask, nics) if nics else NO_NICS
            if best is not None and nic > best.key[2]:
                continue
            key = (span, numa, nic, self._damage_of(mask), self._live_cost(mask))
            if best is None or key < best.key:
                best = Found(mask, order, rank, key)
                best_loss = None
                group = (rank, span, numa)
            elif key == best.key and best_loss != 0:
                # (5) among equals: leave each free GPU its best free partner.
                if best_loss is None:
                    best_loss = self._partner_loss(best.mask)
                    if best_loss == 0:
                        continue  # nothing to improve on
                loss = self._partner_loss(mask)
                if loss < best_loss:
                    best = Found(mask, order, rank, key)
                    best_loss = loss
        return best

    def _live_cost(self, mask: int) -> tuple[int, int]:
        return self.live.cost(mask) if self.live else NO_LIVE_COST

    def _best_loss(self, best: Found) -> int:
        if best.loss is None:
            best.loss = self._partner_loss(best.mask)
        return best.loss

    def _partner_loss(self, mask: int) -> int:
        """Tie-break (5): how much taking ``mask`` lowers, summed over the GPUs left free,
        the rank of each one's best link to another free GPU.  Only GPUs whose best free
        partners all go with ``mask`` lose anything, so only those are looked at."""
        if self.partner is None:
            best: dict[int, int] = {}
            top: dict[int, int] = {}
            exact = self.prep.rank_exact
            for v in bits(self.free_all):
                others = self.free_all & ~(1 << v)
                best[v], top[v] = -1, 0
                for r in range(len(exact) - 1, -1, -1):
                    if exact[r][v] & others:
                        best[v], top[v] = r, exact[r][v] & others
                        break
            self.partner = (best, top, {})
        best, top, dependents = self.partner
        affected = 0
        for u in bits(mask):
            dep = dependents.get(u)
            if dep is None:
                dep = dependents[u] = sum(1 << v for v, t in top.items() if t >> u & 1)
            affected |= dep
        loss = 0
        left = self.free_all & ~mask
        exact = self.prep.rank_exact
        for v in bits(affected & ~mask):
            if top[v] & ~mask:
                continue  # a best partner stays free
            others = left & ~(1 << v)
            after = -1
            for r in range(best[v] - 1, -1, -1):
                if exact[r][v] & others:
                    after = r
                    break
            loss += best[v] - after
        return loss

    def _feasible_on_idle_node(self, r: int) -> bool:
        """Whether any k GPUs of the whole node carry the pattern at threshold ``r``.

        Busy GPUs and constraints only remove sets, so a threshold no set of the idle
        node reaches is skipped at once (remembered per matrix): without this the search
        would try every set before learning that, e.g., a DGX-1 has no all-NV2 ring of 4.
        """
        key = (self.req.pattern, self.k, r)
        got = self.prep.idle_feasible.get(key)
        if got is None:
            idle = Search(
                self.prep, Request(gpus=self.k, pattern=self.req.pattern), self.prep.all_mask, self.prep.all_mask, 0,
                self.deadline,
            )
            got = self.prep.idle_feasible[key] = idle._search_at(r, stop_at_first=True) is not None
        return got

    def _ranks_present(self) -> list[int]:
        """The ranks of links among the candidates (that min_level allows), ascending."""
        cand = self.candidates
        verts = list(bits(cand))
        h = self.h_adj
        present = []
        for r, exact in enumerate(self.prep.rank_exact):
            if h is None:
                if any(exact[v] & cand for v in verts):
                    present.append(r)
            elif any(exact[v] & h[v] & cand for v in verts):
                present.append(r)
        return present

    def _search_at(self, r: int | None, stop_at_first: bool) -> Found | None:
        prep = self.prep
        k = self.k
        pattern = self.req.pattern
        n = prep.n
        h = self.h_adj
        if r is None:
            eff = list(h) if h is not None else None
        else:
            adj = prep.adj(r)
            eff = [adj[i] & h[i] for i in range(n)] if h is not None else adj
        # Degree core: a ring member needs 2 good links inside the set, a path member 1,
        # an all-to-all member k-1.
        need = 0
        if r is not None:
            need = {Pattern.ALLREDUCE: 2, Pattern.PIPELINE: 1, Pattern.ALLTOALL: k - 1}[pattern]
            need = min(need, k - 1)
        elif h is not None:
            need = k - 1  # min_level: the set is a clique of close-enough pairs
        verts = self.candidates
        if need:
            assert eff is not None  # need > 0 only with a level (r) or a min_level (h)
            changed = True
            while changed:
                changed = False
                for v in bits(verts):
                    if (eff[v] & verts).bit_count() < need:
                        verts &= ~(1 << v)
                        changed = True
        if self.include & ~verts:
            return None
        if verts.bit_count() < k:
            return None
        comps = [verts] if eff is None else connected_components(verts, eff)
        comps = [c for c in comps if c.bit_count() >= k and not (self.include & ~c)]
        if not comps:
            return None
        # Per GPU, which other GPUs may join it.
        allowed = prep.no_limit
        if h is not None:
            allowed = [h[i] for i in range(n)]
        if r is not None and pattern is Pattern.ALLTOALL:
            assert eff is not None  # a level's adjacency, set above whenever r is
            allowed = [allowed[i] & eff[i] for i in range(n)]
        if self.req.single_numa:
            allowed = [allowed[i] & prep.numa_masks[prep.numa_of[i]] for i in range(n)]
        self.allowed = allowed
        self.r = r
        self.check_order = r is not None and pattern in (Pattern.ALLREDUCE, Pattern.PIPELINE) and k >= 3
        self.best = None
        self.stop_at_first = stop_at_first
        classes_all = prep.classes(self.nics > 0)
        for comp in comps:
            start = self.include
            cand = comp & ~start
            ok = True
            for v in bits(start):
                cand &= allowed[v]
                if (start & ~(1 << v)) & ~allowed[v]:
                    ok = False
            if not ok:
                continue
            self.classes = self._ordered_classes(classes_all, cand, k - start.bit_count())
            dmg = self.damage_add(0, start)
            self._branch(0, start, k - start.bit_count(), cand, dmg)
            if self.best is not None and stop_at_first:
                break
        return self.best

    def _ordered_classes(
        self, classes_all: list[tuple[int, tuple[int, ...]]], cand: int, rem: int
    ) -> list[tuple[int, tuple[int, ...]]]:
        """The classes to branch on, best-fit first so the first answer found is good and
        the bounds cut early: NUMA nodes that can hold the whole job, fewest candidates
        first; then the others, nearest (NUMA distance) to the one with most candidates
        first, then most candidates first.  Hierarchy order within a node."""
        prep = self.prep
        counts = [(g & cand).bit_count() for g in prep.numa_masks]
        dist = prep.numa_dist
        anchor = max(range(len(counts)), key=counts.__getitem__)
        group_key = []
        for gi, c in enumerate(counts):
            near = dist[anchor][gi] if dist is not None else 0
            group_key.append((0, 0, c) if c >= rem else (1, near, -c))
        ordered = [(m & cand, zones) for m, zones in classes_all if m & cand]
        if len(group_key) > 1:
            numa_of = prep.numa_of
            ordered.sort(key=lambda item: group_key[numa_of[(item[0] & -item[0]).bit_length() - 1]])
        return ordered

    def _free_in(self, zone: int) -> int:
        got = self.zone_free_count.get(zone)
        if got is None:
            got = self.zone_free_count[zone] = (zone & self.free_all).bit_count()
        return got

    def damage_add(self, taken: int, add: int) -> int:
        """Damage of taking ``add`` on top of ``taken``: sum of f^2 - (f-s)^2 increments."""
        cost = 0
        for _, zone_of in self.prep.zone_levels:
            t = taken
            for v in bits(add):
                z = zone_of[v]
                cost += 2 * (self._free_in(z) - (t & z).bit_count()) - 1
                t |= 1 << v
        return cost

    def _damage_of(self, mask: int) -> int:
        """Damage of taking ``mask``: sum over zones of f^2 - (f-s)^2 = s * (2f - s);
        a zone of one GPU costs 1 when taken."""
        zone_f2 = self.zone_f2
        if zone_f2 is None:
            zone_f2 = self.zone_f2 = [(z, 2 * (z & self.free_all).bit_count()) for z in self.prep.multi_zones]
        cost = 0
        for z, f2 in zone_f2:
            s = (z & mask).bit_count()
            if s:
                cost += s * (f2 - s)
        for single in self.prep.single_zones:
            cost += (single & mask).bit_count()
        return cost

    def _class_damage(self, zones: tuple[int, ...], taken: int, c: int) -> int:
        """Damage of taking ``c`` GPUs of one class on top of ``taken``."""
        cost = 0
        for z in zones:
            if z:
                cost += c * (2 * (self._free_in(z) - (taken & z).bit_count()) - c)
            else:
                cost += c  # each member is a zone of its own at this level
        return cost

    def _damage_bound(self, taken: int, cand: int, rem: int) -> int:
        """Least damage of adding ``rem`` more GPUs from ``cand`` (per level; levels add).

        Taking a of the c candidates left in a zone with L = f - s free and untaken costs
        g(a) = a * (2L - a), concave in a.  A concave sum over "take rem in all" is least
        at a vertex: every zone taken whole or not at all, except at most one.  With up to
        three zones in play the vertices are few and we try them all (exact); otherwise
        g(a) >= a * (2L - c), the per-GPU cost of taking the whole zone, and filling the
        cheapest zones first with those rates is a lower bound.
        """
        total = 0
        counts = self.zone_free_count
        for zones in self.prep.zones_by_level:
            parts = []
            for z in zones:
                c = (z & cand).bit_count()
                if c:
                    f = counts.get(z)
                    if f is None:
                        f = counts[z] = (z & self.free_all).bit_count()
                    parts.append((2 * (f - (taken & z).bit_count()) - c, c))  # (rate, c)
            if len(parts) <= 3:
                total += _least_concave_fill(parts, rem)
                continue
            parts.sort()
            need = rem
            for rate, c in parts:
                if c >= need:
                    total += need * rate
                    break
                total += c * rate
                need -= c
        return total

    def _distance_bound(self, taken: int, cand: int, rem: int) -> int:
        """Least NUMA distance of adding ``rem`` more GPUs from ``cand``: the span of what
        is taken (it only grows), or, when the groups already touched cannot hold the
        rest, the least span of those plus one more group."""
        prep = self.prep
        touched = prep.groups_of(taken)
        span = prep.numa_span(touched)
        cap = 0
        for gi in bits(touched):
            cap += (prep.numa_masks[gi] & cand).bit_count()
        if rem <= cap:
            return span
        least = 1 << 30
        for gi, g in enumerate(prep.numa_masks):
            if g & cand and not touched >> gi & 1:
                least = min(least, prep.numa_span(touched | 1 << gi))
        return least

    def _numa_bound(self, taken: int, cand: int, rem: int) -> int:
        touched = 0
        cap = 0
        others = []
        for g in self.prep.numa_masks:
            if g & taken:
                touched += 1
                cap += (g & cand).bit_count()
            else:
                c = (g & cand).bit_count()
                if c:
                    others.append(c)
        need = rem - cap
        if need > 0:
            others.sort(reverse=True)
            for c in others:
                touched += 1
                need -= c
                if need <= 0:
                    break
            else:
                return 1 << 30
        return touched

    def _branch(self, ci: int, taken: int, rem: int, cand: int, dmg: int) -> None:
        if self.deadline is not None:
            self.deadline.tick()
        if rem == 0:
            self._leaf(taken, dmg)
            return
        if cand.bit_count() < rem:
            return
        best = self.best
        if best is not None:
            if self.stop_at_first:
                return
            # The bound, one term at a time: later terms only matter on a tie.
            best_span, best_numa, best_nic, best_dmg, best_live = best.key
            span = self._distance_bound(taken, cand, rem) if self.prep.numa_dist is not None else 0
            if span > best_span:
                return
            if span == best_span:
                numa = self._numa_bound(taken, cand, rem)
                if numa > best_numa:
                    return
                if numa == best_numa:
                    nic = self.prep.nic_cost(taken | cand, self.nics) if self.nics else NO_NICS
                    if nic > best_nic:
                        return
                    if nic == best_nic:
                        least = dmg + self._damage_bound(taken, cand, rem)
                        # Term (6) only grows as GPUs are added: what is taken bounds it.
                        if least > best_dmg or (least == best_dmg and self._live_cost(taken) >= best_live):
                            return
        classes = self.classes
        while ci < len(classes) and not (classes[ci][0] & cand):
            ci += 1
        if ci >= len(classes):
            return
        class_mask, zones = classes[ci]
        members = list(bits(class_mask & cand))
        if self.live:  # a class's members differ only in term (6): the cheapest go first
            members.sort(key=self.live.of.__getitem__)
        rest = cand & ~class_mask
        allowed = self.allowed
        top = min(len(members), rem)
        if top >= 2 and not (allowed[members[0]] >> members[1] & 1):
            top = 1  # all pairs inside a class are alike: if one pair may not join, none may
        for c in range(top, -1, -1):
            pick = 0
            nxt = rest
            for v in members[:c]:
                pick |= 1 << v
                nxt &= allowed[v]
            added = self._class_damage(zones, taken, c) if c else 0
            self._branch(ci + 1, taken | pick, rem - c, nxt, dmg + added)
            if self.best is not None and self.stop_at_first:
                return

    def _leaf(self, taken: int, dmg: int) -> None:
        prep = self.prep
        order: tuple[int, ...] | None
        if self.check_order:
            assert self.r is not None  # check_order is only ever set with a level
            order = prep.ham(taken, self.r, self.req.pattern is Pattern.ALLREDUCE, self.deadline)
            if order is None:
                return
        elif self.r is not None and self.k == 2:
            order = tuple(sorted(bits(taken)))
            a, b = order
            if prep.rank[a][b] < self.r:
                return
        else:
            order = tuple(sorted(bits(taken), key=prep.hier_pos.__getitem__))
        groups = prep.groups_of(taken)
        nic = prep.nic_cost(taken, self.nics) if self.nics else NO_NICS
        key = (prep.numa_span(groups), groups.bit_count(), nic, dmg, self._live_cost(taken))
        best = self.best
        if best is None or key < best.key:
            self.best = Found(taken, order, self.r, key)
        elif key == best.key and self._best_loss(best) != 0:
            loss = self._partner_loss(taken)  # (5), among the equals visited
            if loss < self._best_loss(best):
                self.best = Found(taken, order, self.r, key, loss)


def _least_concave_fill(parts: list[tuple[int, int]], rem: int) -> int:
    """min sum of a_i * (rate_i + c_i - a_i) over 0 <= a_i <= c_i, sum a_i = rem, by
    trying the vertices (all zones whole or empty but one); 0 if rem cannot be met
    (the caller's other checks reject that case)."""
    best = None
    m = len(parts)
    for subset in range(1 << m):
        whole = 0
        cost = 0
        for i in range(m):
            if subset >> i & 1:
                rate, c = parts[i]
                whole += c
                cost += c * rate
        left = rem - whole
        if left < 0:
            continue
        if left == 0:
            best = cost if best is None or cost < best else best
            continue
        for i in range(m):
            if not subset >> i & 1:
                rate, c = parts[i]
                if left < c:
                    value = cost + left * (rate + c - left)
                    best = value if best is None or value < best else best
    return best if best is not None else 0


def numa_label(prep: Prepared, group: int) -> int | str:
    """How an answer names a NUMA group: its node id, else ``cpus:<list>``, else unknown."""
    kind, value = prep.numa_keys[group]
    return value if kind == "numa" else (f"cpus:{value}" if kind == "cpus" else "unknown")
