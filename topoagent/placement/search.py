"""The search: per-matrix tables, bandwidth thresholds, interchangeable-GPU classes,
branch and bound, and the Hamiltonian ring/path search.  See the package docstring for
the objective it is exact for.

Everything here works on GPU *positions* (rows of the DistanceMatrix, bits of a mask);
nvidia-smi indices appear only where a request or an answer is read or written.

Anytime, under a deadline (Search.run):
1. a first set at the lowest threshold, which every link meets: the first leaf of the
   best-fit descent, found without looking at the clock;
2. bandwidth first, cheaply (a step budget each, proving nothing): by halving over the
   thresholds, the highest at which a ring, path or clique grows over all candidates;
   there, a set on one NUMA node or on a pair or triple of near ones;
3. the exact search: thresholds above that one, best first, then that one with the cheap
   set's key as a cutoff -- only branches strictly worse than that set are cut, and the
   optimum is no worse than it, so every set the answer is chosen among (the optimum and
   its equals, in the same order) is still visited and the answer is the same, sooner.
When the deadline stops it, the answer is the best set found, not proven, and the bound is
the best threshold not yet ruled out.  Rings and paths also cut branches that cannot be
completed (members short of links, runs of members apart), which changes no answer.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from itertools import accumulate, combinations, pairwise
from math import comb
from time import monotonic
from typing import TYPE_CHECKING, Any, Protocol

from topoagent.node.cpulist import format_cpulist, parse_cpulist
from topoagent.node.levels import LinkLevel
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES, time_key
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


def connected_components(verts: int, adjacency: list[int], start: int = 0) -> list[int]:
    """The connected components (as GPU bitmasks) of the graph restricted to ``verts``;
    with ``start`` (a GPU's bit), only the one holding it."""
    comps = []
    remaining = start or verts
    while remaining:
        comp = frontier = remaining & -remaining
        while frontier:
            reach = 0
            while frontier:  # the hot loop of the search: bits() inlined
                low = frontier & -frontier
                frontier ^= low
                reach |= adjacency[low.bit_length() - 1]
            frontier = reach & verts & ~comp
            comp |= frontier
        comps.append(comp)
        remaining = 0 if start else remaining & ~comp
    return comps


def biconnected_blocks(verts: int, adjacency: list[int]) -> list[int]:
    """The blocks (biconnected components, as GPU bitmasks) of the graph restricted to
    ``verts``: every cycle lies inside one block, so a ring of k GPUs lies inside a block
    of k or more (Tarjan's low points, depth first without recursion)."""
    disc: dict[int, int] = {}
    low: dict[int, int] = {}
    blocks: list[int] = []
    edges: list[tuple[int, int]] = []
    for root in bits(verts):
        if root in disc:
            continue
        disc[root] = low[root] = len(disc)
        stack = [(root, -1, adjacency[root] & verts)]
        while stack:
            v, parent, rest = stack[-1]
            if rest:
                w_bit = rest & -rest
                stack[-1] = (v, parent, rest ^ w_bit)
                w = w_bit.bit_length() - 1
                if w not in disc:
                    edges.append((v, w))
                    disc[w] = low[w] = len(disc)
                    stack.append((w, v, adjacency[w] & verts))
                elif w != parent and disc[w] < disc[v]:
                    edges.append((v, w))
                    low[v] = min(low[v], disc[w])
                continue
            stack.pop()
            if not stack:
                continue
            u = stack[-1][0]
            low[u] = min(low[u], low[v])
            if low[v] >= disc[u]:  # u separates v's subtree: the edges since (u, v) are a block
                block = 0
                while True:
                    a, b = edges.pop()
                    block |= 1 << a | 1 << b
                    if (a, b) == (u, v):
                        break
                blocks.append(block)
    return blocks


NO_NIC = 99
_MISSING = object()  # a memo's "not there" (None is an answer)


class DeadlineReached(Exception):
    """The search's time is up: the caller answers with the best set found so far."""


clock = monotonic  # what a Deadline reads; tests put a clock that counts steps here


class Deadline:
    """A point on the monotonic clock a search stops at.  The clock is read every
    CHECK_EVERY steps (a step is one branch or one Hamiltonian extension: a few to a
    hundred microseconds at 128 GPUs): cheap next to the search, finer than 0.5 ms."""

    CHECK_EVERY = 4
    # The search stops this much before the deadline (half of it at most): building the
    # answer from the set takes ~0.1 ms for one GPU and 1-5 ms for 64 (ranks, bindings,
    # launch forms; the more the busier the machine).
    ANSWER_RESERVE_S = 0.0015
    ANSWER_RESERVE_PER_GPU_S = 0.0001

    def __init__(self, seconds: float, gpus: int = 1):
        self.seconds = seconds
        reserve = self.ANSWER_RESERVE_S + gpus * self.ANSWER_RESERVE_PER_GPU_S
        self.at = clock() + seconds - min(reserve, seconds / 2)
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
            if self.reached or clock() >= self.at:
                self.reached = True
                raise DeadlineReached

    def check(self) -> None:
        """Read the clock now: for work in coarse steps (a GPU's row of a matrix's tables,
        about 0.4 ms at 128 GPUs), where every fourth step would be too late."""
        if self.reached or clock() >= self.at:
            self.reached = True
            raise DeadlineReached


def _no_check() -> None:
    """Deadline.check where there is no deadline (warm(), requests without one)."""


class StepsSpent(Exception):
    """A heuristic's step budget is spent: the search it serves goes on without its set."""


class StepBudget:
    """A number of search steps for a cheap try (a first answer at a threshold), counted
    inside the search's own deadline: a deterministic bound, whatever the machine's load."""

    def __init__(self, steps: int, deadline: Deadline | None):
        self.left = steps
        self.deadline = deadline

    def tick(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise StepsSpent
        if self.deadline is not None:
            self.deadline.tick()


class Ticker(Protocol):
    """What a search calls once per step: a Deadline or a StepBudget."""

    def tick(self) -> None: ...


SMALL_TABLE_SETS = 128  # most k-sets a node may have for place() to scan a table of them
# Caps on the per-matrix memos, so a node's tables stay a few MB at 128 GPUs (bench/placement.py
# measures them): past a cap a memo starts again empty, costing time, never answers.
HAM_MEMO_MAX = 50_000
WARM_RANKS_MAX = 64  # thresholds whose adjacency warm() builds ahead (n masks each)
NIC_COST_MAX = 50_000
FIRST_SET_STEPS = 400  # per cheap try at a threshold (Search._first_set_at): about a millisecond
FIRST_SET_UNIONS = 12  # pairs and triples of NUMA nodes tried there
FIRST_SET_NODES = 4  # single NUMA nodes tried there, best fit first
# Most links among the candidates for which a ring search first splits them into blocks
# (linear in the links; denser sets are cliques or near them and one block anyway).
BLOCKS_EDGES_MAX = 1500


class Prepared:
    """Everything about a matrix the search reads, as bitmasks over GPU positions."""

    def __init__(
        self, matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None, deadline: Deadline | None = None
    ):
        """``deadline``: a request's, when it builds the tables itself (a latency order
        warm() did not build): the build stops with DeadlineReached, and nothing is kept."""
        n = matrix.size
        check = deadline.check if deadline is not None else _no_check
        self.n = n
        # Weak: the matrix keeps its tables (derived_cache), and a strong link back would
        # make a cycle that only Python's full collection frees -- a pause of tens of ms
        # in whichever request comes after a snapshot is replaced.  Without the cycle the
        # old tables go the moment the old snapshot does.
        self.matrix: DistanceMatrix = weakref.proxy(matrix)
        self._matrix_ref = weakref.ref(matrix)  # the matrix itself, for timed() tables (no proxy of a proxy)
        self.now = now
        self.all_mask = (1 << n) - 1
        levels = matrix.gpu_levels
        # Edge key: bandwidth first, then closeness of the level (NV18 > NV2 > PIX > PXB ...);
        # with ``message_bytes`` (latency-bound patterns) one message's time first (placement.latency).
        self.message_bytes = message_bytes
        bw: list[list[float]] = []
        self.alpha: list[list[float]] = []  # placement.latency
        closeness: list[list[tuple[int, ...]]] = []
        edge: list[list[tuple]] = []
        for i in range(n):  # row by row, so a request's deadline is looked at while building
            check()
            bw_i = [matrix.bandwidth(i, j, now) or 0.0 for j in range(n)]
            alpha_i = [matrix.latency_us(i, j, now) for j in range(n)]
            near_i = [tuple(-x for x in levels[i][j].sort_key()) for j in range(n)]
            bw.append(bw_i)
            self.alpha.append(alpha_i)
            closeness.append(near_i)
            edge.append([
                (bw_i[j], near_i[j]) if message_bytes is None else time_key(alpha_i[j], bw_i[j], near_i[j], message_bytes)
                for j in range(n)
            ])
        self.bw = bw
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
            check()
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
            zone_of = self._components_at_level(level, check)
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

    def timed(self, message_bytes: int, deadline: Deadline | None = None) -> Prepared:
        """The tables for a latency-bound pattern at ``message_bytes`` (placement.latency):
        these when one message's time orders the links as bandwidth does -- every pair of a
        bandwidth key with one alpha, in the same order, as with no latency measured --
        else ones built for that order, shared by every size giving it.  warm() builds
        them for the default size; a request building others keeps to its ``deadline``
        (DeadlineReached: tens of ms at 128 GPUs, and nothing is kept)."""
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
            matrix = self._matrix_ref()
            assert matrix is not None  # alive while its tables are asked for (self.matrix would be a proxy)
            got = self._timed[signature] = Prepared(matrix, self.now, message_bytes, deadline)
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

    def _components_at_level(self, level: LinkLevel, check: Callable[[], None]) -> list[int]:
        n = self.n
        limit = level.sort_key()
        adj = []
        for i in range(n):
            check()  # see __init__'s deadline
            adj.append(sum(1 << j for j in range(n) if j != i and self.matrix.gpu_levels[i][j].sort_key() <= limit))
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
        """The NUMA groups (a bitmask of group numbers) the GPUs ``mask`` touch."""
        groups = 0
        if len(self.numa_masks) < mask.bit_count():  # the fewer loops: groups or GPUs
            for gi, g in enumerate(self.numa_masks):
                if g & mask:
                    groups |= 1 << gi
            return groups
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
        self, pattern: Pattern, k: int, deadline: Ticker | None = None
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
        self, mask: int, verts: tuple[int, ...], pattern: Pattern, deadline: Ticker | None
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

    def ham(self, mask: int, r: int, cycle: bool, deadline: Ticker | None = None) -> tuple[int, ...] | None:
        """An order of the GPUs in ``mask`` whose consecutive links all rank >= r, or None."""
        key = (mask, r, cycle)
        # One lookup, not a test then a read: another thread may clear the memo between them.
        got = self.ham_memo.get(key, _MISSING)
        if got is not _MISSING:
            return got  # type: ignore[return-value]
        if len(self.ham_memo) > HAM_MEMO_MAX:
            self.ham_memo.clear()
        result = self._ham_search(mask, self.adj(r), cycle, deadline)
        self.ham_memo[key] = result
        return result

    def _ham_search(self, mask: int, adj: list[int], cycle: bool, deadline: Ticker | None) -> tuple[int, ...] | None:
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
        if len(connected_components(mask, adj)) > 1:
            return None  # without this a split set is refuted only by trying every path
        # Taking one GPU out of a ring leaves a path: one piece (a path, at most two).  A
        # GPU whose removal splits the set further is refuted here in a few microseconds;
        # the path search below takes tens to learn it (most sets a sparse mesh refutes).
        for v in verts:
            rest = mask & ~(1 << v)
            if len(connected_components(rest, adj)) > (1 if cycle else 2):
                return None
        starts = verts[:1] if cycle else sorted(verts, key=lambda v: degree[v])
        if not cycle and degree[starts[0]] == 1:
            starts = starts[:1]  # a GPU with one link ends every path: the one start to try
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
                if left & ~connected_components(left | 1 << last, adj, 1 << last)[0]:
                    return False  # the rest cannot all be reached from here
                # Each GPU still to visit has two path neighbours among the rest, the last
                # visited and (a ring) the start -- but for the one that ends a path.
                around = left | 1 << last | (1 << start if cycle else 0)
                ends = 0
                for v in bits(left):
                    if (adj[v] & around).bit_count() < 2:
                        ends += 1
                        if cycle or ends > 1:
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


def prepare(
    matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None, deadline: Deadline | None = None
) -> Prepared:
    """The matrix's tables, built once per matrix and set of fresh measurements; with
    ``message_bytes``, for a latency-bound pattern at that size (Prepared.timed, whose
    build keeps to ``deadline``: the bandwidth tables' does not, warm() builds them)."""
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
    return prepared if message_bytes is None else prepared.timed(message_bytes, deadline)


def warm(matrix: DistanceMatrix, budget_s: float = 2.0) -> Prepared:
    """Build the matrix's tables before any request needs them (the agent does this when
    it builds a snapshot, off its event loop): the per-matrix bitmasks, the adjacency at
    every threshold, the classes and the small tables of k-sets -- and, when measured
    latencies reorder the links for alltoall and pipeline at the default message size,
    the same for that order (Prepared.timed), which a request would otherwise build
    itself (tens of ms at 128 GPUs).  A small table that does not finish within
    ``budget_s`` is left for requests to build under their deadlines."""
    prep = prepare(matrix, None)
    deadline = Deadline(budget_s)
    _warm_prepared(prep, tuple(Pattern), deadline)
    timed = prep.timed(LATENCY_BOUND_MESSAGE_BYTES)
    if timed is not prep:
        _warm_prepared(timed, tuple(p for p in Pattern if p.latency_bound), deadline)
    return prep


def _warm_prepared(prep: Prepared, patterns: tuple[Pattern, ...], deadline: Deadline) -> None:
    if prep.n_ranks <= WARM_RANKS_MAX:
        for r in range(prep.n_ranks):
            prep.adj(r)
    prep.classes(False)
    prep.classes(True)
    try:
        for pattern in patterns:
            for k in range(1, prep.n + 1):
                if prep.has_small_table(pattern, k):
                    prep.small_table(pattern, k, deadline)
    except DeadlineReached:
        pass


# --- the search -----------------------------------------------------------------------


NO_NICS = (0, 0.0)  # term (4) when no NICs are asked for
NO_LIVE_COST = (0, 0)  # term (6) without live signals (placement.live)

# A set's score, terms (2)-(6) of the objective: NUMA distance, NUMA nodes, NICs, damage, live.
Key = tuple[int, int, tuple[int, float], int, tuple[int, int]]


@dataclass(slots=True)
class Found:
    mask: int
    order: tuple[int, ...]
    rank: int | None
    key: Key  # terms (2)-(6): distance, nodes, NICs, damage, live
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
        steps: StepBudget | None = None,
    ):
        self.prep = prep
        self.deadline = deadline
        self.live = live  # term (6): unverified GPUs, NIC traffic now (placement.live)
        self.ticker: Ticker | None = steps if steps is not None else deadline  # called once per step
        # The key of a set known at the threshold being searched (a cheap first answer's):
        # branches that cannot come within it are cut.  Cut only when strictly worse, so
        # the optimum and its equals are still visited in the same order (see _cut): the
        # same answer.  Only sets worse than the cutoff, never the answer, go unvisited.
        self.cutoff: Key | None = None
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
        seed = self._seed(present)
        if seed is None:
            return None
        # Then bandwidth first, cheaply (proving nothing): by halving, the highest threshold
        # at which a set can be grown over all candidates; there, a set on fewer or nearer
        # NUMA nodes.  A good answer is in hand early, and the exact search below starts
        # with its key as a cutoff.
        lo, known = 0, seed
        hi = len(present) - 1 if self.k > 2 else 0  # a pair: the exact search is as quick
        while lo < hi:
            mid = (lo + hi + 1) // 2
            found = self._offer(self._cheap_set(present[mid], self.candidates | self.include))
            if found is None:
                hi = mid - 1
            else:
                lo, known = mid, found
        closer = self._offer(self._first_set_at(present[lo])) if lo else None
        if closer is not None and closer.key < known.key:
            known = closer
        # Feasibility falls as the threshold rises: find the best feasible one, above lo.
        if len(present) - lo <= 8:
            for i in range(len(present) - 1, lo, -1):
                r = present[i]
                self.bound_rank = r  # every better threshold is ruled out
                if not self._feasible_on_idle_node(r):
                    continue
                found = self._search_at(r, stop_at_first=False)
                if found is not None:
                    return found
        else:
            hi = len(present) - 1  # present ascending; find the highest feasible
            self.bound_rank = present[hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                found = self._search_at(present[mid], stop_at_first=True) if self._feasible_on_idle_node(present[mid]) else None
                if self._offer(found) is not None:
                    assert found is not None
                    lo, known = mid, found
                else:
                    hi = mid - 1
                    self.bound_rank = present[hi]
        self.bound_rank = present[lo]
        return self._search_at(present[lo], stop_at_first=False, cutoff=known.key)

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

    def _first_set_at(self, r: int) -> Found | None:
        """A set at threshold ``r`` found cheaply, or None (which proves nothing).  Where
        NUMA nodes can hold the job alone: the first set of a best-fit descent in each
        (fewest candidates first), the best kept.  Else over growing groups of nodes,
        nearest the one with most candidates first: a ring, path or clique grown link by
        link (_grow).  Each try has FIRST_SET_STEPS steps."""
        prep = self.prep
        cand = self.candidates | self.include
        counts = [(g & cand).bit_count() for g in prep.numa_masks]
        holding = sorted((c, gi) for gi, c in enumerate(counts) if c >= self.k and not self.include & ~prep.numa_masks[gi])
        best: Found | None = None
        for _, gi in holding[:FIRST_SET_NODES]:
            sub = Search(
                prep, self.req, self.free_all, self.candidates & prep.numa_masks[gi], self.include, self.deadline,
                self.live, StepBudget(FIRST_SET_STEPS, self.deadline),
            )
            try:
                found = sub._search_at(r, stop_at_first=True)
            except StepsSpent:
                continue
            if found is not None and (best is None or found.key < best.key):
                best = found
        if best is not None or self.req.single_numa:
            return best
        for union in self._unions(counts):
            found = self._cheap_set(r, union & cand)
            if found is not None:
                return found
        return None

    def _cheap_set(self, r: int, pool: int) -> Found | None:
        """A set of ``pool`` at threshold ``r`` within FIRST_SET_STEPS steps, or None: grown
        link by link, or, for a ring or path that must hold ``include``, the first set of a
        best-fit descent."""
        steps = StepBudget(FIRST_SET_STEPS, self.deadline)
        try:
            if self.include and self.req.pattern is not Pattern.ALLTOALL:
                sub = Search(
                    self.prep, self.req, self.free_all, pool & self.candidates, self.include, self.deadline, self.live, steps
                )
                return sub._search_at(r, stop_at_first=True)
            return self._grow(r, pool, steps)
        except StepsSpent:
            return None

    def _unions(self, counts: list[int]) -> list[int]:
        """Groups of NUMA nodes that can hold the job, as GPU masks, best first: pairs and
        triples by the NUMA distance and count they span, most candidates first (the first
        FIRST_SET_UNIONS of them), then the nodes nearest the one with most candidates,
        one more at a time."""
        prep = self.prep
        include = self.include
        live = [gi for gi, c in enumerate(counts) if c]
        combos = []
        for size in (2, 3):
            for combo in combinations(live, size):
                mask = sum(prep.numa_masks[gi] for gi in combo)
                held = sum(counts[gi] for gi in combo)
                if held >= self.k and not include & ~mask:
                    combos.append((prep.numa_span(sum(1 << gi for gi in combo)), size, -held, mask))
            if len(combos) >= FIRST_SET_UNIONS:
                break
        tries = [mask for *_, mask in sorted(combos)[:FIRST_SET_UNIONS]]
        anchor = max(range(len(counts)), key=counts.__getitem__)
        dist = prep.numa_dist
        near = sorted(range(len(counts)), key=lambda gi: (dist[anchor][gi] if dist else gi != anchor, -counts[gi]))
        union = held = 0
        for gi in near:
            union |= prep.numa_masks[gi]
            held += counts[gi]
            if held >= self.k and not include & ~union and union not in tries:
                tries.append(union)
        return tries

    def _grow(self, r: int, pool: int, steps: StepBudget) -> Found | None:
        """k GPUs of ``pool`` holding the pattern at threshold ``r``, grown from one GPU
        (every ``include`` GPU first): a path extended depth first by the GPU with fewest
        onward links (closing the ring at the end), or for all-to-all a clique grown by
        the GPU joined to most of the rest.  None when ``steps`` run out first."""
        prep = self.prep
        k = self.k
        adj = prep.adj(r)
        h = self.h_adj
        eff = [adj[v] & h[v] for v in range(prep.n)] if h is not None else adj
        numa_masks, numa_of = prep.numa_masks, prep.numa_of
        single = self.req.single_numa
        include = self.include
        # Only GPUs with enough links in the pool (a ring member 2, a path's 1, a clique's
        # k - 1), in a component of k or more: where none is left, no set grows (at once).
        cycle = self.req.pattern is Pattern.ALLREDUCE and k >= 3
        need = k - 1 if self.req.pattern is Pattern.ALLTOALL else min(2 if cycle else 1, k - 1)
        peeled = True
        while peeled:
            peeled = False
            for v in bits(pool):
                steps.tick()
                if (eff[v] & pool).bit_count() < need:
                    pool &= ~(1 << v)
                    peeled = True
        pool = sum(c for c in connected_components(pool, eff) if c.bit_count() >= k and not include & ~c)
        if cycle and pool and sum((eff[v] & pool).bit_count() for v in bits(pool)) <= 2 * BLOCKS_EDGES_MAX:
            blocks = [b for b in biconnected_blocks(pool, eff) if b.bit_count() >= k and not include & ~b]
            pool = 0  # blocks share cut vertices: their union, not their sum
            for b in blocks:
                pool |= b
        if not pool:
            return None
        if self.req.pattern is Pattern.ALLTOALL:
            for start in bits(include or pool):
                steps.tick()
                taken = include | 1 << start
                left = pool & ~taken
                for v in bits(taken):
                    left &= eff[v]
                if single:
                    left &= numa_masks[numa_of[start]]
                while taken.bit_count() < k and left:
                    steps.tick()
                    v = max(bits(left), key=lambda u: (eff[u] & left).bit_count())
                    taken |= 1 << v
                    left &= eff[v]
                if taken.bit_count() == k and self._meets(taken, r):
                    return self._found(taken, tuple(sorted(bits(taken), key=prep.hier_pos.__getitem__)), r)
            return None
        if include:
            return None  # a path through every named GPU: left to the exact search
        path: list[int] = []

        def extend(last: int, room: int) -> bool:
            """``room``: the GPUs that may still join (unvisited; with a min_level, close
            to every GPU on the path)."""
            steps.tick()
            if len(path) == k:
                return not cycle or bool(eff[last] >> path[0] & 1)
            left = room
            options = eff[last] & left
            if cycle and len(path) == k - 1:
                options &= eff[path[0]]
            # Fewest onward links first (long paths are found fast), same NUMA node first.
            for v in sorted(bits(options), key=lambda u: (numa_of[u] != numa_of[path[0]], (eff[u] & left).bit_count())):
                path.append(v)
                if extend(v, room & ~(1 << v) & (h[v] if h is not None else room)):
                    return True
                path.pop()
            return False

        # One start per NUMA node, fewest candidates first (best fit: the path keeps to its
        # start's node first), each with its own steps; the best set kept.  Then, if none
        # grew, every other GPU, most links first, on the steps left.
        by_links = sorted(bits(pool), key=lambda u: -(eff[u] & pool).bit_count())
        firsts: dict[int, int] = {}
        for u in by_links:
            firsts.setdefault(numa_of[u], u)
        per_node = sorted(firsts.values(), key=lambda u: (numa_masks[numa_of[u]] & pool).bit_count())[:FIRST_SET_NODES]
        best: Found | None = None
        for start in per_node + [u for u in by_links if u not in per_node]:
            if best is not None and start not in per_node:
                break
            path[:] = [start]
            room = pool & ~(1 << start) & (h[start] if h is not None else pool)
            if single:
                room &= numa_masks[numa_of[start]]
            try:
                grown = extend(start, room)
            except StepsSpent:
                if start in per_node:
                    steps.left = FIRST_SET_STEPS
                    continue
                raise
            if start in per_node:
                steps.left = FIRST_SET_STEPS
            taken = sum(1 << v for v in path)
            if grown and self._meets(taken, None):
                found = self._found(taken, tuple(path), r)
                if best is None or found.key < best.key:
                    best = found
        return best

    def _meets(self, taken: int, r: int | None) -> bool:
        """Whether the GPUs ``taken`` meet the request's constraints and (with ``r``, an
        all-to-all set) every pair threshold ``r``: checked whole, since a cheap set
        becomes the exact search's cutoff and a wrong one would hide the answer."""
        prep = self.prep
        if taken & ~(self.candidates | self.include) or self.include & ~taken:
            return False
        if self.req.single_numa and prep.groups_of(taken).bit_count() > 1:
            return False
        h = self.h_adj
        adj = prep.adj(r) if r is not None else None
        return all(
            (adj is None or (adj[v] | 1 << v) & taken == taken) and (h is None or (h[v] | 1 << v) & taken == taken)
            for v in bits(taken)
        )

    def _found(self, taken: int, order: tuple[int, ...], r: int) -> Found:
        """``taken`` in ``order`` as the search scores a set (terms 2-6)."""
        prep = self.prep
        groups = prep.groups_of(taken)
        nic = prep.nic_cost(taken, self.nics) if self.nics else NO_NICS
        key = (prep.numa_span(groups), groups.bit_count(), nic, self._damage_of(taken), self._live_cost(taken))
        return Found(taken, order, r, key)

    def _search_at(self, r: int | None, stop_at_first: bool, cutoff: Key | None = None) -> Found | None:
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
        # A ring or path at r: every member needs `need` links at r inside the set, and the
        # set lies in one component of those links; _branch cuts branches that cannot --
        # unless every pair of candidates qualifies, when there is nothing to cut (and the
        # checks would cost O(k) a branch: 30 ms for 64 of 128 GPUs).
        self.eff = None
        if self.check_order:
            assert eff is not None  # check_order is only ever set with a level
            if any((eff[v] | 1 << v) & verts != verts for v in bits(verts)):
                self.eff = eff
        ring = self.eff
        if (
            ring is not None and pattern is Pattern.ALLREDUCE
            and sum((ring[v] & verts).bit_count() for v in bits(verts)) <= 2 * BLOCKS_EDGES_MAX
        ):
            # A ring lies inside one block of its links: a mesh with failed links often has
            # no block of k, which proves at once what the search would take every set to.
            comps = [
                b for c in comps for b in biconnected_blocks(c, ring)
                if b.bit_count() >= k and not (self.include & ~b)
            ]
            if not comps:
                return None
        self.need = need
        self.best = None
        self.cutoff = None if stop_at_first else cutoff
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
        if self.ticker is not None:
            self.ticker.tick()
        if rem == 0:
            self._leaf(taken, dmg)
            return
        if cand.bit_count() < rem:
            return
        best = self.best
        if best is not None and self.stop_at_first:
            return
        forced = 0  # GPUs every ring or path completing this branch holds
        eff = self.eff
        if eff is not None and taken:
            # No ring/path at r can be completed: such a branch holds no set, so cutting it
            # changes no answer.  In a ring, the members taken lie in runs between the rem
            # GPUs still to come (at most rem runs, a path rem + 1), each run inside one
            # component of the links among them; each member has 2 ring links (a path's
            # two ends 1), those not among the taken go to the rem newcomers, 2 each.
            need = self.need
            ends = 0 if self.req.pattern is Pattern.ALLREDUCE else 2
            reach = taken | cand
            # A candidate with fewer than `need` links among what can still be in the
            # set is in no ring or path of it: peel such candidates until none is left.
            peeled = True
            while peeled:
                peeled = False
                left = reach & ~taken
                while left:
                    low = left & -left
                    left ^= low
                    if (eff[low.bit_length() - 1] & reach).bit_count() < need:
                        reach ^= low
                        peeled = True
            cand = reach & ~taken
            if cand.bit_count() < rem:
                return
            short = 0
            left = taken
            while left:
                low = left & -left
                left ^= low
                v = low.bit_length() - 1
                links = eff[v] & reach
                degree = links.bit_count()
                if degree < need:
                    return
                if degree == need:
                    forced |= links  # every link it has left is one it needs
                inside = (eff[v] & taken).bit_count()
                if inside < 2:
                    short += 2 - inside
            forced &= ~taken
            if short > 2 * rem + ends or forced.bit_count() > rem:
                return
            if len(connected_components(taken, eff)) > rem + ends // 2:
                return
            comp = connected_components(reach, eff, taken & -taken)[0]
            if taken & ~comp or comp.bit_count() < self.k:
                return
        cutoff = self.cutoff
        if cutoff is not None and (best is None or cutoff < best.key):
            if self._cut(taken, cand, rem, dmg, forced, cutoff, strict=True):
                return
        elif best is not None and self._cut(taken, cand, rem, dmg, forced, best.key, strict=False):
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

    def _cut(
        self, taken: int, cand: int, rem: int, dmg: int, forced: int, limit: Key, strict: bool
    ) -> bool:
        """Whether no completion of ``taken`` from ``cand`` (holding ``forced``) can beat
        ``limit`` (or, strict, equal it): the bound, one term at a time -- later terms only
        matter on a tie."""
        if forced:
            dmg += self.damage_add(taken, forced)
            taken |= forced
            cand &= ~forced
            rem -= forced.bit_count()
        limit_span, limit_numa, limit_nic, limit_dmg, limit_live = limit
        span = self._distance_bound(taken, cand, rem) if self.prep.numa_dist is not None else 0
        if span != limit_span:
            return span > limit_span
        numa = self._numa_bound(taken, cand, rem)
        if numa != limit_numa:
            return numa > limit_numa
        nic = self.prep.nic_cost(taken | cand, self.nics) if self.nics else NO_NICS
        if nic != limit_nic:
            return nic > limit_nic
        least = dmg + self._damage_bound(taken, cand, rem)
        if least != limit_dmg:
            return least > limit_dmg
        # Term (6) only grows as GPUs are added: what is taken bounds it.
        live = self._live_cost(taken)
        return live > limit_live if strict else live >= limit_live

    def _leaf(self, taken: int, dmg: int) -> None:
        prep = self.prep
        order: tuple[int, ...] | None
        if self.check_order:
            assert self.r is not None  # check_order is only ever set with a level
            order = prep.ham(taken, self.r, self.req.pattern is Pattern.ALLREDUCE, self.ticker)
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
    m = len(parts)
    if m <= 2:  # the common case (two NUMA nodes), directly: the concave cost of one
        # zone's share is least at an end of its range
        if m == 0:
            return 0
        (rate0, c0), (rate1, c1) = parts if m == 2 else (parts[0], (0, 0))
        lo, hi = max(0, rem - c1), min(c0, rem)
        if lo > hi:
            return 0
        return min(a * (rate0 + c0 - a) + (rem - a) * (rate1 + c1 - rem + a) for a in (lo, hi))
    best = None
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
