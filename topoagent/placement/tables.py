"""A matrix's tables as the search reads them: bitmasks and arrays over GPU *positions*
(rows of the DistanceMatrix, bits of a mask), built once per matrix and set of fresh
measurements, never written after (``Prepared`` is frozen).  What is derived lazily from
them (adjacency per threshold, rings, classes, NUMA spans, NIC costs, answers) is kept
by the module that derives it, in a memo kept per tables (PerTables, below), so
it goes when they go.

nvidia-smi indices appear only where a request or an answer is read or written.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from itertools import accumulate
from typing import Any, Generic, NamedTuple, TypeVar

from topoagent.node.cpulist import format_cpulist, parse_cpulist
from topoagent.node.levels import LinkLevel
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement.deadline import Deadline, no_check
from topoagent.placement.latency import time_key

NO_NIC = 99


def bits(mask: int) -> Iterator[int]:
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def neighbours(mask: int, adjacency: list[int]) -> int:
    """Every GPU linked to one of ``mask``'s (bits() inlined: the search calls this per branch)."""
    near = 0
    while mask:
        low = mask & -mask
        mask ^= low
        near |= adjacency[low.bit_length() - 1]
    return near


def connected_components(verts: int, adjacency: list[int], start: int = 0, most: int | None = None) -> list[int]:
    """The connected components (as GPU bitmasks) of the graph restricted to ``verts``;
    with ``start`` (a GPU's bit), only the one holding it; with ``most``, the first ``most``
    and then, where more remain, the rest in one last mask (len() > most: "more than most")."""
    comps: list[int] = []
    remaining = start or verts
    while remaining:
        if most is not None and len(comps) == most:
            comps.append(remaining)  # stop as soon as the count is known to pass ``most``
            break
        comp = frontier = remaining & -remaining
        while frontier:
            frontier = neighbours(frontier, adjacency) & verts & ~comp
            comp |= frontier
        comps.append(comp)
        remaining = 0 if start else remaining & ~comp
    return comps


# A link's class: (alpha us, GB/s, closeness) -- what a message size orders links by.
EdgeClass = tuple[float, float, tuple[int, ...]]
# How a NUMA group is known: ("numa", node id), ("cpus", cpulist) or ("unknown", None).
NumaKey = tuple[str, Any]


@dataclass(frozen=True, slots=True, eq=False, repr=False, weakref_slot=True)
class Prepared:
    """Everything about a matrix the search reads, as bitmasks over GPU positions.

    Frozen: computed once by ``build_tables`` (through ``prepare``); compared and hashed
    by identity, so modules key their memos by it."""

    n: int
    # Weak: the matrix keeps its tables (derived_cache), and a strong link back would
    # make a cycle that only Python's full collection frees -- a pause of tens of ms
    # in whichever request comes after a snapshot is replaced.  Without the cycle the
    # old tables go the moment the old snapshot does.
    matrix: DistanceMatrix
    matrix_ref: weakref.ref[DistanceMatrix]  # the matrix itself, for timed tables (no proxy of a proxy)
    now: float | None
    message_bytes: int | None  # the size links are ordered for (latency-bound patterns); None: bandwidth
    all_mask: int
    # --- links: edge key ranks (bandwidth, or one message's time, then closeness) ---
    bw: list[list[float]]
    alpha: list[list[float]]  # placement.latency
    rank: list[list[int]]  # per pair, its edge key's rank (-1 on the diagonal)
    n_ranks: int
    rank_gbps: list[float]  # a threshold's bound on bandwidth: the widest link ranked at or below it
    edge_classes: frozenset[EdgeClass]
    rank_exact: list[list[int]]  # per rank, per GPU: the GPUs joined to it by a link of exactly that rank
    # --- NUMA groups ---
    numa_of: list[int]
    numa_keys: list[NumaKey]
    numa_masks: list[int]
    numa_bit: list[int]
    numa_dist: list[list[int]] | None
    # --- GPUs kept off unless named, and GPUs taken last ---
    unhealthy: int
    links_unknown: int
    # --- NICs ---
    nic_usable: list[bool]
    nic_rate: list[float]
    nic_kind: list[list[int]]
    n_nics: int  # the NICs a job can be given
    nic_steps: list[list[tuple[int, int]]]
    nic_names: list[str]
    nics_without_device: frozenset[str]
    usable_nics: list[int]  # positions in matrix.nics of the NICs with a port up
    nearest_nics: list[tuple[int, list[int]]]  # per GPU: its closest kind among usable NICs, and those NICs
    # --- zones and the hierarchy ---
    zone_levels: list[tuple[str, list[int]]]  # (name, gpu -> zone mask)
    hier_key: list[tuple[int, ...]]
    hier_pos: list[int]
    no_limit: list[int]  # "any GPU may join", shared, never mutated
    zones_by_level: list[list[int]]
    multi_zones: list[int]
    single_zones: list[int]
    named_zones: list[tuple[int, str]]
    # --- CPUs ---
    gpu_cpus: list[frozenset[int] | None]
    cpu_list_bit: list[int]
    pos_of: dict[int, int]

    def gpus_mask(self, indices: Iterable[int]) -> int:
        """The GPUs of these nvidia-smi indices (all on the node), as a bitmask of positions."""
        return sum(1 << self.pos_of[i] for i in indices)

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


def numa_label(prep: Prepared, group: int) -> int | str:
    """How an answer names a NUMA group: its node id, else ``cpus:<list>``, else unknown."""
    return _label(prep.numa_keys, group)


def _label(numa_keys: list[NumaKey], group: int) -> int | str:
    kind, value = numa_keys[group]
    return value if kind == "numa" else (f"cpus:{value}" if kind == "cpus" else "unknown")


def nearest_usable(nic_kind: list[list[int]], pos: int, among: list[int]) -> tuple[int, list[int]]:
    """The closest link kind from GPU ``pos`` to the NICs ``among``, and those NICs."""
    kinds = nic_kind[pos]
    best = min((kinds[j] for j in among), default=NO_NIC)
    if best >= NO_NIC:
        return NO_NIC, []
    return best, [j for j in among if kinds[j] == best]


# --- building the tables ------------------------------------------------------------------


def build_tables(
    matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None, deadline: Deadline | None = None
) -> Prepared:
    """``deadline``: a request's, when it builds the tables itself (a latency order
    warm() did not build): the build stops with DeadlineReached, and nothing is kept."""
    n = matrix.size
    check = deadline.check if deadline is not None else no_check
    links = _link_tables(matrix, now, message_bytes, check)
    numa = _numa_tables(matrix)
    nics = _nic_tables(matrix)
    zones = _zone_tables(matrix, numa, check)
    distinct: dict[str | None, int] = {}
    return Prepared(
        n=n,
        matrix=weakref.proxy(matrix),
        matrix_ref=weakref.ref(matrix),
        now=now,
        message_bytes=message_bytes,
        all_mask=(1 << n) - 1,
        **links,
        **numa,
        unhealthy=sum(1 << i for i, g in enumerate(matrix.gpus) if g.unhealthy is not None),
        links_unknown=sum(1 << i for i, g in enumerate(matrix.gpus) if not g.links_known),
        **nics,
        **zones,
        no_limit=[(1 << n) - 1] * n,
        gpu_cpus=[parse_cpulist(g.cpus) if g.cpus else None for g in matrix.gpus],
        cpu_list_bit=[1 << distinct.setdefault(g.cpus, len(distinct)) for g in matrix.gpus],
        pos_of={g.index: pos for pos, g in enumerate(matrix.gpus)},
    )


def _link_tables(
    matrix: DistanceMatrix, now: float | None, message_bytes: int | None, check: Callable[[], None]
) -> dict[str, Any]:
    """Edge key: bandwidth first, then closeness of the level (NV18 > NV2 > PIX > PXB ...);
    with ``message_bytes`` (latency-bound patterns) one message's time first
    (placement.latency).  Row by row, so a request's deadline is looked at while building."""
    n = matrix.size
    levels = matrix.gpu_levels
    bw: list[list[float]] = []
    alpha: list[list[float]] = []
    closeness: list[list[tuple[int, ...]]] = []
    edge: list[list[tuple]] = []
    for i in range(n):
        check()
        bw_i = [matrix.bandwidth(i, j, now) or 0.0 for j in range(n)]
        alpha_i = [matrix.latency_us(i, j, now) for j in range(n)]
        near_i = [tuple(-x for x in levels[i][j].sort_key()) for j in range(n)]
        bw.append(bw_i)
        alpha.append(alpha_i)
        closeness.append(near_i)
        edge.append([
            (bw_i[j], near_i[j]) if message_bytes is None else time_key(alpha_i[j], bw_i[j], near_i[j], message_bytes)
            for j in range(n)
        ])
    ordered = sorted({edge[i][j] for i in range(n) for j in range(n) if i != j})
    index_of = {key: r for r, key in enumerate(ordered)}
    rank = [[index_of[edge[i][j]] if i != j else -1 for j in range(n)] for i in range(n)]
    rank_exact = [[0] * n for _ in ordered]
    for i in range(n):
        check()
        for j in range(n):
            if i != j:
                rank_exact[rank[i][j]][i] |= 1 << j
    return {
        "bw": bw,
        "alpha": alpha,
        "rank": rank,
        "n_ranks": len(ordered),
        "rank_gbps": list(accumulate((key[0] if message_bytes is None else key[1] for key in ordered), max)),
        "edge_classes": frozenset((alpha[i][j], bw[i][j], closeness[i][j]) for i in range(n) for j in range(n) if i != j),
        "rank_exact": rank_exact,
    }


def _numa_tables(matrix: DistanceMatrix) -> dict[str, Any]:
    """NUMA groups: the NUMA node when known, else the CPU list, else one group; and the
    SLIT distance between two groups (term 2), when every group is a NUMA node the matrix
    has distances for -- else None and the term is 0 for every set."""
    keys_numa: list[NumaKey] = []
    for g in matrix.gpus:
        if g.numa_node is not None:
            keys_numa.append(("numa", g.numa_node))
        elif g.cpus:
            keys_numa.append(("cpus", format_cpulist(parse_cpulist(g.cpus))))
        else:
            keys_numa.append(("unknown", None))
    seen: dict[NumaKey, int] = {}
    numa_of = [seen.setdefault(key, len(seen)) for key in keys_numa]
    numa_keys = list(seen)
    numa_masks = [0] * len(seen)
    for i, gi in enumerate(numa_of):
        numa_masks[gi] |= 1 << i
    slit = matrix.numa_distances
    ids = [value for kind, value in numa_keys if kind == "numa"]
    numa_dist = None
    if slit and len(ids) == len(numa_keys) and all((a, b) in slit for a in ids for b in ids):
        numa_dist = [[slit[(a, b)] for b in ids] for a in ids]
    return {
        "numa_of": numa_of,
        "numa_keys": numa_keys,
        "numa_masks": numa_masks,
        "numa_bit": [1 << gi for gi in numa_of],
        "numa_dist": numa_dist,
    }


def _nic_tables(matrix: DistanceMatrix) -> dict[str, Any]:
    """GPU -> NIC distance as a LevelKind number; per NIC, the GPUs within each kind.
    A NIC with no ACTIVE port carries no traffic: it is as far as no NIC at all (NO_NIC)
    and has no steps, so it never counts in term (3) nor is listed."""
    n = matrix.size
    nic_usable = [nic.active is not False for nic in matrix.nics]
    nic_kind = [
        [
            int(lv.kind) if lv is not None and nic_usable[j] else NO_NIC
            for j, lv in enumerate(matrix.gpu_nic_levels[i] if matrix.gpu_nic_levels else ())
        ]
        for i in range(n)
    ]
    n_nics = len(matrix.nics) if matrix.gpu_nic_levels else 0
    nic_steps: list[list[tuple[int, int]]] = []
    for j in range(n_nics):
        kinds = sorted({nic_kind[i][j] for i in range(n)} - {NO_NIC})
        nic_steps.append([(kv, sum(1 << i for i in range(n) if nic_kind[i][j] <= kv)) for kv in kinds])
    usable = [j for j, ok in enumerate(nic_usable) if ok]  # a NIC with every port down is no NIC
    return {
        "nic_usable": nic_usable,
        "nic_rate": [nic.rate_gbps or 0.0 for nic in matrix.nics],
        "nic_kind": nic_kind,
        "n_nics": sum(nic_usable) if n_nics else 0,
        "nic_steps": nic_steps,
        "nic_names": [nic.device or nic.name for nic in matrix.nics],
        # NICs known only by nvidia-smi's label (NIC0..., no NIC Legend): NCCL cannot use those.
        "nics_without_device": frozenset(nic.name for nic in matrix.nics if nic.device is None),
        "usable_nics": usable,
        "nearest_nics": [nearest_usable(nic_kind, pos, usable) for pos in range(n)],
    }


def _zone_tables(matrix: DistanceMatrix, numa: dict[str, Any], check: Callable[[], None]) -> dict[str, Any]:
    """Zones: connected groups at each distinct link level, plus NUMA nodes; the hierarchy
    order they give the GPUs; and the zones' masks as damage and answers read them."""
    n = matrix.size
    levels = matrix.gpu_levels
    numa_masks, numa_of = numa["numa_masks"], numa["numa_of"]
    zone_levels: list[tuple[str, list[int]]] = []
    seen_partitions: set[tuple[int, ...]] = set()
    distinct_levels = sorted({levels[i][j] for i in range(n) for j in range(n) if i != j})
    for level in distinct_levels:
        zone_of = _components_at_level(matrix, level, check)
        partition = tuple(sorted(set(zone_of)))
        if len(partition) in (1, n) or partition in seen_partitions:
            continue
        seen_partitions.add(partition)
        zone_levels.append((f"{level} zone", zone_of))
    if len(numa_masks) > 1:
        zone_of = [numa_masks[numa_of[i]] for i in range(n)]
        partition = tuple(sorted(set(zone_of)))
        if partition not in seen_partitions:
            zone_levels.append(("NUMA node", zone_of))
    # Coarse zones first, so the hierarchy key groups GPUs like the machine does.
    zone_levels.sort(key=lambda item: len(set(item[1])))
    hier_key = [tuple(min(bits(zone_of[i])) for _, zone_of in zone_levels) + (i,) for i in range(n)]
    # Rank of each GPU in hierarchy order: a cheap sort key.
    hier_pos = [0] * n
    for pos, v in enumerate(sorted(range(n), key=lambda i: hier_key[i])):
        hier_pos[v] = pos
    zones_by_level = [sorted(set(zone_of)) for _, zone_of in zone_levels]
    return {
        "zone_levels": zone_levels,
        "hier_key": hier_key,
        "hier_pos": hier_pos,
        "zones_by_level": zones_by_level,
        # For damage from scratch: zones of several GPUs (a zone per level it is one at),
        # and per level the GPUs that are a zone of their own.
        "multi_zones": [z for zones in zones_by_level for z in zones if z.bit_count() > 1],
        "single_zones": [sum(z for z in zones if z.bit_count() == 1) for zones in zones_by_level],
        # Whole zones by name, for "breaks whole free zones" in the answer.
        "named_zones": [
            (z, _zone_label(matrix, numa["numa_keys"], numa_of, name, z))
            for (name, _), zones in zip(zone_levels, zones_by_level)
            for z in zones
            if z.bit_count() > 1
        ],
    }


def _components_at_level(matrix: DistanceMatrix, level: LinkLevel, check: Callable[[], None]) -> list[int]:
    n = matrix.size
    limit = level.sort_key()
    adj = []
    for i in range(n):
        check()  # see build_tables' deadline
        adj.append(sum(1 << j for j in range(n) if j != i and matrix.gpu_levels[i][j].sort_key() <= limit))
    zone_of = [0] * n
    for comp in connected_components((1 << n) - 1, adj):
        for v in bits(comp):
            zone_of[v] = comp
    return zone_of


def _zone_label(matrix: DistanceMatrix, numa_keys: list[NumaKey], numa_of: list[int], name: str, zone: int) -> str:
    """'GPUs 0,1 (one NV8 zone)' or 'GPUs 0,1 (all of NUMA node 3)': GPU indices
    first, so they cannot be read as NUMA node ids."""
    gpus = "GPUs " + ",".join(str(matrix.gpus[v].index) for v in bits(zone))
    if name != "NUMA node":
        return f"{gpus} (one {name})"
    label = _label(numa_keys, numa_of[min(bits(zone))])
    if isinstance(label, int):
        return f"{gpus} (all of NUMA node {label})"
    if label.startswith("cpus:"):
        return f"{gpus} (all sharing CPUs {label[5:]})"
    return f"{gpus} (all of one NUMA node)"


# --- what modules keep per tables ---------------------------------------------------------

T = TypeVar("T")


class PerTables(Generic[T]):
    """A memo a module keeps per tables: ``memo(prep)`` is the value ``make(prep)`` made
    the first time these tables asked, dropped when they go.  Keyed by the tables'
    identity, cleared by a finalizer: a WeakKeyDictionary makes a weak reference at each
    look-up, microseconds that a request paid several times over.  A value must not
    hold the tables themselves (they would never go).  Modules call the bound ``of``
    (a method call costs less than an instance's ``__call__``)."""

    __slots__ = ("_by_id", "_make")

    def __init__(self, make: Callable[[Prepared], T]):
        self._make = make
        self._by_id: dict[int, T] = {}

    def of(self, prep: Prepared) -> T:
        key = id(prep)
        got = self._by_id.get(key)
        if got is None:
            got = self._by_id.setdefault(key, self._make(prep))  # two threads: one value kept
            weakref.finalize(prep, self._by_id.pop, key, None).atexit = False
        return got

    def peek(self, prep: Prepared) -> T | None:
        """The value kept for these tables, without making one."""
        return self._by_id.get(id(prep))

    def __len__(self) -> int:
        """How many tables have a value kept."""
        return len(self._by_id)


# --- which tables a request reads -----------------------------------------------------------


def prepare(
    matrix: DistanceMatrix, now: float | None, message_bytes: int | None = None, deadline: Deadline | None = None
) -> Prepared:
    """The matrix's tables, built once per matrix and set of fresh measurements; with
    ``message_bytes``, for a latency-bound pattern at that size (``timed``, whose build
    keeps to ``deadline``: the bandwidth tables' does not, warm() builds them)."""
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
        prepared = cache[fresh] = build_tables(matrix, now)
    return prepared if message_bytes is None else timed(prepared, message_bytes, deadline)


class TimedKey(NamedTuple):
    """Which latency order a timed table is for: the link classes, in that order."""

    order: tuple[EdgeClass, ...]


# Per bandwidth-ordered tables: the tables built for each latency order asked.
_TIMED: PerTables[dict[TimedKey, Prepared]] = PerTables(lambda _prep: {})


def timed(prep: Prepared, message_bytes: int, deadline: Deadline | None = None) -> Prepared:
    """The tables for a latency-bound pattern at ``message_bytes`` (placement.latency):
    ``prep`` when one message's time orders the links as bandwidth does -- every pair of a
    bandwidth key with one alpha, in the same order, as with no latency measured -- else
    ones built for that order, shared by every size giving it.  warm() builds them for
    the default size; a request building others keeps to its ``deadline``
    (DeadlineReached: tens of ms at 128 GPUs, and nothing is kept)."""
    order = sorted(prep.edge_classes, key=lambda c: time_key(c[0], c[1], c[2], message_bytes))
    alphas: dict[tuple, set[float]] = {}
    for alpha, gbps, near in prep.edge_classes:
        alphas.setdefault((gbps, near), set()).add(alpha)
    if all(len(a) == 1 for a in alphas.values()) and [c[1:] for c in order] == sorted(alphas):
        return prep
    key = TimedKey(tuple(order))
    memo = _TIMED.of(prep)
    got = memo.get(key)
    if got is None:
        if len(memo) > 8:
            memo.clear()
        matrix = prep.matrix_ref()
        assert matrix is not None  # alive while its tables are asked for (prep.matrix would be a proxy)
        got = memo[key] = build_tables(matrix, prep.now, message_bytes, deadline)
    return got


def timed_tables_built(prep: Prepared) -> int:
    """How many latency-ordered tables are kept beside ``prep`` (tests read it)."""
    return len(_TIMED.peek(prep) or {})
