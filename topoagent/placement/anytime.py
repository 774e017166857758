"""The anytime search: the best set of k GPUs for a request, within its deadline.

Under a deadline (Anytime.run):
1. a first set at the lowest threshold, which every link meets: the first leaf of the
   best-fit descent, found without looking at the clock;
2. bandwidth first, cheaply (a step budget each, proving nothing): by halving over the
   thresholds, the highest at which a ring, path or clique grows over all candidates,
   without looking at the clock (so an answer the deadline cuts has that bandwidth);
   there, a set on one NUMA node or on a group of NUMA nodes (past 64 GPUs, then on the
   groups where a better one may lie, least damage first);
3. the exact search (placement.search, the branch and bound): thresholds above that one,
   best first, then that one with the cheap set's key as a cutoff -- only branches
   strictly worse than that set are cut, and the optimum is no worse than it, so every
   set the answer is chosen among (the optimum and its equals, in the same order) is
   still visited and the answer is the same, sooner.
When the deadline stops it, the answer is the best set found, not proven, and the bound is
the best threshold not yet ruled out.  On nodes with a small table of k-sets
(placement.ksets) the table is scanned instead.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations, pairwise
from typing import TYPE_CHECKING

from topoagent.placement.deadline import Deadline, DeadlineReached, StepBudget, StepsSpent
from topoagent.placement.ksets import has_small_table, small_table, small_table_if_built
from topoagent.placement.request import Request
from topoagent.placement.rings import BLOCKS_EDGES_MAX, biconnected_blocks
from topoagent.placement.search import Found, Search
from topoagent.placement.tables import PerTables, Prepared, bits, connected_components
from topoagent.vocabulary import Pattern

if TYPE_CHECKING:
    from topoagent.placement.live import LiveCosts

FIRST_SET_STEPS = 400  # per cheap try at a threshold (Anytime._first_set_at): about a millisecond
FIRST_SET_UNIONS = 60  # groups of NUMA nodes tried there (most refuted in a few steps)
FIRST_SET_UNION_STEPS = 5_000  # steps of all those tries together (a grown path tops up its own per start)
FIRST_SET_COMBOS_MAX = 600  # groups of one size listed to pick those from (C(16, 3) = 560)
FIRST_SET_NODES = 4  # single NUMA nodes tried there, best fit first
# Past this many GPUs, once a group of NUMA nodes yields a first set there, the groups where a
# better one may lie are tried too (Anytime._better_union), least damage first: at 128 GPUs
# the group tried first is often far from the best; at 64 and fewer the tries cost more
# than they save (bench.placement_versus --mesh).
BETTER_UNION_GPUS_MIN = 65
BETTER_UNION_STEPS = 2_000  # steps of those tries together, FIRST_SET_STEPS each at most
# Steps of those tries the clock is not read for (Anytime._unhurried): nearly all of them on
# the 32- and 64-GPU meshes bench.placement's loaded study asks about (1-2 ms of a core there).
BANDWIDTH_FIRST_STEPS = 2_000
# Steps of the idle node's check at one threshold (Anytime._feasible_on_idle_node): a few
# ms.  Past them the check says nothing and the search at the threshold decides alone.
IDLE_CHECK_STEPS = 500


IdleKey = tuple[Pattern, int, int]  # (pattern, k, threshold)


# Per tables: whether any k GPUs of the idle node may carry a pattern at a threshold
# (False: none can; True: one does, or the check ran out of steps).
_idle_feasible = PerTables[dict[IdleKey, bool]](lambda _prep: {}).of


class Anytime:
    """One request's search over the thresholds, keeping to its deadline (module docstring)."""

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
        self.req = req
        self.k = req.gpus
        self.free_all = free_all
        self.candidates = candidates
        self.include = include
        self.deadline = deadline
        self.live = live
        self.bb = Search(prep, req, free_all, candidates, include, deadline, live)  # the exact search, per threshold
        self.h_adj = self.bb.h_adj
        # What run() leaves when the deadline stopped it: proven False, the best set found
        # at any threshold, and the best threshold not ruled out (its bandwidth bounds
        # every set's; None when links do not matter or nothing was ruled in).
        self.proven = True
        self.best_so_far: Found | None = None
        self.best_value = -2
        self.bound_rank: int | None = None

    @property
    def bandwidth_bound_gbps(self) -> float | None:
        return None if self.bound_rank is None else self.prep.rank_gbps[self.bound_rank]

    def run(self) -> Found | None:
        """The best set; when the deadline stops the search first, the best set found so
        far (``proven`` False), or None when none was found in time."""
        try:
            return self._run()
        except DeadlineReached:
            self.proven = False
            self._offer(self.bb.best)  # the threshold being searched when time ran out
            if self.best_so_far is not None and self.deadline is not None:
                self.deadline.bound_gbps = self.bandwidth_bound_gbps
            return self.best_so_far

    def _run(self) -> Found | None:
        prep = self.prep
        pattern = self.req.pattern
        if has_small_table(prep, self.k):
            built = small_table_if_built(prep, pattern, self.k)
            if built is None:
                # Not warmed (or dropped): have an answer before building it under the deadline.
                if self._seed() is None:
                    return None  # none at the lowest threshold: the table would hold none
                built = small_table(prep, pattern, self.k, self.deadline)
            assert built is not None  # has_small_table said so
            return self.bb.scan(built)
        if not self.bb.links_needed():
            self._seed()
            return self.bb.search_at(None, stop_at_first=False)
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
        # The clock is not read for BANDWIDTH_FIRST_STEPS steps here: an answer the deadline
        # cuts is then at the best bandwidth these tries find, not the lowest threshold's.
        lo, known = 0, seed
        hi = len(present) - 1 if self.k > 2 else 0  # a pair: the exact search is as quick
        with self._unhurried(BANDWIDTH_FIRST_STEPS, to_deadline=True):
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
                found = self.bb.search_at(r, stop_at_first=False)
                if found is not None:
                    return found
        else:
            hi = len(present) - 1  # present ascending; find the highest feasible
            self.bound_rank = present[hi]
            while lo < hi:
                mid = (lo + hi + 1) // 2
                found = self.bb.search_at(present[mid], stop_at_first=True) if self._feasible_on_idle_node(present[mid]) else None
                if self._offer(found) is not None:
                    assert found is not None
                    lo, known = mid, found
                else:
                    hi = mid - 1
                    self.bound_rank = present[hi]
        self.bound_rank = present[lo]
        return self.bb.search_at(present[lo], stop_at_first=False, cutoff=known.key)

    def _seed(self, present: list[int] | None = None) -> Found | None:
        """A first answer, found before the deadline is looked at: the first leaf of a
        best-fit descent at the lowest threshold, which every link meets, so it needs no
        backtracking.  With a ``min_level`` a set is a clique of close pairs and finding one
        may take long: that descent keeps to the deadline."""
        if self.bb.links_needed():
            present = present if present is not None else self._ranks_present()
            if not present:
                return None
            self.bound_rank = present[-1]  # no set beats its best link
        r = present[0] if present else None
        if self.h_adj is not None:
            return self._offer(self.bb.search_at(r, stop_at_first=True))
        with self._unhurried():
            return self._offer(self.bb.search_at(r, stop_at_first=True))

    @contextmanager
    def _unhurried(self, steps: float = math.inf, *, to_deadline: bool = False) -> Iterator[None]:
        """The deadline's clocks left unread for up to ``steps`` steps while a first answer
        is found (a descent without backtracking, or the cheap tries); read as usual after.
        ``to_deadline``: those steps still stop at the deadline itself (less the reserve), read
        by the wall clock alone (the first answer, without it, must be found whatever it costs)."""
        deadline = self.deadline
        if deadline is None:
            yield
            return
        deadline.leave_unread(steps, to_deadline)
        try:
            yield
        finally:
            deadline.leave_unread(0.0)

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
        if not self.bb.links_needed() or len(order) < 2:
            return -1
        rank = self.prep.rank
        pattern = self.req.pattern
        if pattern is Pattern.ALLTOALL:
            return min(rank[a][b] for i, a in enumerate(order) for b in order[i + 1 :])
        steps = list(pairwise(order))
        if pattern is Pattern.ALLREDUCE and len(order) >= 3:
            steps.append((order[-1], order[0]))
        return min(rank[a][b] for a, b in steps)

    def _feasible_on_idle_node(self, r: int) -> bool:
        """Whether any k GPUs of the whole node may carry the pattern at threshold ``r``.

        Busy GPUs and constraints only remove sets, so a threshold no set of the idle
        node reaches is skipped at once (remembered per matrix): without this the search
        would try every set before learning that, e.g., a DGX-1 has no all-NV2 ring of 4.
        The idle node has more sets than a busy one: its check may cost more than the
        search it would spare (up to a minute for 21 of 128 GPUs of an irregular mesh), so it
        has IDLE_CHECK_STEPS; past them it rules nothing out, and that too is
        remembered -- else every such request would spend its deadline on it again.
        """
        key: IdleKey = (self.req.pattern, self.k, r)
        memo = _idle_feasible(self.prep)
        got = memo.get(key)
        if got is None:
            idle = Search(
                self.prep, Request(gpus=self.k, pattern=self.req.pattern), self.prep.all_mask, self.prep.all_mask, 0,
                self.deadline, steps=StepBudget(IDLE_CHECK_STEPS, self.deadline),
            )
            try:
                got = idle.search_at(r, stop_at_first=True) is not None
            except StepsSpent:
                got = True  # not ruled out: the search at ``r`` decides, as without this check
            memo[key] = got
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
                found = sub.search_at(r, stop_at_first=True)
            except StepsSpent:
                continue
            if found is not None and (best is None or found.key < best.key):
                best = found
        if best is not None or self.req.single_numa:
            return best
        left = FIRST_SET_UNION_STEPS  # most unions are refuted in a few steps: many can be tried
        unions = self._unions(counts)
        for i, union in enumerate(unions):
            if left <= 0:
                break
            steps = StepBudget(min(FIRST_SET_STEPS, left), self.deadline)
            found = self._cheap_set(r, union & cand, steps)
            if found is not None:
                return self._better_union(r, found, unions[i + 1 :]) if prep.n >= BETTER_UNION_GPUS_MIN else found
            left -= steps.spent  # not what ``left`` lost: a grown path tops it up per start
        return None

    def _better_union(self, r: int, found: Found, unions: list[int]) -> Found:
        """The best of ``found`` and the sets grown in those of ``unions`` (groups of NUMA
        nodes not tried yet) that look more promising: the group's own NUMA span and count
        no worse than the set's, and with as much the least damage a set there can do
        (Bounds.damage_bound) below its own -- least such damage first, FIRST_SET_STEPS each
        (no fresh steps per start), within BETTER_UNION_STEPS.  A choice of where to look,
        not a bound (a set may use fewer of a group's nodes; the NIC term is left out): what
        is found there is kept only if its whole key is better.  _unions lists the groups
        most candidates first, which finds a set soon but seldom a good one.  Still a cheap
        set: it only becomes the exact search's cutoff."""
        self._offer(found)  # the answer, should the deadline stop these tries
        bb = self.bb
        cand = self.candidates | self.include
        groups_of = self.prep.groups_of
        promising = []
        for union in unions:
            groups = groups_of(union)
            at_least = (bb.terms.numa_span(groups), groups.bit_count(), bb.damage_bound(0, union & cand, self.k))
            if at_least < found.key[:2] + found.key[3:4]:
                promising.append((at_least, union))
        promising.sort()
        left = BETTER_UNION_STEPS
        for at_least, union in promising:
            if left <= 0 or at_least >= found.key[:2] + found.key[3:4]:
                break
            steps = StepBudget(min(FIRST_SET_STEPS, left), self.deadline)
            got = self._cheap_set(r, union & cand, steps, top_up=False)
            left -= steps.spent
            if got is not None and got.key < found.key:
                found = got
                self._offer(found)
        return found

    def _cheap_set(self, r: int, pool: int, steps: StepBudget | None = None, top_up: bool = True) -> Found | None:
        """A set of ``pool`` at threshold ``r`` within ``steps`` (FIRST_SET_STEPS), or None:
        grown link by link, or, for a ring or path that must hold ``include``, the first
        set of a best-fit descent.  ``top_up``: see _grow_path."""
        if steps is None:
            steps = StepBudget(FIRST_SET_STEPS, self.deadline)
        try:
            if self.include and self.req.pattern is not Pattern.ALLTOALL:
                sub = Search(
                    self.prep, self.req, self.free_all, pool & self.candidates, self.include, self.deadline, self.live, steps
                )
                return sub.search_at(r, stop_at_first=True)
            return self._grow(r, pool, steps, top_up)
        except StepsSpent:
            return None

    def _unions(self, counts: list[int]) -> list[int]:
        """Groups of NUMA nodes that can hold the job, as GPU masks, best first: by the NUMA
        distance and count they span, most candidates first (the first FIRST_SET_UNIONS of
        them, the fewest nodes first: where a job needs four, four), then the nodes
        nearest the one with most candidates, one more at a time."""
        prep = self.prep
        include = self.include
        live = [gi for gi, c in enumerate(counts) if c]
        most = sorted((counts[gi] for gi in live), reverse=True)
        combos = []
        for size in range(2, len(live) + 1):
            if sum(most[:size]) < self.k:
                continue  # no group of this many nodes holds the job
            if math.comb(len(live), size) > FIRST_SET_COMBOS_MAX:
                break
            for combo in combinations(live, size):
                mask = sum(prep.numa_masks[gi] for gi in combo)
                held = sum(counts[gi] for gi in combo)
                if held >= self.k and not include & ~mask:
                    combos.append((self.bb.terms.numa_span(sum(1 << gi for gi in combo)), size, -held, mask))
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

    def _grow(self, r: int, pool: int, steps: StepBudget, top_up: bool = True) -> Found | None:
        """k GPUs of ``pool`` holding the pattern at threshold ``r``, grown from one GPU
        (every ``include`` GPU first): a path extended depth first by the GPU with fewest
        onward links (closing the ring at the end), or for all-to-all a clique grown by
        the GPU joined to most of the rest.  None when ``steps`` run out first."""
        k = self.k
        adj = self.bb.rings.adj(r)
        h = self.h_adj
        eff = [adj[v] & h[v] for v in range(self.prep.n)] if h is not None else adj
        cycle = self.req.pattern is Pattern.ALLREDUCE and k >= 3
        pool = self._growable(pool, eff, cycle, steps)
        if not pool:
            return None
        if self.req.pattern is Pattern.ALLTOALL:
            return self._grow_clique(r, pool, eff, steps)
        if self.include:
            return None  # a path through every named GPU: left to the exact search
        return self._grow_path(r, pool, eff, cycle, steps, top_up)

    def _growable(self, pool: int, eff: list[int], cycle: bool, steps: StepBudget) -> int:
        """Only GPUs with enough links in the pool (a ring member 2, a path's 1, a clique's
        k - 1), in a component (a ring: a block) of k or more: where none is left, no set
        grows (at once)."""
        k = self.k
        include = self.include
        need = k - 1 if self.req.pattern is Pattern.ALLTOALL else min(2 if cycle else 1, k - 1)
        peeled = True
        while peeled:
            peeled = False
            for v in bits(pool):
                steps.tick_light()
                if (eff[v] & pool).bit_count() < need:
                    pool &= ~(1 << v)
                    peeled = True
        pool = sum(c for c in connected_components(pool, eff) if c.bit_count() >= k and not include & ~c)
        if cycle and pool and sum((eff[v] & pool).bit_count() for v in bits(pool)) <= 2 * BLOCKS_EDGES_MAX:
            blocks = [b for b in biconnected_blocks(pool, eff) if b.bit_count() >= k and not include & ~b]
            pool = 0  # blocks share cut vertices: their union, not their sum
            for b in blocks:
                pool |= b
        return pool

    def _grow_clique(self, r: int, pool: int, eff: list[int], steps: StepBudget) -> Found | None:
        """All-to-all: from each start (the ``include`` GPUs with it), the GPU joined to
        most of what may still join, until k."""
        prep = self.prep
        k = self.k
        include = self.include
        for start in bits(include or pool):
            steps.tick()
            taken = include | 1 << start
            left = pool & ~taken
            for v in bits(taken):
                left &= eff[v]
            if self.req.single_numa:
                left &= prep.numa_masks[prep.numa_of[start]]
            while taken.bit_count() < k and left:
                steps.tick()
                v = max(bits(left), key=lambda u: (eff[u] & left).bit_count())
                taken |= 1 << v
                left &= eff[v]
            if taken.bit_count() == k and self._meets(taken, r):
                return self.bb.found(taken, tuple(sorted(bits(taken), key=prep.hier_pos.__getitem__)), r)
        return None

    def _grow_path(
        self, r: int, pool: int, eff: list[int], cycle: bool, steps: StepBudget, top_up: bool = True
    ) -> Found | None:
        """A ring or path: extended depth first, fewest onward links first, from one start
        per NUMA node (fewest candidates first: best fit, the path keeps to its start's
        node first), each with its own steps (``top_up``; else all on ``steps``), the best
        set kept; then, if none grew, every other GPU, most links first, on the steps left."""
        prep = self.prep
        k = self.k
        h = self.h_adj
        numa_masks, numa_of = prep.numa_masks, prep.numa_of
        single = self.req.single_numa
        path: list[int] = []
        home = 0  # the start's NUMA node's GPUs
        # extend() orders a GPU's options by one int each, packing (away from the start's
        # node, onward links, the GPU): ints sort far faster than tuples from a key function,
        # and this is the cheap tries' hot loop.
        width = prep.n.bit_length()
        gpu_bits = (1 << width) - 1

        def extend(last: int, room: int) -> bool:
            """``room``: the GPUs that may still join (unvisited; with a min_level, close
            to every GPU on the path)."""
            steps.tick_light()
            if len(path) == k:
                return not cycle or bool(eff[last] >> path[0] & 1)
            options = eff[last] & room
            if cycle and len(path) == k - 1:
                options &= eff[path[0]]
            # Same NUMA node as the start first, then fewest onward links (long paths are
            # found fast), then the lowest index: bits() inlined.
            order = []
            while options:
                low = options & -options
                options ^= low
                u = low.bit_length() - 1
                order.append(((0 if home & low else 1) << width | (eff[u] & room).bit_count()) << width | u)
            order.sort()
            for key in order:
                v = key & gpu_bits
                path.append(v)
                if extend(v, room & ~(1 << v) & (h[v] if h is not None else room)):
                    return True
                path.pop()
            return False

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
            home = numa_masks[numa_of[start]]
            room = pool & ~(1 << start) & (h[start] if h is not None else pool)
            if single:
                room &= numa_masks[numa_of[start]]
            try:
                grown = extend(start, room)
            except StepsSpent:
                if start in per_node and top_up:
                    steps.left = FIRST_SET_STEPS
                    continue
                raise
            if start in per_node and top_up:
                steps.left = FIRST_SET_STEPS
            taken = sum(1 << v for v in path)
            if grown and self._meets(taken, None):
                found = self.bb.found(taken, tuple(path), r)
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
        adj = self.bb.rings.adj(r) if r is not None else None
        return all(
            (adj is None or (adj[v] | 1 << v) & taken == taken) and (h is None or (h[v] | 1 << v) & taken == taken)
            for v in bits(taken)
        )
