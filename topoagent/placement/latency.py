"""How long one message takes over one link: the alpha-beta model the latency-bound
patterns are placed by (issue #19, with issue #9's estimate).

``alltoall`` and ``pipeline`` jobs send many messages between pairs of ranks, each often
small: a link's fixed cost per message counts beside its bandwidth.  For them term (1) of
the objective (placement.objective) ranks links by the time of one message of
``message_bytes`` (the request's; default ``LATENCY_BOUND_MESSAGE_BYTES``)::

    time_us = alpha_us + message_bytes / (1000 * gbps)

``alpha_us`` is the pair's small-copy latency: the probes' fresh measurement (the slower
direction), else its level's figure (``topoagent.node.levels.LATENCY_US``, calibrated on
p2pBandwidthLatencyTest's matrices); ``gbps`` is the figure the bandwidth-bound patterns
rank by (the level's expectation, or what a degraded pair achieves).  The pattern's value
is its slowest link (every pair for ``alltoall``, the path for ``pipeline``), so the
search stays a bottleneck search; at equal time the wider link, then the closer level,
wins.  With every level's alpha equal (no measurements) the order is the bandwidth order,
so only a measured latency -- a pair whose copies are staged, a congested path -- or a
small message can change an answer.

``allreduce`` stays bandwidth-bound (a ring pipelines its chunks); its ``estimate`` is
NCCL's ring model (placement.tiers) at ``message_bytes`` (default 256 MiB).
"""

from __future__ import annotations

import math

# One message between two ranks of an alltoall (a MoE layer's tokens for one expert) or a
# pipeline stage's send when the request does not say: 1 MiB, where a PCIe link's
# ~40 us of transfer still dwarfs its ~1.5 us of latency unless the pair is staged.
LATENCY_BOUND_MESSAGE_BYTES = 1 << 20


def link_time_us(alpha_us: float, gbps: float, message_bytes: int) -> float:
    """One message over one link, microseconds; infinite over a link with no bandwidth."""
    return alpha_us + message_bytes / (1000 * gbps) if gbps > 0 else math.inf


def time_key(alpha_us: float, gbps: float, closeness: tuple[int, ...], message_bytes: int) -> tuple:
    """A link's comparable key for a latency-bound pattern: larger is better."""
    return (-link_time_us(alpha_us, gbps, message_bytes), gbps, closeness)
