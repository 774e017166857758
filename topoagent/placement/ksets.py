"""Small tables: every k-set of the node with its best pattern rank, NUMA distance, NUMA
count and order, best first -- only where there are at most SMALL_TABLE_SETS of them
(8-GPU nodes, and k near 1 or n elsewhere).  A query then scans the table (Search.scan)
instead of searching, which on such nodes is several times faster.

The tables are kept here per ``Prepared`` (tables.PerTables: they go when it goes).
"""

from __future__ import annotations

from itertools import combinations
from math import comb

from topoagent.placement.bounds import terms
from topoagent.placement.deadline import Ticker
from topoagent.placement.rings import rings
from topoagent.placement.tables import PerTables, Prepared
from topoagent.vocabulary import Pattern

SMALL_TABLE_SETS = 128  # most k-sets a node may have for place() to scan a table of them

# One k-set: (mask, best pattern rank, NUMA distance, NUMA nodes, order).
Row = tuple[int, int, int, int, tuple[int, ...]]


# (pattern, k): a plain tuple, as every key built per request (a NamedTuple takes a
# Python call to build).
TableKey = tuple[Pattern, int]


_tables_of = PerTables[dict[TableKey, list[Row]]](lambda _prep: {}).of


def has_small_table(prep: Prepared, k: int) -> bool:
    return comb(prep.n, k) <= SMALL_TABLE_SETS


def small_table_if_built(prep: Prepared, pattern: Pattern, k: int) -> list[Row] | None:
    return _tables_of(prep).get((pattern, k))


def built_small_tables(prep: Prepared) -> list[tuple[Pattern, list[Row]]]:
    """(pattern, rows) of every small table built so far."""
    return [(pattern, rows) for (pattern, _k), rows in list(_tables_of(prep).items())]


def small_table(prep: Prepared, pattern: Pattern, k: int, deadline: Ticker | None = None) -> list[Row] | None:
    """The table of k-sets for ``pattern`` (module docstring), None where there would be
    more than SMALL_TABLE_SETS rows.  Built once per (pattern, k); a build the deadline
    stops is not kept."""
    if comb(prep.n, k) > SMALL_TABLE_SETS:
        return None
    key: TableKey = (pattern, k)
    built = _tables_of(prep)
    if key in built:
        return built[key]
    links = k >= 2 and pattern is not Pattern.INDEPENDENT
    span = terms(prep).numa_span
    by_hier = sorted(range(prep.n), key=prep.hier_pos.__getitem__)
    rows = []
    for verts in combinations(by_hier, k):
        mask = sum(1 << v for v in verts)
        groups = prep.groups_of(mask)
        order: tuple[int, ...] | None
        rank, order = -1, verts
        if links:
            rank, order = _best_rank(prep, mask, verts, pattern, deadline)
            if order is None:
                continue
        rows.append((mask, rank, span(groups), groups.bit_count(), order))
    rows.sort(key=lambda row: (-row[1], row[2], row[3]))  # stable: hierarchy order on ties
    built[key] = rows
    return rows


def _best_rank(
    prep: Prepared, mask: int, verts: tuple[int, ...], pattern: Pattern, deadline: Ticker | None
) -> tuple[int, tuple[int, ...] | None]:
    rank = prep.rank
    pairs = [rank[a][b] for i, a in enumerate(verts) for b in verts[i + 1 :]]
    if pattern is Pattern.ALLTOALL:
        return min(pairs), verts
    if len(verts) == 2:
        return pairs[0], tuple(sorted(verts))
    ham = rings(prep).ham
    for r in sorted(set(pairs), reverse=True):
        order = ham(mask, r, pattern is Pattern.ALLREDUCE, deadline)
        if order is not None:
            return r, order
    return -1, None
