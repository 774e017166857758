"""The percentile every benchmark reports its tails by (p10, p99), written once."""

from __future__ import annotations

import math


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank percentile: the smallest value that at least ``q`` of ``values``
    do not exceed (NaN for none).  Below 1 / (1 - q) samples that is the largest: a p99
    of fewer than 100 calls is their maximum."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = math.ceil(round(q * len(ordered), 9))  # round: 0.1 * 30 is 3.0000000000000004
    return ordered[min(len(ordered), max(rank, 1)) - 1]
