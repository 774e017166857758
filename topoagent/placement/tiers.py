"""Affinity tiers, topology satisfaction and the estimate of an answer (each pattern its model).

Tiers (a request's ``affinity``), strictest first
-------------------------------------------------
* ``best``: every link of the pattern is at the node's best GPU-pair level (the closest
  level any two of its GPUs have: NV12 on a DGX A100, NV2 on a DGX-1) and every GPU is on
  one NUMA node.
* ``better``: no link of the pattern crosses the socket interconnect (none at ``SYS``) and
  every GPU is on one socket.  Sockets are NUMA nodes closer than
  ``topoagent.node.matrix.SAME_SOCKET_DISTANCE`` in the SLIT table, joined; without a table
  (nvidia-smi text) each NUMA node is taken as a socket.
* ``any``: whatever fits.
A job without links (one GPU, ``independent``) meets the link parts of every tier.

Every answer says the strictest tier it meets (``affinity``).  A request asking for a tier
is searched with the existing constraints, no new search: ``best`` adds ``single_numa``;
``better`` runs the search once on each socket's GPUs and keeps the best answer (pattern
bandwidth first, then the objective's other terms).  The answer found is then checked
against the tier: the objective ranks pattern bandwidth first, so when the best set on one
NUMA node (socket) has a link below the tier's level, no set there has all its links at
it (with expected figures; a measured figure may reorder sets).

Topology satisfaction
---------------------
The share of the pattern's links (``links`` of the answer: the ring's k links for
``allreduce`` with k >= 3, the one pair for k = 2, k - 1 for ``pipeline``, every pair for
``alltoall``) whose level is *local*: NVLink (``NV<n>``) or one PCIe switch (``PIX``).
Anything through a host bridge or the CPUs (``PXB``, ``PHB``, ``NODE``, ``SYS``) is not.
A job without links scores 1.0: nothing it needs is far.

Estimate
--------
Each pattern's own model (``Estimate.model``), of one node's links, not a measurement:
compare answers with it ("4 GPUs on NVLink" against "8 across sockets" at the job's
message size), then measure.  ``independent`` jobs exchange nothing: no estimate (nor for
one GPU).

``ring_allreduce`` (``allreduce``): ring all-reduce of ``message_bytes`` (default 256 MiB)
over the GPUs in rank order (the ring closing last -> first), by NCCL's own alpha-beta
model for the ring algorithm and the Simple protocol (NVIDIA/nccl src/graph/tuning.cc,
``ncclTopoTuneModel``)::

    time_us  = 8.4 + 2(k-1) * hop_us + S / (1000 * B * k / (2(k-1)))
    bus GB/s = S * 2(k-1)/k / (1000 * time_us)

``8.4`` us is NCCL's base latency (``baseLat[Ring][Simple]``); ``hop_us`` its per-step
latency (``hwLat[..][Ring][Simple]``): 3.4 us when every ring link is NVLink, else 5.7 us
(PCI); ``2(k-1)`` the steps of a ring all-reduce; ``B`` (GB/s per direction) the ring's
weakest link by the answer's own figures (measured when fresh, else the level's expected
rate); ``B * k / (2(k-1))`` NCCL's algorithm bandwidth from bus bandwidth.

``alltoall`` and ``pipeline_p2p`` time messages as the objective does (placement.latency:
``alpha_us + S / (1000 * gbps)`` per link, the pair's small-copy latency and bandwidth),
with ``message_bytes`` one message (default 1 MiB, as the search ranks them):

* ``alltoall``: every rank sends one message to each of the k-1 others, its sends one
  after another (they share the GPU's links); the slowest rank's total is the time, and
  ``bus GB/s = (k-1) * S / (1000 * time_us)`` (what each rank sent per unit time: nccl-tests'
  alltoall busbw, algbw * (n-1)/n, for a buffer of k messages).
* ``pipeline_p2p``: each stage sends one message to the next, all stages at once; the
  slowest stage link sets the pace (``time_us`` per message), and ``bus GB/s = S / (1000 *
  time_us)`` (nccl-tests' sendrecv busbw).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

from topoagent.node.levels import LevelKind, LinkLevel
from topoagent.placement.anytime import Anytime
from topoagent.placement.deadline import Deadline
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES, link_time_us
from topoagent.placement.search import Found
from topoagent.placement.tables import Prepared, bits
from topoagent.vocabulary import Affinity, EstimateModel, Pattern

if TYPE_CHECKING:
    from topoagent.placement.live import LiveCosts
    from topoagent.placement.request import Request

DEFAULT_MESSAGE_BYTES = 256 << 20
NCCL_RING_BASE_LATENCY_US = 8.4  # baseLat[Ring][Simple]
NCCL_RING_HOP_LATENCY_US = {"nvlink": 3.4, "pci": 5.7}  # hwLat[NVLINK|PCI][Ring][Simple]


class PatternLink(Protocol):
    """A link the pattern uses as tiers read it (placement.answer.PatternLink)."""

    @property
    def level(self) -> LinkLevel: ...

    @property
    def gbps(self) -> float: ...


MODEL_OF = {Pattern.ALLREDUCE: EstimateModel.RING_ALLREDUCE, Pattern.ALLTOALL: EstimateModel.ALLTOALL,
            Pattern.PIPELINE: EstimateModel.PIPELINE_P2P}  # independent: none


@dataclass(frozen=True, slots=True)
class Estimate:
    model: EstimateModel
    message_bytes: int  # ring_allreduce: the all-reduce's size; else one message
    link_gbps: float  # the weakest link the model uses, GB/s per direction
    latency_us: float  # ring: NCCL's per-step latency; else the largest small-copy latency among its links
    time_us: float  # ring: one all-reduce; alltoall: one exchange; pipeline: one message through the slowest stage
    bus_bandwidth_gbps: float
    ring_gbps: float | None = None  # the ring's weakest link (ring_allreduce only; link_gbps says the same)
    hop_latency_us: float | None = None  # NCCL's per-step latency (ring_allreduce only)


def is_local(level: LinkLevel) -> bool:
    return level.is_nvlink or level.kind is LevelKind.PIX


def satisfaction(links: tuple[PatternLink, ...]) -> float:
    if not links:
        return 1.0
    return round(sum(1 for link in links if is_local(link.level)) / len(links), 4)


def estimate(
    prep: Prepared, order: tuple[int, ...], pattern: Pattern, ring: tuple[PatternLink, ...], message_bytes: int | None
) -> Estimate | None:
    """The pattern's model for the GPUs at positions ``order`` in rank order (module
    docstring); ``ring``: the ring through them, which the all-reduce model reads."""
    k = len(order)
    model = MODEL_OF.get(pattern)
    if k < 2 or model is None:
        return None
    if model is EstimateModel.RING_ALLREDUCE:
        return _ring_allreduce(ring, k, message_bytes)
    size = message_bytes or LATENCY_BOUND_MESSAGE_BYTES
    alpha, bw = prep.alpha, prep.bw
    if model is EstimateModel.ALLTOALL:
        pairs = [(a, b) for a in order for b in order if a != b]
        time_us = max(sum(link_time_us(alpha[a][b], bw[a][b], size) for b in order if b != a) for a in order)
        sent = (k - 1) * size
    else:
        pairs = list(itertools.pairwise(order))
        time_us = max(link_time_us(alpha[a][b], bw[a][b], size) for a, b in pairs)
        sent = size
    if math.isinf(time_us):
        return None  # a link of unknown bandwidth: no time to give
    link = min(bw[a][b] for a, b in pairs)
    latency = max(alpha[a][b] for a, b in pairs)
    return Estimate(model, size, round(link, 2), round(latency, 3), round(time_us, 3), round(sent / (1000 * time_us), 3))


def _ring_allreduce(ring: tuple[PatternLink, ...], k: int, message_bytes: int | None) -> Estimate | None:
    """NCCL's ring all-reduce model for ``k`` GPUs joined by ``ring`` (module docstring)."""
    if not ring:
        return None
    size = message_bytes or DEFAULT_MESSAGE_BYTES
    link_gbps = min(link.gbps for link in ring)
    hop = NCCL_RING_HOP_LATENCY_US["nvlink" if all(link.level.is_nvlink for link in ring) else "pci"]
    steps = 2 * (k - 1)
    algorithm_gbps = link_gbps * k / steps
    time_us = NCCL_RING_BASE_LATENCY_US + steps * hop + (size / (1000 * algorithm_gbps) if algorithm_gbps else float("inf"))
    bus = size * steps / k / (1000 * time_us)
    return Estimate(EstimateModel.RING_ALLREDUCE, size, link_gbps, hop, round(time_us, 3), round(bus, 3), link_gbps, hop)


# --- which tier a set meets ---------------------------------------------------------------


class TierTables:
    """Per matrix: the node's best GPU-pair level, each GPU's socket, the sockets' GPUs."""

    def __init__(self, prep: Prepared):
        matrix = prep.matrix
        n = matrix.size
        self.best_level = min(
            (matrix.gpu_levels[i][j] for i in range(n) for j in range(n) if i != j), default=None
        )
        host = matrix.host
        socket_key: list[tuple[str, int]] = []
        for pos, g in enumerate(matrix.gpus):
            if host is not None and g.numa_node is not None and g.numa_node in host.socket_of:
                socket_key.append(("socket", host.socket_of[g.numa_node]))
            else:  # no SLIT table: the objective's NUMA group stands for the socket
                socket_key.append(("numa", prep.numa_of[pos]))
        self.socket_key = socket_key
        masks: dict[tuple[str, int], int] = {}
        for pos, key in enumerate(socket_key):
            masks[key] = masks.get(key, 0) | 1 << pos
        self.socket_masks = list(masks.values())


def tier_tables(prep: Prepared) -> TierTables:
    got = prep.matrix.derived_cache.get("tiers")
    if got is None:
        got = prep.matrix.derived_cache["tiers"] = TierTables(prep)
    return got


def tier_met(prep: Prepared, mask: int, links: tuple[PatternLink, ...]) -> Affinity:
    """The strictest tier the GPUs ``mask`` with pattern links ``links`` meet."""
    t = tier_tables(prep)
    if len({t.socket_key[v] for v in bits(mask)}) > 1 or any(link.level.kind >= LevelKind.SYS for link in links):
        return Affinity.ANY
    one_numa = len({prep.numa_of[v] for v in bits(mask)}) == 1
    if one_numa and all(link.level == t.best_level for link in links):
        return Affinity.BEST
    return Affinity.BETTER


def search_tier(
    prep: Prepared, req: Request, tier: Affinity, free_all: int, candidates: int, include: int,
    deadline: Deadline | None = None, live: LiveCosts | None = None,
) -> Found | None:
    """The search for ``req`` under ``tier``'s constraints (module docstring); the caller
    checks the answer with ``tier_met``."""
    if tier is Affinity.BEST:
        return Anytime(prep, replace(req, single_numa=True), free_all, candidates, include, deadline, live).run()
    if tier is Affinity.ANY:
        return Anytime(prep, req, free_all, candidates, include, deadline, live).run()
    best: Found | None = None
    for socket in tier_tables(prep).socket_masks:
        if include & ~socket or (candidates & socket).bit_count() < req.gpus:
            continue
        found = Anytime(prep, req, free_all, candidates & socket, include, deadline, live).run()
        if found is not None and (best is None or _better(found, best)):
            best = found
    return best


def _better(a: Found, b: Found) -> bool:
    """Pattern bandwidth first (a higher rank), then the objective's other terms."""
    return (-(a.rank or 0), a.key) < (-(b.rank or 0), b.key)

