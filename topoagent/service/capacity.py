"""What this node can take now: the figures a cluster scheduler compares nodes by.

``capacity(matrix, leased, running)`` is pure.  It says which GPUs are free (not leased,
running no process, without a critical finding), the largest free zone, and for
each job size k from 1 to the node's GPU count whether a k-GPU all-reduce fits now and
how good the placement core's best answer is.  The agent computes it once per (snapshot,
busy set) and serves it at ``GET /capacity`` and in /metrics.

*Largest free zone*: the largest group of free GPUs joined to each other by local links
(NVLink, or one PCIe switch: ``PIX``, what the answers' ``satisfaction`` counts as local,
placement.tiers.is_local) along paths that stay within the free GPUs; a GPU with no free
local peer is a zone of one.  PCIe-switch groups count as zones as NVLink groups do (HAMi's
zones, which the schedulers our users run know, count them too): an idle PCIe node with
two switches of four GPUs has zones of four, not eight zones of one.  *Fragmentation* =
1 - largest free zone / free GPUs: 0 when every free GPU is in one zone (or none is
free), towards 1 as the free GPUs scatter across zones.  A node whose GPUs share no
switch and no NVLink scores 1 - 1/free: they can only talk through host bridges or CPUs.

*Budget*: with ``budget_ms`` the searches for all k together keep to about that much wall
time (each k's search gets what is left divided by the k still to search, at least 1 ms,
so time a small k does not need goes to the larger ones); a k whose search the deadline
stopped carries ``proven_optimal=False``, as /place says it.  The placement core answers
such a search with its first cheap set, so the whole stays bounded whatever the node's
size.  Without a budget every search is exact (no deadline): for tests and the CLI.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, Placement, Request, place
from topoagent.placement.explain import ReasonCode
from topoagent.placement.live import NO_LIVE
from topoagent.placement.tiers import is_local
from topoagent.vocabulary import Affinity


@dataclass(frozen=True, slots=True)
class Fit:
    """The best answer for k GPUs now (every figure null when it does not fit)."""

    gpus: int  # k
    fits: bool
    indices: tuple[int, ...]  # the GPUs the best answer takes
    score: float | None
    bandwidth_gbps: float | None
    numa_distance: int | None
    affinity: Affinity | None  # the strictest tier the answer meets
    satisfaction: float | None
    # False when the budget stopped the search: the best set found in time (or, with
    # ``fits`` False, none found in time -- not a proof that none fits).
    proven_optimal: bool = True


@dataclass(frozen=True, slots=True)
class Capacity:
    gpus: int  # on the node
    free: tuple[int, ...]  # nvidia-smi indices
    leased: tuple[int, ...]
    running: tuple[int, ...]  # running processes the agent did not place
    unhealthy: tuple[int, ...]  # a critical finding
    largest_free_zone: tuple[int, ...]
    fragmentation: float
    fits: tuple[Fit, ...]  # k = 1 .. gpus


def free_zones(matrix: DistanceMatrix, free: Iterable[int]) -> list[tuple[int, ...]]:
    """The free GPUs grouped by local links (NVLink or one PCIe switch) among themselves,
    largest first."""
    pos_of = {g.index: pos for pos, g in enumerate(matrix.gpus)}
    left = sorted(free)
    zones = []
    while left:
        zone, todo = {left[0]}, [left[0]]
        while todo:
            a = todo.pop()
            for b in left:
                if b not in zone and is_local(matrix.gpu_levels[pos_of[a]][pos_of[b]]):
                    zone.add(b)
                    todo.append(b)
        zones.append(tuple(sorted(zone)))
        left = [g for g in left if g not in zone]
    return sorted(zones, key=lambda z: (-len(z), z))


def capacity(
    matrix: DistanceMatrix, leased: Iterable[int], running: Iterable[int], live: Live = NO_LIVE, budget_ms: int | None = None,
) -> Capacity:
    """``live``: what /place weighs at equal merit (placement.live), so each k's GPUs are
    the ones /place would give now.  ``budget_ms``: the wall time all k's searches share
    (see the module docstring); None searches exactly, without a deadline."""
    on_node = {g.index for g in matrix.gpus}
    leased_set, running_set = set(leased) & on_node, set(running) & on_node
    busy = leased_set | running_set
    unhealthy = {g.index for g in matrix.gpus if g.unhealthy is not None}
    free = tuple(sorted(on_node - busy - unhealthy))
    zones = free_zones(matrix, free)
    largest = zones[0] if zones else ()
    fragmentation = 1 - len(largest) / len(free) if free else 0.0
    fits = []
    ends_at = None if budget_ms is None else time.monotonic() + budget_ms / 1000
    for k in range(1, len(matrix.gpus) + 1):
        # place() leaves out unhealthy GPUs by itself; more than the free count cannot fit.
        if k > len(free):
            fits.append(Fit(k, False, (), None, None, None, None, None))
            continue
        deadline_ms = None
        if ends_at is not None:
            left_ms = (ends_at - time.monotonic()) * 1000
            deadline_ms = max(1, int(left_ms / (len(free) - k + 1)))
        answer = place(matrix, Request(gpus=k, deadline_ms=deadline_ms), busy, live=live)
        if isinstance(answer, Placement):
            fits.append(Fit(k, True, answer.indices, answer.score, answer.bandwidth_gbps,
                            answer.objective.numa_distance, answer.affinity, answer.satisfaction, answer.proven_optimal))
        else:  # with a deadline: none found in time (none_in_time) proves nothing
            proven = answer.why.code is not ReasonCode.NONE_IN_TIME
            fits.append(Fit(k, False, (), None, None, None, None, None, proven))
    return Capacity(
        len(matrix.gpus), free, tuple(sorted(leased_set)), tuple(sorted(running_set - leased_set)),
        tuple(sorted(unhealthy - busy)), largest, round(fragmentation, 6), tuple(fits),
    )
