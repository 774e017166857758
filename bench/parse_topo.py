"""Parse time of the largest `nvidia-smi topo -m` output: 16 GPUs + 10 NICs (DGX-2 shape).

The corpus capture of a DGX-2 is cut after 4 rows, so the full 26x26 output is rebuilt
from it: the 4 real GPU rows set the pattern (NV6 everywhere, 2 GPUs per PCIe switch,
NIC pairs per switch pair), rendered the way nvidia-smi prints it (tabs).

    python bench/parse_topo.py [--runs N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from topoagent.collectors.nvidia_smi import TopoDevice, TopoMatrix, parse_topo_matrix, render_topo_matrix
from topoagent.node.levels import LevelKind, LinkLevel


def dgx2_like() -> TopoMatrix:
    gpus = [TopoDevice(f"GPU{i}", "gpu", cpu_affinity="0-23,48-71" if i < 8 else "24-47,72-95") for i in range(16)]
    nics = [TopoDevice(f"mlx5_{k}", "nic", device=f"mlx5_{k}") for k in range(10)]
    devices = gpus + nics

    def socket(i: int) -> int:
        return (i // 8) if i < 16 else (0 if i - 16 < 5 else 1)

    def switch(i: int) -> int:
        return i // 2 if i < 16 else [0, 1, 2, 3, 99, 4, 5, 6, 7, 98][i - 16]

    n = len(devices)
    grid = [[LinkLevel(LevelKind.SELF)] * n for _ in range(n)]
    for i in range(n):
        for j in range(n):
            if i == j:
                continue
            if i < 16 and j < 16:
                level = LinkLevel(LevelKind.NV, 6)
            elif switch(i) == switch(j):
                level = LinkLevel(LevelKind.PIX)
            elif switch(i) // 2 == switch(j) // 2:
                level = LinkLevel(LevelKind.PXB)
            elif socket(i) == socket(j):
                level = LinkLevel(LevelKind.NODE)
            else:
                level = LinkLevel(LevelKind.SYS)
            grid[i][j] = level
    return TopoMatrix(tuple(devices), tuple(tuple(r) for r in grid))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    args = parser.parse_args()
    text = render_topo_matrix(dgx2_like(), style="tabs")
    assert len(parse_topo_matrix(text).devices) == 26
    for _ in range(50):  # warm-up
        parse_topo_matrix(text)
    samples = []
    for _ in range(args.runs):
        start = time.perf_counter_ns()
        parse_topo_matrix(text)
        samples.append((time.perf_counter_ns() - start) / 1000)
    samples.sort()
    p99 = samples[int(len(samples) * 0.99) - 1]
    print(f"parse_topo_matrix, 16 GPU + 10 NIC ({len(text)} bytes), {args.runs} runs:")
    print(f"  median {statistics.median(samples):.0f} us   p99 {p99:.0f} us   min {samples[0]:.0f} us")


if __name__ == "__main__":
    main()
