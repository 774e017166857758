"""Rings and paths: adjacency at a bandwidth threshold, the blocks (biconnected
components) a ring must lie in, and the Hamiltonian ring/path search that orders a set's
GPUs so every consecutive link meets a threshold.

What is derived per tables (adjacency, rings found) is kept here, in a ``Rings`` per
``Prepared`` (tables.PerTables: it goes when the tables go).
"""

from __future__ import annotations

from topoagent.node.levels import LinkLevel
from topoagent.placement.deadline import Ticker
from topoagent.placement.tables import PerTables, Prepared, bits, connected_components

HAM_MEMO_MAX = 50_000  # past this the memo starts again empty, costing time, never answers
HAM_FAILED_MAX = 50_000  # states one ring search remembers failing from (a few MiB); past it, again empty
# Most links among the candidates for which a ring search first splits them into blocks
# (linear in the links; denser sets are cliques or near them and one block anyway).
BLOCKS_EDGES_MAX = 1500
_MISSING = object()  # a memo's "not there" (None is an answer)


def biconnected_blocks(verts: int, adjacency: list[int]) -> list[int]:
    """The blocks (biconnected components, as GPU bitmasks) of the graph restricted to
    ``verts``: every cycle lies inside one block, so a ring of k GPUs lies inside a block
    of k or more (Tarjan's low points, depth first without recursion)."""
    # Lists by GPU and frames changed in place: the cheap tries split a few pools per
    # request (0.2-1 ms of a 64-GPU mesh's), a quarter faster than dicts and a fresh tuple per step.
    disc = [-1] * len(adjacency)  # -1: not reached yet
    low = [0] * len(adjacency)
    reached = 0
    blocks: list[int] = []
    edges: list[tuple[int, int]] = []
    for root in bits(verts):
        if disc[root] >= 0:
            continue
        disc[root] = low[root] = reached
        reached += 1
        stack = [[root, -1, adjacency[root] & verts]]
        while stack:
            frame = stack[-1]
            v, parent, rest = frame
            if rest:
                w_bit = rest & -rest
                frame[2] = rest ^ w_bit
                w = w_bit.bit_length() - 1
                if disc[w] < 0:
                    edges.append((v, w))
                    disc[w] = low[w] = reached
                    reached += 1
                    stack.append([w, v, adjacency[w] & verts])
                elif w != parent and disc[w] < disc[v]:
                    edges.append((v, w))
                    if disc[w] < low[v]:
                        low[v] = disc[w]
                continue
            stack.pop()
            if not stack:
                continue
            u = stack[-1][0]
            if low[v] < low[u]:
                low[u] = low[v]
            if low[v] >= disc[u]:  # u separates v's subtree: the edges since (u, v) are a block
                block = 0
                while True:
                    a, b = edges.pop()
                    block |= 1 << a | 1 << b
                    if (a, b) == (u, v):
                        break
                blocks.append(block)
    return blocks


# (the GPUs to order, the threshold every consecutive link meets, a ring or else a path):
# a plain tuple, built once per leaf of a ring search.
HamKey = tuple[int, int, bool]


class Rings:
    """Per tables: the GPUs joined at each threshold and level, and the orders found.

    Holds the tables' arrays, never the tables themselves (a memo kept per tables
    must not keep them alive)."""

    __slots__ = ("_adj", "_ham", "_level_adj", "hier_pos", "levels", "n", "rank")

    def __init__(self, prep: Prepared):
        self.n = prep.n
        self.rank = prep.rank
        self.hier_pos = prep.hier_pos
        self.levels = prep.matrix.gpu_levels
        self._adj: dict[int, list[int]] = {}
        self._level_adj: dict[tuple[int, ...], list[int]] = {}
        self._ham: dict[HamKey, tuple[int, ...] | None] = {}

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
                    if j != i and self.levels[i][j].sort_key() <= key
                )
                for i in range(self.n)
            ]
            self._level_adj[key] = got
        return got

    def ham(self, mask: int, r: int, cycle: bool, deadline: Ticker | None = None) -> tuple[int, ...] | None:
        """An order of the GPUs in ``mask`` whose consecutive links all rank >= r, or None."""
        key: HamKey = (mask, r, cycle)
        # One lookup, not a test then a read: another thread may clear the memo between them.
        got = self._ham.get(key, _MISSING)
        if got is not _MISSING:
            return got  # type: ignore[return-value]
        if len(self._ham) > HAM_MEMO_MAX:
            self._ham.clear()
        result = self._ham_search(mask, self.adj(r), cycle, deadline)
        self._ham[key] = result
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
        if cycle:
            # Links no ring can use go: every ring through a GPU with two links uses both.
            # The rings are the same, so what is refuted below is refuted sooner.
            reduced = ring_links(mask, adj)
            if reduced is None:
                return None
            links = reduced
        else:
            links = adj
        if len(connected_components(mask, links)) > 1:
            return None  # without this a split set is refuted only by trying every path
        # Taking one GPU out of a ring leaves a path: one piece (a path, at most two).  A
        # GPU whose removal splits the set further is refuted here in a few microseconds;
        # the path search below takes tens to learn it (most sets a sparse mesh refutes).
        for v in verts:
            rest = mask & ~(1 << v)
            if len(connected_components(rest, links)) > (1 if cycle else 2):
                return None
        starts = verts[:1] if cycle else sorted(verts, key=lambda v: degree[v])
        if not cycle and degree[starts[0]] == 1:
            starts = starts[:1]  # a GPU with one link ends every path: the one start to try
        rank = self.rank
        # (visited, last) states, as one int, from which the rest cannot be completed: a
        # path reaching one again by another order is cut at once.  Only ring or path
        # searches that fail are cut, so the first order found is the one found before.
        shift = mask.bit_length().bit_length()
        failed: set[int] = set()
        for start in starts:
            path = [start]
            if cycle:
                failed.clear()  # a ring's completions depend on where it started

            def extend(last: int, visited: int) -> bool:
                if deadline is not None:
                    deadline.tick()
                if len(path) == k:
                    return not cycle or bool(adj[last] & (1 << start))
                state = visited << shift | last
                if state in failed:
                    return False
                if len(failed) > HAM_FAILED_MAX:
                    failed.clear()
                left = mask & ~visited
                if cycle and not (links[start] & left):
                    failed.add(state)
                    return False
                # Each GPU still to visit has two path neighbours among the rest, the last
                # visited and (a ring) the start -- but for the one that ends a path.
                around = left | 1 << last | (1 << start if cycle else 0)
                ends = 0
                onward = links[last] & left
                following = 0  # in a ring, GPUs linked to the last visited and to one other only
                for v in bits(left):
                    degree = (links[v] & around).bit_count()
                    if degree < 2:
                        ends += 1
                        if cycle or ends > 1:
                            failed.add(state)
                            return False
                    elif cycle and degree == 2 and links[v] >> last & 1 and last != start:
                        following |= 1 << v
                if following:
                    # The last GPU's ring neighbours are the one before it and the next: a
                    # GPU whose two links are to it and one more must come next (one only).
                    onward = following if following & (following - 1) == 0 else 0
                    if not onward:
                        failed.add(state)
                        return False
                if left & ~connected_components(left | 1 << last, links, 1 << last)[0]:
                    failed.add(state)
                    return False  # the rest cannot all be reached from here
                options = list(bits(onward))
                # Fewest onward options first (finds Hamiltonian paths fast), best link first.
                options.sort(key=lambda v: ((adj[v] & left).bit_count(), -rank[last][v]))
                for v in options:
                    path.append(v)
                    if extend(v, visited | (1 << v)):
                        return True
                    path.pop()
                failed.add(state)
                return False

            if extend(start, 1 << start):
                return tuple(path)
        return None


def ring_links(mask: int, adj: list[int]) -> list[int] | None:
    """Per GPU of ``mask``, its links in ``mask`` that some ring through all of ``mask``
    may use (the others' entries are 0), or None when no such ring can exist.

    A GPU with two links uses both in every ring, and a GPU two of whose links are so
    forced uses no other: its other links go, which may leave another GPU with two.
    Forced links that close a cycle short of the whole set prove that there is none."""
    links = [0] * len(adj)
    for v in bits(mask):
        links[v] = adj[v] & mask
    forced = [0] * len(adj)
    check = mask
    while check:
        low = check & -check
        check ^= low
        v = low.bit_length() - 1
        have = links[v]
        degree = have.bit_count()
        if degree < 2:
            return None
        if degree != 2 or forced[v] == have:
            continue
        for u in bits(have & ~forced[v]):
            forced[v] |= 1 << u
            forced[u] |= 1 << v
            f = forced[u].bit_count()
            if f > 2:
                return None
            if f == 2 and links[u] != forced[u]:
                for w in bits(links[u] & ~forced[u]):
                    links[w] &= ~(1 << u)  # u's ring links are both forced: not this one
                    check |= 1 << w
                links[u] = forced[u]
                check |= 1 << u
    # Forced links are paths and cycles (none has more than two); a cycle is the whole ring.
    for comp in connected_components(mask, forced):
        if comp != mask and all(forced[v].bit_count() == 2 for v in bits(comp)):
            return None
    return links


def ring_may_hold(taken: int, reach: int, adj: list[int], k: int, tight: int) -> bool:
    """Whether a ring of ``k`` GPUs within ``reach`` through all of ``taken`` may exist, by
    forcing (False: none does; True: none was ruled out).  ``reach`` holds ``taken``.

    A member of the ring with two links uses both: their far ends are members too, and a
    member two of whose links are so forced uses no other, which may leave a GPU with
    fewer than two (a member: no ring; any other: not in one) or a member with two.  It
    starts from ``tight``, the members taken with two links in ``reach`` (every member
    with more is looked at when it gains a forced link or loses one).  It fails when a
    GPU is forced a third link, the members pass ``k``, or a forced link closes a cycle
    short of ``k`` or one that leaves a member out.  The search's ring check forces the
    links of the members taken only; this carries on, which inside a few NUMA nodes of
    a sparse mesh rules out many sets the plain checks pass."""
    must = taken
    forced: dict[int, int] = {}  # GPU -> its forced links
    dropped: dict[int, int] = {}  # GPU -> links it cannot use (a forced member's others)
    # Forced links are paths (none has more than two): each path's far end and length
    # per end, so that a link closing one is seen as it is forced.
    far_end: dict[int, tuple[int, int]] = {}
    check = tight  # the rest are looked at once they gain a forced link or lose one
    while check:
        low = check & -check
        check ^= low
        if not reach & low:
            continue
        v = low.bit_length() - 1
        links = adj[v] & reach & ~dropped.get(v, 0)
        degree = links.bit_count()
        if degree < 2:
            if must & low:
                return False
            reach ^= low  # in no ring: its neighbours lose a link
            check |= links
            continue
        if not must & low:
            continue
        have = forced.get(v, 0)
        if degree == 2 and have != links:
            new = links & ~have
            while new:
                bit = new & -new
                new ^= bit
                u = bit.bit_length() - 1
                have |= bit
                other = forced.get(u, 0)
                if other.bit_count() == 2:
                    return False  # a third forced link
                forced[u] = other | low
                # Join the paths ending at v and u: a cycle when they are one path.
                end_v, end_u = far_end.get(v, (v, 1)), far_end.get(u, (u, 1))
                if end_v[0] == u:
                    if end_v[1] < k or (must | bit).bit_count() > end_v[1]:
                        return False  # a cycle short of k, or members off the only ring
                else:
                    length = end_v[1] + end_u[1]
                    far_end[end_v[0]] = (end_u[0], length)
                    far_end[end_u[0]] = (end_v[0], length)
                if not must & bit:
                    must |= bit
                    if must.bit_count() > k:
                        return False
                check |= bit
            forced[v] = have
            if have.bit_count() > 2:
                return False
        if have.bit_count() == 2 and links != have:
            spare = links & ~have
            dropped[v] = dropped.get(v, 0) | spare
            while spare:
                bit = spare & -spare
                spare ^= bit
                w = bit.bit_length() - 1
                dropped[w] = dropped.get(w, 0) | low
                check |= bit
    return True


RINGS: PerTables[Rings] = PerTables(Rings)
rings = RINGS.of  # rings(prep): the adjacency and ring memo of these tables
