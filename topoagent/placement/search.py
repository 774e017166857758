"""The branch and bound: the best set of k GPUs at one bandwidth threshold, over classes
of interchangeable GPUs, cut by the bounds on the objective's later terms (placement.bounds)
-- and, on nodes small enough, the scan of every k-set instead (placement.ksets).  See
placement.objective for the objective it is exact for, and placement.anytime for the
driver that picks the thresholds and keeps to a deadline.

Everything here works on GPU *positions* (rows of the DistanceMatrix, bits of a mask).
Rings and paths also cut branches that cannot be completed (members short of links, runs
of members apart, newcomers too few to bring the links members lack), which changes no
answer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from topoagent.node.matrix import DistanceMatrix
from topoagent.placement.bounds import Bounds
from topoagent.placement.deadline import Deadline, DeadlineReached, StepBudget, Ticker
from topoagent.placement.ksets import Row, has_small_table, small_table
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES
from topoagent.placement.request import Request
from topoagent.placement.rings import BLOCKS_EDGES_MAX, biconnected_blocks, ring_may_hold, rings
from topoagent.placement.tables import PerTables, Prepared, bits, connected_components, neighbours, prepare, timed
from topoagent.vocabulary import Pattern

if TYPE_CHECKING:
    from topoagent.placement.live import LiveCosts

__all__ = ["Found", "Key", "Search", "classes", "warm"]

WARM_RANKS_MAX = 64  # thresholds whose adjacency warm() builds ahead (n masks each)
NO_NICS = (0, 0.0)  # term (4) when no NICs are asked for
NO_LIVE_COST = (0, 0)  # term (6) without live signals (placement.live)
SPANS_MAX = 64  # sets of NUMA nodes _spans_left checks a branch against; past this it does not
SPANS_NODES_MIN = 3  # NUMA nodes a node needs for _spans_left to run
SPANS_GPUS_MAX = 64  # past it (128 GPUs) a branch's per-set checks cost more than the deadline allows
SPANS_OPEN_MAX = 12  # NUMA nodes it lists the sets of (2^12) before the limit filters them
FORCING_GPUS_MAX = 16  # the largest ring _spans_left checks by forcing (see there)
LACKS_KEPT_MAX = 4_096  # members taken whose lacking links _lacks keeps (a parent and its children share them)
_STALE = object()  # Search._branch's spans_for when its parent's list may not be its own

# A set's score, terms (2)-(6) of the objective: NUMA distance, NUMA nodes, NICs, damage, live.
Key = tuple[int, int, tuple[int, float], int, tuple[int, int]]
# A class of interchangeable GPUs: its mask, and its zone per level (placement.tables).
GpuClass = tuple[int, tuple[int, ...]]
# What a ring check leaves its branch's children: the GPUs that can still be in the set
# (taken and candidates, peeled), the component of their links holding what is taken, the
# members it checked, those of them with no link to spare in that reach, and their links.
Reach = tuple[int, int, int, int, int]
# A set of NUMA nodes (a bitmask of group numbers) a completion may lie within, and what
# the ring check on their candidates left (None before the first).
Span = tuple[int, Reach | None]


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


def _classes_of(prep: Prepared, with_nics: bool) -> list[GpuClass]:
    """Interchangeable GPUs in hierarchy order, each as (mask, its zone per level).

    Members of a class share their zone at every level, except where each of them is
    a zone of its own (then the level's entry is 0): GPUs with identical rows are
    joined by the same links to everyone else.
    """
    n = prep.n
    assigned = [-1] * n
    classes: list[int] = []
    for u in sorted(range(n), key=lambda i: prep.hier_key[i]):
        if assigned[u] >= 0:
            continue
        mask = 1 << u
        for v in range(n):
            if v == u or assigned[v] >= 0 or prep.numa_of[u] != prep.numa_of[v]:
                continue
            if with_nics and prep.nic_kind[u] != prep.nic_kind[v]:
                continue
            if all(
                prep.rank[u][w] == prep.rank[v][w] for w in range(n) if w != u and w != v
            ):
                mask |= 1 << v
                assigned[v] = len(classes)
        assigned[u] = len(classes)
        classes.append(mask)
    with_zones = []
    for mask in classes:
        first = (mask & -mask).bit_length() - 1
        zones = tuple(
            zone_of[first] if mask & ~zone_of[first] == 0 else 0 for _, zone_of in prep.zone_levels
        )
        for z, (_, zone_of) in zip(zones, prep.zone_levels):  # the claim above
            assert z or all(zone_of[v] == 1 << v for v in bits(mask))
        with_zones.append((mask, zones))
    return with_zones


_classes_kept = PerTables[dict[bool, list[GpuClass]]](lambda _prep: {}).of


def classes(prep: Prepared, with_nics: bool) -> list[GpuClass]:
    """The classes of these tables (kept per tables; see _classes_of)."""
    memo = _classes_kept(prep)
    got = memo.get(with_nics)
    if got is None:
        got = memo[with_nics] = _classes_of(prep, with_nics)
    return got


def warm(matrix: DistanceMatrix, budget_s: float = 2.0) -> Prepared:
    """Build the matrix's tables before any request needs them (the agent does this when
    it builds a snapshot, off its event loop): the per-matrix bitmasks, the adjacency at
    every threshold, the classes and the small tables of k-sets -- and, when measured
    latencies reorder the links for alltoall and pipeline at the default message size,
    the same for that order (tables.timed), which a request would otherwise build
    itself (tens of ms at 128 GPUs).  A small table that does not finish within
    ``budget_s`` is left for requests to build under their deadlines."""
    prep = prepare(matrix, None)
    deadline = Deadline(budget_s)
    _warm_prepared(prep, tuple(Pattern), deadline)
    latency_ordered = timed(prep, LATENCY_BOUND_MESSAGE_BYTES)
    if latency_ordered is not prep:
        _warm_prepared(latency_ordered, tuple(p for p in Pattern if p.latency_bound), deadline)
    return prep


def _warm_prepared(prep: Prepared, patterns: tuple[Pattern, ...], deadline: Deadline) -> None:
    if prep.n_ranks <= WARM_RANKS_MAX:
        adj = rings(prep).adj
        for r in range(prep.n_ranks):
            adj(r)
    classes(prep, False)
    classes(prep, True)
    try:
        for pattern in patterns:
            for k in range(1, prep.n + 1):
                if has_small_table(prep, k):
                    small_table(prep, pattern, k, deadline)
    except DeadlineReached:
        pass


# --- the branch and bound ------------------------------------------------------------


class Search(Bounds):
    """Branch and bound over interchangeable-GPU classes at one bandwidth threshold.

    A Bounds (placement.bounds) for the GPUs not busy: one object per search, not two
    (a request makes several searches, each cheap tries included)."""

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
        super().__init__(prep, free_all)  # damage against ``free_all``: the GPUs not busy
        self.rings = rings(prep)
        self.deadline = deadline
        self.live = live  # term (6): unverified GPUs, NIC traffic now (placement.live)
        self.ticker: Ticker | None = steps if steps is not None else deadline  # called once per step
        # The key of a set known at the threshold being searched (a cheap first answer's):
        # branches that cannot come within it are cut.  Cut only when strictly worse, so
        # the optimum and its equals are still visited in the same order (see _cut): the
        # same answer.  Only sets worse than the cutoff, never the answer, go unvisited.
        self.cutoff: Key | None = None
        self.best: Found | None = None
        self.req = req
        self.k = req.gpus
        self.nics = req.nics
        self.candidates = candidates  # not busy, not excluded
        self.include = include
        self.h_adj = self.rings.level_adj(req.min_level) if req.min_level else None
        self.partner: tuple[dict[int, int], dict[int, int], dict[int, int]] | None = None
        self.groups_masks: dict[int, int] = {}  # NUMA groups (a bitmask) -> their GPUs
        self.lacks_kept: dict[int, tuple[int, int] | None] = {}  # _lacks, per members taken
        # _spans_left: with one or two NUMA nodes its sets are what the checks before it
        # see already, or one node more, and it costs more than it cuts; at 128 GPUs its
        # checks made answers late (docs/benchmarks.md, the deadline block).
        self.spans_worth = len(prep.numa_masks) >= SPANS_NODES_MIN and prep.n <= SPANS_GPUS_MAX

    def links_needed(self) -> bool:
        return self.k >= 2 and self.req.pattern is not Pattern.INDEPENDENT

    def scan(self, table: list[Row]) -> Found | None:
        """The best set from the node's table of all k-sets (placement.ksets)."""
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
            nic = self.terms.nic_cost(mask, nics) if nics else NO_NICS
            if best is not None and nic > best.key[2]:
                continue
            key = (span, numa, nic, self.damage_of(mask), self._live_cost(mask))
            if best is None or key < best.key:
                best = Found(mask, order, rank, key)
                best_loss = None
                group = (rank, span, numa)
            elif key == best.key and best_loss != 0:
                # (7) among equals: leave each free GPU its best free partner.
                if best_loss is None:
                    best_loss = self.partner_loss(best.mask)
                    if best_loss == 0:
                        continue  # nothing to improve on
                loss = self.partner_loss(mask)
                if loss < best_loss:
                    best = Found(mask, order, rank, key)
                    best_loss = loss
        return best

    def _live_cost(self, mask: int) -> tuple[int, int]:
        return self.live.cost(mask) if self.live else NO_LIVE_COST

    def _best_loss(self, best: Found) -> int:
        if best.loss is None:
            best.loss = self.partner_loss(best.mask)
        return best.loss

    def partner_loss(self, mask: int) -> int:
        """Tie-break (7): how much taking ``mask`` lowers, summed over the GPUs left free,
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

    def found(self, taken: int, order: tuple[int, ...], r: int) -> Found:
        """``taken`` in ``order`` as the search scores a set (terms 2-6)."""
        prep = self.prep
        groups = prep.groups_of(taken)
        nic = self.terms.nic_cost(taken, self.nics) if self.nics else NO_NICS
        key = (self.terms.numa_span(groups), groups.bit_count(), nic, self.damage_of(taken), self._live_cost(taken))
        return Found(taken, order, r, key)

    def search_at(self, r: int | None, stop_at_first: bool, cutoff: Key | None = None) -> Found | None:
        """The best set whose pattern's links all rank ``r`` or more (None: any links), or
        with ``stop_at_first`` the first set of the best-fit descent; only branches
        strictly worse than ``cutoff`` are cut (see __init__)."""
        k = self.k
        eff = self._links_at(r)
        need = self._links_each(r)
        verts = self._degree_core(self.candidates, eff, need)
        if self.include & ~verts:
            return None
        if verts.bit_count() < k:
            return None
        comps = [verts] if eff is None else connected_components(verts, eff)
        comps = [c for c in comps if c.bit_count() >= k and not (self.include & ~c)]
        if not comps:
            return None
        self.allowed = self._allowed(r, eff)
        self.r = r
        self.check_order = r is not None and self.req.pattern in (Pattern.ALLREDUCE, Pattern.PIPELINE) and k >= 3
        self.eff = self._ring_links(eff, verts)
        ring = self.eff
        if (
            ring is not None and self.req.pattern is Pattern.ALLREDUCE
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
        self.lacks_kept = {}
        self.best = None
        self.cutoff = None if stop_at_first else cutoff
        self.stop_at_first = stop_at_first
        self._descend(comps, stop_at_first)
        return self.best

    def _links_at(self, r: int | None) -> list[int] | None:
        """Per GPU, the GPUs it may be linked to in the pattern at ``r`` (and ``min_level``);
        None when any link will do."""
        h = self.h_adj
        if r is None:
            return list(h) if h is not None else None
        adj = self.rings.adj(r)
        return [adj[i] & h[i] for i in range(self.prep.n)] if h is not None else adj

    def _links_each(self, r: int | None) -> int:
        """The links at ``r`` each member needs inside the set: a ring member 2, a path
        member 1, an all-to-all member k-1 (with a min_level, a clique of close pairs)."""
        k = self.k
        if r is not None:
            need = {Pattern.ALLREDUCE: 2, Pattern.PIPELINE: 1, Pattern.ALLTOALL: k - 1}[self.req.pattern]
            return min(need, k - 1)
        return k - 1 if self.h_adj is not None else 0

    @staticmethod
    def _degree_core(verts: int, eff: list[int] | None, need: int) -> int:
        """``verts`` less, repeatedly, every GPU with fewer than ``need`` links among them."""
        if need:
            assert eff is not None  # need > 0 only with a level (r) or a min_level (h)
            changed = True
            while changed:
                changed = False
                for v in bits(verts):
                    if (eff[v] & verts).bit_count() < need:
                        verts &= ~(1 << v)
                        changed = True
        return verts

    def _allowed(self, r: int | None, eff: list[int] | None) -> list[int]:
        """Per GPU, which other GPUs may join it."""
        prep = self.prep
        n = prep.n
        h = self.h_adj
        allowed = prep.no_limit
        if h is not None:
            allowed = [h[i] for i in range(n)]
        if r is not None and self.req.pattern is Pattern.ALLTOALL:
            assert eff is not None  # a level's adjacency, set whenever r is
            allowed = [allowed[i] & eff[i] for i in range(n)]
        if self.req.single_numa:
            allowed = [allowed[i] & prep.numa_masks[prep.numa_of[i]] for i in range(n)]
        return allowed

    def _ring_links(self, eff: list[int] | None, verts: int) -> list[int] | None:
        """The links _branch checks rings and paths against: a ring or path at r needs
        `need` links at r for every member inside the set, and the set lies in one
        component of those links; _branch cuts branches that cannot -- unless every pair
        of candidates qualifies, when there is nothing to cut (and the checks would cost
        O(k) a branch: 30 ms for 64 of 128 GPUs).  None: no such checks."""
        if self.check_order:
            assert eff is not None  # check_order is only ever set with a level
            if any((eff[v] | 1 << v) & verts != verts for v in bits(verts)):
                return eff
        return None

    def _descend(self, comps: list[int], stop_at_first: bool) -> None:
        """The branch and bound over each component that can hold the set, best-fit order."""
        k = self.k
        allowed = self.allowed
        classes_all = classes(self.prep, self.nics > 0)
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

    def _ordered_classes(
        self, classes_all: list[GpuClass], cand: int, rem: int
    ) -> list[GpuClass]:
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

    def _branch(
        self, ci: int, taken: int, rem: int, cand: int, dmg: int, was: Reach | None = None,
        spans: list[Span] | None = None, spans_for: object = _STALE,
    ) -> None:
        """``was``: what the parent's ring check left (see _ring_completable), or None;
        ``spans``: the sets of NUMA nodes a set as good as the limit may still lie within
        (see _spans_left), or None when not yet worked out; ``spans_for``: the best set
        when they are exactly what this branch's _spans_left would return (_STALE: not)."""
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
        reach: Reach | None = None
        if self.eff is not None and taken:
            completable = self._ring_completable(taken, cand, rem, was)
            if completable is None:
                return
            cand, forced, reach = completable
        cutoff = self.cutoff
        limit: Key | None = None
        if cutoff is not None and (best is None or cutoff < best.key):
            limit = cutoff
            if self._cut(taken, cand, rem, dmg, forced, cutoff, strict=True):
                return
        elif best is not None:
            limit = best.key
            if self._cut(taken, cand, rem, dmg, forced, limit, strict=False):
                return
        within = -1  # the candidates a set as good as the limit may hold (-1: any)
        if limit is not None and reach is not None and self.spans_worth:
            # Sharper, per set of NUMA nodes such a set may lie within; these cut only
            # branches that hold nothing as good as the limit (nothing better, once no
            # equal set can win the tie-break), and leave the candidates as they are, so
            # every set that can win is still visited, in the same order, and the checks
            # above still see what they saw before: the same answer.
            if spans_for is not best:
                ties_lose = best is not None and limit is best.key and self._best_loss(best) == 0
                spans = self._spans_left(taken, cand, rem, dmg, limit, not ties_lose, spans)
            if spans is not None:
                if not spans:
                    return
                within = 0
                for _, span_reach in spans:
                    assert span_reach is not None  # _spans_left checked every set it keeps
                    within |= span_reach[0]
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
        # Leaving out a class none of whose candidates any of these sets can hold changes
        # no set's check in _spans_left (the same members taken, the same candidates on
        # each set's nodes): while the best set is the same, that child keeps the list.
        outside = within != -1 and not (class_mask & cand & within)
        for c in range(top, -1, -1):
            pick = 0
            nxt = rest
            for v in members[:c]:
                pick |= 1 << v
                nxt &= allowed[v]
            if pick & ~within:
                continue  # every set holding it is worse than the limit
            added = self.class_damage(zones, taken, c) if c else 0
            after = ci + 1
            kept_for: object = _STALE  # the best set the list was made for
            if c == 0 and outside:
                kept_for = best
                # The chain of children that leave out, one by one, the classes after it that
                # none of these sets can hold either: straight to its end, which sees what
                # it saw at the end of the chain (the candidates less those classes).
                while after < len(classes) and not (classes[after][0] & nxt & within):
                    nxt &= ~classes[after][0]
                    after += 1
            self._branch(after, taken | pick, rem - c, nxt, dmg + added, reach, spans, kept_for)
            if self.best is not None and self.stop_at_first:
                return

    def _ring_completable(
        self, taken: int, cand: int, rem: int, was: Reach | None, forcing: bool = False
    ) -> tuple[int, int, Reach] | None:
        """The candidates that can still complete a ring or path at r through ``taken``,
        the GPUs every such completion holds, and what the children's checks start from;
        None when none can.  ``was``: what an earlier check on this branch's path left
        (see Reach), which the peel, the members' links and the component start from (a
        child's reach is the parent's less a few GPUs: only their neighbours can have
        lost links) -- the same result as from nothing.  ``forcing``: a ring's check
        carries the forcing of links on (rings.ring_may_hold), which costs more."""
        # No ring/path at r can be completed: such a branch holds no set, so cutting it
        # changes no answer.  In a ring, the members taken lie in runs between the rem
        # GPUs still to come (at most rem runs, a path rem + 1), each run inside one
        # component of the links among them; each member has 2 ring links (a path's
        # two ends 1), those not among the taken go to the rem newcomers, 2 each.
        eff = self.eff
        assert eff is not None  # _branch asks only when rings are checked
        need = self.need
        ends = 0 if self.req.pattern is Pattern.ALLREDUCE else 2
        reach = taken | cand
        # A candidate with fewer than `need` links among what can still be in the set
        # is in no ring or path of it: peel such candidates until none is left.  The
        # parent's candidates all had `need` links in its reach: only the neighbours of
        # what left it are looked at again (and of what the peel takes, in turn).
        if was is None:
            check = cand
        else:
            check = neighbours(was[0] & ~reach, eff) & cand
        while check:
            low = check & -check
            check ^= low
            v = low.bit_length() - 1
            if (eff[v] & reach).bit_count() < need:
                reach ^= low
                check |= eff[v] & reach & ~taken
        cand = reach & ~taken
        if cand.bit_count() < rem:
            return None
        if was is None:
            tight_members, tight, left = 0, 0, taken
        elif reach == was[0]:
            # The same reach: the members it checked have the same links in it.
            tight_members, tight, left = was[3], was[4], taken & ~was[2]
        else:
            # Only the members next to what left the reach can have lost links: the others
            # keep theirs (and, with two, the same two).
            near = neighbours(was[0] & ~reach, eff)
            left = taken & (near | ~was[2])
            tight_members = was[3] & ~left
            tight = neighbours(tight_members, eff) & reach
        while left:
            low = left & -left
            left ^= low
            links = eff[low.bit_length() - 1] & reach
            degree = links.bit_count()
            if degree < need:
                return None
            if degree == need:
                tight_members |= low
                tight |= links  # every link it has left is one it needs
        forced = tight & ~taken
        if forced.bit_count() > rem:
            return None
        lacks = self._lacks(taken, rem, ends)
        if lacks is None:
            return None
        short, lacking = lacks
        if short > ends and not self._newcomers_cover(cand, lacking, rem, short - ends):
            return None
        if was is not None and not (was[1] & ~reach):
            # The parent's component is whole in this reach, which lies inside the parent's:
            # it is still the component, and what is taken outside it is cut off.
            comp = was[1]
            if taken & ~comp:
                return None
        else:
            comp = self._still_connected(was[1], reach) if was is not None else 0
            if not comp:
                comp = connected_components(reach, eff, taken & -taken)[0]
            if taken & ~comp or comp.bit_count() < self.k:
                return None
        if forcing and tight_members and not ring_may_hold(taken, reach, eff, self.k, tight_members):
            return None
        return cand, forced, (reach, comp, taken, tight_members, tight)

    def _still_connected(self, comp: int, reach: int) -> int:
        """What is left of ``comp`` (a component of a wider reach) in ``reach`` when that is
        still connected, else 0 (not known).  It is when the neighbours of what left are
        all joined to one another: a path through what left goes around it.  A walk from
        one of them that stops once it has them all takes a few GPUs where the component's
        whole walk took tens (a seventh of the CPU of the 64-GPU mesh's 32-GPU requests)."""
        eff = self.eff
        assert eff is not None
        verts = comp & reach
        targets = neighbours(comp & ~reach, eff) & verts
        if not targets:
            return 0
        seen = frontier = targets & -targets
        while frontier and targets & ~seen:
            frontier = neighbours(frontier, eff) & verts & ~seen
            seen |= frontier
        return verts if not targets & ~seen else 0

    def _lacks(self, taken: int, rem: int, ends: int) -> tuple[int, int] | None:
        """The ring links the members taken lack among themselves (2 each) and which members
        lack any; None when they lie in more runs than ``rem`` newcomers can join, or lack
        more links than those can bring.  It depends on ``taken`` alone, which a branch's
        sets of NUMA nodes and its child leaving a class out share: it is kept per search."""
        got = self.lacks_kept.get(taken, _STALE)
        if got is not _STALE:
            return got  # type: ignore[return-value]
        eff = self.eff
        assert eff is not None
        short = 0
        lacking = 0  # the members taken with fewer than 2 links among the taken
        left = taken
        while left:
            low = left & -left
            left ^= low
            inside = (eff[low.bit_length() - 1] & taken).bit_count()
            if inside < 2:
                short += 2 - inside
                lacking |= low
        runs = rem + ends // 2
        lacks: tuple[int, int] | None = (short, lacking)
        if short > 2 * rem + ends or (
            taken.bit_count() > runs and len(connected_components(taken, eff, most=runs)) > runs
        ):
            lacks = None
        if len(self.lacks_kept) >= LACKS_KEPT_MAX:
            self.lacks_kept.clear()
        self.lacks_kept[taken] = lacks
        return lacks

    def _spans_left(
        self, taken: int, cand: int, rem: int, dmg: int, limit: Key, strict: bool, spans: list[Span] | None
    ) -> list[Span] | None:
        """The sets of NUMA nodes that may still hold a completion of ``taken`` as good as
        ``limit`` (``strict``; else better), each with what its ring check left (see
        Span): those whose (span, count) does not pass the limit's, where a ring or path
        can still be completed from their candidates alone (_ring_completable) and the
        bounds (_cut) do not rule such a completion out there.  The NUMA nodes of such a
        completion are one of them, so when none is left there is none.  Children only
        lose candidates and limits only fall: a child starts from its parent's list.
        None: too many sets (SPANS_OPEN_MAX, SPANS_MAX)."""
        prep = self.prep
        touched = prep.groups_of(taken)
        limit_span, limit_numa = limit[0], limit[1]
        if spans is None:
            free = prep.groups_of(cand) & ~touched
            if free.bit_count() > SPANS_OPEN_MAX:
                return None
            every = [touched]
            for gi in bits(free):
                every += [t | 1 << gi for t in every]
            spans = [(groups, None) for groups in every]
        tried = []
        for groups, was in spans:
            if touched & ~groups or (was is not None and taken & ~was[0]):
                continue  # a member taken outside these nodes, or in no ring on them
            count = groups.bit_count()
            span = self.terms.numa_span(groups)
            if span > limit_span or (span == limit_span and count > limit_numa):
                continue
            sub = cand & self._groups_mask(groups)
            if was is not None:
                sub &= was[0]  # what its own check left: the reach its next check starts from
            if sub.bit_count() >= rem:
                tried.append((groups, sub, was))
        if len(tried) > SPANS_MAX:
            return None
        kept: list[Span] = []
        # Forcing on each set's candidates (rings.ring_may_hold): a ring of a few NUMA
        # nodes' sparse links is often ruled out by it; past FORCING_GPUS_MAX none was, at
        # a cost (docs/benchmarks.md).
        forcing = self.req.pattern is Pattern.ALLREDUCE and self.k <= FORCING_GPUS_MAX
        for groups, sub, was in tried:
            # Each set's ring check costs about a branch: the deadline counts it as a step
            # (up to SPANS_MAX of them in one branch, milliseconds at 128 GPUs).
            if self.deadline is not None:
                self.deadline.tick()
            got = self._ring_completable(taken, sub, rem, was, forcing)
            if got is None:
                continue
            sub, forced, reach = got
            if not self._cut(taken, sub, rem, dmg, forced, limit, strict):
                kept.append((groups, reach))
        return kept

    def _groups_mask(self, groups: int) -> int:
        got = self.groups_masks.get(groups)
        if got is None:
            numa_masks = self.prep.numa_masks
            got = self.groups_masks[groups] = sum(numa_masks[gi] for gi in bits(groups))
        return got

    def _newcomers_cover(self, cand: int, lacking: int, rem: int, short: int) -> bool:
        """Whether ``rem`` candidates can bring the ``short`` links the members taken still
        lack: a newcomer links to a member once and has two ring links, so it brings at
        most min(2, its links to ``lacking``)."""
        eff = self.eff
        assert eff is not None
        near = neighbours(lacking, eff) & cand  # the candidates linked to a member that lacks links
        ones = near.bit_count()
        if min(ones, rem) >= short:
            return True  # one link each is enough
        twos = 0
        while near:
            low = near & -near
            near ^= low
            if (eff[low.bit_length() - 1] & lacking).bit_count() >= 2:
                twos += 1
        twos = min(twos, rem)
        return 2 * twos + min(ones - twos, rem - twos) >= short

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
        span = self.distance_bound(taken, cand, rem) if self.prep.numa_dist is not None else 0
        if span != limit_span:
            return span > limit_span
        numa = self.numa_bound(taken, cand, rem)
        if numa != limit_numa:
            return numa > limit_numa
        nic = self.terms.nic_cost(taken | cand, self.nics) if self.nics else NO_NICS
        if nic != limit_nic:
            return nic > limit_nic
        least = dmg + self.damage_bound(taken, cand, rem)
        if least != limit_dmg:
            return least > limit_dmg
        # Term (6) only grows as GPUs are added: what is taken bounds it.
        live = self._live_cost(taken)
        return live > limit_live if strict else live >= limit_live

    def _leaf(self, taken: int, dmg: int) -> None:
        prep = self.prep
        groups = prep.groups_of(taken)
        nic = self.terms.nic_cost(taken, self.nics) if self.nics else NO_NICS
        key = (self.terms.numa_span(groups), groups.bit_count(), nic, dmg, self._live_cost(taken))
        # Scored before its order is looked for: a set that cannot replace the best one
        # needs none (a ring's order is the costly part of a leaf).
        best = self.best
        loss: int | None = None
        if best is not None and key >= best.key:
            if key != best.key or self._best_loss(best) == 0:
                return
            loss = self.partner_loss(taken)  # (7), among the equals visited
            if loss >= self._best_loss(best):
                return
        order: tuple[int, ...] | None
        if self.check_order:
            assert self.r is not None  # check_order is only ever set with a level
            order = self.rings.ham(taken, self.r, self.req.pattern is Pattern.ALLREDUCE, self.ticker)
            if order is None:
                return
        elif self.r is not None and self.k == 2:
            order = tuple(sorted(bits(taken)))
            a, b = order
            if prep.rank[a][b] < self.r:
                return
        else:
            order = tuple(sorted(bits(taken), key=prep.hier_pos.__getitem__))
        self.best = Found(taken, order, self.r, key, loss)
