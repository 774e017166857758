"""Placement benchmark: latency, quality against brute force, and a job-stream simulation.

    python -m bench.placement            # everything (a few minutes on 2 cores)
    python -m bench.placement --quick    # fewer samples and events
    python -m bench.placement --quick --only deadline   # bounded time at 8-128 GPUs
    python -m bench.placement --only deadline --markdown   # the same as a markdown table (bench/report.py)

Prints tables; asserts nothing (tests check correctness, this measures).
"""

from __future__ import annotations

import argparse
import random
import statistics
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
    nv_zones,
    self_check,
)
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.matrix import DistanceMatrix
from topoagent.placement import Placement, Request, numa_distance, numa_groups, place, warm
from topoagent.placement.request import SERVICE_DEADLINE_MS
from topoagent.placement.synthetic import (
    irregular_mesh,
    node_32,
    nvswitch_16,
    nvswitch_node,
    pcie_16,
    pcie_two_socket_8,
    tree_node,
)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
CORPUS = SHARED / "corpus" / "nvidia-smi-topo"


def corpus() -> list[tuple[str, DistanceMatrix]]:
    out = []
    for path in sorted(CORPUS.glob("*.txt")):
        try:
            m = DistanceMatrix.from_topo_matrix(parse_topo_matrix(path.read_text()))
        except ValueError:
            continue
        if m.size >= 3:
            out.append((path.name.split(".txt")[0][:34], m))
    out.append(("synthetic-pcie-2socket-8", pcie_two_socket_8()))
    return out


def snapshot(name: str) -> DistanceMatrix:
    """A recorded node of fixtures/snapshots, with its SLIT table and NIC states."""
    from topoagent.commands.discover import discover_root

    return discover_root(str(Path(__file__).resolve().parents[1] / "fixtures" / "snapshots" / name)).distance_matrix()


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


# --- latency --------------------------------------------------------------------------


def latency(samples: int) -> None:
    nodes = [
        ("8: DGX-1 V100 cube mesh", next(m for n, m in corpus() if n.startswith("dlperf-8xV100"))),
        ("8: HGX H20 NVSwitch+8 NIC", next(m for n, m in corpus() if n.startswith("sglang-24966"))),
        ("8: PCIe 2 sockets", pcie_two_socket_8()),
        ("16: NVSwitch DGX-2-like", nvswitch_16()),
        ("16: PCIe 2 sockets x 4 sw", pcie_16()),
        ("32: 4 sockets, NV18 zones", node_32()),
    ]
    print("\n## Latency of place() in-process, warm (ms; random busy sets)\n")
    print("wall = perf_counter; cpu = this thread's CPU time (immune to other processes on a")
    print("shared machine).  The matrix is warmed first, as the agent does when it builds a")
    print("snapshot (placement.warm), and every request shape is asked once before timing;")
    print("see 'first call' below for a cold matrix.\n")
    print(
        f"{'node':28} {'k':>3} {'ring p50':>8} {'p99':>7} {'max':>7} {'cpu p99':>7}"
        f"   {'nics=2 p99':>10} {'alltoall p99':>12} {'pipeline p99':>12}"
    )
    rng = random.Random(1)
    worst: dict[int, float] = {}
    for name, m in nodes:
        n = m.size
        warm(m)  # what the agent does when it builds a snapshot (cold costs below)
        for k in sorted({1, 2, 3, 4, 8, n // 2, n - 2} - {0}):
            if k > n:
                continue
            row = {}
            for label, req in (
                ("ring", Request(gpus=k)),
                ("nics", Request(gpus=k, nics=min(2, len(m.nics)))),
                ("a2a", Request(gpus=k, pattern="alltoall")),
                ("pipe", Request(gpus=k, pattern="pipeline")),
            ):
                place(m, req)
                wall, cpu = [], []
                for _ in range(samples):
                    busy = rng.sample(range(n), rng.randint(0, n - k))
                    c0 = time.thread_time_ns()
                    t0 = time.perf_counter_ns()
                    place(m, req, busy)
                    wall.append((time.perf_counter_ns() - t0) / 1e6)
                    cpu.append((time.thread_time_ns() - c0) / 1e6)
                row[label] = (wall, cpu)
                worst[n] = max(worst.get(n, 0.0), pct(cpu, 0.99))
            r, rc = row["ring"]
            print(
                f"{name:28} {k:>3} {statistics.median(r):8.3f} {pct(r, .99):7.3f} {max(r):7.3f} {pct(rc, .99):7.3f}"
                f"   {pct(row['nics'][0], .99):10.3f} {pct(row['a2a'][0], .99):12.3f} {pct(row['pipe'][0], .99):12.3f}"
            )
    print("\nworst cpu p99 over every k and pattern: " + ", ".join(f"{n} GPUs {v:.3f} ms" for n, v in sorted(worst.items())))
    print("\nfirst call (ms): on a new matrix (builds its tables), then a new request shape on it:")
    for name, m in nodes:
        fresh = replace(m)  # the same value with an empty cache
        t0 = time.perf_counter()
        place(fresh, Request(gpus=min(4, m.size)))
        first = 1000 * (time.perf_counter() - t0)
        t0 = time.perf_counter()
        place(fresh, Request(gpus=min(3, m.size), pattern="pipeline"))
        shape = 1000 * (time.perf_counter() - t0)
        print(f"  {name:28} {first:8.2f} {shape:8.2f}")


# --- bounded time at every node size --------------------------------------------------

TREES = {8: (2, 2, 2), 16: (2, 4, 2), 32: (2, 4, 4), 64: (2, 4, 8), 128: (2, 8, 8)}
FAMILIES = {
    "NVSwitch": lambda n: nvswitch_node(n),
    "PCIe tree": lambda n: tree_node(*TREES[n]),
    "irregular mesh": lambda n: irregular_mesh(n),
}


def deadline_study(samples: int, deadline_ms: int = SERVICE_DEADLINE_MS, markdown: bool = False) -> None:
    import tracemalloc

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
            wall, cpu, proven, ratios = [], [], 0, []
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
                    exact = place(m, Request(gpus=k), busy)
                    assert isinstance(exact, Placement) and exact.bandwidth_gbps
                    ratios.append(answer.bandwidth_gbps / exact.bandwidth_gbps)
            rows.append({
                "family": family, "n": n, "warm": warm_ms,
                "p50": statistics.median(wall), "p99": pct(wall, .99), "max": max(wall),
                "cpu p50": statistics.median(cpu), "cpu p99": pct(cpu, .99),
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
        print(f"  {family:15} warm {after_warm / 2**20:6.1f} MiB   after use {(after_use - base) / 2**20:6.1f} MiB   peak {(peak - base) / 2**20:6.1f} MiB")


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


def simulate(events: int, load: float, seed: int = 7) -> None:
    print("\n## Job stream: 1/2/4/8-GPU jobs arrive and leave (seeded); same stream for every policy\n")
    print("Jobs smaller than the node (a whole-node job only needs an empty node, which every policy")
    print("gives alike), sizes weighted .35/.30/.20/.15, Poisson arrivals, exponential lengths set so")
    print(f"the offered load is {load:.0%} of the node's GPUs; a job that does not fit on arrival is")
    print("rejected (it would go to another node) -- the same jobs for every policy, since all fit by count.")
    print("delivered = mean ring bandwidth of multi-GPU jobs / the best the empty node offers for that k;")
    print("clean = share of large jobs (8 GPUs, or the size of a whole NUMA node / NVLink or PCIe zone)")
    print("placed at the empty-node best bandwidth on the fewest NUMA nodes.")
    print("NUMA dist = mean NUMA distance spanned by multi-GPU jobs (largest SLIT entry between their")
    print("NUMA nodes; '-' on nodes without a SLIT table: nvidia-smi matrices).")
    print("satisf = mean topology satisfaction of multi-GPU jobs (share of the ring's links that are")
    print("NVLink or one PCIe switch).\n")
    print(f"{'fixture':36} {'policy':13} {'delivered':>9} {'clean large':>11} {'large jobs':>10} {'rejected':>8} {'NUMA dist':>9} {'satisf':>6}")
    nodes = [(n, m) for n, m in corpus() if m.size >= 4] + [
        ("snapshot-dgx-a100", snapshot("dgx-a100")),
        ("synthetic-nvswitch-16", nvswitch_16()),
        ("synthetic-pcie-16", pcie_16()),
    ]
    summary = []
    for name, m in nodes:
        n = m.size
        sizes = [s for s in (1, 2, 4, 8) if s < n]
        weights = [0.35, 0.3, 0.2, 0.15][: len(sizes)]
        zone_sizes = {len(g) for g in numa_groups(m)} | {len(z) for z in nv_zones(m)}
        large = {s for s in sizes if s == 8 or s in zone_sizes} or {max(sizes)}
        empty = {}
        for k in sizes:
            a = place(m, Request(gpus=k))
            empty[k] = (a.bandwidth_gbps, a.objective.numa_nodes)
        mean_size = sum(s * w for s, w in zip(sizes, weights)) / sum(weights)
        rng = random.Random(seed)
        stream = []
        t = 0.0
        for _ in range(events):
            t += rng.expovariate(1.0)
            k = rng.choices(sizes, weights)[0]
            stream.append((t, k, rng.expovariate(1.0 / (load * n / mean_size))))
        pols = policies(m)
        results = {}
        for pname, policy in pols.items():
            running: list[tuple[float, tuple[int, ...]]] = []
            ratios, clean, n_large, rejected, invalid, refused, spans, sats = [], 0, 0, 0, 0, 0, [], []
            for arrive, k, duration in stream:
                running = [(end, g) for end, g in running if end > arrive]
                busy = {i for _, g in running for i in g}
                if k in large:
                    n_large += 1
                got = ask(policy, k, busy) if n - len(busy) >= k else None
                if isinstance(got, Refused):
                    refused += 1
                    got = None
                elif got is not None and (len(set(got)) != k or set(got) & busy):
                    invalid += 1  # go-gpuallocator can hand back a set holding placeholders
                    got = None
                if not got:
                    rejected += 1
                    continue
                running.append((arrive + duration, tuple(got)))
                if k >= 2:
                    span = numa_distance(m, got)
                    if span is not None:
                        spans.append(span)
                    others = [g.index for g in m.gpus if g.index not in got]
                    ev = place(m, Request(gpus=k), others)
                    ratios.append(ev.bandwidth_gbps / empty[k][0])
                    sats.append(ev.satisfaction)
                    if k in large and ev.bandwidth_gbps >= empty[k][0] and ev.objective.numa_nodes <= empty[k][1]:
                        clean += 1
                elif k in large:
                    clean += 1
            mean = statistics.mean(ratios) if ratios else float("nan")
            results[pname] = (mean, clean / max(1, n_large))
            dist = f"{statistics.mean(spans):9.2f}" if spans else f"{'-':>9}"
            sat = f"{statistics.mean(sats):6.3f}" if sats else f"{'-':>6}"
            print(
                f"{name:36} {pname:13} {mean:9.3f} {100 * clean / max(1, n_large):10.1f}% {n_large:10d}"
                f" {100 * rejected / len(stream):7.1f}% {dist} {sat}"
                + (f"  ({invalid} invalid answers)" if invalid else "")
                + (f"  (refused {refused}: search too large)" if refused else "")
            )
        summary.append((name, results))
    print("\nwhere a baseline beats ours (delivered, clean large):")
    behind = 0
    for name, results in summary:
        ours = results["ours"]
        for pname, (mean, clean) in results.items():
            if pname != "ours" and (mean > ours[0] + 1e-9 or clean > ours[1] + 1e-9):
                behind += 1
                print(f"  {name:36} {pname:13} {mean - ours[0]:+.3f} {100 * (clean - ours[1]):+.1f}%")
    if not behind:
        print("  nowhere")


def pair_score_cost() -> None:
    print("\n## go-gpuallocator best-effort: time for one query on an empty node (exhaustive, no cap)\n")
    for name, m, ks in (("16: NVSwitch DGX-2-like", nvswitch_16(), (2, 3)), ("8: PCIe 2 sockets", pcie_two_socket_8(), (2, 4))):
        for k in ks:
            t0 = time.perf_counter()
            outcome = ask(BestEffortPolicy(m), k, set())
            note = f" (refused: {outcome})" if isinstance(outcome, Refused) else ""
            print(f"  {name} k={k}: {time.perf_counter() - t0:.2f} s{note}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--only", choices=["latency", "quality", "simulate", "pairscore", "deadline"])
    parser.add_argument("--load", type=float, default=0.25, help="offered load of the job stream (share of GPUs)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--markdown", action="store_true", help="deadline: print the study as a markdown table")
    args = parser.parse_args()
    anchors = dict(corpus())
    self_check(
        next(m for n, m in anchors.items() if n.startswith("dlperf-8xV100")),
        next(m for n, m in anchors.items() if n.startswith("sglang-24966")),
        pcie_two_socket_8(),
    )
    samples = 200 if args.quick else 1000
    events = 400 if args.quick else 3000
    if args.only in (None, "latency"):
        latency(samples)
    if args.only in (None, "quality"):
        quality(8)
    if args.only in (None, "simulate"):
        simulate(events, args.load, args.seed)
    if args.only in (None, "pairscore"):
        pair_score_cost()
    if args.only in (None, "deadline"):
        deadline_study(60 if args.quick else 300, markdown=args.markdown)


if __name__ == "__main__":
    main()
