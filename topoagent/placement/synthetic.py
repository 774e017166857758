"""Synthetic nodes of known shapes for what-if studies, benchmarks and tests, built as
nvidia-smi would print them."""

from __future__ import annotations

from topoagent.node.levels import LinkLevel, expected_gbps
from topoagent.node.matrix import DistanceMatrix, GpuInfo, NicInfo


def socket_distances(sockets: int) -> dict[tuple[int, int], int]:
    """A SLIT table over one NUMA node per socket: 10 local; with 4 sockets, sockets
    0-1 and 2-3 are linked directly (16) and the others two hops apart (32), as on
    glueless 4-socket boards; with 2, 21."""
    def far(a: int, b: int) -> int:
        if a == b:
            return 10
        if sockets <= 2:
            return 21
        return 16 if a // 2 == b // 2 else 32

    return {(a, b): far(a, b) for a in range(sockets) for b in range(sockets)}


def build(
    levels: list[list[str]],
    numa: list[int],
    cpus: list[str],
    nic_levels: list[list[str]],
    numa_distances: dict[tuple[int, int], int] | None = None,
) -> DistanceMatrix:
    n = len(levels)
    parsed = tuple(tuple(LinkLevel.parse(x) for x in row) for row in levels)
    return DistanceMatrix(
        gpus=tuple(GpuInfo(index=i, name=f"GPU{i}", numa_node=numa[i], cpus=cpus[i]) for i in range(n)),
        nics=tuple(NicInfo(name=f"NIC{j}", device=f"mlx5_{j}") for j in range(len(nic_levels[0]) if nic_levels else 0)),
        gpu_levels=parsed,
        gpu_expected_gbps=tuple(tuple(expected_gbps(lv) for lv in row) for row in parsed),
        gpu_nic_levels=tuple(tuple(LinkLevel.parse(x) for x in row) for row in nic_levels) if nic_levels else (),
        numa_distances=numa_distances or {},
    )


def tree_node(sockets: int, switches_per_socket: int, gpus_per_switch: int, nv_zone: int = 0, nv_links: int = 18) -> DistanceMatrix:
    """GPUs under PCIe switches under sockets; optional NVLink all-to-all zones of ``nv_zone``
    consecutive GPUs; one NIC per switch (PIX to its GPUs)."""
    n = sockets * switches_per_socket * gpus_per_switch
    sock = [i // (switches_per_socket * gpus_per_switch) for i in range(n)]
    sw = [i // gpus_per_switch for i in range(n)]
    levels = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
            elif nv_zone and i // nv_zone == j // nv_zone:
                row.append(f"NV{nv_links}")
            elif sw[i] == sw[j]:
                row.append("PIX")
            elif sock[i] == sock[j]:
                row.append("NODE")
            else:
                row.append("SYS")
        levels.append(row)
    n_sw = sockets * switches_per_socket
    nic_levels = [
        ["PIX" if sw[i] == s else ("NODE" if sock[i] == s // switches_per_socket else "SYS") for s in range(n_sw)]
        for i in range(n)
    ]
    cores = 16
    cpus = [f"{sock[i] * cores}-{sock[i] * cores + cores - 1}" for i in range(n)]
    return build(levels, sock, cpus, nic_levels, socket_distances(sockets))


def pcie_two_socket_8() -> DistanceMatrix:
    """An 8-GPU PCIe server: 2 sockets, 2 switches per socket, 2 GPUs per switch."""
    return tree_node(2, 2, 2)


def nvswitch_16() -> DistanceMatrix:
    """A DGX-2-like node: 16 GPUs all NV6 (NVSwitch), 2 sockets, a NIC per GPU pair."""
    n = 16
    sock = [i // 8 for i in range(n)]
    levels = [["X" if i == j else "NV6" for j in range(n)] for i in range(n)]
    nic_levels = [
        ["PIX" if i // 2 == s else ("NODE" if sock[i] == s // 4 else "SYS") for s in range(8)] for i in range(n)
    ]
    cpus = ["0-23,48-71" if s == 0 else "24-47,72-95" for s in sock]
    return build(levels, sock, cpus, nic_levels, socket_distances(2))


def node_32() -> DistanceMatrix:
    """32 GPUs: 4 sockets x 2 switches x 4 GPUs, NV18 zones of 8 (one per socket)."""
    return tree_node(4, 2, 4, nv_zone=8)


def pcie_16() -> DistanceMatrix:
    """16 PCIe GPUs: 2 sockets x 4 switches x 2 GPUs, no NVLink."""
    return tree_node(2, 4, 2)


def nvswitch_node(n: int, sockets: int = 2) -> DistanceMatrix:
    """``n`` GPUs all NV18 (one NVSwitch fabric), split evenly over ``sockets``, no NICs."""
    per = n // sockets
    sock = [i // per for i in range(n)]
    levels = [["X" if i == j else "NV18" for j in range(n)] for i in range(n)]
    cpus = [f"{s * 16}-{s * 16 + 15}" for s in sock]
    return build(levels, sock, cpus, [], socket_distances(sockets))


def irregular_mesh(n: int, seed: int = 1, p: float = 0.3, socket_size: int = 8) -> DistanceMatrix:
    """An NVLink mesh with no symmetry (a mesh with failed links is such a node): each pair
    NV1 or NV2 with probability ``p``, else NODE within a socket of ``socket_size`` GPUs
    and SYS across.  Deterministic for a seed."""
    import random

    rng = random.Random(seed)
    sock = [i // socket_size for i in range(n)]
    levels = [["X"] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            if rng.random() < p:
                level = rng.choice(("NV1", "NV2"))
            else:
                level = "NODE" if sock[i] == sock[j] else "SYS"
            levels[i][j] = levels[j][i] = level
    sockets = sock[-1] + 1
    cpus = [f"{s * 16}-{s * 16 + 15}" for s in sock]
    return build(levels, sock, cpus, [], socket_distances(sockets) if sockets <= 4 else None)
