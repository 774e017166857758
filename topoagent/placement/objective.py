"""The placement objective: the terms every answer is ranked by, how the search reaches
the exact optimum, and helpers that score an arbitrary set by the same terms.

Who may be chosen
-----------------
A GPU with a critical finding (``GpuInfo.unhealthy``: off the bus, outside the NVSwitch
fabric, every NVLink down) is never chosen unless the request's ``include`` names it.
GPUs whose levels are unknown (``GpuInfo.links_known`` false: sysfs does not show the GPU
and nvidia-smi did not say) come last: the best set of GPUs whose links are known; when
those cannot hold the job, every one of them plus the fewest unknown ones; only then
any set.  Their links count at the farthest level with no bandwidth.  A NIC with no
ACTIVE port is never counted nor listed.

Objective (lexicographic; an earlier term always wins over a later one)
-----------------------------------------------------------------------
1. **Pattern bandwidth**, maximised.  Every GPU pair has an edge key
   ``(bandwidth, closeness)``: bandwidth is the level's expected GB/s, or, when a fresh
   measurement shows the pair clearly below what its level achieves, what it achieves on
   the same peak scale (``levels.measured_gbps``: a tolerance band with hysteresis, so
   noise never changes an answer and a degraded pair ranks below every healthy one of
   its level); at equal bandwidth the closer level wins (so from an nvidia-smi matrix
   alone NV n beats every PCIe level and more NVLinks beat fewer, and PIX beats PXB).
   The pattern's value is the key of its weakest link: for ``allreduce`` the best ring
   (a Hamiltonian cycle through the set; bottleneck), for ``pipeline`` the best path, for
   ``alltoall`` the weakest pair.  ``independent`` jobs and single GPUs have no links.
   The latency-bound patterns (``alltoall``, ``pipeline``) key a link by one message's
   time first, small-copy latency + ``message_bytes`` / bandwidth (placement.latency),
   then bandwidth and closeness: the same bottleneck search over another ranking.
2. **Least NUMA distance** spanned: the largest SLIT distance (``numactl -H``) between
   the NUMA nodes of the chosen GPUs, a node with itself included (10 for one node, 12
   for two nodes of one socket on a DGX A100, 32 across its sockets).  0 for every set
   on a node without distances (an nvidia-smi matrix alone, a NUMA group known only by
   its CPU list): then term (3) alone speaks for NUMA.
3. **Fewest NUMA nodes** (sockets) spanned.  A GPU's NUMA node is the one nvidia-smi or
   sysfs reports; when only the CPU affinity is known, GPUs with the same CPU list count
   as one node.
4. **NIC affinity**, only when ``nics`` > 0: the sum of the link-kind distances of the
   ``nics`` NICs closest to the set (each NIC's distance is its closest GPU in the set),
   then, at an equal sum, the most port rate (NICs taken closest first, faster first).
5. **Least damage to what stays free**: for every zone of the node -- NUMA nodes and the
   connected groups at each link level (NVLink zones, PCIe switches, host bridges) --
   taking ``s`` of the zone's ``f`` free GPUs costs ``f^2 - (f-s)^2``.  Minimising it is
   best fit: take from the most used zone (this applies to k=1 too) and keep whole zones
   whole for later large jobs.
6. **Live signals at equal merit** (placement.live), passed beside ``busy`` and never
   in the matrix: first the fewest *unverified* GPUs (a job gave them back and the probes
   have not checked them since), then the least traffic now on the GPUs' nearest NICs
   (each GPU counts its least loaded nearest NIC, in steps of a tenth of the port's line
   rate, so noise does not flip answers).  Both are 0 without live signals.
7. **Deterministic tie-break**: leave each GPU that stays free its best link to another
   free GPU (least *partner loss*: summed over the GPUs left free, how far the rank of
   each one's best free link falls).  Where zones say nothing -- on a DGX-1 hybrid cube
   mesh every NVLink graph is connected, so its only zones are the sockets -- this keeps
   NV2 pairs whole for later 2-GPU jobs.  Then the first set in search order.  On nodes
   answered from a table (below) the partner rule is applied to every tied set; in the
   branch and bound, to the tied sets it visits.

Terms (1)-(3) are exact -- the global optimum over all k-subsets, not a heuristic --
and so are (4), (5) and (6) given the terms before them.  The search never enumerates
partitions:

* Small nodes.  Where a node has at most ``SMALL_TABLE_SETS`` k-sets (every k on an
  8-GPU node; k near 1 or n on larger ones) the per-matrix tables hold every k-set with
  its best pattern rank, order, NUMA distance and NUMA count, best first; a query scans
  it, skipping busy and disallowed sets, and stops at the first worse (bandwidth, NUMA
  distance, NUMA nodes) group.
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
  one per socket, when NICs do not matter).  Members of a class differ only in (6), which
  a GPU adds to on its own: a count of them is taken cheapest first (verified, then quiet
  NICs), the least (6) of any subset of that size.
* Branch and bound over classes, NUMA nodes that can hold the job first (best fit), with
  lower bounds taken one term at a time for (2) (the span of the NUMA nodes touched --
  it only grows -- or, when they cannot hold the rest, the least span with one more
  node), (3) (NUMA nodes touched plus the fewest further nodes that can hold the rest),
  (4) (the NIC cost of everything still allowed -- it only falls as GPUs are added),
  (5): taking a of a zone's c remaining candidates costs a(2L - a) with L its free
  untaken GPUs, concave in a, so the least completion has every zone taken whole or not
  at all but one -- tried exactly when at most three zones are in play, else bounded by
  the whole-zone rate 2L - c per GPU -- and (6) (what is taken: each GPU only adds to
  it).  A memoised Hamiltonian check runs at the leaves for sets whose links at ``t`` are
  not a clique.
* Rings and paths per set of NUMA nodes.  Where rings or paths are checked on a node of
  three NUMA nodes or more and 64 GPUs at most (at 128 the checks cost the deadline), a branch is also bounded on each set of NUMA nodes the best
  set could lie within (its span and count no worse than the best's): the ring checks
  and the bounds above on those nodes' candidates alone.  A set of nodes whose candidates hold no ring, or whose bounds say
  every completion there is worse, drops out; the branch is cut when none is left, and
  takes no GPU outside them (a run of classes with none there is left out at once).  For
  rings of 16 GPUs or fewer each set's ring check also follows the links a ring is forced
  to use (rings.ring_may_hold).  On an irregular mesh the bounds alone would favour sockets
  where no ring fits.  Only branches holding nothing as good as the best are cut (nothing
  better once no tie can win the tie-break below), so the answer is the same.

Everything that depends only on the matrix (bitmasks, classes, tables, answer pieces) is
built once per matrix and kept in its ``derived_cache``.

The node ``score`` is ``10 x quality - loss``: quality is the pattern bandwidth in GB/s
(absolute, so comparable across nodes; 0 for jobs without links), loss is the number of
extra NUMA nodes spanned plus the number of whole zones the placement breaks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from topoagent.node.levels import LinkLevel
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement.bounds import Bounds, terms
from topoagent.placement.request import Request
from topoagent.placement.search import Search
from topoagent.placement.tables import bits, prepare


@dataclass(frozen=True, slots=True)
class Objective:
    """The terms of the objective for one answer (see the module docstring)."""

    bandwidth_gbps: float | None  # (1), None when the pattern has no links
    bottleneck_level: LinkLevel | None  # (1), the level of the weakest pattern link
    numa_distance: int | None  # (2), None when the node has no NUMA distances
    numa_nodes: int  # (3)
    nic_cost: int  # (4), the kinds summed; 0 when no NICs were asked for
    damage: int  # (5)
    link_time_us: float | None = None  # (1) for alltoall and pipeline: one message over the slowest link
    unverified_gpus: int = 0  # (6), GPUs not probed since a job gave them back
    nic_traffic_steps: int = 0  # (6), traffic now on the GPUs' nearest NICs, tenths of line rate


def evaluate_damage(matrix: DistanceMatrix, busy: Iterable[int], chosen: Iterable[int]) -> int:
    """Objective term (5) for an arbitrary set: lets tests and benchmarks compare policies."""
    prep = prepare(matrix, None)
    return Bounds(prep, prep.all_mask & ~prep.gpus_mask(busy)).damage_add(0, prep.gpus_mask(chosen))


def evaluate_partner_loss(matrix: DistanceMatrix, busy: Iterable[int], chosen: Iterable[int]) -> int:
    """Tie-break (7) for an arbitrary set: summed over the GPUs left free, how far the rank
    of each one's best free link falls.  Lets benchmarks say which of two sets equal on
    terms (1)-(6) the tie-break prefers."""
    prep = prepare(matrix, None)
    taken = prep.gpus_mask(chosen)
    free = prep.all_mask & ~prep.gpus_mask(busy)
    search = Search(prep, Request(gpus=max(1, taken.bit_count())), free, free, 0)
    return search.partner_loss(taken)


def numa_groups(matrix: DistanceMatrix) -> list[tuple[int, ...]]:
    """GPU indices per NUMA group as the objective counts them (term 3)."""
    prep = prepare(matrix, None)
    return [tuple(matrix.gpus[v].index for v in bits(m)) for m in prep.numa_masks]


def numa_distance(matrix: DistanceMatrix, indices: Iterable[int]) -> int | None:
    """Objective term (2) for an arbitrary set of GPU indices; None without distances."""
    prep = prepare(matrix, None)
    if prep.numa_dist is None:
        return None
    return terms(prep).numa_span(prep.groups_of(prep.gpus_mask(indices)))


def edge_key(matrix: DistanceMatrix, a_index: int, b_index: int, now: float | None = None) -> tuple[float, tuple[int, ...]]:
    """The comparable key of one GPU pair (by nvidia-smi index): (GB/s, closeness);
    larger is better."""
    a_pos, b_pos = matrix.gpu_by_index(a_index), matrix.gpu_by_index(b_index)
    closeness = tuple(-x for x in matrix.gpu_levels[a_pos][b_pos].sort_key())
    return (matrix.bandwidth(a_pos, b_pos, now) or 0.0, closeness)
