"""The placement core: which k GPUs of this node a job should get, in which rank order.

``place(matrix, request, busy) -> Placement | NoFit`` is pure: it reads a DistanceMatrix,
a Request and the set of busy GPU indices, and returns a value.  The HTTP endpoint, the
CLI and the lease manager are thin shells over it.

Objective (lexicographic; an earlier term always wins over a later one)
-----------------------------------------------------------------------
1. **Pattern bandwidth**, maximised.  Every GPU pair has an edge key
   ``(bandwidth, closeness)``: bandwidth is the measured GB/s when fresh, else the level's
   expected GB/s; at equal bandwidth the closer level wins (so from an nvidia-smi matrix
   alone NV n beats every PCIe level and more NVLinks beat fewer, and PIX beats PXB).
   The pattern's value is the key of its weakest link: for ``allreduce`` the best ring
   (a Hamiltonian cycle through the set; bottleneck), for ``pipeline`` the best path, for
   ``alltoall`` the weakest pair.  ``independent`` jobs and single GPUs have no links.
2. **Fewest NUMA nodes** (sockets) spanned.  A GPU's NUMA node is the one nvidia-smi or
   sysfs reports; when only the CPU affinity is known, GPUs with the same CPU list count
   as one node.
3. **NIC affinity**, only when ``nics`` > 0: the sum of the link-kind distances of the
   ``nics`` NICs closest to the set (each NIC's distance is its closest GPU in the set).
4. **Least damage to what stays free**: for every zone of the node -- NUMA nodes and the
   connected groups at each link level (NVLink zones, PCIe switches, host bridges) --
   taking ``s`` of the zone's ``f`` free GPUs costs ``f^2 - (f-s)^2``.  Minimising it is
   best fit: take from the most used zone (this applies to k=1 too) and keep whole zones
   whole for later large jobs.
5. **Deterministic tie-break**: leave each GPU that stays free its best link to another
   free GPU (least *partner loss*: summed over the GPUs left free, how far the rank of
   each one's best free link falls).  Where zones say nothing -- on a DGX-1 hybrid cube
   mesh every NVLink graph is connected, so its only zones are the sockets -- this keeps
   NV2 pairs whole for later 2-GPU jobs.  Then the first set in search order.  On nodes
   answered from a table (below) the partner rule is applied to every tied set; in the
   branch and bound, to the tied sets it visits.

Terms (1) and (2) are exact -- the global optimum over all k-subsets, not a heuristic --
and so are (3) and (4) given (1)-(2).  The search never enumerates partitions:

* Small nodes.  Where a node has at most ``SMALL_TABLE_SETS`` k-sets (every k on an
  8-GPU node; k near 1 or n on larger ones) the per-matrix tables hold every k-set with
  its best pattern rank, order and NUMA count, best first; a query scans it, skipping
  busy and disallowed sets, and stops at the first worse (bandwidth, NUMA) group.
* Thresholds.  Feasibility of (1) is monotone in the threshold, so the search walks the
  distinct edge keys from best to worst (binary search when there are many) and, at each
  threshold ``t``, works on the graph of links at least as good as ``t``.  A ring needs
  every member to have two such links inside the set and the whole set inside one
  connected component, so a degree core and the components discard most thresholds in a
  few bit operations; a threshold that no k-set of the idle node reaches is remembered
  and skipped.
* Symmetry.  GPUs whose rows are identical (same key to every other GPU, same NUMA node,
  same NIC distances when NICs matter) are interchangeable; the search picks a *count*
  from each such class instead of subsets of it (an 8-GPU NVSwitch node has two classes,
  one per socket, when NICs do not matter).
* Branch and bound over classes, NUMA nodes that can hold the job first (best fit), with
  lower bounds taken one term at a time for (2) (NUMA nodes touched plus the fewest
  further nodes that can hold the rest), (3) (the NIC cost of everything still allowed --
  it only falls as GPUs are added) and (4): taking a of a zone's c remaining candidates
  costs a(2L - a) with L its free untaken GPUs, concave in a, so the least completion has
  every zone taken whole or not at all but one -- tried exactly when at most three zones
  are in play, else bounded by the whole-zone rate 2L - c per GPU.  A memoised
  Hamiltonian check runs at the leaves for sets whose links at ``t`` are not a clique.

Everything that depends only on the matrix (bitmasks, classes, tables, answer pieces) is
built once per matrix and kept in its ``derived_cache``.

The node ``score`` is ``10 x quality - loss``: quality is the pattern bandwidth in GB/s
(absolute, so comparable across nodes; 0 for jobs without links), loss is the number of
extra NUMA nodes spanned plus the number of whole zones the placement breaks.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import combinations
from math import comb
from typing import Any

from topoagent.cpulist import format_cpulist, parse_cpulist
from topoagent.levels import LevelError, LevelKind, LinkLevel, nv
from topoagent.matrix import DistanceMatrix

PATTERNS = ("allreduce", "alltoall", "pipeline", "independent")
REQUEST_FIELDS = ("gpus", "pattern", "min_level", "single_numa", "include", "exclude", "nics")


class RequestError(ValueError):
    """A request field is invalid; ``field`` names it."""

    def __init__(self, field_name: str, message: str):
        self.field = field_name
        self.message = message
        super().__init__(f"{field_name}: {message}")


def _parse_min_level(value: Any) -> LinkLevel | None:
    if value is None or isinstance(value, LinkLevel):
        return value
    if not isinstance(value, str):
        raise RequestError("min_level", f"expected a link level such as 'NV' or 'PIX', got {value!r}")
    if value.strip().upper() == "NV":
        return nv(1)  # "any NVLink"
    try:
        level = LinkLevel.parse(value)
    except LevelError as exc:
        raise RequestError("min_level", str(exc)) from None
    if level.kind in (LevelKind.SELF, LevelKind.NET_SUBNET, LevelKind.NET_OTHER):
        raise RequestError("min_level", f"{value!r} is not a level between two GPUs of a node")
    return level


def _index_tuple(field_name: str, value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise RequestError(field_name, f"expected a list of GPU indices, got {value!r}")
    out = []
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise RequestError(field_name, f"{item!r} is not a GPU index")
        out.append(item)
    if len(set(out)) != len(out):
        raise RequestError(field_name, "lists a GPU twice")
    return tuple(sorted(out))


@dataclass(frozen=True, slots=True)
class Request:
    """What a job asks for.  Construction validates; a bad field raises RequestError."""

    gpus: int
    pattern: str = "allreduce"
    min_level: LinkLevel | None = None  # every pair at least this close (NV = any NVLink)
    single_numa: bool = False
    include: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    nics: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise RequestError("gpus", f"expected a whole number >= 1, got {self.gpus!r}")
        if self.pattern not in PATTERNS:
            raise RequestError("pattern", f"{self.pattern!r} is not one of {', '.join(PATTERNS)}")
        object.__setattr__(self, "min_level", _parse_min_level(self.min_level))
        if not isinstance(self.single_numa, bool):
            raise RequestError("single_numa", f"expected true or false, got {self.single_numa!r}")
        object.__setattr__(self, "include", _index_tuple("include", self.include))
        object.__setattr__(self, "exclude", _index_tuple("exclude", self.exclude))
        if set(self.include) & set(self.exclude):
            both = sorted(set(self.include) & set(self.exclude))
            raise RequestError("include", f"GPU {both[0]} is both included and excluded")
        if len(self.include) > self.gpus:
            raise RequestError("include", f"lists {len(self.include)} GPUs but only {self.gpus} requested")
        if isinstance(self.nics, bool) or not isinstance(self.nics, int) or self.nics < 0:
            raise RequestError("nics", f"expected a whole number >= 0, got {self.nics!r}")

    @classmethod
    def from_json(cls, obj: Any) -> Request:
        """From a JSON object; unknown keys are errors (a typo must not be ignored)."""
        if not isinstance(obj, dict):
            raise RequestError("request", "expected a JSON object")
        unknown = sorted(set(obj) - set(REQUEST_FIELDS))
        if unknown:
            raise RequestError(unknown[0], "unknown request field")
        if "gpus" not in obj:
            raise RequestError("gpus", "missing")
        return cls(**obj)

    def to_json(self) -> dict[str, Any]:
        return {
            "gpus": self.gpus,
            "pattern": self.pattern,
            "min_level": str(self.min_level) if self.min_level else None,
            "single_numa": self.single_numa,
            "include": list(self.include),
            "exclude": list(self.exclude),
            "nics": self.nics,
        }


@dataclass(frozen=True, slots=True)
class PlacedGpu:
    rank: int
    index: int
    uuid: str | None
    pci_address: str | None
    numa_node: int | None
    nearest_nics: tuple[str, ...]  # RDMA device names of the closest NICs
    nic_level: LinkLevel | None  # how close those NICs are

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "index": self.index,
            "uuid": self.uuid,
            "pci_address": self.pci_address,
            "numa_node": self.numa_node,
            "nearest_nics": list(self.nearest_nics),
            "nic_level": str(self.nic_level) if self.nic_level else None,
        }


@dataclass(frozen=True, slots=True)
class PatternLink:
    a: int  # GPU indices
    b: int
    level: LinkLevel
    gbps: float


@dataclass(frozen=True, slots=True)
class Objective:
    """The terms of the objective for one answer (see the module docstring)."""

    bandwidth_gbps: float | None  # (1), None when the pattern has no links
    bottleneck_level: LinkLevel | None  # (1), the level of the weakest pattern link
    numa_nodes: int  # (2)
    nic_cost: int  # (3), 0 when no NICs were asked for
    damage: int  # (4)

    def to_json(self) -> dict[str, Any]:
        return {
            "bandwidth_gbps": self.bandwidth_gbps,
            "bottleneck_level": str(self.bottleneck_level) if self.bottleneck_level else None,
            "numa_nodes": self.numa_nodes,
            "nic_cost": self.nic_cost,
            "damage": self.damage,
        }


@dataclass(frozen=True, slots=True)
class Placement:
    request: Request
    gpus: tuple[PlacedGpu, ...]  # in rank order
    bandwidth_gbps: float | None
    worst_level: LinkLevel | None
    links: tuple[PatternLink, ...]
    numa_nodes: tuple[int | str, ...]
    cpus: str | None
    nics: tuple[str, ...]  # the NICs chosen for the job (``nics`` asked), else nearest ones
    env: dict[str, str]
    numactl: tuple[str, ...]
    score: float
    objective: Objective
    broken_zones: tuple[str, ...]
    explain: tuple[str, ...]

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "fit": True,
            "gpus": [g.to_json() for g in self.gpus],
            "pattern": self.request.pattern,
            "bandwidth_gbps": self.bandwidth_gbps,
            "worst_level": str(self.worst_level) if self.worst_level else None,
            "links": [
                {"a": ln.a, "b": ln.b, "level": str(ln.level), "gbps": ln.gbps} for ln in self.links
            ],
            "numa_nodes": list(self.numa_nodes),
            "cpus": self.cpus,
            "nics": list(self.nics),
            "env": dict(self.env),
            "numactl": list(self.numactl),
            "score": self.score,
            "objective": self.objective.to_json(),
            "broken_zones": list(self.broken_zones),
            "explain": list(self.explain),
            "request": self.request.to_json(),
        }


@dataclass(frozen=True, slots=True)
class NoFit:
    request: Request
    reason: str
    constraint: str  # the request field that cannot hold: gpus, include, min_level, ...
    free: tuple[int, ...]
    best_available: Placement | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "fit": False,
            "reason": self.reason,
            "constraint": self.constraint,
            "free": list(self.free),
            "best_available": self.best_available.to_json() if self.best_available else None,
            "request": self.request.to_json(),
        }


# --- per-matrix preparation (cached; independent of the request and of busy GPUs) ---------


def _bits(mask: int) -> Iterator[int]:
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
            for v in _bits(frontier):
                reach |= adjacency[v]
            frontier = reach & verts & ~comp
            comp |= frontier
        comps.append(comp)
        remaining &= ~comp
    return comps


_NO_NIC = 99
SMALL_TABLE_SETS = 128  # most k-sets a node may have for place() to scan a table of them


class _Prepared:
    """Everything about a matrix the search reads, as bitmasks over GPU positions."""

    def __init__(self, matrix: DistanceMatrix, now: float | None):
        n = matrix.size
        self.n = n
        self.matrix = matrix
        self.all_mask = (1 << n) - 1
        levels = matrix.gpu_levels
        bw = [[matrix.bandwidth(i, j, now) or 0.0 for j in range(n)] for i in range(n)]
        self.bw = bw
        # Edge key: bandwidth first, then closeness of the level (NV18 > NV2 > PIX > PXB ...).
        keys = {
            (bw[i][j], tuple(-x for x in levels[i][j].sort_key()))
            for i in range(n)
            for j in range(n)
            if i != j
        }
        ordered = sorted(keys)
        index_of = {key: r for r, key in enumerate(ordered)}
        self.rank = [
            [
                index_of[(bw[i][j], tuple(-x for x in levels[i][j].sort_key()))] if i != j else -1
                for j in range(n)
            ]
            for i in range(n)
        ]
        self.n_ranks = len(ordered)
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

        # GPU -> NIC distance as a LevelKind number; per NIC, the GPUs within each kind.
        self.nic_kind = [
            [
                int(lv.kind) if lv is not None else _NO_NIC
                for lv in (matrix.gpu_nic_levels[i] if matrix.gpu_nic_levels else ())
            ]
            for i in range(n)
        ]
        n_nics = len(matrix.nics) if matrix.gpu_nic_levels else 0
        self.n_nics = n_nics
        self.nic_steps: list[list[tuple[int, int]]] = []
        for j in range(n_nics):
            kinds = sorted({self.nic_kind[i][j] for i in range(n)})
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
            tuple(min(_bits(zone_of[i])) for _, zone_of in self.zone_levels) + (i,)
            for i in range(n)
        ]
        # Rank of each GPU in hierarchy order: a cheap sort key.
        self.hier_pos = [0] * n
        for pos, v in enumerate(sorted(range(n), key=lambda i: self.hier_key[i])):
            self.hier_pos[v] = pos
        self.no_limit = [self.all_mask] * n  # "any GPU may join", shared, never mutated
        self._small_tables: dict[tuple[str, int], list | None] = {}
        self._links: dict[tuple[int, int], PatternLink] = {}
        self._placed: dict[tuple[int, int], PlacedGpu] = {}
        self.nic_names = [nic.device or nic.name for nic in matrix.nics]
        # NICs known only by nvidia-smi's label (NIC0..., no NIC Legend): NCCL cannot use those.
        self.nics_without_device = frozenset(nic.name for nic in matrix.nics if nic.device is None)
        self._nic_cost: dict[tuple[int, int], int] = {}
        self._classes: dict[bool, list[tuple[int, tuple[int, ...]]]] = {}
        self.gpu_cpus = [parse_cpulist(g.cpus) if g.cpus else None for g in matrix.gpus]
        distinct: dict[str | None, int] = {}
        self.cpu_list_bit = [1 << distinct.setdefault(g.cpus, len(distinct)) for g in matrix.gpus]
        self._cpus_of: dict[int, str | None] = {}
        self.pos_of = {g.index: pos for pos, g in enumerate(matrix.gpus)}
        self.idle_feasible: dict[tuple[str, int, int], bool] = {}  # see _Search
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
        self.answer_parts: dict[tuple[tuple[int, ...], str, int], _AnswerParts] = {}

    def _zone_label(self, name: str, zone: int) -> str:
        """'GPUs 0,1 (one NV8 zone)' or 'GPUs 0,1 (all of NUMA node 3)': GPU indices
        first, so they cannot be read as NUMA node ids."""
        gpus = "GPUs " + ",".join(str(self.matrix.gpus[v].index) for v in _bits(zone))
        if name != "NUMA node":
            return f"{gpus} (one {name})"
        label = _numa_label(self, self.numa_of[min(_bits(zone))])
        if isinstance(label, int):
            return f"{gpus} (all of NUMA node {label})"
        if label.startswith("cpus:"):
            return f"{gpus} (all sharing CPUs {label[5:]})"
        return f"{gpus} (all of one NUMA node)"

    def pattern_link(self, a: int, b: int) -> PatternLink:
        got = self._links.get((a, b))
        if got is None:
            m = self.matrix
            got = self._links[(a, b)] = PatternLink(
                m.gpus[a].index, m.gpus[b].index, m.gpu_levels[a][b], round(self.bw[a][b], 2)
            )
        return got

    def placed_gpu(self, v: int, rank_no: int) -> PlacedGpu:
        """GPU ``v`` as an answer lists it at rank ``rank_no``, with its closest NICs."""
        got = self._placed.get((v, rank_no))
        if got is None:
            g = self.matrix.gpus[v]
            kinds = self.nic_kind[v]
            nearest: tuple[str, ...] = ()
            nic_level = None
            if kinds and min(kinds) < _NO_NIC:
                best_kind = min(kinds)
                nearest = tuple(self.nic_names[j] for j, kv in enumerate(kinds) if kv == best_kind)
                nic_level = next(
                    self.matrix.gpu_nic_levels[v][j] for j, kv in enumerate(kinds) if kv == best_kind
                )
            got = self._placed[(v, rank_no)] = PlacedGpu(
                rank_no, g.index, g.uuid, g.pci_address, g.numa_node, nearest, nic_level
            )
        return got

    def cpus_of(self, mask: int) -> str | None:
        """The CPU list close to these GPUs (None when any GPU's is unknown)."""
        # GPUs share few distinct CPU lists (one per socket): key by which ones are in play.
        lists = 0
        for v in _bits(mask):
            lists |= self.cpu_list_bit[v]
        got = self._cpus_of.get(lists, "")
        if got == "":
            sets = [self.gpu_cpus[v] for v in _bits(mask)]
            got = None if any(c is None for c in sets) else format_cpulist(set().union(*sets))
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
            for v in _bits(comp):
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
                assert z or all(zone_of[v] == 1 << v for v in _bits(mask))
            with_zones.append((mask, zones))
        self._classes[with_nics] = with_zones
        return with_zones

    def small_table(self, pattern: str, k: int) -> list[tuple[int, int, int, tuple[int, ...]]] | None:
        """Every k-set of the node with its best pattern rank, NUMA count and order, best
        first -- only where there are at most SMALL_TABLE_SETS of them (8-GPU nodes, and
        k near 1 or n elsewhere).  Built once per (pattern, k); a query then scans it
        instead of searching, which on such nodes is several times faster."""
        if comb(self.n, k) > SMALL_TABLE_SETS:
            return None
        key = (pattern, k)
        if key in self._small_tables:
            return self._small_tables[key]
        links = k >= 2 and pattern != "independent"
        by_hier = sorted(range(self.n), key=self.hier_pos.__getitem__)
        rows = []
        for verts in combinations(by_hier, k):
            mask = sum(1 << v for v in verts)
            numa = sum(1 for g in self.numa_masks if g & mask)
            rank, order = -1, verts
            if links:
                rank, order = self._best_rank(mask, verts, pattern)
                if order is None:
                    continue
            rows.append((mask, rank, numa, order))
        rows.sort(key=lambda row: (-row[1], row[2]))  # stable: hierarchy order on ties
        self._small_tables[key] = rows
        return rows

    def _best_rank(self, mask: int, verts: tuple[int, ...], pattern: str) -> tuple[int, tuple[int, ...] | None]:
        rank = self.rank
        pairs = [rank[a][b] for i, a in enumerate(verts) for b in verts[i + 1 :]]
        if pattern == "alltoall":
            return min(pairs), verts
        if len(verts) == 2:
            return pairs[0], tuple(sorted(verts))
        for r in sorted(set(pairs), reverse=True):
            order = self.ham(mask, r, pattern == "allreduce")
            if order is not None:
                return r, order
        return -1, None

    def nic_cost(self, mask: int, wanted: int) -> int:
        """Term (3): the link kinds of the ``wanted`` NICs closest to these GPUs, summed."""
        key = (mask, wanted)
        got = self._nic_cost.get(key)
        if got is None:
            if len(self._nic_cost) > 100_000:
                self._nic_cost.clear()
            got = self._nic_cost[key] = self._nic_cost_of(mask, wanted)
        return got

    def _nic_cost_of(self, mask: int, wanted: int) -> int:
        dists = []
        for steps in self.nic_steps:
            for kv, m in steps:
                if m & mask:
                    dists.append(kv)
                    break
            else:
                dists.append(_NO_NIC)
        dists.sort()
        return sum(dists[:wanted])

    def ham(self, mask: int, r: int, cycle: bool) -> tuple[int, ...] | None:
        """An order of the GPUs in ``mask`` whose consecutive links all rank >= r, or None."""
        key = (mask, r, cycle)
        if key in self.ham_memo:
            return self.ham_memo[key]
        if len(self.ham_memo) > 200_000:
            self.ham_memo.clear()
        result = self._ham_search(mask, self.adj(r), cycle)
        self.ham_memo[key] = result
        return result

    def _ham_search(self, mask: int, adj: list[int], cycle: bool) -> tuple[int, ...] | None:
        verts = sorted(_bits(mask), key=self.hier_pos.__getitem__)
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
                if len(path) == k:
                    return not cycle or bool(adj[last] & (1 << start))
                left = mask & ~visited
                if cycle and not (adj[start] & left):
                    return False
                options = list(_bits(adj[last] & left))
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


def _prepare(matrix: DistanceMatrix, now: float | None) -> _Prepared:
    """The matrix's tables, built once per matrix and set of fresh measurements."""
    if matrix.measured:
        fresh = frozenset(
            key
            for key, m in matrix.measured.items()
            if now is None or now - m.taken_at <= matrix.measurement_max_age_s
        )
    else:
        fresh = frozenset()
    cache = matrix.derived_cache.setdefault("placement", {})
    prepared = cache.get(fresh)
    if prepared is None:
        if len(cache) > 8:  # measurements aging out one by one: keep a few, not all
            cache.clear()
        prepared = cache[fresh] = _Prepared(matrix, now)
    return prepared


# --- the search -----------------------------------------------------------------------


@dataclass(slots=True)
class _Found:
    mask: int
    order: tuple[int, ...]
    rank: int | None
    key: tuple[int, int, int]
    loss: int | None = None  # partner loss, computed when a tie needs it


class _Search:
    """Branch and bound over interchangeable-GPU classes at one bandwidth threshold."""

    def __init__(self, prep: _Prepared, req: Request, free_all: int, candidates: int, include: int):
        self.prep = prep
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
        return self.k >= 2 and self.req.pattern != "independent"

    def run(self) -> _Found | None:
        table = self.prep.small_table(self.req.pattern, self.k)
        if table is not None:
            return self._scan(table)
        if not self.links_needed():
            return self._search_at(None, stop_at_first=False)
        present = self._ranks_present()
        if not present:
            return None
        # Feasibility falls as the threshold rises: find the best feasible one.
        if len(present) <= 8:
            for r in reversed(present):
                if not self._feasible_on_idle_node(r):
                    continue
                found = self._search_at(r, stop_at_first=False)
                if found is not None:
                    return found
            return None
        lo, hi = 0, len(present) - 1  # present ascending; find the highest feasible
        if self._search_at(present[lo], stop_at_first=True) is None:
            return None
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._feasible_on_idle_node(present[mid]) and (
                self._search_at(present[mid], stop_at_first=True) is not None
            ):
                lo = mid
            else:
                hi = mid - 1
        return self._search_at(present[lo], stop_at_first=False)

    def _scan(self, table: list[tuple[int, int, int, tuple[int, ...]]]) -> _Found | None:
        """The best set from the node's table of all k-sets (see _Prepared.small_table)."""
        cand = self.candidates | self.include
        include = self.include
        single_numa = self.req.single_numa
        h = self.h_adj
        nics = self.nics
        best: _Found | None = None
        group = None
        for mask, rank, numa, order in table:
            if mask & ~cand or include & ~mask or (single_numa and numa > 1):
                continue
            if h is not None and any((h[v] | 1 << v) & mask != mask for v in order):
                continue
            if best is not None and (rank, numa) != group:
                break  # sorted by (bandwidth, NUMA): the rest are worse
            nic = self.prep.nic_cost(mask, nics) if nics else 0
            if best is not None and nic > best.key[1]:
                continue
            key = (numa, nic, self._damage_of(mask))
            if best is None or key < best.key:
                best = _Found(mask, order, rank, key)
                best_loss = None
                group = (rank, numa)
            elif key == best.key and best_loss != 0:
                # (5) among equals: leave each free GPU its best free partner.
                if best_loss is None:
                    best_loss = self._partner_loss(best.mask)
                    if best_loss == 0:
                        continue  # nothing to improve on
                loss = self._partner_loss(mask)
                if loss < best_loss:
                    best = _Found(mask, order, rank, key)
                    best_loss = loss
        return best

    def _best_loss(self, best: _Found) -> int:
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
            for v in _bits(self.free_all):
                others = self.free_all & ~(1 << v)
                best[v], top[v] = -1, 0
                for r in range(len(exact) - 1, -1, -1):
                    if exact[r][v] & others:
                        best[v], top[v] = r, exact[r][v] & others
                        break
            self.partner = (best, top, {})
        best, top, dependents = self.partner
        affected = 0
        for u in _bits(mask):
            dep = dependents.get(u)
            if dep is None:
                dep = dependents[u] = sum(1 << v for v, t in top.items() if t >> u & 1)
            affected |= dep
        loss = 0
        left = self.free_all & ~mask
        exact = self.prep.rank_exact
        for v in _bits(affected & ~mask):
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
            idle = _Search(self.prep, Request(gpus=self.k, pattern=self.req.pattern), self.prep.all_mask, self.prep.all_mask, 0)
            got = self.prep.idle_feasible[key] = idle._search_at(r, stop_at_first=True) is not None
        return got

    def _ranks_present(self) -> list[int]:
        """The ranks of links among the candidates (that min_level allows), ascending."""
        cand = self.candidates
        verts = list(_bits(cand))
        h = self.h_adj
        present = []
        for r, exact in enumerate(self.prep.rank_exact):
            if h is None:
                if any(exact[v] & cand for v in verts):
                    present.append(r)
            elif any(exact[v] & h[v] & cand for v in verts):
                present.append(r)
        return present

    def _search_at(self, r: int | None, stop_at_first: bool) -> _Found | None:
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
            need = {"allreduce": 2, "pipeline": 1, "alltoall": k - 1}[pattern]
            need = min(need, k - 1)
        elif h is not None:
            need = k - 1  # min_level: the set is a clique of close-enough pairs
        verts = self.candidates
        if need:
            changed = True
            while changed:
                changed = False
                for v in _bits(verts):
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
        if r is not None and pattern == "alltoall":
            allowed = [allowed[i] & eff[i] for i in range(n)]
        if self.req.single_numa:
            allowed = [allowed[i] & prep.numa_masks[prep.numa_of[i]] for i in range(n)]
        self.allowed = allowed
        self.r = r
        self.check_order = r is not None and pattern in ("allreduce", "pipeline") and k >= 3
        self.best: _Found | None = None
        self.stop_at_first = stop_at_first
        classes_all = prep.classes(self.nics > 0)
        for comp in comps:
            start = self.include
            cand = comp & ~start
            ok = True
            for v in _bits(start):
                cand &= allowed[v]
                if (start & ~(1 << v)) & ~allowed[v]:
                    ok = False
            if not ok:
                continue
            self.classes = self._ordered_classes(classes_all, cand, k - start.bit_count())
            dmg = self._damage_add(0, start)
            self._branch(0, start, k - start.bit_count(), cand, dmg)
            if self.best is not None and stop_at_first:
                break
        return self.best

    def _ordered_classes(
        self, classes_all: list[tuple[int, tuple[int, ...]]], cand: int, rem: int
    ) -> list[tuple[int, tuple[int, ...]]]:
        """The classes to branch on, best-fit first so the first answer found is good and
        the bounds cut early: NUMA nodes that can hold the whole job, fewest candidates
        first; then the others, most candidates first.  Hierarchy order within a node."""
        prep = self.prep
        group_key = []
        for g in prep.numa_masks:
            c = (g & cand).bit_count()
            group_key.append((0, c) if c >= rem else (1, -c))
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

    def _damage_add(self, taken: int, add: int) -> int:
        """Damage of taking ``add`` on top of ``taken``: sum of f^2 - (f-s)^2 increments."""
        cost = 0
        for _, zone_of in self.prep.zone_levels:
            t = taken
            for v in _bits(add):
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
            best_numa, best_nic, best_dmg = best.key
            numa = self._numa_bound(taken, cand, rem)
            if numa > best_numa:
                return
            if numa == best_numa:
                nic = self.prep.nic_cost(taken | cand, self.nics) if self.nics else 0
                if nic > best_nic:
                    return
                if nic == best_nic and dmg + self._damage_bound(taken, cand, rem) >= best_dmg:
                    return
        classes = self.classes
        while ci < len(classes) and not (classes[ci][0] & cand):
            ci += 1
        if ci >= len(classes):
            return
        class_mask, zones = classes[ci]
        members = list(_bits(class_mask & cand))
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
            order = prep.ham(taken, self.r, self.req.pattern == "allreduce")
            if order is None:
                return
        elif self.r is not None and self.k == 2:
            order = tuple(sorted(_bits(taken)))
            a, b = order
            if prep.rank[a][b] < self.r:
                return
        else:
            order = tuple(sorted(_bits(taken), key=prep.hier_pos.__getitem__))
        numa = sum(1 for g in prep.numa_masks if g & taken)
        nic = prep.nic_cost(taken, self.nics) if self.nics else 0
        key = (numa, nic, dmg)
        best = self.best
        if best is None or key < best.key:
            self.best = _Found(taken, order, self.r, key)
        elif key == best.key and self._best_loss(best) != 0:
            loss = self._partner_loss(taken)  # (5), among the equals visited
            if loss < self._best_loss(best):
                self.best = _Found(taken, order, self.r, key, loss)


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


# --- the answer -----------------------------------------------------------------------


def place(
    matrix: DistanceMatrix,
    request: Request,
    busy: Iterable[int] = (),
    *,
    now: float | None = None,
) -> Placement | NoFit:
    """The best placement of ``request`` on this node given the ``busy`` GPU indices."""
    prep = _prepare(matrix, now)
    pos_of = prep.pos_of

    def mask_of(field_name: str, indices: Iterable[int]) -> int:
        mask = 0
        for i in indices:
            if isinstance(i, bool) or not isinstance(i, int):
                raise RequestError(field_name, f"{i!r} is not a GPU index")
            if i not in pos_of:
                known = ", ".join(str(g.index) for g in matrix.gpus)
                raise RequestError(field_name, f"GPU {i} is not on this node (GPUs: {known})")
            mask |= 1 << pos_of[i]
        return mask

    busy_mask = mask_of("busy", busy)
    include = mask_of("include", request.include)
    exclude = mask_of("exclude", request.exclude)
    free_all = prep.all_mask & ~busy_mask
    candidates = free_all & ~exclude
    k = request.gpus
    if include & busy_mask:
        gone = [matrix.gpus[v].index for v in _bits(include & busy_mask)]
        return NoFit(request, f"included GPU {gone[0]} is busy", "include", _indices(matrix, candidates))
    if candidates.bit_count() < k:
        return NoFit(
            request,
            f"{k} GPUs requested, {candidates.bit_count()} free"
            + (f" of {prep.n}" if prep.n else "")
            + (f" ({exclude.bit_count()} excluded)" if exclude else ""),
            "gpus",
            _indices(matrix, candidates),
        )
    if request.nics > prep.n_nics:
        relaxed = replace(request, nics=prep.n_nics)
        best = place(matrix, relaxed, busy, now=now)
        return NoFit(
            request,
            f"{request.nics} NICs requested, the node has {prep.n_nics}",
            "nics",
            _indices(matrix, candidates),
            best if isinstance(best, Placement) else None,
        )
    found = _Search(prep, request, free_all, candidates, include).run()
    if found is not None:
        return _build(prep, request, found, free_all)
    return _diagnose(prep, matrix, request, busy, free_all, candidates, include, _indices(matrix, candidates), now)


def _indices(matrix: DistanceMatrix, mask: int) -> tuple[int, ...]:
    return tuple(matrix.gpus[v].index for v in _bits(mask))


def _diagnose(prep, matrix, request, busy, free_all, candidates, include, free_indices, now) -> NoFit:
    k = request.gpus
    relaxations = []
    if request.min_level is not None:
        relaxations.append(("min_level", replace(request, min_level=None)))
    if request.single_numa:
        relaxations.append(("single_numa", replace(request, single_numa=False)))
    if request.include:
        relaxations.append(("include", replace(request, include=())))
    for name, relaxed in relaxations:
        found = _Search(prep, relaxed, free_all, candidates, include if name != "include" else 0).run()
        if found is None:
            continue
        best = _build(prep, relaxed, found, free_all)
        if name == "min_level":
            reason = (
                f"no {k} free GPUs are all within {request.min_level} of each other; "
                f"the best set has pairs at {_worst_pair_level(prep, found.mask)}"
            )
        elif name == "single_numa":
            counts = sorted(
                ((g & candidates).bit_count(), -i) for i, g in enumerate(prep.numa_masks)
            )
            most, node = counts[-1][0], _numa_label(prep, -counts[-1][1])
            reason = f"no NUMA node has {k} free GPUs (most: {most} on node {node})"
        else:
            reason = "the included GPUs cannot be part of any set meeting the other constraints"
        return NoFit(request, reason, name, free_indices, best)
    names = [name for name, _ in relaxations]
    reason = (
        f"constraints {', '.join(names)} cannot hold together"
        if len(names) > 1
        else "no set of free GPUs meets the request"
    )
    return NoFit(request, reason, names[0] if names else "gpus", free_indices)


def _numa_label(prep: _Prepared, group: int) -> int | str:
    kind, value = prep.numa_keys[group]
    return value if kind == "numa" else (f"cpus:{value}" if kind == "cpus" else "unknown")


def _worst_pair_level(prep: _Prepared, mask: int) -> LinkLevel:
    verts = list(_bits(mask))
    levels = [prep.matrix.gpu_levels[a][b] for i, a in enumerate(verts) for b in verts[i + 1 :]]
    return max(levels)


@dataclass(frozen=True, slots=True)
class _AnswerParts:
    """What an answer says that depends only on the GPUs, their order, pattern and NICs."""

    gpus: tuple[PlacedGpu, ...]
    links: tuple[PatternLink, ...]
    bandwidth: float | None
    worst: LinkLevel | None
    weakest: PatternLink | None
    numa_labels: tuple[int | str, ...]
    cpus: str | None
    nics: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    numactl: tuple[str, ...]
    explain_head: tuple[str, ...]  # bottleneck, then NUMA (NIC line added per request)


def _answer_parts(prep: _Prepared, order: tuple[int, ...], mask: int, pattern: str, nics: int) -> _AnswerParts:
    key = (order, pattern, nics)
    got = prep.answer_parts.get(key)
    if got is not None:
        return got
    k = len(order)
    link = prep.pattern_link
    links: list[PatternLink] = []
    if k >= 2 and pattern != "independent":
        if pattern == "alltoall":
            links = [link(a, b) for i, a in enumerate(order) for b in order[i + 1 :]]
        else:
            links = [link(order[i], order[i + 1]) for i in range(k - 1)]
            if pattern == "allreduce" and k >= 3:
                links.append(link(order[-1], order[0]))
    bandwidth = min((ln.gbps for ln in links), default=None)
    worst = max((ln.level for ln in links), default=None)
    weakest = None
    if links:
        pos_of = prep.pos_of
        weakest = min(links, key=lambda ln: prep.rank[pos_of[ln.a]][pos_of[ln.b]])

    placed = [prep.placed_gpu(v, rank_no) for rank_no, v in enumerate(order)]
    nic_names = prep.nic_names
    if nics:
        dist = []
        for j, steps in enumerate(prep.nic_steps):
            kv = next((kv for kv, m in steps if m & mask), _NO_NIC)
            dist.append((kv, j))
        chosen = tuple(nic_names[j] for _, j in sorted(dist)[:nics])
    else:
        chosen = tuple(dict.fromkeys(p.nearest_nics[0] for p in placed if p.nearest_nics))

    numa_groups = sorted({prep.numa_of[v] for v in order})
    numa_labels = tuple(_numa_label(prep, gi) for gi in numa_groups)
    cpus = prep.cpus_of(mask)
    if numa_labels and all(isinstance(x, int) for x in numa_labels):
        nodes = ",".join(str(x) for x in numa_labels)
        numactl: tuple[str, ...] = ("numactl", f"--cpunodebind={nodes}", f"--membind={nodes}")
    elif cpus:
        numactl = ("numactl", f"--physcpubind={cpus}")
    else:
        numactl = ()
    env = [
        # nvidia-smi indices equal CUDA's only in PCI bus order.
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(p.index) for p in placed)),
    ]
    hcas = [name for name in chosen if name not in prep.nics_without_device]
    unnamed = [name for name in chosen if name in prep.nics_without_device]
    if hcas:
        env.append(("NCCL_IB_HCA", "=" + ",".join(hcas)))  # '=' : exact names, mlx5_1 is not mlx5_10

    explain = []
    if weakest is not None:
        shape = {"allreduce": "ring", "pipeline": "path", "alltoall": "all pairs"}[pattern]
        explain.append(
            f"{shape} bottleneck {weakest.gbps:g} GB/s over {weakest.level} "
            f"(GPU{weakest.a}-GPU{weakest.b}); no free set of {k} does better"
        )
    if len(numa_labels) == 1:
        explain.append(f"stays on one NUMA node ({numa_labels[0]})")
    else:
        explain.append(f"spans {len(numa_labels)} NUMA nodes: no set on fewer has the same bandwidth")
    if nics:
        explain.append(f"{nics} NIC(s) closest to the set: {', '.join(chosen)}")
    if unnamed:
        explain.append(
            f"NCCL_IB_HCA leaves out {', '.join(unnamed)}: their RDMA device names are unknown "
            "(e.g. nvidia-smi output without its NIC Legend)"
        )
    parts = _AnswerParts(
        tuple(placed), tuple(links), bandwidth, worst, weakest, numa_labels, cpus, chosen,
        tuple(env), numactl, tuple(explain),
    )
    if len(prep.answer_parts) >= 50_000:
        prep.answer_parts.clear()
    prep.answer_parts[key] = parts
    return parts


def _build(prep: _Prepared, req: Request, found: _Found, free_all: int) -> Placement:
    parts = _answer_parts(prep, found.order, found.mask, req.pattern, req.nics)
    mask = found.mask
    broken = tuple(
        label for z, label in prep.named_zones if (z & mask) and (z & ~mask) and not (z & ~free_all)
    )
    objective = Objective(
        bandwidth_gbps=parts.bandwidth,
        bottleneck_level=parts.weakest.level if parts.weakest else None,
        numa_nodes=found.key[0],
        nic_cost=found.key[1],
        damage=found.key[2],
    )
    quality = parts.bandwidth or 0.0
    loss = (objective.numa_nodes - 1) + len(broken)
    head = parts.explain_head
    if req.include and len(parts.numa_labels) > 1:
        # The cached line claims the NUMA spread was the best on offer; with --include it
        # may have been forced, so say so instead.
        include_nodes = {prep.numa_of[prep.pos_of[i]] for i in req.include}
        held = ",".join(str(i) for i in req.include)
        why = (
            f"--include GPUs {held} alone span {len(include_nodes)}"
            if len(include_nodes) > 1
            else f"forced by --include GPUs {held}: no set on fewer that holds them has the same bandwidth"
        )
        head = tuple(
            f"spans {len(parts.numa_labels)} NUMA nodes: {why}" if line.startswith("spans ") else line
            for line in head
        )
    if req.include:
        held = ",".join(str(i) for i in req.include)
        head = tuple(
            line.replace("does better", f"holding GPUs {held} does better") if "bottleneck" in line else line
            for line in head
        )
    explain = head + (
        ("breaks whole free zones: " + "; ".join(broken),) if broken else ("keeps every whole free zone whole",)
    )
    return Placement(
        request=req,
        gpus=parts.gpus,
        bandwidth_gbps=parts.bandwidth,
        worst_level=parts.worst,
        links=parts.links,
        numa_nodes=parts.numa_labels,
        cpus=parts.cpus,
        nics=parts.nics,
        env=dict(parts.env),
        numactl=parts.numactl,
        score=round(10 * quality - loss, 3),
        objective=objective,
        broken_zones=broken,
        explain=explain,
    )


def evaluate_damage(matrix: DistanceMatrix, busy: Iterable[int], chosen: Iterable[int]) -> int:
    """Objective term (4) for an arbitrary set: lets tests and benchmarks compare policies."""
    prep = _prepare(matrix, None)
    pos_of = {g.index: pos for pos, g in enumerate(matrix.gpus)}
    busy_mask = sum(1 << pos_of[i] for i in busy)
    search = _Search(prep, Request(gpus=1), prep.all_mask & ~busy_mask, 0, 0)
    return search._damage_add(0, sum(1 << pos_of[i] for i in chosen))


def numa_groups(matrix: DistanceMatrix) -> list[tuple[int, ...]]:
    """GPU indices per NUMA group as the objective counts them (term 2)."""
    prep = _prepare(matrix, None)
    return [tuple(matrix.gpus[v].index for v in _bits(m)) for m in prep.numa_masks]


def edge_key(matrix: DistanceMatrix, a: int, b: int, now: float | None = None) -> tuple[float, tuple[int, int]]:
    """The comparable key of one GPU pair (by index): (GB/s, closeness); larger is better."""
    i, j = matrix.gpu_by_index(a), matrix.gpu_by_index(b)
    return (matrix.bandwidth(i, j, now) or 0.0, tuple(-x for x in matrix.gpu_levels[i][j].sort_key()))
