"""The answer: a Placement (GPUs in rank order, with what a job launches with) or a NoFit
(which request field cannot hold), built from what the search found.

Answers carry typed reasons (explain.py); the JSON form renders them with field names.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeVar

from topoagent.node.cpulist import format_cpulist
from topoagent.node.levels import LevelKind, LinkLevel
from topoagent.placement.binding import Launch, LaunchInput, RankBinding, bind_ranks, launch_input, rank_numactl, tables
from topoagent.placement.explain import Door, Reason, ReasonCode, render
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES, link_time_us
from topoagent.placement.live import LiveCosts
from topoagent.placement.objective import Objective
from topoagent.placement.request import Request
from topoagent.placement.search import Found
from topoagent.placement.tables import NO_NIC, PerTables, Prepared, bits, nearest_usable, numa_label
from topoagent.placement.tiers import Estimate, estimate, satisfaction, tier_met, tier_tables
from topoagent.vocabulary import Affinity, Pattern


@dataclass(frozen=True, slots=True)
class PlacedGpu:
    rank: int
    index: int  # nvidia-smi index
    uuid: str | None
    pci_address: str | None
    numa_node: int | None
    nearest_nics: tuple[str, ...]  # RDMA device names of the closest of the job's NICs (a port up)
    nic_level: LinkLevel | None  # the level between this GPU and ``nic``, the NIC the rank was given
    # This rank's own binding (placement.binding): its share of its NUMA node's CPUs, its
    # memory node, its NIC, and the numactl command that applies the first two.
    cpus: str | None = None
    memory_node: int | None = None
    nic: str | None = None
    numactl: tuple[str, ...] = ()
    rail: int | None = None  # the rail of its NIC (topoagent.node.fabric); None: unknown


@dataclass(frozen=True, slots=True)
class PatternLink:
    """One link the pattern uses, between two GPUs named by nvidia-smi index."""

    a_index: int
    b_index: int
    level: LinkLevel
    gbps: float


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
    reasons: tuple[Reason, ...]
    # What the per-rank forms for torchrun, srun and mpirun are written from; ``launch``
    # writes them, on request only (placement.binding).
    launch_input: LaunchInput | None = None
    affinity: Affinity = Affinity.ANY  # the strictest tier the answer meets (placement.tiers)
    satisfaction: float = 1.0  # share of the pattern's links that are local (placement.tiers)
    estimate: Estimate | None = None  # the pattern's model (placement.tiers); None for one GPU or independent
    # False when the request's deadline stopped the search: the best set found in time,
    # and the bandwidth no set can exceed as far as the search got (None: not bounded).
    proven_optimal: bool = True
    bandwidth_bound_gbps: float | None = None
    unverified: tuple[int, ...] = ()  # chosen GPUs not probed since a job gave them back (placement.live)

    fit = True  # a NoFit says False: topoagent.documents.agent.answer_document tells them apart by it

    @property
    def indices(self) -> tuple[int, ...]:
        return tuple(g.index for g in self.gpus)

    @property
    def explain(self) -> tuple[str, ...]:
        """The reasons in words, as JSON answers give them."""
        return render(self.reasons, Door.JSON)

    @property
    def launch(self) -> Launch | None:
        """The launchers' forms of the bindings, written now (only a door that shows them asks)."""
        return None if self.launch_input is None else self.launch_input.forms()


@dataclass(frozen=True, slots=True)
class NoFit:
    request: Request
    why: Reason
    constraint: str  # the request field that cannot hold: gpus, include, min_level, ...
    free: tuple[int, ...]  # nvidia-smi indices
    best_available: Placement | None = None
    # True: it fits no more with every GPU free (placement.place decides it by searching the
    # idle node): waiting will not help, and ``why`` is the idle node's reason.
    never_fits: bool = False

    fit = False

    @property
    def reason(self) -> str:
        return self.why.render(Door.JSON)


# (GPU position, rank, the rank's CPU share, its NIC, the closest of the job's NICs): a plain
# tuple, one per rank built.
PlacedKey = tuple[int, int, str | None, int | None, tuple[int, ...]]


# (GPU positions in rank order, pattern, NICs asked, per NIC its traffic in steps or None).
PartsKey = tuple[tuple[int, ...], Pattern, int, tuple[int, ...] | None]
# The same without the pattern: what binding ranks to NICs and CPUs decides.
BindingKey = tuple[tuple[int, ...], int, tuple[int, ...] | None]


class AnswerMemo:
    """Per tables: the pieces of answers built so far (they hold no reference to the tables)."""

    __slots__ = ("bindings", "cpus", "links", "parts", "placed")

    def __init__(self) -> None:
        self.links: dict[tuple[int, int], PatternLink] = {}
        self.placed: dict[PlacedKey, PlacedGpu] = {}
        self.parts: dict[PartsKey, AnswerParts] = {}
        self.bindings: dict[BindingKey, BindingParts] = {}  # shared by the patterns' parts
        self.cpus: dict[int, str | None] = {}  # by which CPU lists are in play


ANSWERS: PerTables[AnswerMemo] = PerTables(lambda _prep: AnswerMemo())
_memo = ANSWERS.of
MEMO_ENTRIES_MAX = 50_000  # per kind of piece: past it the kind starts afresh (memory stays bounded)

_K = TypeVar("_K")
_V = TypeVar("_V")


def _remember(memo: dict[_K, _V], key: _K, piece: _V) -> _V:
    """``piece`` kept in ``memo`` under ``key``, and given back."""
    if len(memo) >= MEMO_ENTRIES_MAX:
        memo.clear()
    memo[key] = piece
    return piece


def built_answer_parts(prep: Prepared) -> dict[PartsKey, AnswerParts]:
    """A copy of the answer pieces built so far for these tables (what warm_answers builds)."""
    return dict(_memo(prep).parts)


def cpus_of(prep: Prepared, mask: int) -> str | None:
    """The CPU list close to these GPUs (None when any GPU's is unknown)."""
    # GPUs share few distinct CPU lists (one per socket): key by which ones are in play.
    lists = 0
    for v in bits(mask):
        lists |= prep.cpu_list_bit[v]
    memo = _memo(prep).cpus
    got = memo.get(lists, "")
    if got == "":
        sets = [prep.gpu_cpus[v] for v in bits(mask)]
        known = [c for c in sets if c is not None]
        got = None if len(known) < len(sets) else format_cpulist(set().union(*known))
        memo[lists] = got
    return got


def pattern_link(prep: Prepared, a_pos: int, b_pos: int) -> PatternLink:
    memo = _memo(prep).links
    got = memo.get((a_pos, b_pos))
    if got is None:
        m = prep.matrix
        got = memo[(a_pos, b_pos)] = PatternLink(
            m.gpus[a_pos].index, m.gpus[b_pos].index, m.gpu_levels[a_pos][b_pos], round(prep.bw[a_pos][b_pos], 2)
        )
    return got


def placed_gpu(prep: Prepared, pos: int, rank_no: int, binding: RankBinding, job_nics: list[int]) -> PlacedGpu:
    """The GPU at position ``pos`` as an answer lists it at rank ``rank_no``: the closest
    of the job's NICs (``job_nics``) to it, the level to the NIC the rank was given, and
    the rank's own binding (cached)."""
    share = binding.share
    t = tables(prep)
    best_kind, closest = t.nearest[pos] if job_nics is t.usable else nearest_usable(prep.nic_kind, pos, job_nics)
    # Listed: the fastest of the closest (bind_ranks still spreads ranks over all of them).
    top_rate = max((prep.nic_rate[j] for j in closest), default=0.0)
    nearest = tuple(j for j in closest if prep.nic_rate[j] == top_rate)
    key: PlacedKey = (pos, rank_no, None if share is None else share.text, binding.nic, nearest)
    memo = _memo(prep).placed
    got = memo.get(key)
    if got is None:
        g = prep.matrix.gpus[pos]
        # The level printed beside a rank's NIC is that NIC's own, never another's.
        nic_level = prep.matrix.gpu_nic_levels[pos][binding.nic] if binding.nic is not None and best_kind < NO_NIC else None
        nic_names = prep.nic_names
        got = PlacedGpu(
            rank_no, g.index, g.uuid, g.pci_address, g.numa_node, tuple(nic_names[j] for j in nearest), nic_level,
            None if share is None else share.text, binding.memory_node,
            None if binding.nic is None else nic_names[binding.nic], rank_numactl(prep, binding),
            None if binding.nic is None else prep.matrix.nics[binding.nic].rail,
        )
        _remember(memo, key, got)
    return got


@dataclass(frozen=True, slots=True)
class AnswerParts:
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
    nic_reasons: tuple[Reason, ...]  # the NICs chosen, NICs NCCL cannot be told about, CPUs left unsplit
    # (chosen, passed over) NICs that traffic alone decided: build() words them with the
    # request's own read of the traffic, which these parts (cached by steps) must not hold.
    nic_passed: tuple[tuple[int, int], ...]
    launch: LaunchInput
    affinity: Affinity
    satisfaction: float
    ring: tuple[PatternLink, ...]  # allreduce: the ring through the ranks in order, for the estimate


@dataclass(frozen=True, slots=True)
class BindingParts:
    """The pieces of AnswerParts that the pattern does not change: the ranks bound to NICs
    and CPUs and what a job launches with.  Built once for the four patterns' parts, which
    hold the same objects: warm_answers keeps every small set's parts for good, and four
    copies of these were over half of what they held (an idle agent's largest cache)."""

    gpus: tuple[PlacedGpu, ...]
    numa_labels: tuple[int | str, ...]
    cpus: str | None
    nics: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    numactl: tuple[str, ...]
    nic_reasons: tuple[Reason, ...]
    nic_passed: tuple[tuple[int, int], ...]
    launch: LaunchInput


def answer_parts(
    prep: Prepared, order: tuple[int, ...], mask: int, pattern: Pattern, nics: int, live: LiveCosts | None = None
) -> AnswerParts:
    """The request-independent pieces for GPUs at positions ``order`` (cached; by the
    NICs' traffic steps too, which choose among equally near NICs)."""
    loads = live.loads_key if live is not None else None
    key: PartsKey = (order, pattern, nics, loads)
    memo = _memo(prep).parts
    got = memo.get(key)
    if got is not None:
        return got
    links = _pattern_links(prep, order, pattern)
    bandwidth = min((ln.gbps for ln in links), default=None)
    worst = max((ln.level for ln in links), default=None)
    weakest = None
    if links:
        pos_of = prep.pos_of
        weakest = min(links, key=lambda ln: prep.rank[pos_of[ln.a_index]][pos_of[ln.b_index]])
    shared = _binding_parts(prep, order, mask, nics, loads)
    # The ring through the ranks in order, which all-reduce's estimate reads (the other
    # patterns' models read their own links: placement.tiers).
    ring = links if pattern is Pattern.ALLREDUCE else []
    parts = AnswerParts(
        shared.gpus, tuple(links), bandwidth, worst, weakest, shared.numa_labels, shared.cpus, shared.nics,
        shared.env, shared.numactl, shared.nic_reasons, shared.nic_passed, shared.launch,
        tier_met(prep, mask, tuple(links)), satisfaction(tuple(links)), tuple(ring),
    )
    return _remember(memo, key, parts)


def _binding_parts(prep: Prepared, order: tuple[int, ...], mask: int, nics: int, loads: tuple[int, ...] | None) -> BindingParts:
    """BindingParts for GPUs at positions ``order`` (cached by order, NICs asked and traffic)."""
    key: BindingKey = (order, nics, loads)
    memo = _memo(prep).bindings
    got = memo.get(key)
    if got is not None:
        return got
    nic_names = prep.nic_names
    job_nics, passed = _job_nics(prep, order, nics, loads)
    bindings, by_load, cpus_shared = bind_ranks(prep, order, job_nics, list(loads) if loads else None)
    # Said only where the busier NIC stays unused: else traffic decided which rank, not which NIC.
    used = {b.nic for b in bindings}
    passed += [pair for pair in by_load if pair not in passed and pair[1] not in used]
    placed = [
        placed_gpu(prep, pos, rank_no, binding, job_nics) for rank_no, (pos, binding) in enumerate(zip(order, bindings))
    ]
    ranks_nics = [nic_names[b.nic] for b in bindings if b.nic is not None]
    # NCCL_IB_HCA names exactly the NICs the ranks use (with ``nics``: the NICs asked for).
    chosen = tuple(nic_names[j] for j in job_nics) if nics else tuple(dict.fromkeys(ranks_nics))

    numa_groups = sorted({prep.numa_of[pos] for pos in order})
    numa_labels = tuple(numa_label(prep, gi) for gi in numa_groups)
    cpus = cpus_of(prep, mask)
    numactl = _job_numactl(numa_labels, cpus)
    env = _env(prep, order, placed, chosen)
    unnamed = [name for name in chosen if name in prep.nics_without_device]
    nic_reasons = []
    if nics:
        nic_reasons.append(Reason(ReasonCode.NICS_CLOSEST, {"nics": nics, "names": chosen, **_sockets_served(prep, order, job_nics)}))
    if unnamed:
        nic_reasons.append(Reason(ReasonCode.NCCL_HCA_LEAVES_OUT, {"names": tuple(unnamed)}))
    if cpus_shared:
        nic_reasons.append(Reason(ReasonCode.CPUS_SHARED, {"gpus": cpus_shared}))
    parts = BindingParts(
        tuple(placed), numa_labels, cpus, chosen, tuple(env), numactl, tuple(nic_reasons), tuple(passed),
        launch_input(prep, order, bindings),
    )
    return _remember(memo, key, parts)


def _pattern_links(prep: Prepared, order: tuple[int, ...], pattern: Pattern) -> list[PatternLink]:
    """The links ``pattern`` uses between the GPUs at positions ``order``, in rank order."""
    k = len(order)
    links: list[PatternLink] = []
    if k >= 2 and pattern is not Pattern.INDEPENDENT:
        if pattern is Pattern.ALLTOALL:
            links = [pattern_link(prep, a, b) for i, a in enumerate(order) for b in order[i + 1 :]]
        else:
            links = [pattern_link(prep, order[i], order[i + 1]) for i in range(k - 1)]
            if pattern is Pattern.ALLREDUCE and k >= 3:
                links.append(pattern_link(prep, order[-1], order[0]))
    return links


def _job_nics(
    prep: Prepared, order: tuple[int, ...], nics: int, loads: tuple[int, ...] | None
) -> tuple[list[int], list[tuple[int, int]]]:
    """The NICs the job gets, and the (chosen, passed over) pairs that traffic alone decided.

    ``nics`` asked: chosen in rounds over the ranks' sockets (placement.tiers: SLIT sockets,
    else NUMA nodes), the sockets with the closest NIC and the most ranks first, one NIC per
    socket a round -- so every socket has a NIC before any has a second, and a rank never
    has to cross the socket link while a NIC on its own socket could have been chosen.  A
    socket's pick: the NIC that brings the most of its ranks closer to a chosen NIC, then
    the closest to its GPUs, with more of them at that level, faster, less traffic, lower
    position.  Else every usable NIC.  In position order (NCCL_IB_HCA's)."""
    usable = tables(prep).usable  # a NIC with every port down: never
    passed: list[tuple[int, int]] = []
    if not nics:
        return usable, passed
    kinds, rate = prep.nic_kind, prep.nic_rate
    steps = loads or (0,) * len(rate)
    socket_key = tier_tables(prep).socket_key
    groups: dict[tuple[str, int], list[int]] = {}
    for pos in order:
        groups.setdefault(socket_key[pos], []).append(pos)
    sockets = sorted(
        groups.values(), key=lambda g: (min((kinds[p][j] for p in g for j in usable), default=NO_NIC), -len(g), order.index(g[0]))
    )
    closest = {pos: NO_NIC for pos in order}  # per rank: its closest kind among the NICs chosen so far
    left, chosen = list(usable), list[int]()
    while left and len(chosen) < nics:
        for group in sockets:
            if not left or len(chosen) >= nics:
                break

            def merit(j: int, group: list[int] = group) -> tuple[int, int, int, float]:
                nearest = min(kinds[p][j] for p in group)
                improved = sum(1 for p in group if kinds[p][j] < closest[p])
                return (-improved, nearest, -sum(1 for p in group if kinds[p][j] == nearest), -rate[j])

            ranked = sorted(left, key=lambda j: (merit(j), steps[j], j))
            pick = ranked[0]
            # A NIC left out only for its traffic: as good as the one chosen in every other way.
            runner = next((j for j in ranked[1:] if merit(j) == merit(pick) and steps[j] > steps[pick]), None)
            if loads and runner is not None:
                passed.append((pick, runner))
            chosen.append(pick)
            left.remove(pick)
            for p in order:
                closest[p] = min(closest[p], kinds[p][pick])
    return sorted(chosen), [(a, b) for a, b in passed if b not in chosen]


def _sockets_served(prep: Prepared, order: tuple[int, ...], job_nics: list[int]) -> dict[str, int]:
    """The ranks' sockets, and how many have one of the job's NICs short of the socket link."""
    socket_key = tier_tables(prep).socket_key
    ranks = {socket_key[p] for p in order}
    served = {socket_key[p] for p in order if any(prep.nic_kind[p][j] < LevelKind.SYS for j in job_nics)}
    return {"served": len(served), "sockets": len(ranks)}


def _job_numactl(numa_labels: tuple[int | str, ...], cpus: str | None) -> tuple[str, ...]:
    """The job's numactl command: its NUMA nodes, else its CPUs, else none."""
    if numa_labels and all(isinstance(x, int) for x in numa_labels):
        nodes = ",".join(str(x) for x in numa_labels)
        return ("numactl", f"--cpunodebind={nodes}", f"--membind={nodes}")
    if cpus:
        return ("numactl", f"--physcpubind={cpus}")
    return ()


def _env(prep: Prepared, order: tuple[int, ...], placed: list[PlacedGpu], chosen: tuple[str, ...]) -> list[tuple[str, str]]:
    """The job's environment: its GPUs for CUDA, its NICs (or plain interfaces) for NCCL."""
    env = [
        # nvidia-smi indices equal CUDA's only in PCI bus order.
        ("CUDA_DEVICE_ORDER", "PCI_BUS_ID"),
        ("CUDA_VISIBLE_DEVICES", ",".join(str(p.index) for p in placed)),
    ]
    hcas = [name for name in chosen if name not in prep.nics_without_device]
    if hcas:
        env.append(("NCCL_IB_HCA", "=" + ",".join(hcas)))  # '=' : exact names, mlx5_1 is not mlx5_10
    else:
        # No RDMA NIC serves the ranks: NCCL falls back to sockets; name the plain
        # interfaces nearest their GPUs ('=': exact names, eth1 is not eth10).
        sockets = dict.fromkeys(i for pos in order for i in prep.matrix.gpus[pos].socket_interfaces)
        if sockets:
            env.append(("NCCL_SOCKET_IFNAME", "=" + ",".join(sockets)))
    return env


@dataclass(frozen=True, slots=True)
class SlowestMessage:
    """A latency-bound pattern's weakest link as its term (1) ranks it (placement.latency)."""

    time_us: float
    alpha_us: float
    message_bytes: int


def _slowest_message(prep: Prepared, req: Request, weakest: PatternLink | None) -> SlowestMessage | None:
    if weakest is None or not req.pattern.latency_bound:
        return None
    a, b = prep.pos_of[weakest.a_index], prep.pos_of[weakest.b_index]
    size = req.message_bytes or LATENCY_BOUND_MESSAGE_BYTES
    alpha = prep.alpha[a][b]
    time_us = link_time_us(alpha, prep.bw[a][b], size)
    if math.isinf(time_us):
        return None  # a link of unknown bandwidth: no time to give
    return SlowestMessage(round(time_us, 3), round(alpha, 3), size)


def build(
    prep: Prepared, req: Request, found: Found, free_all: int, live: LiveCosts | None = None, *, fell_back: bool = False
) -> Placement:
    parts = answer_parts(prep, found.order, found.mask, req.pattern, req.nics, live)
    slowest = _slowest_message(prep, req, parts.weakest)
    mask = found.mask
    broken = tuple(
        label for z, label in prep.named_zones if (z & mask) and (z & ~mask) and not (z & ~free_all)
    )
    objective = Objective(
        bandwidth_gbps=parts.bandwidth,
        bottleneck_level=parts.weakest.level if parts.weakest else None,
        numa_distance=found.numa_distance if prep.numa_dist is not None else None,
        numa_nodes=found.numa_nodes,
        nic_cost=found.nic_cost,
        damage=found.damage,
        unverified_gpus=found.key[4][0],
        nic_traffic_steps=found.key[4][1],
        link_time_us=slowest.time_us if slowest is not None else None,
    )
    quality = parts.bandwidth or 0.0
    loss = (objective.numa_nodes - 1) + len(broken)
    reasons: list[Reason] = []
    weakest = parts.weakest
    if weakest is not None:
        reasons.append(Reason(ReasonCode.BOTTLENECK, {
            "shape": req.pattern.shape, "gbps": weakest.gbps, "level": weakest.level,
            "a_index": weakest.a_index, "b_index": weakest.b_index, "gpus": len(found.order),
            "held": req.include,
            **({} if slowest is None else {
                "time_us": slowest.time_us, "alpha_us": slowest.alpha_us, "message_bytes": slowest.message_bytes,
            }),
        }))
    count = len(parts.numa_labels)
    if count == 1:
        reasons.append(Reason(ReasonCode.ONE_NUMA_NODE, {"node": parts.numa_labels[0]}))
    elif not req.include:
        reasons.append(Reason(ReasonCode.SPANS_NUMA_BEST, {"count": count}))
    else:
        # The spread may have been forced by what the request holds: say so, never claim
        # it was the best on offer.
        included_span = len({prep.numa_of[prep.pos_of[i]] for i in req.include})
        if included_span > 1:
            reasons.append(Reason(ReasonCode.SPANS_NUMA_INCLUDED_ALONE, {
                "count": count, "field": "include", "held": req.include, "included_span": included_span,
            }))
        else:
            reasons.append(Reason(ReasonCode.SPANS_NUMA_FORCED, {"count": count, "field": "include", "held": req.include}))
    reasons += parts.nic_reasons
    for chosen_j, over_j in parts.nic_passed:
        assert live is not None  # traffic decides only with live costs
        reasons.append(Reason(ReasonCode.NIC_LESS_TRAFFIC, {
            "chosen": prep.nic_names[chosen_j], "over": prep.nic_names[over_j],
            "chosen_gbs": round(live.gbs(chosen_j), 1), "over_gbs": round(live.gbs(over_j), 1),
        }))
    reasons.append(Reason(ReasonCode.BREAKS_ZONES, {"zones": broken}) if broken else Reason(ReasonCode.KEEPS_ZONES))
    if fell_back:
        reasons.append(Reason(ReasonCode.AFFINITY_FELL_BACK, {"asked": req.affinity, "met": parts.affinity}))
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
        reasons=tuple(reasons),
        launch_input=parts.launch,
        affinity=parts.affinity,
        satisfaction=parts.satisfaction,
        estimate=estimate(prep, found.order, req.pattern, parts.ring, req.message_bytes),
    )
