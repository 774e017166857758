"""Placement benchmark: latency, quality against brute force, and a job-stream simulation.

    python -m bench.placement            # everything (a few minutes on 2 cores)
    python -m bench.placement --quick    # fewer samples and events
    python -m bench.placement --quick --only deadline   # bounded time at 8-128 GPUs
    python -m bench.placement --quick --only loaded     # the same beside 2 CPU-bound processes (--spinners N)
    python -m bench.placement --only simulate --markdown  # a docs block (bench/report.py; also latency, deadline)

Prints tables; asserts nothing (tests check correctness, this measures).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from itertools import combinations, permutations
from pathlib import Path

from bench.baselines import (
    BestEffortPolicy,
    HamiTopologyPolicy,
    HamiZonePolicy,
    RandomFit,
    Refused,
    first_fit,
    self_check,
)
from bench.neutral import Grader
from bench.stats import percentile
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Placement, Request, numa_groups, place, warm
from topoagent.placement.request import SERVICE_DEADLINE_MS
from topoagent.placement.search import warm as warm_tables
from topoagent.placement.synthetic import (
    irregular_mesh,
    node_32,
    nvswitch_16,
    nvswitch_node,
    pcie_16,
    pcie_two_socket_8,
    tree_node,
)

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
CORPUS = SHARED / "corpus" / "nvidia-smi-topo"
# Without the corpus beside the checkout (a clean clone), the recordings shipped in
# fixtures/snapshots stand in: their `nvidia-smi topo -m` answers, named after the fixture.
SHIPPED = REPO / "fixtures" / "snapshots"
# The corpus captures the studies name, and the shipped recording of the same kind of node.
STAND_INS = {"dlperf-8xV100": "dgx1-v100", "sglang-24966": "hgx-h100"}


def corpus() -> list[tuple[str, DistanceMatrix]]:
    """The corpus's matrices; the shipped recordings' when the corpus is not there (said on stderr)."""
    files = sorted(CORPUS.glob("*.txt"))
    if files:
        named = [(path.name.split(".txt")[0][:34], path) for path in files]
    else:
        named = [(path.parts[-3], path) for path in sorted(SHIPPED.glob("*/commands/nvidia-smi_topo_-m.out"))]
        _say_once(f"bench: no corpus at {CORPUS}; using the {len(named)} recordings shipped in {SHIPPED.relative_to(REPO)}")
    out = []
    for name, path in named:
        try:
            m = DistanceMatrix.from_topo_matrix(parse_topo_matrix(path.read_text()))
        except ValueError:
            continue
        if m.size >= 3:
            out.append((name, m))
    out.append(("synthetic-pcie-2socket-8", pcie_two_socket_8()))
    return out


def recorded(prefix: str) -> tuple[str, DistanceMatrix]:
    """The corpus capture named ``prefix``, or its stand-in from fixtures/snapshots."""
    found = corpus()
    for name, m in found:
        if name.startswith(prefix):
            return name, m
    stand_in = STAND_INS[prefix]
    for name, m in found:
        if name == stand_in:
            _say_once(f"bench: {prefix} is not in the corpus; fixtures/snapshots/{stand_in} stands in for it")
            return name, m
    raise SystemExit(f"bench: neither {prefix} (corpus) nor {stand_in} (fixtures/snapshots) is there")


_SAID: set[str] = set()


def _say_once(line: str) -> None:
    if line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)


def snapshot(name: str) -> DistanceMatrix:
    """A recorded node of fixtures/snapshots, with its SLIT table and NIC states."""
    from topoagent.commands.discover import discover_root

    return discover_root(str(Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / name)).distance_matrix()


# --- latency --------------------------------------------------------------------------


PATTERNS = {"ring": {}, "ring+2 NICs": {"nics": 2}, "alltoall": {"pattern": "alltoall"}, "pipeline": {"pattern": "pipeline"}}


def shapes(m: DistanceMatrix) -> list[tuple[str, Request]]:
    """Every request shape the latency study asks: k by pattern (NICs where the node has them)."""
    out = []
    for k in sorted({1, 2, 3, 4, 8, m.size // 2, m.size - 2} - {0}):
        if k <= m.size:
            for label, extra in PATTERNS.items():
                extra = {**extra, "nics": min(extra["nics"], len(m.nics))} if "nics" in extra else extra
                out.append((f"k={k} {label}", Request(gpus=k, **extra)))
    return out


def timed(m: DistanceMatrix, request: Request, busy=()) -> tuple[float, float]:
    """Wall and thread CPU milliseconds of one place() call."""
    c0 = time.thread_time_ns()
    t0 = time.perf_counter_ns()
    place(m, request, busy)
    return (time.perf_counter_ns() - t0) / 1e6, (time.thread_time_ns() - c0) / 1e6


def _labelled(label: str, prefix: str) -> tuple[str, DistanceMatrix]:
    """A latency row's node: the corpus capture, or its stand-in named as such."""
    name, m = recorded(prefix)
    return (label if name.startswith(prefix) else f"{name} (shipped stand-in for: {label})"), m


def latency_results(samples: int) -> list[dict]:
    nodes = [
        _labelled("DGX-1 V100 cube mesh", "dlperf-8xV100"),
        _labelled("HGX H20 NVSwitch + 8 NICs", "sglang-24966"),
        ("PCIe, 2 sockets", pcie_two_socket_8()),
        ("NVSwitch, DGX-2-like", nvswitch_16()),
        ("PCIe, 2 sockets x 4 switches", pcie_16()),
        ("4 sockets, NV18 zones", node_32()),
    ]
    rng = random.Random(1)
    out = []
    for name, m in nodes:
        asked = shapes(m)
        # Nothing warmed: a new matrix for each shape, its first call builds everything.
        cold = [(timed(replace(m), req)[0], label) for label, req in asked]
        # After a topology change the agent builds the search tables before serving
        # (placement.search.warm); the answers are built later, in the background.
        fresh = replace(m)
        warm_tables(fresh)
        first = [(timed(fresh, req)[0], label) for label, req in asked]
        # Steady state: tables and answers built (placement.warm), every shape asked once.
        warm(m)
        for _, req in asked:
            place(m, req)
        wall, cpu = [], []
        for _ in range(samples * len(asked)):
            _, req = rng.choice(asked)
            w, c = timed(m, req, rng.sample(range(m.size), rng.randint(0, m.size - req.gpus)))
            wall.append(w)
            cpu.append(c)
        out.append({"node": name, "gpus": m.size, "shapes": len(asked), "calls": len(wall),
                    "p50": statistics.median(wall), "p99": percentile(wall, 0.99), "max": max(wall), "cpu_p99": percentile(cpu, 0.99),
                    "first": first, "cold": cold})
    return out


def latency(samples: int, markdown: bool = False) -> None:
    results = latency_results(samples)
    if not markdown:
        print("\n## Latency of place() in-process, wall time (ms)\n")
    print("Wall time (perf_counter) of place() in this process, exact search (no deadline), random busy sets.")
    print("Steady state: the matrix's tables and answers built as the agent builds them after a")
    print("snapshot (placement.warm) and every request shape asked once, then random shapes")
    print("(k by ring / ring with 2 NICs / alltoall / pipeline). First call after a topology change:")
    print("each shape's first call on a new matrix whose search tables were built as the agent builds")
    print("them before serving (placement.search.warm), answers not yet built. Nothing warmed: each")
    print("shape's first call on a new matrix, no tables at all. Median over the shapes, and the worst.\n")
    print("| node | GPUs | calls | wall p50 | wall p99 | wall max | CPU p99 | first call after a topology change: median / worst | nothing warmed: median / worst |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---|")
    for r in results:
        def spread(calls: list[tuple[float, str]]) -> str:
            worst, label = max(calls)
            return f"{statistics.median(c for c, _ in calls):.2f} / {worst:.2f} ({label})"

        print(f"| {r['node']} | {r['gpus']} | {r['calls']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['max']:.2f} | {r['cpu_p99']:.3f}"
              f" | {spread(r['first'])} | {spread(r['cold'])} |")


# --- bounded time at every node size --------------------------------------------------

TREES = {8: (2, 2, 2), 16: (2, 4, 2), 32: (2, 4, 4), 64: (2, 4, 8), 128: (2, 8, 8)}
FAMILIES = {
    "NVSwitch": lambda n: nvswitch_node(n),
    "PCIe tree": lambda n: tree_node(*TREES[n]),
    "irregular mesh": lambda n: irregular_mesh(n),
}


def deadline_study(samples: int, deadline_ms: int = SERVICE_DEADLINE_MS, markdown: bool = False) -> None:
    import tracemalloc

    if markdown:  # a docs block (bench/report.py): the page has the heading
        print(f"place() with deadline_ms={deadline_ms}, tables warmed as the agent does (ms).")
    else:
        print(f"\n## Bounded time: place() with deadline_ms={deadline_ms}, tables warmed as the agent does (ms)\n")
    print("k drawn from 1, 2, 4, 8, n/4, n/2 with a random busy set each.  wall = perf_counter, cpu = this")
    print("thread's CPU time (what the search itself spent; wall adds the other processes of a shared")
    print("machine).  late = answers after the deadline + 1 ms, by the wall clock and by CPU time;")
    print("proven = share proven optimal; ratio = the worst deadline answer's bandwidth over the")
    print("optimum's (the same request without a deadline: the exact search, which the tests check")
    print("against brute force), at 8-32 GPUs where that finishes; '-' where it is not run.\n")
    rows = []
    rng = random.Random(5)
    for family, make in FAMILIES.items():
        for n in (8, 16, 32, 64, 128):
            m = make(n)
            t0 = time.perf_counter()
            warm(m)
            warm_ms = 1000 * (time.perf_counter() - t0)
            wall, cpu, proven, unproven = [], [], 0, []
            for _ in range(samples):
                k = rng.choice(sorted({1, 2, 4, 8, max(1, n // 4), n // 2}))
                busy = rng.sample(range(n), rng.randint(0, n - k))
                req = Request(gpus=k, deadline_ms=deadline_ms)
                c0 = time.thread_time_ns()
                t0 = time.perf_counter_ns()
                answer = place(m, req, busy)
                wall.append((time.perf_counter_ns() - t0) / 1e6)
                cpu.append((time.thread_time_ns() - c0) / 1e6)
                if not isinstance(answer, Placement):
                    continue
                proven += answer.proven_optimal
                if not answer.proven_optimal and n <= 32 and answer.bandwidth_gbps:
                    unproven.append((k, busy, answer.bandwidth_gbps))
            # The optimum after the timed calls: its search fills the matrix's memos (rings
            # found, answers built), which the timed calls after it would otherwise read.
            ratios = []
            for k, busy, gbps in unproven:
                exact = place(m, Request(gpus=k), busy)
                assert isinstance(exact, Placement) and exact.bandwidth_gbps
                ratios.append(gbps / exact.bandwidth_gbps)
            rows.append({
                "family": family, "n": n, "warm": warm_ms,
                "p50": statistics.median(wall), "p99": percentile(wall, .99), "max": max(wall),
                "cpu p50": statistics.median(cpu), "cpu p99": percentile(cpu, .99),
                "late": sum(w > deadline_ms + 1 for w in wall), "late cpu": sum(c > deadline_ms + 1 for c in cpu),
                "proven": proven / samples,
                "ratio": f"{min(ratios):.2f}" if ratios else ("-" if n > 32 else "1.00"),
            })
    if markdown:
        print(f"| family | GPUs | p50 ms | p99 ms (wall) | p99 ms (cpu) | late (wall / cpu, of {samples}) | proven | worst ratio to optimum |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(
                f"| {r['family']} | {r['n']} | {r['p50']:.3f} | {r['p99']:.3f} | {r['cpu p99']:.3f} |"
                f" {r['late']} / {r['late cpu']} | {r['proven']:.0%} | {r['ratio']} |"
            )
    else:
        print(
            f"{'family':15} {'n':>4} {'warm ms':>8} {'p50':>7} {'p99':>7} {'max':>7} {'cpu p50':>7} {'cpu p99':>7}"
            f" {'late':>5} {'(cpu)':>5} {'proven':>7} {'ratio':>6}"
        )
        for r in rows:
            print(
                f"{r['family']:15} {r['n']:>4} {r['warm']:8.1f} {r['p50']:7.3f} {r['p99']:7.3f} {r['max']:7.2f}"
                f" {r['cpu p50']:7.3f} {r['cpu p99']:7.3f} {r['late']:>5} {r['late cpu']:>5} {r['proven']:7.0%} {r['ratio']:>6}"
            )
    print("\nper-matrix tables at 128 GPUs (tracemalloc: after warm(), and after the requests above):")
    if markdown:
        print("\n| family | warm MiB | after use MiB | peak MiB |\n|---|---:|---:|---:|")
    for family, make in FAMILIES.items():
        tracemalloc.start()
        m = make(128)
        base = tracemalloc.get_traced_memory()[0]
        warm(m)
        after_warm = tracemalloc.get_traced_memory()[0] - base
        for _ in range(samples):
            k = rng.choice([1, 2, 4, 8, 32, 64])
            place(m, Request(gpus=k, deadline_ms=deadline_ms), rng.sample(range(128), rng.randint(0, 128 - k)))
        after_use, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        mib = [after_warm / 2**20, (after_use - base) / 2**20, (peak - base) / 2**20]
        if markdown:
            print(f"| {family} | {mib[0]:.1f} | {mib[1]:.1f} | {mib[2]:.1f} |")
        else:
            print(f"  {family:15} warm {mib[0]:6.1f} MiB   after use {mib[1]:6.1f} MiB   peak {mib[2]:6.1f} MiB")


# --- bounded time on a busy node ------------------------------------------------------


def _spin(stop) -> None:
    while not stop.is_set():
        pass


def loaded_study(samples: int, deadline_ms: int = SERVICE_DEADLINE_MS, markdown: bool = False, spinners: int = 2) -> None:
    """The deadline study's kind of requests while ``spinners`` CPU-bound processes run
    beside the benchmark: the deadline is kept by the wall clock, the search getting only
    a share of a core (placement.deadline)."""
    import multiprocessing

    stop = multiprocessing.Event()
    loops = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(spinners)]
    for loop in loops:
        loop.start()
    rows = []
    try:
        for family in ("NVSwitch", "PCIe tree", "irregular mesh"):
            for n in (8, 16, 32, 64):
                m = FAMILIES[family](n)
                warm(m)
                rng = random.Random(11)
                asks = []
                for _ in range(samples):
                    k = rng.choice(sorted({2, 4, 8, max(1, n // 4), n // 2}))
                    asks.append((k, rng.sample(range(n), rng.randint(0, n - k))))
                optimum = {}
                if n <= 32:  # the exact answer, without a deadline (after warming: memos shared alike); seconds a request at 64
                    for k, busy in asks:
                        exact = place(m, Request(gpus=k), busy)
                        optimum[(k, tuple(busy))] = exact.bandwidth_gbps if isinstance(exact, Placement) else None
                wall, ratios, proven = [], [], 0
                for k, busy in asks:
                    t0 = time.perf_counter()
                    answer = place(m, Request(gpus=k, deadline_ms=deadline_ms), busy)
                    wall.append(1000 * (time.perf_counter() - t0))
                    best = optimum.get((k, tuple(busy)))
                    if isinstance(answer, Placement):
                        proven += answer.proven_optimal
                        if best and answer.bandwidth_gbps is not None:
                            ratios.append(answer.bandwidth_gbps / best)
                rows.append({
                    "family": family, "n": n, "p50": statistics.median(wall), "p99": percentile(wall, .99), "max": max(wall),
                    "late": sum(w > deadline_ms + 1 for w in wall), "proven": proven / samples,
                    "worst": f"{min(ratios):.2f}" if ratios else "-", "below 0.9": sum(r < 0.9 for r in ratios) if optimum else "-",
                })
    finally:
        stop.set()
        for loop in loops:
            loop.join()
    head = (f"place() with deadline_ms={deadline_ms} beside {spinners} CPU-bound processes on {os.cpu_count()} cores, "
            f"{samples} requests per row (k from 2, 4, 8, n/4, n/2, a random busy set each).")
    if markdown:
        print(head)
        print("late = answers past the deadline + 1 ms by the wall clock; worst = the worst answer's bandwidth over the exact")
        print("optimum's, < 0.9 = answers below 0.9 of it ('-' at 64 GPUs, where the exact search takes seconds a request).\n")
        print("| family | GPUs | p50 ms | p99 ms | max ms | late | proven | worst | < 0.9 |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['family']} | {r['n']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.2f} | {r['late']} | "
                  f"{r['proven']:.0%} | {r['worst']} | {r['below 0.9']} |")
    else:
        print(f"\n## {head}\n")
        print(f"{'family':15} {'n':>3} {'p50':>7} {'p99':>7} {'max':>7} {'late':>5} {'proven':>7} {'worst':>6} {'<0.9':>5}")
        for r in rows:
            print(f"{r['family']:15} {r['n']:>3} {r['p50']:7.2f} {r['p99']:7.2f} {r['max']:7.2f} {r['late']:>5} "
                  f"{r['proven']:7.0%} {r['worst']:>6} {r['below 0.9']:>5}")


# --- quality against brute force -------------------------------------------------------


class Truth:
    """Brute-force ring bottleneck per subset, and the NUMA group of each GPU."""

    def __init__(self, m: DistanceMatrix):
        self.m = m
        n = m.size
        self.key = [[(m.bandwidth(a, b) or 0.0, tuple(-x for x in m.gpu_levels[a][b].sort_key())) for b in range(n)] for a in range(n)]
        self.numa_of = {}
        for gid, group in enumerate(numa_groups(m)):
            for idx in group:
                self.numa_of[m.gpu_by_index(idx)] = gid
        self.ring: dict[tuple, tuple] = {}

    def ring_key(self, subset: tuple[int, ...]):
        if len(subset) < 2:
            return (float("inf"), ())
        got = self.ring.get(subset)
        if got is None:
            if len(subset) == 2:
                got = self.key[subset[0]][subset[1]]
            else:
                first, rest = subset[0], subset[1:]
                got = max(
                    min([self.key[a][b] for a, b in zip((first,) + p, p + (first,))])
                    for p in permutations(rest)
                )
            self.ring[subset] = got
        return got

    def numa(self, subset) -> int:
        return len({self.numa_of[p] for p in subset})


def policies(m: DistanceMatrix):
    def ours(k, busy):
        answer = place(m, Request(gpus=k), busy)
        return answer.indices if isinstance(answer, Placement) else None

    return {
        "ours": ours,
        "first-fit": lambda k, b: first_fit(m, k, b),
        "random": RandomFit(m),
        "go-besteffort": BestEffortPolicy(m),
        "hami-topology": HamiTopologyPolicy(m),
        "hami-zone": HamiZonePolicy(m),
    }


def ask(policy, k: int, busy: set[int]) -> tuple[int, ...] | Refused | None:
    """The policy's answer; a Refused (node too large for its search) is returned, not raised."""
    try:
        return policy(k, busy)
    except Refused as refused:
        return refused


def quality(max_gpus: int) -> None:
    print("\n## Quality on every fixture: every free subset x every k (ring), against brute force\n")
    print(f"{'fixture':36} {'policy':13} {'answers':>7} {'optimal(1)':>10} {'worst ratio':>11} {'needless NUMA':>13} {'invalid':>7}")
    for name, m in corpus():
        if m.size > max_gpus:
            continue
        truth = Truth(m)
        pos = list(range(m.size))
        pols = policies(m)
        stats = {p: [0, 0, 1.0, 0, 0] for p in pols}
        for n_free in range(2, m.size + 1):
            for free in combinations(pos, n_free):
                busy = {m.gpus[p].index for p in pos if p not in free}
                for k in range(2, n_free + 1):
                    subsets = list(combinations(free, k))
                    best = max(truth.ring_key(s) for s in subsets)
                    for pname, policy in pols.items():
                        st = stats[pname]
                        st[0] += 1
                        got = ask(policy, k, busy)
                        got = None if isinstance(got, Refused) else got
                        chosen = tuple(sorted(m.gpu_by_index(i) for i in got)) if got else ()
                        if len(chosen) != k or len(set(chosen)) != k or any(m.gpus[p].index in busy for p in chosen):
                            st[4] += 1
                            continue
                        key = truth.ring_key(chosen)
                        st[1] += key == best
                        st[2] = min(st[2], key[0] / best[0] if best[0] else 1.0)
                        min_numa = min(truth.numa(s) for s in subsets if truth.ring_key(s) >= key)
                        st[3] += truth.numa(chosen) > min_numa
        for pname, (total, opt, worst, numa_bad, invalid) in stats.items():
            print(f"{name:36} {pname:13} {total:7d} {100 * opt / total:9.1f}% {worst:11.2f} {numa_bad:13d} {invalid:7d}")


# --- job-stream simulation -------------------------------------------------------------

# The neutral measures, in the order printed, and which way is better.
MEASURES = (
    ("ring GB/s", "ring", max),
    ("NUMA nodes", "numa", min),
    ("SLIT dist", "slit", min),
    ("free NVLink zone", "zone", max),
    ("waited", "waited", min),
)


def sim_nodes() -> list[tuple[str, DistanceMatrix]]:
    return [(n, m) for n, m in corpus() if m.size >= 4] + [
        ("snapshot-dgx-a100", snapshot("dgx-a100")),
        ("synthetic-nvswitch-16", nvswitch_16()),
        ("synthetic-pcie-16", pcie_16()),
    ]


def job_stream(n: int, events: int, load: float, seed: int) -> list[tuple[float, int, float]]:
    """(arrival, GPUs, duration): sizes 1/2/4/8 below the node's size, weighted
    .35/.30/.20/.15, Poisson arrivals, exponential lengths for the offered load."""
    sizes = [s for s in (1, 2, 4, 8) if s < n]
    weights = [0.35, 0.3, 0.2, 0.15][: len(sizes)]
    mean_size = sum(s * w for s, w in zip(sizes, weights)) / sum(weights)
    rng = random.Random(seed)
    stream, t = [], 0.0
    for _ in range(events):
        t += rng.expovariate(1.0)
        k = rng.choices(sizes, weights)[0]
        stream.append((t, k, rng.expovariate(1.0 / (load * n / mean_size))))
    return stream


def run_stream(m: DistanceMatrix, policy, stream, grader: Grader) -> dict:
    """Play the stream through one policy, first come first served: a job that cannot be
    placed when it arrives waits (and holds back those behind it) until one that leaves
    frees enough GPUs for the policy to answer.  Graded by the neutral measures only."""
    everyone = grader.positions(g.index for g in m.gpus)
    running: list[tuple[float, frozenset[int]]] = []
    queue: list[int] = []  # job numbers, oldest first
    ring, numa, slit, zone = [], [], [], []
    waited = invalid = refused = 0

    def start_waiting(now: float) -> None:
        nonlocal waited, invalid, refused
        while queue:
            arrive, k, duration = stream[queue[0]]
            busy_pos = frozenset().union(*(g for _, g in running))
            got = None
            if len(everyone) - len(busy_pos) >= k:
                busy = {m.gpus[p].index for p in busy_pos}
                got = ask(policy, k, busy)
                if isinstance(got, Refused):  # it cannot run on this node: the job goes elsewhere
                    refused += 1
                    queue.pop(0)
                    continue
                if got is not None and (len(set(got)) != k or set(got) & busy):
                    invalid += 1  # go-gpuallocator can hand back a set holding placeholders
                    got = None
            if not got:
                return
            queue.pop(0)
            waited += now > arrive
            chosen = grader.positions(got)
            running.append((now + duration, chosen))
            if k >= 2:
                ring.append(grader.ring_gbps(chosen))
                numa.append(grader.numa_nodes(chosen))
                slit.append(grader.slit_distance(chosen))
            zone.append(grader.largest_free_nvlink_zone(everyone - busy_pos - chosen))

    for number, (arrive, _k, _d) in enumerate(stream):
        while running and min(end for end, _ in running) <= arrive:
            end = min(end for end, _ in running)
            running = [(e, g) for e, g in running if e != end]
            start_waiting(end)
        queue.append(number)
        start_waiting(arrive)
    waited += len(queue)  # still waiting when the stream ends
    return {
        "ring": statistics.mean(ring) if ring else None,
        "numa": statistics.mean(numa) if numa else None,
        "slit": statistics.mean(slit) if slit and None not in slit else None,
        "zone": statistics.mean(zone) if zone and None not in zone else None,
        "waited": 100 * waited / len(stream),
        "invalid": invalid,
        "refused": refused,
    }


def beats(theirs: dict, ours: dict) -> list[str]:
    """The measures on which ``theirs`` is strictly better than ``ours`` (none when either
    refused jobs: their measures then cover other jobs)."""
    out: list[str] = []
    if theirs["refused"] or ours["refused"]:
        return out
    for label, key, better in MEASURES:
        a, b = theirs[key], ours[key]
        if a is not None and b is not None and abs(a - b) > 1e-9 and better(a, b) == a:
            out.append(label)
    return out


def simulate_results(events: int, load: float, seed: int = 7) -> list[tuple[str, dict[str, dict]]]:
    out = []
    for name, m in sim_nodes():
        stream = job_stream(m.size, events, load, seed)
        grader = Grader(m)
        out.append((name, {pname: run_stream(m, policy, stream, grader) for pname, policy in policies(m).items()}))
    return out


def _cell(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _cells(r: dict) -> list[str]:
    return [_cell(r["ring"], ".2f"), _cell(r["numa"], ".3f"), _cell(r["slit"], ".2f"), _cell(r["zone"], ".3f"),
            f"{r['waited']:.1f}%"]


def _failures(r: dict) -> str:
    return ", ".join(f"{r[key]} {key}" for key in ("invalid", "refused") if r[key])


SIM_NOTES = (
    "Every policy, ours included, is graded by measures no policy's objective defines"
    " (bench/neutral.py): ring GB/s = the set's best-ring bottleneck from the level table"
    " (levels.expected_gbps of each pair's level); NUMA nodes = NUMA nodes its GPUs sit on;"
    " SLIT dist = the largest SLIT distance between them ('-' without a SLIT table); all three"
    " are means over multi-GPU jobs; free NVLink zone = the largest NVLink-connected group of"
    " free GPUs left after each placement ('-' without NVLink); waited = share of jobs not"
    " started on arrival (first come first served; an invalid answer makes the job wait)."
    " A policy whose search is too large for the node refuses the job, which goes elsewhere;"
    " its row is then not compared."
)


def simulate(events: int, load: float, seed: int = 7, markdown: bool = False) -> None:
    results = simulate_results(events, load, seed)
    setting = (f"{events} jobs of 1/2/4/8 GPUs (below the node's size) per node, Poisson arrivals,"
               f" offered load {load:.0%} of the node's GPUs, seed {seed}; the same stream for every policy.")
    header = ["node", "policy", *(label for label, _, _ in MEASURES), "beats ours on"]
    if markdown:
        print(f"Job-stream simulation: {setting} {SIM_NOTES}\n")
        rows = [(name, pname, r, beats(r, res["ours"])) for name, res in results for pname, r in res.items()]
        won = [row for row in rows if row[3]]
        policy_names = [p for p in results[0][1] if p != "ours"]
        print("| baseline | nodes where it beats ours on some measure | nodes where ours beats it on some measure | nodes not compared (it refused) |")
        print("|---|---:|---:|---:|")
        for pname in policy_names:
            theirs = sum(1 for name, res in results if beats(res[pname], res["ours"]))
            ours = sum(1 for name, res in results if beats(res["ours"], res[pname]))
            skipped = sum(1 for name, res in results if res[pname]["refused"])
            print(f"| {pname} | {theirs} of {len(results)} | {ours} of {len(results)} | {skipped} |")
        print(f"\nEvery row where a baseline beats ours, beside ours on that node ({len(won)} rows):\n")
        print("| " + " | ".join(header) + " |")
        print("|---|---|" + "---:|" * len(MEASURES) + "---|")
        shown = set()
        for name, pname, r, better in won:
            if name not in shown:
                shown.add(name)
                print(f"| {name} | ours | " + " | ".join(_cells(results_of(results, name)["ours"])) + " | |")
            note = ", ".join(better) + (f" ({_failures(r)})" if _failures(r) else "")
            print(f"| {name} | {pname} | " + " | ".join(_cells(r)) + f" | **{note}** |")
        if not won:
            print("| (none) |" + " |" * (len(header) - 1))
        return
    print("\n## Job stream, graded by neutral measures\n")
    print(setting)
    print(SIM_NOTES + "\n")
    print(f"{'node':36} {'policy':13} {'ring GB/s':>9} {'NUMA nodes':>10} {'SLIT dist':>9} {'free NVLink zone':>16} {'waited':>7}  beats ours on")
    for name, res in results:
        for pname, r in res.items():
            better = ", ".join(beats(r, res["ours"])) if pname != "ours" else ""
            c = _cells(r)
            print(f"{name:36} {pname:13} {c[0]:>9} {c[1]:>10} {c[2]:>9} {c[3]:>16} {c[4]:>7}  {better}"
                  + (f"  ({_failures(r)})" if _failures(r) else ""))


def results_of(results: list[tuple[str, dict[str, dict]]], name: str) -> dict[str, dict]:
    return next(res for n, res in results if n == name)


def pair_score_cost() -> None:
    print("\n## go-gpuallocator best-effort: time for one query on an empty node (exhaustive, no cap)\n")
    for name, m, ks in (("16: NVSwitch DGX-2-like", nvswitch_16(), (2, 3)), ("8: PCIe 2 sockets", pcie_two_socket_8(), (2, 4))):
        for k in ks:
            t0 = time.perf_counter()
            outcome = ask(BestEffortPolicy(m), k, set())
            note = f" (refused: {outcome})" if isinstance(outcome, Refused) else ""
            print(f"  {name} k={k}: {time.perf_counter() - t0:.2f} s{note}")


MARKDOWN_SECTIONS = ("latency", "simulate", "deadline", "loaded")  # those printing a docs block (bench/report.py)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["latency", "quality", "simulate", "pairscore", "deadline", "loaded"])
    parser.add_argument("--load", type=float, default=0.25, help="offered load of the job stream (share of GPUs)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--spinners", type=int, default=2, help="CPU-bound processes beside --only loaded (default 2)")
    parser.add_argument("--markdown", action="store_true", help="print --only's figures as its markdown block in the docs")
    args = parser.parse_args()
    if args.markdown and args.only not in MARKDOWN_SECTIONS:
        parser.error(f"--markdown goes with --only {' or '.join(MARKDOWN_SECTIONS)} (the docs' blocks)")
    self_check(
        recorded("dlperf-8xV100")[1],
        recorded("sglang-24966")[1],
        pcie_two_socket_8(),
    )
    samples = 200 if args.quick else 1000
    events = 400 if args.quick else 3000
    if args.only in (None, "latency"):
        latency(samples // 4, args.markdown)  # per shape: 28 shapes at 8+ GPUs
    if args.only in (None, "quality"):
        quality(8)
    if args.only in (None, "simulate"):
        simulate(events, args.load, args.seed, args.markdown)
    if args.only in (None, "pairscore"):
        pair_score_cost()
    if args.only in (None, "deadline"):
        deadline_study(60 if args.quick else 300, markdown=args.markdown)
    if args.only == "loaded":  # only when asked: it loads every core of the machine
        loaded_study(30 if args.quick else 100, markdown=args.markdown, spinners=args.spinners)


if __name__ == "__main__":
    main()
