"""Link levels derived from the hardware's own description (pure functions).

Levels follow nvidia-smi's words:
  NV<n>  n bonded NVLinks between the two GPUs; through an NVSwitch fabric, every pair
         of GPUs in the fabric gets NV<links per GPU> (the fewer of the two, when a link
         is down on one side);
  PIX    at most one PCIe switch between them (one bridge level on each side at most);
  PXB    several bridges, without crossing the host bridge;
  PHB    through the host bridge (same root complex);
  NODE   different root complexes of one NUMA node;
  SYS    across NUMA nodes (the socket interconnect).
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from topoagent.collectors.nvml import NvmlInfo
from topoagent.collectors.pci import PciDevice, PciLink, PciTree
from topoagent.node.facts import BRIDGE, GPU
from topoagent.node.levels import NODE, PHB, PIX, PXB, SYS, LinkLevel, expected_gbps
from topoagent.node.model import GpuTopo, NicTopo


def shared_bridges(a: PciDevice, b: PciDevice) -> int:
    """How many bridges, from the root complex down, two devices have in common (0 under
    different root complexes): a transfer between them does not cross those."""
    common = 0
    if a.root_complex is not None and a.root_complex == b.root_complex:
        for x, y in zip(a.bridges, b.bridges):
            if x != y:
                break
            common += 1
    return common


def pcie_level(a: PciDevice, b: PciDevice) -> LinkLevel:
    """The PCIe level between two devices, from their bridge chains and NUMA nodes."""
    if a.root_complex is None or b.root_complex is None or a.root_complex != b.root_complex:
        return NODE if a.numa_node == b.numa_node else SYS
    common = shared_bridges(a, b)
    if common == 0:
        return PHB
    below_a, below_b = len(a.bridges) - common, len(b.bridges) - common
    if below_a <= 1 and below_b <= 1:
        return PIX
    return PXB


# (bandwidth, generation, width) of the link above a device; None: no link known.
_Figures = tuple[float, int | None, int | None] | None


def _figures(device: PciDevice) -> _Figures:
    """The link above a device as it runs now.

    GPUs drop their link speed at idle to save power (and the port above follows), so
    for GPUs and bridges we count the width now and the speed the link can train to; a
    narrower link is a real fault, a slower one at idle is not.
    """
    if device.link is None:
        return None
    rate, gen = _rated(device.link, device.kind in (GPU, BRIDGE))
    return None if rate is None else (rate, gen, device.link.current_width)


@lru_cache(maxsize=1024)
def _rated(link: PciLink, at_max_speed: bool) -> tuple[float | None, int | None]:
    """(bandwidth, generation) of a link, counted at the speed it can train to or at the
    speed it runs.  Remembered: a node has a handful of distinct links."""
    return link.gbps(assume_max_speed=at_max_speed), link.max_gen if at_max_speed else link.current_gen


def _slowest(figures: Iterable[_Figures]) -> _Figures:
    """The first of the slowest, in the order given (the first wins a tie)."""
    best: _Figures = None
    for f in figures:
        if f is not None and (best is None or f[0] < best[0]):
            best = f
    return best


class PathLinks:
    """The slowest PCIe link a transfer between two devices of a tree crosses: the
    endpoints' own, and those of the bridges below the switch they share (its upstream link
    is not crossed), in that order, the first winning a tie.

    Every pair of a node asks, and pairs share their bridges: each device's slowest link
    below each depth of its chain is found once (walking each pair's path device by device
    took 39% of merging the 128-GPU node's 32,640 pairs)."""

    def __init__(self, tree: PciTree) -> None:
        self.tree = tree
        self._below: dict[tuple[str, int], _Figures] = {}  # (address, depth) -> slowest bridge there and below

    def narrowest(self, a: PciDevice, b: PciDevice) -> tuple[int | None, int | None]:
        """(generation, width) of the slowest link between ``a`` and ``b``."""
        common = shared_bridges(a, b)
        best = _slowest((_figures(a), _figures(b), self._bridges_below(a, common), self._bridges_below(b, common)))
        return (best[1], best[2]) if best else (None, None)

    def _bridges_below(self, device: PciDevice, depth: int) -> _Figures:
        key = (device.address, depth)
        if key not in self._below:
            found = (self.tree.get(x) for x in device.bridges[depth:])
            self._below[key] = _slowest(_figures(d) for d in found if d is not None)
        return self._below[key]


def nvlink_levels(nvml: NvmlInfo, nvswitch_addresses: set[str]) -> tuple[dict[tuple[int, int], int], set[int], dict[int, int]]:
    """(index pair -> active links between them, GPUs in a switch fabric, links per GPU)."""
    by_address = {g.pci_address: g.index for g in nvml.gpus if g.pci_address}
    direct: dict[tuple[int, int], int] = {}
    to_switch: dict[int, int] = {}
    for g in nvml.gpus:
        for link in g.nvlinks:
            if not link.active:
                continue
            remote = link.remote_pci_address
            kind = link.remote_type
            if kind is None and remote is not None:
                kind = "gpu" if remote in by_address else "switch" if remote in nvswitch_addresses else None
            if kind == "gpu" and remote in by_address and by_address[remote] != g.index:
                key = (g.index, by_address[remote])
                direct[key] = direct.get(key, 0) + 1
            elif kind == "switch":
                to_switch[g.index] = to_switch.get(g.index, 0) + 1
    counts: dict[tuple[int, int], int] = {}
    for (i, j), links in direct.items():
        # Each side reports the link; trust the larger count if a side lost one report.
        key = (min(i, j), max(i, j))
        counts[key] = max(counts.get(key, 0), links)
    fabric = {i for i, n in to_switch.items() if n > 0}
    for i in fabric:
        for j in fabric:
            if i < j and (i, j) not in counts:
                counts[(i, j)] = min(to_switch[i], to_switch[j])
    return counts, fabric, to_switch



def expected_for_pair(
    level: LinkLevel | None,
    a: str,
    b: str,
    gpus: dict[str, GpuTopo],
    nics: dict[str, NicTopo],
    pci_of: dict[str, PciDevice],
    paths: PathLinks | None,
) -> float | None:
    if level is None:
        return None
    generation = None
    if a in gpus and b in gpus:
        gens = {gpus[a].nvlink_generation, gpus[b].nvlink_generation}
        generation = gens.pop() if len(gens) == 1 else None
    gen = width = None
    if not level.is_nvlink and a in pci_of and b in pci_of and paths is not None:
        gen, width = paths.narrowest(pci_of[a], pci_of[b])
    value = expected_gbps(level, nvlink_generation=generation, pcie_gen=gen, pcie_width=width)
    for name in (a, b):
        nic = nics.get(name)
        if nic is not None and nic.ports and value is not None:
            if not nic.active:
                return 0.0
            if nic.rate_gbps:
                value = round(min(value, nic.rate_gbps / 8), 2)
    return value


def faces_down(device: PciDevice) -> bool:
    """Whether a bridge is a downstream-facing port (root port or switch downstream port).

    sysfs gives each device one link status: a root port or a switch's downstream port
    shows the link *below* it, every other device (endpoint, switch upstream port) the
    link *above* it.  The port type lives in config space, which we do not read; along a
    chain of bridges the kinds alternate from the root port down (root port, upstream,
    downstream, upstream, ...), so the depth tells them apart.
    """
    return _is_bridge(device) and device.depth % 2 == 0


def _is_bridge(device: PciDevice) -> bool:
    return device.kind == BRIDGE
