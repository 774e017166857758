"""Merge what the collectors saw into one NodeTopology, and derive every pair's level.

Two witnesses per pair: the level *derived* here from the sysfs PCIe tree, NUMA and
NVML's NVLink state, and the level *declared* by `nvidia-smi topo -m`.  The derived level
is kept (it comes from the hardware's own description); a disagreement is a finding, never
a silent pick.  Where we cannot derive (a GPU sysfs does not show, NVLink state unknown
without NVML) the declared level is used and the pair says so in ``source``.

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

import asyncio
import re
from dataclasses import dataclass, field
from typing import Any

from topoagent import __version__
from topoagent.collectors import infiniband as ib_collector
from topoagent.collectors import numa as numa_collector
from topoagent.collectors import nvidia_smi as smi_collector
from topoagent.collectors import nvml as nvml_collector
from topoagent.collectors import pci as pci_collector
from topoagent.collectors.base import ERROR, CollectorResult
from topoagent.collectors.infiniband import Hca, IbPort
from topoagent.collectors.numa import NumaTopology
from topoagent.collectors.nvidia_smi import TopoDevice, TopoMatrix
from topoagent.collectors.nvml import NvLink, NvmlInfo
from topoagent.collectors.pci import GPU, NVSWITCH, PciDevice, PciLink, PciTree
from topoagent.host import Host
from topoagent.levels import (
    NODE,
    PHB,
    PIX,
    PXB,
    SELF,
    SYS,
    LinkLevel,
    expected_gbps,
    nv,
    nvlink_generation_for_model,
)
from topoagent.matrix import DistanceMatrix, GpuInfo, NicInfo, first_numa_node
from topoagent.vocabulary import FindingKind, Severity

SCHEMA_VERSION = 1

DERIVED = "derived"
DECLARED = "nvidia-smi"


@dataclass(frozen=True, slots=True)
class Finding:
    """Something discovery or a measurement says about the node (the one finding type)."""

    kind: FindingKind
    severity: Severity
    subject: str  # "GPU3", "GPU0/NIC1", "mlx5_2 port 1", "0000:3b:00.0", a collector name
    message: str
    source: str = "discovery"  # or "probe"
    expected_gbps: float | None = None  # a measurement's finding: what the level should give
    measured_gbps: float | None = None  # and what was measured

    def to_json(self) -> dict:
        return {"kind": self.kind, "severity": self.severity, "subject": self.subject,
                "message": self.message}


@dataclass(frozen=True, slots=True)
class CollectorStatus:
    name: str
    status: str
    message: str | None
    seconds: float
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class GpuTopo:
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


@dataclass(frozen=True, slots=True)
class NicTopo:
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
class Pair:
    a: str
    b: str
    level: LinkLevel | None
    source: str  # DERIVED or DECLARED
    declared: LinkLevel | None
    expected_gbps: float | None


@dataclass(frozen=True, repr=False)
class NodeTopology:
    schema_version: int
    hostname: str | None
    numa: NumaTopology | None
    pci: PciTree | None
    gpus: tuple[GpuTopo, ...]
    nics: tuple[NicTopo, ...]
    pairs: tuple[Pair, ...]
    findings: tuple[Finding, ...]
    collectors: tuple[CollectorStatus, ...]
    declared: TopoMatrix | None = None
    _pair_index: dict[tuple[str, str], Pair] = field(default_factory=dict, repr=False, compare=False)

    def __repr__(self) -> str:
        # Short on purpose: asyncio.run() (3.11) formats the main task's result while
        # restoring its SIGINT handler, and the full dataclass repr of a big node took
        # longer than reading it.
        return (f"NodeTopology(hostname={self.hostname!r}, gpus={len(self.gpus)}, "
                f"nics={len(self.nics)}, pairs={len(self.pairs)}, findings={len(self.findings)})")

    def __post_init__(self) -> None:
        for pair in self.pairs:
            self._pair_index[(pair.a, pair.b)] = pair
            self._pair_index[(pair.b, pair.a)] = pair

    def pair(self, a: str, b: str) -> Pair | None:
        return self._pair_index.get((a, b))

    def level(self, a: str, b: str) -> LinkLevel | None:
        if a == b:
            return SELF
        pair = self.pair(a, b)
        return pair.level if pair else None

    # --- exports ------------------------------------------------------------------

    def to_json(self, *, timings: bool = True) -> dict:
        return {
            "schema_version": self.schema_version,
            "agent_version": __version__,
            "hostname": self.hostname,
            "numa_nodes": [
                {
                    "id": n.id,
                    "cpus": n.cpulist,
                    "memory_bytes": n.memory_bytes,
                    "distances": list(n.distances),
                    "cpuless": n.cpuless,
                    "same_cpus_as": list(n.same_cpus_as),
                }
                for n in (self.numa.nodes if self.numa else ())
            ],
            "pci_devices": [_pci_json(d) for d in (self.pci.devices if self.pci else ())],
            "gpus": [_gpu_json(g) for g in self.gpus],
            "nics": [_nic_json(n) for n in self.nics],
            "pairs": [
                {
                    "a": p.a,
                    "b": p.b,
                    "level": None if p.level is None else str(p.level),
                    "nvlinks": None if p.level is None else p.level.nvlinks,
                    "expected_gbps": p.expected_gbps,
                    "source": p.source,
                    "declared": None if p.declared is None else str(p.declared),
                }
                for p in self.pairs
            ],
            "findings": [f.to_json() for f in self.findings],
            "collectors": {
                c.name: {
                    "status": c.status,
                    "message": c.message,
                    "warnings": list(c.warnings),
                    **({"seconds": round(c.seconds, 6)} if timings else {}),
                }
                for c in self.collectors
            },
        }

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

    def distance_matrix(self) -> DistanceMatrix:
        """The GPU distance matrix the placement core and the exporters read."""
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
                    raise ValueError(f"level of {a.name}/{b.name} is unknown")
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
        )


# --- JSON helpers ---------------------------------------------------------------------


def _hex(value: int | None, digits: int) -> str | None:
    return None if value is None else f"0x{value:0{digits}x}"


def _link_json(link: PciLink | None) -> dict | None:
    if link is None:
        return None
    return {
        "current_gts": link.current_gts,
        "current_width": link.current_width,
        "max_gts": link.max_gts,
        "max_width": link.max_width,
        "current_gen": link.current_gen,
        "max_gen": link.max_gen,
    }


def _pci_json(d: PciDevice) -> dict:
    return {
        "address": d.address,
        "class": _hex(d.class_code, 6),
        "vendor": _hex(d.vendor, 4),
        "device": _hex(d.device, 4),
        "subsystem_vendor": _hex(d.subsystem_vendor, 4),
        "subsystem_device": _hex(d.subsystem_device, 4),
        "kind": d.kind,
        "numa_node": d.numa_node,
        "numa_source": d.numa_source,
        "local_cpus": d.local_cpulist,
        "parent": d.parent,
        "depth": d.depth,
        "root_complex": d.root_complex,
        "driver": d.driver,
        "listed": d.listed,
        "interfaces": list(d.interfaces),
        "link": _link_json(d.link),
    }


def _gpu_json(g: GpuTopo) -> dict:
    return {
        "index": g.index,
        "name": g.name,
        "uuid": g.uuid,
        "model": g.model,
        "address": g.pci_address,
        "numa_node": g.numa_node,
        "cpus": g.cpus,
        "memory_bytes": g.memory_bytes,
        "link": _link_json(g.link),
        "nvlink_generation": g.nvlink_generation,
        "nvlinks": [
            {"link": l.link, "active": l.active, "version": l.version,
             "remote_address": l.remote_pci_address, "remote_type": l.remote_type}
            for l in g.nvlinks
        ],
        "utilization_percent": g.utilization_percent,
        "processes": list(g.processes),
    }


def _nic_json(n: NicTopo) -> dict:
    return {
        "name": n.name,
        "device": n.device,
        "address": n.pci_address,
        "numa_node": n.numa_node,
        "netdev": n.netdevs[0] if n.netdevs else None,
        "netdevs": list(n.netdevs),
        "node_guid": n.node_guid,
        "link": _link_json(n.link),
        "ports": [
            {"port": p.number, "state": p.state, "phys_state": p.phys_state,
             "rate_gbps": p.rate_gbps, "rate": p.rate_text, "link_layer": p.link_layer,
             "lid": p.lid, "subnet_prefix": p.subnet_prefix}
            for p in n.ports
        ],
    }


# --- level derivation (pure) -------------------------------------------------------------


def pcie_level(a: PciDevice, b: PciDevice) -> LinkLevel:
    """The PCIe level between two devices, from their bridge chains and NUMA nodes."""
    if a.root_complex is None or b.root_complex is None or a.root_complex != b.root_complex:
        return NODE if a.numa_node == b.numa_node else SYS
    common = 0
    for x, y in zip(a.bridges, b.bridges):
        if x != y:
            break
        common += 1
    if common == 0:
        return PHB
    below_a, below_b = len(a.bridges) - common, len(b.bridges) - common
    if below_a <= 1 and below_b <= 1:
        return PIX
    return PXB


def path_devices(a: PciDevice, b: PciDevice, tree: PciTree) -> list[PciDevice]:
    """The endpoints and the bridges whose links a transfer between them crosses."""
    common = 0
    if a.root_complex is not None and a.root_complex == b.root_complex:
        for x, y in zip(a.bridges, b.bridges):
            if x != y:
                break
            common += 1
    # Below a common switch, the shared upstream link is not crossed; keep the ports below.
    addresses = list(a.bridges[common:]) + list(b.bridges[common:])
    found = [d for d in (tree.get(x) for x in addresses) if d is not None]
    return [a, b] + found


def link_gbps(device: PciDevice) -> float | None:
    """Bandwidth of the link above a device as it runs now.

    GPUs drop their link speed at idle to save power (and the port above follows), so
    for GPUs and bridges we count the width now and the speed the link can train to; a
    narrower link is a real fault, a slower one at idle is not.
    """
    if device.link is None:
        return None
    return device.link.gbps(assume_max_speed=device.kind in (GPU, pci_collector.BRIDGE))


def narrowest(devices: list[PciDevice]) -> tuple[int | None, int | None]:
    """(generation, width) of the slowest link among these devices."""
    best: tuple[float, int | None, int | None] | None = None
    for d in devices:
        rate = link_gbps(d)
        if rate is None or d.link is None:
            continue
        gen = d.link.max_gen if d.kind in (GPU, pci_collector.BRIDGE) else d.link.current_gen
        if best is None or rate < best[0]:
            best = (rate, gen, d.link.current_width)
    return (best[1], best[2]) if best else (None, None)


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


# --- merge --------------------------------------------------------------------------------


def _status(result: CollectorResult[Any]) -> CollectorStatus:
    return CollectorStatus(result.name, result.status, result.message, result.seconds, result.warnings)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def merge(
    numa_r: CollectorResult[NumaTopology],
    pci_r: CollectorResult[PciTree],
    ib_r: CollectorResult[tuple[Hca, ...]],
    nvml_r: CollectorResult[NvmlInfo],
    smi_r: CollectorResult[TopoMatrix],
    hostname: str | None = None,
) -> NodeTopology:
    findings: list[Finding] = []
    numa = numa_r.data if numa_r.ok else None
    tree = pci_r.data if pci_r.ok else None
    hcas = ib_r.data if ib_r.ok and ib_r.data else ()
    nvml = nvml_r.data if nvml_r.ok else None
    declared = smi_r.data if smi_r.ok else None
    results = (numa_r, pci_r, ib_r, nvml_r, smi_r)
    for r in results:
        if r.status == ERROR:
            findings.append(Finding("collector-error", "error", r.name, r.message or "failed"))

    def node_cpus(node: int | None) -> str | None:
        if numa is None or node is None:
            return None
        n = numa.node(node)
        return n.cpulist if n and n.cpus else None

    # --- GPUs: NVML's indices when we have them, else PCI bus order like nvidia-smi.
    pci_gpus = list(tree.of_kind(GPU)) if tree else []
    gpus: list[GpuTopo] = []
    gpu_pci: dict[str, PciDevice] = {}
    if nvml is not None:
        for g in nvml.gpus:
            dev = tree.get(g.pci_address) if tree and g.pci_address else None
            numa_node = g.numa_node if g.numa_node is not None else (dev.numa_node if dev else None)
            gpus.append(
                GpuTopo(
                    index=g.index,
                    name=f"GPU{g.index}",
                    uuid=g.uuid,
                    model=g.name,
                    pci_address=g.pci_address,
                    numa_node=numa_node,
                    cpus=g.cpu_affinity or (dev.local_cpulist if dev else None) or node_cpus(numa_node),
                    memory_bytes=g.memory_total_bytes,
                    link=dev.link if dev else None,
                    nvlink_generation=nvlink_generation_for_model(g.name)
                    or max((l.version or 0 for l in g.nvlinks), default=0)
                    or None,
                    nvlinks=g.nvlinks,
                    utilization_percent=g.utilization_percent,
                    processes=g.processes,
                )
            )
            if dev is not None:
                gpu_pci[f"GPU{g.index}"] = dev
    else:
        for index, dev in enumerate(pci_gpus):
            gpus.append(
                GpuTopo(
                    index=index,
                    name=f"GPU{index}",
                    pci_address=dev.address,
                    numa_node=dev.numa_node,
                    cpus=dev.local_cpulist or node_cpus(dev.numa_node),
                    link=dev.link,
                )
            )
            gpu_pci[f"GPU{index}"] = dev
    if declared is not None:
        known = {g.name for g in gpus}
        for d in declared.gpus:
            if d.name not in known:
                gpus.append(GpuTopo(index=int(d.name[3:]), name=d.name, cpus=d.cpu_affinity,
                                    numa_node=first_numa_node(d.numa_affinity)))
                if tree is not None:
                    findings.append(Finding("gpu-not-in-sysfs", "warning", d.name,
                                            "nvidia-smi lists this GPU but sysfs/NVML do not show it"))
    gpus.sort(key=lambda g: g.index)

    # --- NICs: RDMA devices in name order, named NIC<k> as nvidia-smi's legend does.
    nics: list[NicTopo] = []
    nic_pci: dict[str, PciDevice] = {}
    for k, hca in enumerate(sorted(hcas, key=lambda h: _natural(h.name))):
        dev = tree.get(hca.pci_address) if tree and hca.pci_address else None
        nics.append(
            NicTopo(
                name=f"NIC{k}",
                device=hca.name,
                pci_address=hca.pci_address,
                numa_node=dev.numa_node if dev else None,
                netdevs=hca.netdevs,
                ports=hca.ports,
                link=dev.link if dev else None,
                node_guid=hca.node_guid,
            )
        )
        if dev is not None:
            nic_pci[f"NIC{k}"] = dev
    declared_nic_name: dict[str, str] = {}  # declared matrix name -> our name
    if declared is not None:
        ours = {n.device: n.name for n in nics}
        for d in declared.nics:
            if d.device in ours:
                declared_nic_name[d.name] = ours[d.device]
            else:
                name = f"NIC{len(nics)}"
                nics.append(NicTopo(name=name, device=d.device))
                declared_nic_name[d.name] = name

    # --- NVLink
    nv_counts: dict[tuple[int, int], int] = {}
    if nvml is not None:
        switches = {d.address for d in tree.of_kind(NVSWITCH)} if tree else set()
        nv_counts, fabric, per_gpu = nvlink_levels(nvml, switches)
        findings.extend(_nvlink_findings(nvml, fabric, per_gpu))
    elif declared is not None and any(
        lvl is not None and lvl.is_nvlink for row in declared.levels for lvl in row
    ):
        findings.append(Finding("nvlink-unknown", "info", "nvml",
                                "NVML gave no NVLink state; NVLink levels are nvidia-smi's alone"))

    # --- health of PCIe links and IB ports
    findings.extend(_pcie_findings(tree, gpu_pci, nic_pci))
    findings.extend(_ib_findings(nics))

    # --- pairs
    names = [g.name for g in gpus] + [n.name for n in nics]
    gpu_by_name = {g.name: g for g in gpus}
    nic_by_name = {n.name: n for n in nics}
    ours_to_declared = {v: k for k, v in declared_nic_name.items()}
    pci_of = {**gpu_pci, **nic_pci}
    pairs: list[Pair] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            declared_level = None
            if declared is not None:
                da, db = ours_to_declared.get(a, a), ours_to_declared.get(b, b)
                try:
                    declared_level = declared.level(da, db)
                except KeyError:
                    declared_level = None
            derived: LinkLevel | None = None
            ga, gb = gpu_by_name.get(a), gpu_by_name.get(b)
            if ga and gb and nvml is not None:
                links = nv_counts.get((min(ga.index, gb.index), max(ga.index, gb.index)), 0)
                if links:
                    derived = nv(links)
            nvlink_unknown = ga is not None and gb is not None and nvml is None
            if derived is None and a in pci_of and b in pci_of:
                derived = pcie_level(pci_of[a], pci_of[b])
                if nvlink_unknown and declared_level is not None and declared_level.is_nvlink:
                    derived = None  # we cannot see NVLink; do not call the driver wrong
            if derived is not None:
                level, source = derived, DERIVED
                if declared_level is not None and declared_level != derived:
                    findings.append(Finding(
                        "level-disagreement", "warning", f"{a}/{b}",
                        f"derived {derived} from sysfs/NVML but nvidia-smi declares {declared_level}",
                    ))
            else:
                level, source = declared_level, DECLARED
            expected = _expected(level, a, b, gpu_by_name, nic_by_name, pci_of, tree)
            pairs.append(Pair(a, b, level, source, declared_level, expected))

    return NodeTopology(
        schema_version=SCHEMA_VERSION,
        hostname=hostname,
        numa=numa,
        pci=tree,
        gpus=tuple(gpus),
        nics=tuple(nics),
        pairs=tuple(pairs),
        findings=tuple(findings),
        collectors=tuple(_status(r) for r in results),
        declared=declared,
    )


def _expected(
    level: LinkLevel | None,
    a: str,
    b: str,
    gpus: dict[str, GpuTopo],
    nics: dict[str, NicTopo],
    pci_of: dict[str, PciDevice],
    tree: PciTree | None,
) -> float | None:
    if level is None:
        return None
    generation = None
    if a in gpus and b in gpus:
        gens = {gpus[a].nvlink_generation, gpus[b].nvlink_generation}
        generation = gens.pop() if len(gens) == 1 else None
    gen = width = None
    if not level.is_nvlink and a in pci_of and b in pci_of and tree is not None:
        gen, width = narrowest(path_devices(pci_of[a], pci_of[b], tree))
    value = expected_gbps(level, nvlink_generation=generation, pcie_gen=gen, pcie_width=width)
    for name in (a, b):
        nic = nics.get(name)
        if nic is not None and nic.ports and value is not None:
            if not nic.active:
                return 0.0
            if nic.rate_gbps:
                value = round(min(value, nic.rate_gbps / 8), 2)
    return value


def _nvlink_findings(nvml: NvmlInfo, fabric: set[int], per_gpu: dict[int, int]) -> list[Finding]:
    found = []
    for g in nvml.gpus:
        down = [l.link for l in g.nvlinks if not l.active]
        if down:
            found.append(Finding(
                "nvlink-down", "warning", f"GPU{g.index}",
                f"NVLink {', '.join(map(str, down))} down ({len(g.nvlinks) - len(down)} of "
                f"{len(g.nvlinks)} links active)",
            ))
    if fabric:
        for g in nvml.gpus:
            if g.index not in fabric:
                found.append(Finding(
                    "gpu-outside-fabric", "error", f"GPU{g.index}",
                    "GPU has no active link to the NVSwitch fabric the other GPUs are on; "
                    "its peers reach it over PCIe",
                ))
    return found


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
    return device.kind == pci_collector.BRIDGE


def _pcie_findings(
    tree: PciTree | None, gpu_pci: dict[str, PciDevice], nic_pci: dict[str, PciDevice]
) -> list[Finding]:
    """One finding per physical link that runs below what its device end can do.

    A link is judged from its device end (the endpoint or switch upstream port): the port
    above shows the same link, so judging both would report one fault twice, and a port
    wider or faster than the card in it is no fault.  When the port above cannot go
    faster either, the link is as good as the slot allows: said, as information.
    """
    if tree is None:
        return []
    names = {dev.address: name for name, dev in {**gpu_pci, **nic_pci}.items()}
    found: list[Finding] = []
    seen: set[str] = set()
    for d in tree.devices:
        link = d.link
        if link is None or faces_down(d):
            continue
        port = tree.get(d.parent) if d.parent else None
        if port is not None and not faces_down(port):
            port = None
        port_link = port.link if port is not None else None
        # Functions of one card share the link: key it by the port above when known.
        key = port.address if port is not None else d.address
        if key in seen:
            continue
        label = names.get(d.address, d.address)
        seen_here = False
        if link.width_below_max:
            seen_here = True
            capped = port_link is not None and port_link.max_width is not None \
                and port_link.max_width <= (link.current_width or 0)
            note = ""
            if capped:
                note = f" (the port above, {port.address}, has only x{port_link.max_width})"
            elif port_link is not None and port_link.current_width == link.current_width:
                note = f" (the port above, {port.address}, sees the same)"
            found.append(Finding(
                "pcie-degraded", "info" if capped else "warning", label,
                f"{d.address} link runs x{link.current_width} of x{link.max_width}{note}",
            ))
        if link.speed_below_max:
            seen_here = True
            capped = port_link is not None and port_link.max_gts is not None \
                and port_link.max_gts <= (link.current_gts or 0)
            idle = d.kind in (GPU, pci_collector.BRIDGE)
            if capped:
                note = f" (the port above, {port.address}, tops out at {port_link.max_gts:g} GT/s)"
            elif idle:
                note = " (GPUs slow their link when idle; check under load)"
            else:
                note = ""
            found.append(Finding(
                "pcie-slow", "info" if idle or capped else "warning", label,
                f"{d.address} link runs at {link.current_gts:g} GT/s of {link.max_gts:g} GT/s{note}",
            ))
        if seen_here:
            seen.add(key)
    return found


def _ib_findings(nics: list[NicTopo]) -> list[Finding]:
    found = []
    for n in nics:
        for p in n.ports:
            if not p.active:
                found.append(Finding(
                    "ib-port-down", "warning", f"{n.device} port {p.number}",
                    f"{n.device} port {p.number} is {p.state or 'unknown'}"
                    f" ({p.phys_state or 'physical state unknown'})",
                ))
    return found


# --- discovery ------------------------------------------------------------------------------


async def discover(host: Host) -> NodeTopology:
    """Run every collector (concurrently; PCI waits for NUMA to place -1 devices) and merge."""

    async def numa_then_pci() -> tuple[CollectorResult[NumaTopology], CollectorResult[PciTree]]:
        numa_r = await numa_collector.collect(host)
        cpus = numa_r.data.cpus_by_node() if numa_r.ok and numa_r.data else {}
        return numa_r, await pci_collector.collect(host, cpus)

    (numa_r, pci_r), ib_r, nvml_r, smi_r = await asyncio.gather(
        numa_then_pci(),
        ib_collector.collect(host),
        nvml_collector.collect(host),
        smi_collector.collect(host),
    )
    hostname = host.read_optional("/proc/sys/kernel/hostname")
    return merge(numa_r, pci_r, ib_r, nvml_r, smi_r, hostname=hostname or None)


def discover_sync(host: Host) -> NodeTopology:
    return asyncio.run(discover(host))
