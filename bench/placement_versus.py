"""place() latency of this tree against an older revision, side by side.

    python -m bench.placement_versus --rev REV [--rounds 3] [--samples 200] [--quick]

REV is any commit that has the placement package (``topoagent/placement/__init__.py``;
older revisions kept placement in one module and are refused with the commit that
introduced the package).  The revision's files are extracted with ``git archive REV | tar
-x`` into a temporary directory, removed afterwards.

Each side is timed in a child process of its own: this script in ``--worker`` mode, run
with cwd and PYTHONPATH set to that tree, so ``import topoagent`` (and ``bench``) is that
tree's code; ``-P`` keeps this script's folder off sys.path.  "new" is this checkout as it
is on disk, uncommitted edits included.  Every child builds the same nodes -- synthetic
ones from its own ``topoagent.placement.synthetic`` and two recorded ones from the shared
corpus through its own ``bench.placement.corpus()`` (a node the tree cannot build is left
out and reported) -- warms each matrix as that revision's agent does (``placement.warm``
where it exists), asks every request shape once, then answers the same seeded busy sets
and prints JSON: per row the per-call times and each answer's comparable terms.  Before
each row the worker freezes what it has kept so far (gc.freeze), so a full collection over
its own growing results does not land in some timed call as a 50 ms outlier.

With ``--mesh`` the children run the irregular-mesh study instead (#38): the deadline
study's request stream (k from 1, 2, 4, 8, n/4, n/2, a random busy set each) on
``synthetic.irregular_mesh`` of 32 and 64 GPUs (``--sizes``) under the service's 20 ms deadline, each
answer's CPU and wall time and whether it was proven optimal; ``--spinners N`` runs N
busy loops beside every child; ``--cpu-only`` stands the deadlines' wall clock still in
the children, so the CPU time the search gets alone stops it (the two revisions' deadlines
read the clocks differently; this compares the searches).  The table gives per side the share proven (median over
rounds), the answers late by the wall clock (past the deadline + 1 ms), and, over the
requests both sides proved in every round, the median ratio new/old of the CPU time and
how many answers differ; below it, each differing answer scored by this tree's objective:
worse or better on terms (1)-(6) (one side was not optimal: a bug) or a tie there that the
tie-break settled differently (partner loss lower, higher or the same: search order).

Children alternate old/new, then new/old, for ``--rounds`` rounds, so load on a shared
machine hits both sides alike.  Per row the table gives the median over rounds of each
round's p50 and p99, wall time (perf_counter) as the main figure and this thread's CPU time
(thread_time) beside it, with the ratio new/old; then the worst p99 per node size, and how
many answers differ on the GPU set, the bandwidth or the NUMA terms (those both revisions
have).  Rank order and the later terms (NICs, damage, tie-breaks) may legitimately change
between revisions and are not compared.  Against HEAD itself no answer should differ and
the ratios should sit near 1 (their spread is this machine's noise).
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
PACKAGE_INIT = "topoagent/placement/__init__.py"
CORPUS = REPO.parent / "shared" / "corpus" / "nvidia-smi-topo"  # where bench.placement looks from a checkout

# (label, source, name): synthetic nodes by function name, corpus nodes by file-name prefix.
NODES = (
    ("8: DGX-1 V100", "corpus", "dlperf-8xV100"),
    ("8: H20 + 8 NIC", "corpus", "sglang-24966"),
    ("8: PCIe 2 sockets", "synthetic", "pcie_two_socket_8"),
    ("16: NVSwitch", "synthetic", "nvswitch_16"),
    ("16: PCIe", "synthetic", "pcie_16"),
    ("32: NV18 zones", "synthetic", "node_32"),
)
PATTERNS = ("ring", "nics=2", "alltoall", "pipeline")
SAMPLES = 200
QUICK_SAMPLES = 30


# --- worker: runs inside the tree under test ----------------------------------------------


def worker(samples: int, corpus_dir: str) -> None:
    import topoagent
    from topoagent import placement

    tree = Path.cwd().resolve()
    loaded = Path(topoagent.__file__).resolve()
    if tree not in loaded.parents:
        raise SystemExit(f"worker in {tree} imported topoagent from {loaded}: PYTHONPATH did not take")
    import topoagent.placement.synthetic as synthetic

    recorded: list[tuple[str, Any]] = []
    corpus_note = "bench.placement.corpus()"
    try:
        import bench.placement as bp

        if hasattr(bp, "CORPUS"):
            bp.CORPUS = Path(corpus_dir)  # an extracted tree is not beside shared/
        recorded = bp.corpus()
    except Exception as e:  # an old tree without it, or one whose bench cannot import
        corpus_note = f"no corpus: {type(e).__name__}: {e}"
    warm = getattr(placement, "warm", None)

    nodes, missing = [], []
    for label, source, name in NODES:
        if source == "synthetic" and hasattr(synthetic, name):
            nodes.append((label, getattr(synthetic, name)()))
        elif source == "corpus" and any(n.startswith(name) for n, _ in recorded):
            nodes.append((label, next(m for n, m in recorded if n.startswith(name))))
        else:
            missing.append(label)

    rows = []
    for label, m in nodes:
        n = m.size
        if warm is not None:
            warm(m)  # what the agent of that revision does when it builds a snapshot
        for k in sorted({1, 2, 3, 4, 8, n // 2, n - 2} - {0}):
            if k > n:
                continue
            for shape in PATTERNS:
                fields: dict[str, Any] = {"gpus": k}
                if shape == "nics=2":
                    fields["nics"] = min(2, len(m.nics))
                elif shape != "ring":
                    fields["pattern"] = shape
                row: dict[str, Any] = {"node": label, "n": n, "k": k, "request": shape, "wall": [], "cpu": [], "answers": []}
                rows.append(row)
                try:
                    req = placement.Request(**fields)
                    placement.place(m, req)  # the shape's first call is not timed
                except Exception as e:
                    row["error"] = f"{type(e).__name__}: {e}"
                    continue
                rng = random.Random(f"{label}/{k}/{shape}")
                gc.collect()
                gc.freeze()  # what this worker has kept so far (times, answers) is no garbage collector's work in the timed calls
                for _ in range(samples):
                    busy = rng.sample(range(n), rng.randint(0, n - k))
                    c0 = time.thread_time_ns()
                    t0 = time.perf_counter_ns()
                    answer = placement.place(m, req, busy)
                    row["wall"].append((time.perf_counter_ns() - t0) / 1e6)
                    row["cpu"].append((time.thread_time_ns() - c0) / 1e6)
                    row["answers"].append(terms(answer))
    json.dump(
        {"topoagent": str(loaded), "warm": warm is not None, "corpus": corpus_note, "missing": missing, "rows": rows},
        sys.stdout,
    )


def terms(answer: Any) -> dict[str, Any]:
    """What two revisions' answers should agree on: GPU set, bandwidth, NUMA terms."""
    objective = getattr(answer, "objective", None)
    if objective is None or not hasattr(answer, "gpus"):
        return {"kind": type(answer).__name__, "constraint": getattr(answer, "constraint", None)}
    out = {"gpus": sorted(g.index for g in answer.gpus), "bandwidth_gbps": answer.bandwidth_gbps}
    for name in ("numa_distance", "numa_nodes"):
        if hasattr(objective, name):
            out[name] = getattr(objective, name)
    return out


MESH_SIZES = (32, 64)
MESH_SIZE_MIN = 8  # mesh_asks draws requests for up to 8 GPUs whatever the size
MESH_DEADLINE_MS = 20  # the service's default (request.SERVICE_DEADLINE_MS)


def mesh_asks(n: int, samples: int) -> list[tuple[int, list[int]]]:
    """The study's requests on n GPUs: (k, busy GPUs), bench.placement's deadline study draws."""
    rng = random.Random(5)
    asks = []
    for _ in range(samples):
        k = rng.choice(sorted({1, 2, 4, 8, max(1, n // 4), n // 2}))
        asks.append((k, rng.sample(range(n), rng.randint(0, n - k))))
    return asks


def mesh_worker(samples: int, cpu_only: bool, sizes: tuple[int, ...] = MESH_SIZES) -> None:
    """The irregular-mesh study in this tree: per size, per request (cpu ms, wall ms, proven, GPUs).
    ``cpu_only``: the deadlines' wall clock stands still, so only the CPU time the search
    gets stops it -- how much search fits in 20 ms of a core, whatever the machine's load."""
    from topoagent import placement
    from topoagent.placement import deadline, synthetic

    if cpu_only:
        deadline.wall_clock = lambda: 0.0

    out = {}
    for n in sizes:
        m = synthetic.irregular_mesh(n)
        placement.warm(m)
        asks = mesh_asks(n, samples)
        gc.collect()
        gc.freeze()
        rows = []
        for k, busy in asks:
            c0 = time.thread_time_ns()
            t0 = time.perf_counter_ns()
            answer = placement.place(m, placement.Request(gpus=k, deadline_ms=MESH_DEADLINE_MS), busy)
            wall = (time.perf_counter_ns() - t0) / 1e6
            proven = bool(getattr(answer, "proven_optimal", False))
            rows.append([(time.thread_time_ns() - c0) / 1e6, wall, proven, list(getattr(answer, "indices", ()))])
        out[str(n)] = rows
    json.dump(out, sys.stdout)


def differing_class(matrix: Any, k: int, busy: list[int], old: list[int], new: list[int]) -> str:
    """How ``new`` compares with ``old`` (the GPUs two revisions proved optimal for the same
    request), scored by this tree: worse or better on terms (1)-(6) of the objective -- then
    one of them was not optimal -- or equal there, a tie that the tie-break (7, partner loss;
    then search order) settled differently."""
    from topoagent import placement
    from topoagent.placement.objective import evaluate_partner_loss

    def score(gpus: list[int]) -> tuple[Any, ...]:
        # Every GPU named: the search scores exactly this set (its best ring included).
        answer = placement.place(matrix, placement.Request(gpus=k, include=tuple(gpus)), busy)
        o = answer.objective
        level = o.bottleneck_level.sort_key() if o.bottleneck_level is not None else ()
        return (-(o.bandwidth_gbps or 0.0), level, o.numa_distance or 0, o.numa_nodes, o.nic_cost, o.damage,
                o.unverified_gpus, o.nic_traffic_steps)

    old_score, new_score = score(old), score(new)
    if new_score != old_score:
        return "worse on (1)-(6)" if new_score > old_score else "better on (1)-(6)"
    old_loss, new_loss = (evaluate_partner_loss(matrix, busy, gpus) for gpus in (old, new))
    if new_loss == old_loss:
        return "tie, same partner loss"
    return "tie, partner loss lower" if new_loss < old_loss else "tie, partner loss higher"


def mesh_report(runs: dict[str, list[dict[str, Any]]], old_name: str, new_name: str, args: argparse.Namespace, took_s: float) -> None:
    counts = "CPU time alone (the wall clock stood still): how much search fits in 20 ms of a core" if args.cpu_only else "as shipped"
    print(f"Irregular NVLink mesh (synthetic.irregular_mesh), deadline_ms={MESH_DEADLINE_MS} counted {counts}:"
          f" old = {old_name}, new = {new_name}.")
    print(f"{args.samples} requests per size and side, {args.rounds} round(s) of one child per side (alternating first), "
          f"{args.spinners} busy loop(s) beside; load average {' / '.join(f'{x:.1f}' for x in os.getloadavg())} after.")
    print("proven = share proven optimal (median over rounds; each round's in brackets); late = answers past the deadline"
          " + 1 ms by the wall clock (each round); cpu new/old = the median over the requests both sides proved in every"
          " round of the ratio of their median CPU times (p10-p90 in brackets).\n")
    print("| GPUs | proven old | proven new | late old | late new | wall p99 old ms | wall p99 new ms | cpu new/old | both proved | answers differing |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    from bench.stats import percentile  # here, not at the top: a worker imports an older tree's bench
    from topoagent.placement import synthetic

    classes: dict[int, collections.Counter[str]] = {}
    for n in args.sizes:
        side = {s: [run[str(n)] for run in runs[s]] for s in ("old", "new")}
        asks = mesh_asks(n, args.samples)
        matrix = synthetic.irregular_mesh(n)
        proven = {s: [sum(r[2] for r in rows) / len(rows) for rows in side[s]] for s in side}
        late = {s: [sum(r[1] > MESH_DEADLINE_MS + 1 for r in rows) for rows in side[s]] for s in side}
        p99 = {s: statistics.median(percentile([r[1] for r in rows], 0.99) for rows in side[s]) for s in side}
        ratios, differ = [], 0
        for i in range(args.samples):
            olds, news = [rows[i] for rows in side["old"]], [rows[i] for rows in side["new"]]
            if all(r[2] for r in olds) and all(r[2] for r in news):
                ratios.append(statistics.median(r[0] for r in news) / statistics.median(r[0] for r in olds))
                if olds[0][3] != news[0][3]:
                    differ += 1
                    k, busy = asks[i]
                    classes.setdefault(n, collections.Counter())[differing_class(matrix, k, busy, olds[0][3], news[0][3])] += 1
        spread = statistics.quantiles(ratios, n=10) if len(ratios) >= 2 else [1.0, 1.0]

        def shares(values: list[float]) -> str:
            return f"{statistics.median(values):.1%} ({', '.join(f'{v:.0%}' for v in values)})"

        print(f"| {n} | {shares(proven['old'])} | {shares(proven['new'])} | {', '.join(map(str, late['old']))} |"
              f" {', '.join(map(str, late['new']))} | {p99['old']:.1f} | {p99['new']:.1f} |"
              f" {statistics.median(ratios) if ratios else float('nan'):.2f} ({spread[0]:.2f}-{spread[-1]:.2f}) | {len(ratios)} | {differ} |")
    for n, counted in classes.items():
        print(f"\n{n} GPUs, answers differing, scored by this tree: "
              + "; ".join(f"{count}: {label}" for label, count in sorted(counted.items())))
    print(f"\nTook {took_s:.0f} s.")


def _spin(stop: Any) -> None:
    while not stop.is_set():
        pass


# --- parent: extract, alternate children, compare ------------------------------------------


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(REPO), *args], check=True, capture_output=True, text=True).stdout.strip()


def check_revision(rev: str) -> str:
    try:
        commit = git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"--rev {rev}: not a commit in {REPO}") from None
    if subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{commit}:{PACKAGE_INIT}"], capture_output=True).returncode:
        first = git("log", "--diff-filter=A", "--format=%h", "--", PACKAGE_INIT).splitlines()
        since = f" (the package arrived in {first[-1]}; pick that or a later commit)" if first else ""
        raise SystemExit(
            f"--rev {rev}: that revision has no {PACKAGE_INIT}; placement was one module then, "
            f"which this script cannot load{since}"
        )
    return commit


def extract(commit: str, into: str) -> None:
    archive = subprocess.Popen(["git", "-C", str(REPO), "archive", commit], stdout=subprocess.PIPE)
    untar = subprocess.run(["tar", "-x", "-C", into], stdin=archive.stdout, capture_output=True, text=True)
    assert archive.stdout is not None
    archive.stdout.close()
    if archive.wait() or untar.returncode:
        raise SystemExit(f"extracting {commit[:12]} failed: {untar.stderr.strip()}")


def run_child(
    tree: Path, samples: int, mesh: bool = False, cpu_only: bool = False, sizes: tuple[int, ...] = MESH_SIZES
) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "--worker", "--samples", str(samples), "--corpus", str(CORPUS)]
    cmd += (["--mesh", "--sizes", ",".join(map(str, sizes))] if mesh else []) + (["--cpu-only"] if cpu_only else [])
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"the worker in {tree} failed (exit {done.returncode}):\n{done.stderr.strip()}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def sizes_arg(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: GPU counts separated by commas, e.g. 32,64,128") from None
    if not sizes or min(sizes) < MESH_SIZE_MIN:
        raise argparse.ArgumentTypeError(f"{text!r}: each size at least {MESH_SIZE_MIN} GPUs (the study asks for 8)")
    return sizes


def ratio(new: float, old: float) -> str:
    return f"{new / old:5.2f}x" if old > 0 else "    -"


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m bench.placement_versus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python -m bench.placement_versus --rev HEAD~5 --quick   (about a minute on 2 busy cores)",
    )
    parser.add_argument("--rev", metavar="REV", help="the older revision: a commit-ish that has topoagent/placement/ (required)")
    parser.add_argument("--samples", type=int, metavar="N", help=f"seeded busy sets per row, per child (default {SAMPLES}; {QUICK_SAMPLES} with --quick)")
    parser.add_argument("--rounds", type=int, default=3, metavar="R", help="old/new child pairs, alternating which side goes first (default 3)")
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_SAMPLES} busy sets per row unless --samples says otherwise")
    parser.add_argument("--mesh", action="store_true", help="the irregular-mesh study (32 and 64 GPUs unless --sizes) under a 20 ms deadline (#38)")
    parser.add_argument("--sizes", type=sizes_arg, default=MESH_SIZES, metavar="N,N",
                        help=f"with --mesh: the mesh sizes in GPUs (default {','.join(map(str, MESH_SIZES))})")
    parser.add_argument("--spinners", type=int, default=0, metavar="N", help="busy loops running beside the children (default 0)")
    parser.add_argument("--cpu-only", action="store_true",
                        help="with --mesh: deadlines count the CPU time the search gets alone (the wall clock stands still)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", default=str(CORPUS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.samples is None:
        args.samples = QUICK_SAMPLES if args.quick else SAMPLES
    if args.worker:
        if args.mesh:
            mesh_worker(args.samples, args.cpu_only, args.sizes)
        else:
            worker(args.samples, args.corpus)
        return
    if not args.rev:
        parser.error("--rev REV is required")
    if args.samples < 1 or args.rounds < 1 or args.spinners < 0:
        parser.error("--samples and --rounds must be at least 1, --spinners at least 0")

    commit = check_revision(args.rev)
    dirty = " + uncommitted edits" if git("status", "--porcelain", "--untracked-files=no") else ""
    new_name = f"this tree ({git('rev-parse', '--short', 'HEAD')}{dirty})"
    old_name = f"{args.rev} ({commit[:9]})"
    started = time.perf_counter()
    runs: dict[str, list[dict[str, Any]]] = {"old": [], "new": []}
    import multiprocessing

    stop = multiprocessing.Event()
    spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(args.spinners)]
    for spinner in spinners:
        spinner.start()
    try:
        with tempfile.TemporaryDirectory(prefix="placement-versus-") as tmp:
            extract(commit, tmp)
            trees = {"old": Path(tmp), "new": REPO}
            for r in range(args.rounds):
                order = ("old", "new") if r % 2 == 0 else ("new", "old")
                took = []
                for side in order:
                    t0 = time.perf_counter()
                    runs[side].append(run_child(trees[side], args.samples, args.mesh, args.cpu_only, args.sizes))
                    took.append(f"{side} {time.perf_counter() - t0:.1f} s")
                print(f"round {r + 1}/{args.rounds}: {', '.join(took)}", file=sys.stderr, flush=True)
    finally:
        stop.set()
        for spinner in spinners:
            spinner.join()
    (mesh_report if args.mesh else report)(runs, old_name, new_name, args, time.perf_counter() - started)


def report(runs: dict[str, list[dict[str, Any]]], old_name: str, new_name: str, args: argparse.Namespace, took_s: float) -> None:
    def rows_of(side: str, run: int) -> dict[tuple[str, int, str], dict[str, Any]]:
        return {(row["node"], row["k"], row["request"]): row for row in runs[side][run]["rows"]}

    old_rows = [rows_of("old", r) for r in range(args.rounds)]
    new_rows = [rows_of("new", r) for r in range(args.rounds)]
    keys = [key for key in new_rows[0] if key in old_rows[0]]
    only = sorted(set(old_rows[0]) ^ set(new_rows[0]))

    print(f"## place() ms: old = {old_name}, new = {new_name}")
    print(f"{args.samples} seeded busy sets per row and side, {args.rounds} round(s) of one child per side (alternating first);")
    print("each figure is the median over rounds of that round's p50/p99.  wall = perf_counter; cpu = thread_time."
          + ("  Below 100 samples a p99 is the slowest call." if args.samples < 100 else ""))
    for side in ("old", "new"):
        first = runs[side][0]
        print(f"  {side}: placement.warm {'called' if first['warm'] else 'absent (cold tables)'}; {first['corpus']}"
              + (f"; nodes it cannot build: {', '.join(first['missing'])}" if first["missing"] else ""))
    print()
    print(f"{'':32}| {'wall':^33} | {'cpu':^33}")
    head = f"{'old p50':>7} {'p99':>6} {'new p50':>7} {'p99':>6} {'p50':>6} {'p99':>6}"
    print(f"{'node':17} {'k':>3} {'request':10}| {head} | {head}")

    from bench.stats import percentile  # here, not at the top: a worker imports an older tree's bench

    def med(side_rows: list[dict[tuple[str, int, str], dict[str, Any]]], key: tuple[str, int, str], clock: str, q: float) -> float:
        return statistics.median(percentile(rows[key][clock], q) for rows in side_rows)

    worst: dict[int, dict[str, float]] = {}
    wall50, wall99, cpu50, cpu99 = [], [], [], []
    compared = gpus_differ = bw_differ = numa_differ = differ = ties = 0
    unstable = {"old": 0, "new": 0}
    examples: list[str] = []
    for key in keys:
        o0, n0 = old_rows[0][key], new_rows[0][key]
        if "error" in o0 or "error" in n0:
            print(f"{key[0]:17} {key[1]:>3} {key[2]:10}| old: {o0.get('error', 'ok')}; new: {n0.get('error', 'ok')}")
            continue
        cells = []
        size = worst.setdefault(o0["n"], {})
        for clock in ("wall", "cpu"):
            o50, o99 = med(old_rows, key, clock, 0.5), med(old_rows, key, clock, 0.99)
            n50, n99 = med(new_rows, key, clock, 0.5), med(new_rows, key, clock, 0.99)
            cells.append(f"{o50:7.3f} {o99:6.3f} {n50:7.3f} {n99:6.3f} {ratio(n50, o50)} {ratio(n99, o99)}")
            size[f"{clock} old"] = max(size.get(f"{clock} old", 0.0), o99)
            size[f"{clock} new"] = max(size.get(f"{clock} new", 0.0), n99)
            if clock == "wall":
                wall50.append(n50 / o50 if o50 else 1.0)
                wall99.append(n99 / o99 if o99 else 1.0)
            else:
                cpu50.append(n50 / o50 if o50 else 1.0)
                cpu99.append(n99 / o99 if o99 else 1.0)
        print(f"{key[0]:17} {key[1]:>3} {key[2]:10}| {cells[0]} | {cells[1]}")
        for i, (a, b) in enumerate(zip(o0["answers"], n0["answers"])):
            compared += 1
            g = a.get("gpus") != b.get("gpus") or a.get("kind") != b.get("kind")
            w = a.get("bandwidth_gbps") != b.get("bandwidth_gbps")
            u = any(a[t] != b[t] for t in ("numa_distance", "numa_nodes") if t in a and t in b)
            gpus_differ += g
            bw_differ += w
            numa_differ += u
            differ += g or w or u
            ties += g and not (w or u)
            if (g or w or u) and len(examples) < 5:
                examples.append(f"  {key[0]}, k={key[1]} {key[2]}, busy set #{i}: old {a} / new {b}")
        for side, side_rows in (("old", old_rows), ("new", new_rows)):
            unstable[side] += sum(
                any(rows[key]["answers"][i] != side_rows[0][key]["answers"][i] for rows in side_rows[1:])
                for i in range(len(side_rows[0][key]["answers"]))
            )

    print("\nworst p99 over every k and request, per node size (old -> new, ms):")
    for n, w in sorted(worst.items()):
        print(
            f"  {n:3} GPUs: wall {w['wall old']:7.3f} -> {w['wall new']:7.3f} ({ratio(w['wall new'], w['wall old']).strip()})"
            f"   cpu {w['cpu old']:7.3f} -> {w['cpu new']:7.3f} ({ratio(w['cpu new'], w['cpu old']).strip()})"
        )
    if wall50:
        print(
            f"new/old over {len(wall50)} rows, median (min-max): wall p50 {statistics.median(wall50):.2f}x"
            f" ({min(wall50):.2f}-{max(wall50):.2f}), wall p99 {statistics.median(wall99):.2f}x"
            f" ({min(wall99):.2f}-{max(wall99):.2f}); cpu p50 {statistics.median(cpu50):.2f}x, p99 {statistics.median(cpu99):.2f}x"
        )
    print(
        f"answers differing: {differ} of {compared} (GPU set {gpus_differ}, bandwidth {bw_differ},"
        f" NUMA terms {numa_differ}; another set at equal bandwidth and NUMA terms {ties}); changed between rounds of one side: old {unstable['old']}, new {unstable['new']}"
    )
    for line in examples:
        print(line)
    if only:
        print(f"rows on one side only: {len(only)} ({', '.join(f'{a} k={b} {c}' for a, b, c in only[:4])}{', ...' if len(only) > 4 else ''})")
    print(f"took {took_s:.0f} s")


if __name__ == "__main__":
    main()
