"""The percentile the benchmarks report their tails by (bench/stats.py)."""

from __future__ import annotations

import math

from bench.stats import percentile


def test_p99_of_a_hundred_calls_is_the_99th_not_the_slowest():
    calls = [float(i) for i in range(1, 101)]  # 1..100 ms
    assert percentile(calls, 0.99) == 99.0
    assert percentile(calls, 0.5) == 50.0
    assert percentile(calls, 0.10) == 10.0
    assert percentile(list(reversed(calls)), 0.99) == 99.0  # order does not matter


def test_fewer_samples_than_the_tail_needs_give_the_extremes():
    assert percentile([3.0, 1.0, 2.0], 0.99) == 3.0
    assert percentile([3.0, 1.0, 2.0], 0.0) == 1.0
    assert percentile([float(i) for i in range(30)], 0.10) == 2.0  # 0.1 * 30 is not quite 3 in floating point
    assert math.isnan(percentile([], 0.5))
