"""The node model: the one typed NodeTopology discovery builds and every door reads.

Discovery (topoagent.node.discovery) runs the collectors; topoagent.node.merge turns their facts
into a NodeTopology, deriving levels with topoagent.node.derive and findings with
topoagent.node.findings.  Exporters read this model only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from topoagent.collectors.infiniband import IbPort
from topoagent.collectors.netdev import NetInterface
from topoagent.collectors.numa import NumaTopology
from topoagent.collectors.nvidia_smi import TopoDevice, TopoMatrix
from topoagent.collectors.nvml import NvLink
from topoagent.collectors.pci import PciDevice, PciLink, PciTree
from topoagent.node.fabric import Fabric, Rail
from topoagent.node.facts import CpuFacts, PortNeighbour
from topoagent.node.levels import SELF, LinkLevel
from topoagent.vocabulary import FindingKind, Severity, Status

if TYPE_CHECKING:
    from topoagent.node.matrix import DistanceMatrix, HostLayout

# The fact types the model is made of, named here so exporters read them from the model
# and never import a collector module.
__all__ = [
    "CollectorStatus", "CpuFacts", "Fabric", "Finding", "GpuTopo", "IbPort", "InterfaceTopo", "NetInterface", "NicTopo", "NodeTopology", "NumaTopology",
    "NvLink", "NvlinkDomain", "Pair", "PciDevice", "PciLink", "PciTree", "PortNeighbour", "Rail", "TopoDevice", "TopoMatrix",
]

DERIVED = "derived"
DECLARED = "nvidia-smi"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something discovery or a measurement says about the node (the one finding type)."""

    kind: FindingKind
    severity: Severity
    subject: str  # "GPU3", "GPU0/NIC1", "mlx5_2 port 1", "0000:3b:00.0", a collector name
    message: str
    source: str = "discovery"  # or "probe", "telemetry"
    expected_gbps: float | None = None  # a measurement's finding: what the level should give
    measured_gbps: float | None = None  # and what was measured
    rate_per_s: float | None = None  # a counter's finding: the rate (per second) that raised it


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    """How one collector fared in a discovery run."""

    name: str
    status: Status
    message: str | None
    seconds: float
    warnings: tuple[str, ...] = ()
    bug: bool = False  # failed through a fault of topoagent's own, not of the node (the log has its traceback)


@dataclass(frozen=True, slots=True)
class GpuTopo:
    """One GPU as discovery merged it from NVML, sysfs and nvidia-smi."""

    index: int
    name: str  # "GPU3"
    uuid: str | None = None
    model: str | None = None
    pci_address: str | None = None
    numa_node: int | None = None
    cpus: str | None = None
    memory_bytes: int | None = None
    link: PciLink | None = None
    nvlink_generation: int | None = None
    nvlinks: tuple[NvLink, ...] = ()
    # What NVML saw running when discovery ran (None/() when NVML did not say).
    utilization_percent: float | None = None
    processes: tuple[int, ...] = ()
    device_minor: int | None = None  # N of /dev/nvidiaN, from the driver's procfs
    # The plain interfaces (up, not RDMA) closest to this GPU in the PCIe tree.
    socket_interfaces: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class NicTopo:
    """One RDMA NIC, named as nvidia-smi names it, with its ports."""

    name: str  # "NIC0", as nvidia-smi names it
    device: str | None  # RDMA device "mlx5_0"
    pci_address: str | None = None
    numa_node: int | None = None
    netdevs: tuple[str, ...] = ()
    ports: tuple[IbPort, ...] = ()
    link: PciLink | None = None
    node_guid: str | None = None  # "0x4885b8933c4c5d93"

    @property
    def active(self) -> bool | None:
        if not self.ports:
            return None
        return any(p.active for p in self.ports)

    @property
    def rate_gbps(self) -> float | None:
        rates = [p.rate_gbps for p in self.ports if p.active and p.rate_gbps]
        return max(rates) if rates else None


@dataclass(frozen=True, slots=True)
class InterfaceTopo:
    """A network interface, RDMA or plain Ethernet, placed in the PCIe tree."""

    name: str  # "ens1f0"
    pci_address: str | None = None  # None: virtual (lo, bridges, veths)
    numa_node: int | None = None
    speed_mbps: int | None = None
    operstate: str | None = None
    rdma_device: str | None = None  # "mlx5_0" when the interface is an RDMA device's netdev
    nearest_gpus: tuple[str, ...] = ()  # the GPUs at the closest PCIe level to it

    @property
    def socket_candidate(self) -> bool:
        """A physical interface NCCL's socket transport could use: not RDMA's, not down."""
        return self.pci_address is not None and self.rdma_device is None and self.operstate != "down"


@dataclass(frozen=True, slots=True)
class NvlinkDomain:
    """The multi-node NVLink domain the node's GPUs are registered in (NVML's GPU fabric
    info): two nodes with the same cluster UUID and clique id are NVLink neighbours."""

    cluster_uuid: str
    clique_id: int | None
    gpus: tuple[str, ...]  # the GPUs NVML registered in it ("GPU0", ...)


@dataclass(frozen=True, slots=True)
class Pair:
    """The link between two devices (GPU or NIC): its level, where the level came from, what it should carry."""

    a: str
    b: str
    level: LinkLevel | None
    source: str  # DERIVED or DECLARED
    declared: LinkLevel | None
    expected_gbps: float | None


@dataclass(frozen=True, repr=False)
class NodeTopology:
    """Everything discovery found on one node; every door reads this."""

    hostname: str | None
    numa: NumaTopology | None
    pci: PciTree | None
    gpus: tuple[GpuTopo, ...]
    nics: tuple[NicTopo, ...]
    pairs: tuple[Pair, ...]
    findings: tuple[Finding, ...]
    collectors: tuple[CollectorStatus, ...]
    declared: TopoMatrix | None = None
    cpu: CpuFacts | None = None  # CPU identity and core map (the NCCL and gres exports read it)
    # The GPUDirect peer-memory module loaded ("nvidia_peermem"), None when none was seen.
    peer_memory: str | None = None
    interfaces: tuple[InterfaceTopo, ...] = ()  # every network interface, /sys/class/net
    nvlink_domain: NvlinkDomain | None = None  # None: NVML reports no completed fabric registration
    fabric: Fabric = field(default_factory=Fabric)  # each port's neighbour switch and the rails they make (topoagent.node.fabric)
    driver_version: str | None = None  # NVIDIA driver, as NVML says ("550.54.15"); /metrics labels GPUs with it as DCGM does
    # device -> device -> their pair: one dict per device rather than a (a, b) tuple per
    # direction, which cost 6 MiB on a 256-device node (32,640 pairs).
    _pair_index: dict[str, dict[str, Pair]] = field(default_factory=dict, repr=False, compare=False)

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run() (3.11) formats the main task's result while
        # restoring its SIGINT handler, and the full dataclass repr of a big node took
        # longer than reading it.
        return (f"NodeTopology(hostname={self.hostname!r}, gpus={len(self.gpus)}, "
                f"nics={len(self.nics)}, pairs={len(self.pairs)}, findings={len(self.findings)})")

    def __post_init__(self) -> None:
        index = self._pair_index
        for pair in self.pairs:
            index.setdefault(pair.a, {})[pair.b] = pair
            index.setdefault(pair.b, {})[pair.a] = pair

    def pair(self, a: str, b: str) -> Pair | None:
        return self._pair_index.get(a, {}).get(b)

    def level(self, a: str, b: str) -> LinkLevel | None:
        if a == b:
            return SELF
        pair = self.pair(a, b)
        return pair.level if pair else None

    def topo_matrix(self) -> TopoMatrix:
        """Our derived matrix in the shape of `nvidia-smi topo -m` (for rendering)."""
        devices: list[TopoDevice] = []
        for g in self.gpus:
            devices.append(
                TopoDevice(
                    name=g.name,
                    kind="gpu",
                    cpu_affinity=g.cpus,
                    numa_affinity=None if g.numa_node is None else str(g.numa_node),
                )
            )
        for n in self.nics:
            devices.append(TopoDevice(name=n.name, kind="nic", device=n.device))
        names = [d.name for d in devices]
        levels = tuple(tuple(self.level(a, b) for b in names) for a in names)
        return TopoMatrix(devices=tuple(devices), levels=levels)

    def gpus_with_unknown_links(self) -> tuple[str, ...]:
        """The GPUs whose levels are unknown (sysfs does not show them and nvidia-smi did
        not say), as few as leave every other pair known (see unknown_link_gpus)."""
        names = [g.name for g in self.gpus]
        return tuple(names[i] for i in unknown_link_gpus(len(names), lambda i, j: self.level(names[i], names[j]) is not None))

    def unhealthy_gpus(self, findings: Iterable[Finding] = ()) -> dict[str, str]:
        """GPU name -> the critical finding placement keeps off it for (the node's own,
        then ``findings``, e.g. the probes')."""
        gpus = {g.name for g in self.gpus}
        out: dict[str, str] = {}
        for f in (*self.findings, *findings):
            if f.severity is Severity.CRITICAL and f.subject in gpus:
                out.setdefault(f.subject, f"{f.kind}: {f.message}")
        return out

    def numa_distances(self) -> dict[tuple[int, int], int]:
        """SLIT distances between NUMA node ids ({} when the table is missing or ragged)."""
        if self.numa is None:
            return {}
        ids = [n.id for n in self.numa.nodes]
        if any(len(n.distances) != len(ids) for n in self.numa.nodes):
            return {}
        return {(a.id, b): d for a in self.numa.nodes for b, d in zip(ids, a.distances)}

    def distance_matrix(self, findings: Iterable[Finding] = ()) -> DistanceMatrix:
        """The GPU distance matrix the placement core and the exporters read; ``findings``
        (the probes') may mark more GPUs unhealthy than the node's own findings do."""
        from topoagent.node.matrix import UNKNOWN_LINK, DistanceMatrix, GpuInfo, NicInfo  # not needed by discover alone
        unknown = set(self.gpus_with_unknown_links())
        unhealthy = self.unhealthy_gpus(findings)
        gpus = tuple(
            GpuInfo(
                index=g.index,
                name=g.name,
                uuid=g.uuid,
                pci_address=g.pci_address,
                numa_node=g.numa_node,
                cpus=g.cpus,
                model=g.model,
                pcie_gen=g.link.max_gen if g.link else None,
                pcie_width=g.link.current_width if g.link else None,
                unhealthy=unhealthy.get(g.name),
                links_known=g.name not in unknown,
                socket_interfaces=g.socket_interfaces,
            )
            for g in self.gpus
        )
        nics = tuple(
            NicInfo(
                name=n.name,
                device=n.device,
                pci_address=n.pci_address,
                numa_node=n.numa_node,
                netdev=n.netdevs[0] if n.netdevs else None,
                rate_gbps=n.rate_gbps,
                active=n.active,
                rail=self.fabric.rail_of_nic(n.name),
            )
            for n in self.nics
        )
        levels: list[tuple[LinkLevel, ...]] = []
        expected: list[tuple[float | None, ...]] = []
        for a in self.gpus:
            row_levels: list[LinkLevel] = []
            row_expected: list[float | None] = []
            for b in self.gpus:
                if a is b:
                    row_levels.append(SELF)
                    row_expected.append(None)
                    continue
                pair = self.pair(a.name, b.name)
                if pair is None or pair.level is None:
                    row_levels.append(UNKNOWN_LINK)  # one of the two is in ``unknown``
                    row_expected.append(None)
                    continue
                row_levels.append(pair.level)
                row_expected.append(pair.expected_gbps)
            levels.append(tuple(row_levels))
            expected.append(tuple(row_expected))
        gpu_nic = tuple(
            tuple(self.level(g.name, n.name) for n in self.nics) for g in self.gpus
        )
        return DistanceMatrix(
            gpus=gpus,
            nics=nics,
            gpu_levels=tuple(levels),
            gpu_expected_gbps=tuple(expected),
            gpu_nic_levels=gpu_nic if self.nics else (),
            numa_distances=self.numa_distances(),
            host=self.host_layout(),
        )

    def host_layout(self) -> HostLayout:
        """CPUs per NUMA node, the core map and the sockets, for per-rank bindings."""
        from topoagent.node.matrix import HostLayout, sockets_from_distances
        nodes = self.numa.nodes if self.numa else ()
        ids = tuple(sorted(n.id for n in nodes))  # distances run in node-id order
        core_map = self.cpu.core_map if self.cpu else None
        return HostLayout(
            hostname=self.hostname,
            numa_cpus={n.id: frozenset(n.cpus) for n in nodes if n.cpus},
            core_of=dict(core_map.core_of) if core_map else {},
            socket_of=sockets_from_distances({n.id: n.distances for n in nodes}, ids),
        )


def unknown_link_gpus(n: int, known: Callable[[int, int], bool]) -> list[int]:
    """The GPUs (positions) to count as having unknown links: few enough that every pair
    among the others is known.  Greedy, most unknown pairs first, the later GPU on a
    tie: a GPU sysfs does not show is unknown to all the others and is the one named,
    not every GPU it has an unknown pair with."""
    unknown_pairs = {i: {j for j in range(n) if j != i and not known(i, j)} for i in range(n)}
    marked: list[int] = []
    while unknown_pairs:
        worst = max(unknown_pairs, key=lambda i: (len(unknown_pairs[i]), i))
        if not unknown_pairs[worst]:
            break
        marked.append(worst)
        for j in unknown_pairs.pop(worst):
            unknown_pairs[j].discard(worst)
    return sorted(marked)
