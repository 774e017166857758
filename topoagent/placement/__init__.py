"""The placement core: which k GPUs of this node a job should get, in which rank order.

``place(matrix, request, busy) -> Placement | NoFit`` is pure: it reads a DistanceMatrix,
a Request and the set of busy GPU indices, and returns a value.  The HTTP endpoint, the
CLI and the lease manager are thin shells over it.

The parts, in layers (a module imports from its own layer or those below, never in a circle;
tests/test_placement_layers.py checks it):

1. ``request`` (Request and the one parser every door uses), ``latency`` (one message's
   time over a link, which alltoall and pipeline rank links by), ``explain`` (typed
   reasons, rendered per door), ``deadline`` (the clock a search keeps to);
2. ``tables`` (a matrix's frozen per-position tables, and PerTables, the memo each module
   keeps beside them);
3. ``rings`` (adjacency per threshold, blocks, Hamiltonian rings and paths), ``bounds``
   (terms 2-5 and their bounds), ``ksets`` (every k-set of small nodes), ``live``
   (unverified GPUs and NIC traffic, weighed at equal merit);
4. the core: ``search`` (the branch and bound at one threshold) and ``anytime`` (the
   search over thresholds under a deadline), which return the choice -- GPUs in rank
   order and the objective's terms;
5. above the core: ``objective`` (the terms answers are ranked by; its docstring explains
   the objective and why the search is exact), ``tiers`` (affinity tiers, satisfaction,
   the all-reduce estimate), ``binding`` (each rank's CPUs, memory node and NIC),
   ``answer`` (Placement, NoFit: the choice rendered, with launch forms and reasons);
6. this module: ``place`` and ``warm``.

``synthetic`` makes nodes of known shapes for studies, benchmarks and tests.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import replace

from topoagent.node.levels import LinkLevel
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement.answer import NoFit, PatternLink, PlacedGpu, Placement, answer_parts, build
from topoagent.placement.anytime import Anytime
from topoagent.placement.deadline import Deadline, DeadlineReached
from topoagent.placement.explain import CLAIMS, Door, Reason, ReasonCode, render
from topoagent.placement.ksets import built_small_tables
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES
from topoagent.placement.live import NO_LIVE, Live, LiveCosts, live_costs
from topoagent.placement.objective import Objective, edge_key, evaluate_damage, numa_distance, numa_groups
from topoagent.placement.request import (
    REQUEST_FIELDS,
    REQUEST_LIMITS,
    Request,
    RequestError,
    not_on_node,
    parse_request,
    request_json_schema,
)
from topoagent.placement.search import Found
from topoagent.placement.search import warm as warm_tables
from topoagent.placement.tables import Prepared, bits, numa_label, prepare, timed
from topoagent.placement.tiers import search_tier
from topoagent.vocabulary import Affinity

__all__ = [
    "REQUEST_FIELDS",
    "REQUEST_LIMITS",
    "Door",
    "Live",
    "NoFit",
    "Objective",
    "PatternLink",
    "PlacedGpu",
    "Placement",
    "Reason",
    "ReasonCode",
    "Request",
    "RequestError",
    "edge_key",
    "evaluate_damage",
    "numa_distance",
    "numa_groups",
    "parse_request",
    "place",
    "render",
    "request_json_schema",
    "warm",
]


WARM_NICS = 2  # answers are built ahead for jobs asking up to this many NICs
# ... and for sets of up to this many GPUs: every set of an 8-GPU node, the 1- and 2-GPU sets
# of larger ones.  An answer for 127 of 128 GPUs takes milliseconds and ~100 KB to build;
# ahead of time, all of them would take seconds and tens of MB for requests seldom made.
WARM_ANSWER_GPUS = 8


def warm_answers(matrix: DistanceMatrix, budget_s: float = 2.0, stopped: Callable[[], bool] | None = None) -> None:
    """Build the answer pieces (ranks' bindings, NICs, launch forms, tier, estimate) of
    every set of up to WARM_ANSWER_GPUS GPUs the matrix's small tables hold -- on an 8-GPU
    node at most 255 sets -- so a request there builds no answer.  The agent runs this in the background after it swaps
    a snapshot in (``search.warm`` builds the tables before); ``budget_s`` bounds it, and
    what it leaves is built on first use.  ``stopped()`` true ends it early: an agent told to
    stop must not wait for answers no request will read (a thread cannot be cancelled)."""
    until = time.monotonic() + budget_s
    prep = prepare(matrix, None)
    # With measured latency reordering links, alltoall and pipeline read tables of their
    # own (warm() builds them; tables.timed): their answers too.
    latency_ordered = timed(prep, LATENCY_BOUND_MESSAGE_BYTES)
    for nics in range(min(prep.n_nics, WARM_NICS) + 1):
        for tables in (prep,) if latency_ordered is prep else (prep, latency_ordered):
            for pattern, rows in built_small_tables(tables):
                for mask, _rank, _span, _nodes, order in rows:
                    if time.monotonic() > until or (stopped is not None and stopped()):
                        return
                    if len(order) <= WARM_ANSWER_GPUS:
                        answer_parts(tables, order, mask, pattern, nics)


def warm(matrix: DistanceMatrix, budget_s: float = 2.0) -> None:
    """The search's tables, then the answers (see warm_answers): what a request reads."""
    warm_tables(matrix, budget_s)
    warm_answers(matrix, budget_s)


def place(
    matrix: DistanceMatrix,
    request: Request,
    busy: Iterable[int] = (),
    *,
    now: float | None = None,
    live: Live = NO_LIVE,
) -> Placement | NoFit:
    """The best placement of ``request`` on this node given the ``busy`` GPU indices.

    ``live``: what the node does now (unverified GPUs, NIC traffic), weighed only at
    equal merit (placement.live).  With ``request.deadline_ms`` the search stops then with
    the best set found so far, marked ``proven_optimal=False`` with the bandwidth bound it
    established.

    A NoFit says whether the request could fit this node at all (``never_fits``): this
    same search, run again with no GPU busy (within what is left of the deadline), found
    nothing either.
    Then its reason is the idle node's (what no waiting can change).  A search either
    deadline stopped proves nothing, so its NoFit never says ``never_fits``."""
    busy = tuple(busy)  # read twice: for the answer now and, on a no fit, the idle node's
    deadline = _deadline(request)
    answer = _place(matrix, request, busy, now, live, deadline)
    if not isinstance(answer, NoFit) or (deadline is not None and deadline.reached):
        return answer
    idle: Placement | NoFit = answer
    if busy:
        idle = _place(matrix, request, (), now, NO_LIVE, deadline)  # the caller waits for both
        if deadline is not None and deadline.reached:
            return answer
    if isinstance(idle, Placement):
        return answer  # busy now: it fits once GPUs are given back
    why = idle.why
    if why.code is ReasonCode.TOO_FEW_FREE:  # its count is what is free now, as `free` lists
        why = replace(why, params={**why.params, "free": len(answer.free)})
    return replace(answer, why=why, constraint=idle.constraint, never_fits=True)


def _deadline(request: Request) -> Deadline | None:
    return Deadline(request.deadline_ms / 1000, request.gpus) if request.deadline_ms is not None else None


def _place(
    matrix: DistanceMatrix, request: Request, busy: Iterable[int], now: float | None, live: Live, deadline: Deadline | None,
) -> Placement | NoFit:
    """place() for the ``busy`` GPUs given, searching under ``deadline``."""
    prep = prepare(matrix, now)
    if request.pattern.latency_bound:  # links ranked by one message's time (placement.latency)
        # Tables for that order not warmed and not built in time: the bandwidth-ordered
        # ones give a valid set at once (their search stops after its first, cheap answer,
        # the deadline being reached), marked not proven.
        with contextlib.suppress(DeadlineReached):
            prep = timed(prep, request.message_bytes or LATENCY_BOUND_MESSAGE_BYTES, deadline)
    costs = live_costs(prep, live)
    pos_of = prep.pos_of

    def mask_of(field_name: str, indices: Iterable[int]) -> int:
        mask = 0
        for index in indices:
            if isinstance(index, bool) or not isinstance(index, int):
                raise RequestError(field_name, f"{index!r} is not a GPU index")
            if index not in pos_of:
                raise not_on_node(field_name, index, pos_of)
            mask |= 1 << pos_of[index]
        return mask

    busy_mask = mask_of("busy", busy)
    include = mask_of("include", request.include)
    exclude = mask_of("exclude", request.exclude)
    free_all = prep.all_mask & ~busy_mask
    # A GPU with a critical finding is left out unless the request names it.
    unhealthy = prep.unhealthy & free_all & ~exclude & ~include
    candidates = free_all & ~exclude & ~unhealthy
    k = request.gpus
    if include & busy_mask:
        gone = _indices(matrix, include & busy_mask)
        why = Reason(ReasonCode.INCLUDED_BUSY, {"index": gone[0]})
        return NoFit(request, why, "include", _indices(matrix, candidates))
    if candidates.bit_count() < k:
        why = Reason(ReasonCode.TOO_FEW_FREE, {
            "gpus": k, "free": candidates.bit_count(), "size": prep.n,
            "excluded": (exclude | unhealthy).bit_count(),
        })
        return NoFit(request, why, "gpus", _indices(matrix, candidates))
    usable_nics = prep.n_nics  # a NIC with every port down is no NIC
    if request.nics > usable_nics:
        relaxed = replace(request, nics=usable_nics)
        best = place(matrix, relaxed, busy, now=now, live=live)  # its own deadline: this one has not started
        why = Reason(ReasonCode.TOO_MANY_NICS, {"nics": request.nics, "node_nics": usable_nics})
        return NoFit(request, why, "nics", _indices(matrix, candidates), best if isinstance(best, Placement) else None)
    answer: Placement | NoFit
    if request.affinity is not Affinity.ANY:
        answer = _place_tier(prep, request, free_all, candidates, include, deadline, costs)
    else:
        found = _search_known_first(prep, request, free_all, candidates, include, deadline, costs)
        if found is None and deadline is not None and deadline.reached:
            why = Reason(ReasonCode.NONE_IN_TIME, {"deadline_ms": request.deadline_ms})
            return NoFit(request, why, "deadline_ms", _indices(matrix, candidates))
        answer = (
            build(prep, request, found, free_all, costs) if found is not None
            else _diagnose(prep, request, free_all, candidates, include, deadline, costs)
        )
    late = deadline is not None and deadline.reached
    if isinstance(answer, NoFit):
        if not late:
            return answer
        assert deadline is not None
        shown = answer.best_available
        return replace(answer, why=_unclaimed(answer.why), best_available=shown and _not_proven(shown, deadline, request))
    answer = _noted(prep, answer, unhealthy, candidates, include, costs)
    if late:
        assert deadline is not None
        answer = _not_proven(answer, deadline, request)
    return answer


def _noted(
    prep: Prepared, answer: Placement, unhealthy: int, candidates: int, include: int, costs: LiveCosts | None
) -> Placement:
    """``answer`` with what the node's state says about it: unhealthy GPUs left out, GPUs
    of unknown links taken, and the live signals (term 6)."""
    matrix = prep.matrix
    taken = prep.gpus_mask(answer.indices)
    notes = []
    if unhealthy:
        causes = tuple(f"GPU{g.index}: {g.unhealthy}" for g in (matrix.gpus[v] for v in bits(unhealthy)))
        notes.append(Reason(ReasonCode.UNHEALTHY_LEFT_OUT, {"gpus": _indices(matrix, unhealthy), "why": causes}))
    if taken & prep.links_unknown:
        notes.append(Reason(ReasonCode.UNKNOWN_LINKS_TAKEN, {"gpus": _indices(matrix, taken & prep.links_unknown)}))
    if costs is not None:
        notes += _live_reasons(matrix, costs, taken, candidates, include)
        answer = replace(answer, unverified=_indices(matrix, costs.unverified & taken))
    if notes:
        answer = replace(answer, reasons=answer.reasons + tuple(notes))
    return answer


def _not_proven(answer: Placement, deadline: Deadline, request: Request) -> Placement:
    """The answer as the deadline left it: not proven optimal, with the bound the search
    established, and no line claiming that no set does better."""
    bound = deadline.bound_gbps
    why = Reason(ReasonCode.NOT_PROVEN, {"deadline_ms": request.deadline_ms, "bound_gbps": bound})
    reasons = tuple(_unclaimed(r) for r in answer.reasons)
    return replace(answer, reasons=(why, *reasons), proven_optimal=False, bandwidth_bound_gbps=bound)


def _unclaimed(reason: Reason) -> Reason:
    """``reason`` as a search the deadline stopped may say it: a claim about every set
    (none does better, none meets a tier) becomes one about the sets found in time."""
    return Reason(reason.code, {**reason.params, "proven": False}) if reason.code in CLAIMS else reason


def _live_reasons(matrix: DistanceMatrix, costs: LiveCosts, taken: int, candidates: int, include: int) -> list[Reason]:
    """What the live signals (term 6) say about the answer: GPUs unverified or with busy
    nearest NICs taken (named by ``include``, or no set of equal merit holding what it
    names did without them), else passed over."""
    reasons = []
    held = {"held": _indices(matrix, include)} if include else {}
    if costs.unverified & taken:
        reasons.append(Reason(ReasonCode.UNVERIFIED_TAKEN, {
            "gpus": _indices(matrix, costs.unverified & taken), "named": _indices(matrix, costs.unverified & taken & include),
            **held,
        }))
    elif costs.unverified & candidates:
        reasons.append(Reason(ReasonCode.UNVERIFIED_PASSED_OVER, {"gpus": _indices(matrix, costs.unverified & candidates)}))
    loaded = sum(1 << pos for pos, steps in enumerate(costs.gpu_load) if steps) & candidates
    if loaded & taken:
        gbs = max(costs.gpu_gbs(pos) for pos in bits(loaded & taken))
        # Term (6) weighs unverified GPUs before traffic: with some among the candidates, a
        # set of equal merit may have quieter NICs and more unverified GPUs.
        reasons.append(Reason(ReasonCode.BUSY_NICS_TAKEN, {
            "gpus": _indices(matrix, loaded & taken), "gbs": round(gbs, 1), "named": _indices(matrix, loaded & taken & include),
            "unverified_first": bool(costs.unverified & candidates), **held,
        }))
    elif loaded:
        gbs = min(costs.gpu_gbs(pos) for pos in bits(loaded))
        reasons.append(Reason(ReasonCode.BUSY_NICS_PASSED_OVER, {"gpus": _indices(matrix, loaded), "gbs": round(gbs, 1)}))
    return reasons


def _search_known_first(
    prep: Prepared, request: Request, free_all: int, candidates: int, include: int, deadline: Deadline | None = None,
    live: LiveCosts | None = None,
) -> Found | None:
    """GPUs whose links are unknown come last: the best set of GPUs with known links (and
    what ``include`` names); else every known GPU plus the fewest unknown ones; else any."""
    unknown = candidates & prep.links_unknown & ~include
    if unknown:
        known = candidates & ~unknown
        found = Anytime(prep, request, free_all, known, include, deadline, live).run()
        if found is not None:
            return found
        if known.bit_count() < request.gpus:
            found = Anytime(prep, request, free_all, candidates, include | known, deadline, live).run()
            if found is not None:
                return found
    return Anytime(prep, request, free_all, candidates, include, deadline, live).run()


def _place_tier(
    prep: Prepared, request: Request, free_all: int, candidates: int, include: int, deadline: Deadline | None,
    live: LiveCosts | None = None,
) -> Placement | NoFit:
    """``affinity`` asked: the tier's answer, else (``fallback``) the best lower tier's,
    else a no fit naming ``affinity`` with the best answer without it (placement.tiers)."""
    asked = request.affinity
    rank = list(Affinity).index  # strictest first
    for tier in (asked, *asked.fallbacks()) if request.fallback else (asked,):
        found = search_tier(prep, request, tier, free_all, candidates, include, deadline, live)
        if found is None:
            continue
        answer = build(prep, request, found, free_all, live, fell_back=tier is not asked)
        if rank(answer.affinity) <= rank(tier):
            return answer
    plain = Anytime(prep, request, free_all, candidates, include, deadline, live).run()
    if plain is None:
        return _diagnose(prep, request, free_all, candidates, include, deadline, live)
    best = build(prep, replace(request, affinity=Affinity.ANY, fallback=False), plain, free_all, live)
    why = Reason(ReasonCode.AFFINITY_UNREACHABLE, {"gpus": request.gpus, "affinity": asked, "met": best.affinity})
    return NoFit(request, why, "affinity", _indices(prep.matrix, candidates), best)


def _indices(matrix: DistanceMatrix, mask: int) -> tuple[int, ...]:
    return tuple(matrix.gpus[pos].index for pos in bits(mask))


def _diagnose(
    prep: Prepared, request: Request, free_all: int, candidates: int, include: int, deadline: Deadline | None = None,
    live: LiveCosts | None = None,
) -> NoFit:
    """Which constraint stops the request: the first whose relaxation fits.  The
    relaxed searches keep to the request's deadline; one it stops proves nothing, and
    when none fits in time the answer says only what is proven (nothing meets it)."""
    k = request.gpus
    free_indices = _indices(prep.matrix, candidates)
    relaxations = []
    if request.min_level is not None:
        relaxations.append(("min_level", replace(request, min_level=None)))
    if request.single_numa:
        relaxations.append(("single_numa", replace(request, single_numa=False)))
    if request.include:
        relaxations.append(("include", replace(request, include=())))
    for name, relaxed in relaxations:
        found = Anytime(prep, relaxed, free_all, candidates, include if name != "include" else 0, deadline, live).run()
        if found is None:
            continue
        best = build(prep, relaxed, found, free_all, live)
        if name == "min_level":
            why = Reason(ReasonCode.MIN_LEVEL_UNREACHABLE, {
                "gpus": k, "min_level": request.min_level, "best_worst": _worst_pair_level(prep, found.mask),
            })
        elif name == "single_numa":
            counts = sorted(
                ((g & candidates).bit_count(), -i) for i, g in enumerate(prep.numa_masks)
            )
            most, node = counts[-1][0], numa_label(prep, -counts[-1][1])
            why = Reason(ReasonCode.NO_NUMA_NODE_HOLDS, {"gpus": k, "most": most, "node": node})
        else:
            why = Reason(ReasonCode.INCLUDE_UNREACHABLE)
        return NoFit(request, why, name, free_indices, best)
    names = tuple(name for name, _ in relaxations)
    if deadline is not None and deadline.reached:
        return NoFit(request, Reason(ReasonCode.NOTHING_MEETS), names[0] if names else "gpus", free_indices)
    why = (
        Reason(ReasonCode.CONSTRAINTS_CONFLICT, {"fields": names})
        if len(names) > 1
        else Reason(ReasonCode.NOTHING_MEETS)
    )
    return NoFit(request, why, names[0] if names else "gpus", free_indices)


def _worst_pair_level(prep: Prepared, mask: int) -> LinkLevel:
    positions = list(bits(mask))
    levels = [prep.matrix.gpu_levels[a][b] for i, a in enumerate(positions) for b in positions[i + 1 :]]
    return max(levels)
