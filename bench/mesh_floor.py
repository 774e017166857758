"""How far the exact search is from 1 ms on an irregular 16-GPU NVLink mesh, and why.

    python -m bench.mesh_floor [--requests N] [--n GPUS] [--markdown]    (from a checkout's root)

The hardest requests of a random stream (the deadline study's k and busy-set draws) are
searched without a deadline three ways, counting the branch-and-bound nodes:

  as is        the search as shipped;
  ring oracle  plus an oracle that cuts, at once, every branch whose completions hold no
               ring (brute force over them: what perfect ring pruning would achieve);
  + exact bound  plus the exact damage bound over all levels together (brute force over the
               vertices of the count polytope) instead of the per-level one.

The aids are idealised (each costs far more than it saves): they bound from below the nodes
any pruning or damage bound of this branch and bound could reach.  With the CPU time per node
the search spends today, the last column is what the worst request would cost at that
floor.  Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import combinations

import topoagent.placement.search as search
from topoagent.placement import Request, place, warm
from topoagent.placement.synthetic import irregular_mesh
from topoagent.vocabulary import Pattern


@contextmanager
def patched(name: str, replacement) -> Iterator[None]:
    original = getattr(search.Search, name)
    setattr(search.Search, name, replacement(original))
    try:
        yield
    finally:
        setattr(search.Search, name, original)


def counting(nodes: list[int]):
    def wrap(original):
        def branch(self, *args):
            nodes[0] += 1
            return original(self, *args)
        return branch
    return wrap


def ring_oracle(original):
    def branch(self, ci, taken, rem, cand, dmg, *was):
        if not self.stop_at_first and self.check_order and rem > 0 and taken:
            cycle = self.req.pattern is Pattern.ALLREDUCE
            members = list(search.bits(cand))
            if not any(
                search.rings(self.prep).ham(taken | sum(1 << v for v in extra), self.r, cycle) is not None
                for extra in combinations(members, rem)
            ):
                return None
        return original(self, ci, taken, rem, cand, dmg, *was)
    return branch


def exact_damage_bound(original):
    """max(the per-level bound, the least damage over every way of taking ``rem`` of
    ``cand``): the damage depends only on how many are taken in each cell (GPUs sharing
    every zone), and is concave in those counts, so its least is at a vertex of the count
    polytope: every cell empty or full but at most one."""

    def bound(self, taken, cand, rem):
        prep = self.prep
        cells: dict[tuple[int, ...], int] = {}
        for v in search.bits(cand):
            key = tuple(zone_of[v] for _, zone_of in prep.zone_levels)
            cells[key] = cells.get(key, 0) + 1
        items = list(cells.items())
        room = {z: 2 * ((z & self.free_all).bit_count() - (taken & z).bit_count()) for zones in prep.zones_by_level for z in zones}

        def damage(counts: list[int]) -> int:
            per_zone: dict[int, int] = {}
            for (zones, _), x in zip(items, counts):
                for z in zones:
                    per_zone[z] = per_zone.get(z, 0) + x
            return sum(x * (room[z] - x) for z, x in per_zone.items() if x)

        least = None
        for full in range(1 << len(items)):
            counts = [cap if full >> i & 1 else 0 for i, (_, cap) in enumerate(items)]
            left = rem - sum(counts)
            options = [counts] if left == 0 else []
            if left > 0:
                for i, (_, cap) in enumerate(items):
                    if not full >> i & 1 and cap > left:
                        options.append(counts[:i] + [left] + counts[i + 1 :])
            for option in options:
                value = damage(option)
                least = value if least is None or value < least else least
        return max(original(self, taken, cand, rem), least or 0)

    return bound


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16, help="GPUs of the mesh (default 16)")
    parser.add_argument("--requests", type=int, default=12, help="hardest requests kept (default 12)")
    parser.add_argument("--markdown", action="store_true", help="print its block in the docs (bench/report.py)")
    args = parser.parse_args()
    n = args.n
    rng = random.Random(5)
    stream = []
    for _ in range(300):
        k = rng.choice(sorted({1, 2, 4, 8, max(1, n // 4), n // 2}))
        stream.append((k, rng.sample(range(n), rng.randint(0, n - k))))
    timed = []
    for k, busy in stream:
        m = irregular_mesh(n)
        warm(m)
        start = time.thread_time_ns()
        place(m, Request(gpus=k), busy)
        timed.append(((time.thread_time_ns() - start) / 1e6, k, busy))
    timed.sort(key=lambda row: -row[0])
    hardest = timed[: args.requests]

    def nodes_of(k: int, busy: list[int], *aids) -> tuple[int, float]:
        nodes = [0]
        m = irregular_mesh(n)
        warm(m)
        with patched("_branch", counting(nodes)):
            managers = [patched(name, aid) for name, aid in aids]
            for manager in managers:
                manager.__enter__()
            try:
                start = time.thread_time_ns()
                place(m, Request(gpus=k), busy)
                seconds = (time.thread_time_ns() - start) / 1e9
            finally:
                for manager in reversed(managers):
                    manager.__exit__(None, None, None)
        return nodes[0], seconds

    rows = []
    cpu = 0.0
    for ms, k, busy in hardest:
        plain, seconds = nodes_of(k, busy)
        oracle, _ = nodes_of(k, busy, ("_branch", ring_oracle))
        both, _ = nodes_of(k, busy, ("_branch", ring_oracle), ("damage_bound", exact_damage_bound))
        cpu += seconds
        rows.append((k, len(busy), ms, plain, oracle, both))
    totals = [sum(row[i] for row in rows) for i in (3, 4, 5)]
    worst = [max(row[i] for row in rows) for i in (3, 4, 5)]
    per_node_us = cpu / totals[0] * 1e6
    title = f"Irregular NVLink mesh, {n} GPUs: the {len(rows)} slowest of 300 requests, exact search (no deadline)."
    floor = (
        f"CPU per node as shipped (a whole place() call over its nodes): {per_node_us:.1f} us; the worst"
        f" request at the floor: {worst[2]} nodes x {per_node_us:.1f} us = {worst[2] * per_node_us / 1e3:.2f} ms."
    )
    if args.markdown:
        print(title, "Branch-and-bound nodes as shipped, with a ring oracle, and with the exact damage bound too.")
        print()
        print("| k | busy | CPU ms | nodes as shipped | with a ring oracle | and the exact damage bound |")
        print("|---:|---:|---:|---:|---:|---:|")
        for k, b, ms, plain, oracle, both in rows:
            print(f"| {k} | {b} | {ms:.2f} | {plain} | {oracle} | {both} |")
        print(f"| all | | | {totals[0]} | {totals[1]} | {totals[2]} |")
        print()
        print(floor)
        return
    print(title + "\n")
    print(f"{'k':>3} {'busy':>4} {'CPU ms':>7} {'as is':>6} {'ring oracle':>12} {'+ exact bound':>14}")
    for k, b, ms, plain, oracle, both in rows:
        print(f"{k:>3} {b:>4} {ms:7.2f} {plain:>6} {oracle:>12} {both:>14}")
    print(f"\ntotal nodes {totals[0]} / {totals[1]} / {totals[2]}; most in one request {worst[0]} / {worst[1]} / {worst[2]}")
    print(floor)


if __name__ == "__main__":
    main()
