"""place() latency of this tree against an older revision, side by side in one process.

    python -m bench.placement_versus --rev 2f3890b [--samples 200]

Both versions answer the same requests on the same busy sets, interleaved, after one
warm-up call per request shape; times are this thread's CPU time (ms), so other load on
a shared machine inflates them less than wall time.  It also checks the two agree on
objective terms (1)-(3) (term 4 and the tie-break may have changed between revisions).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.placement import corpus, pct
from topoagent import placement as current
from topoagent.placement import Request
from topoagent.placement.synthetic import node_32, nvswitch_16, pcie_16, pcie_two_socket_8

REPO = Path(__file__).resolve().parents[1]


def load_revision(rev: str):
    source = subprocess.run(
        ["git", "-C", str(REPO), "show", f"{rev}:topoagent/placement.py"],
        check=True, capture_output=True, text=True,
    ).stdout
    path = Path(tempfile.mkdtemp()) / "placement_at_rev.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("placement_at_rev", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["placement_at_rev"] = module
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rev", required=True)
    parser.add_argument("--samples", type=int, default=200)
    args = parser.parse_args()
    old = load_revision(args.rev)
    nodes = [
        ("8: DGX-1 V100", next(m for n, m in corpus() if n.startswith("dlperf-8xV100"))),
        ("8: H20 + 8 NIC", next(m for n, m in corpus() if n.startswith("sglang-24966"))),
        ("8: PCIe 2 sockets", pcie_two_socket_8()),
        ("16: NVSwitch", nvswitch_16()),
        ("16: PCIe", pcie_16()),
        ("32: NV18 zones", node_32()),
    ]
    print(f"## place() CPU ms, {args.rev} vs this tree ({args.samples} random busy sets per row)\n")
    print(f"{'node':18} {'k':>3} {'request':8} | {'old p50':>8} {'p99':>7} | {'new p50':>8} {'p99':>7}")
    worst: dict[int, list[float]] = {}
    disagree = 0
    for name, m in nodes:
        n = m.size
        for k in sorted({1, 2, 3, 4, 8, n // 2, n - 2} - {0}):
            for label, req in (
                ("ring", Request(gpus=k)),
                ("nics=2", Request(gpus=k, nics=min(2, len(m.nics)))),
                ("alltoall", Request(gpus=k, pattern="alltoall")),
                ("pipeline", Request(gpus=k, pattern="pipeline")),
            ):
                rng = random.Random(f"{name}/{k}/{label}")
                old.place(m, req)
                current.place(m, req)
                times: dict[str, list[float]] = {"old": [], "new": []}
                for _ in range(args.samples):
                    busy = rng.sample(range(n), rng.randint(0, n - k))
                    answers = {}
                    for tag, module in (("old", old), ("new", current)):
                        t0 = time.thread_time_ns()
                        answers[tag] = module.place(m, req, busy)
                        times[tag].append((time.thread_time_ns() - t0) / 1e6)
                    a, b = answers["old"], answers["new"]
                    terms = [
                        (x.bandwidth_gbps, x.objective.numa_nodes, x.objective.nic_cost)
                        if hasattr(x, "objective") else type(x).__name__
                        for x in (a, b)
                    ]
                    disagree += terms[0] != terms[1]
                o, w = times["old"], times["new"]
                row = worst.setdefault(n, [0.0, 0.0])
                row[0], row[1] = max(row[0], pct(o, 0.99)), max(row[1], pct(w, 0.99))
                print(
                    f"{name:18} {k:>3} {label:8} | {statistics.median(o):8.3f} {pct(o, .99):7.3f}"
                    f" | {statistics.median(w):8.3f} {pct(w, .99):7.3f}"
                )
    print("\nworst p99 over all rows (old -> new):")
    for n, (o, w) in sorted(worst.items()):
        print(f"  {n:2} GPUs: {o:7.3f} -> {w:7.3f} ms")
    print(f"answers differing on terms (1)-(3): {disagree}")


if __name__ == "__main__":
    main()
