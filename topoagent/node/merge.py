"""Merge what the collectors saw into one NodeTopology, and derive every pair's level.

Two witnesses per pair: the level *derived* (topoagent.node.derive) from the sysfs PCIe tree,
NUMA and NVML's NVLink state, and the level *declared* by `nvidia-smi topo -m`.  The
derived level is kept (it comes from the hardware's own description); a disagreement is a
finding, never a silent pick.  Where we cannot derive (a GPU sysfs does not show, NVLink
state unknown without NVML) the declared level is used and the pair says so in ``source``.

The same holds for each GPU's own facts:

- A GPU NVML lists twice, or two GPUs sharing a UUID, a PCI address or an index (a
  damaged recording, a driver in trouble), would be handed out twice: leases are keyed by
  UUID, and jobs name GPUs by index.  One of each clashing set is kept -- the first whose
  PCI address sysfs shows, else the first NVML lists -- the others are dropped, and a
  ``duplicate-gpu`` finding names each one dropped: a warning when it was the same GPU
  listed twice (UUID and address alike), critical when identities conflict, so placement
  keeps off any GPU that still goes by the dropped entry's name.
- NUMA node: sysfs's ``numa_node`` wins over NVML's (the kernel placed the device; NVML
  reports what it reads from there), and a difference is a ``numa-disagreement`` finding.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from topoagent.collectors.base import CollectorResult
from topoagent.collectors.infiniband import Hca
from topoagent.collectors.netdev import NetInterface
from topoagent.collectors.numa import NumaTopology
from topoagent.collectors.nvidia_smi import TopoMatrix, first_numa_node
from topoagent.collectors.nvml import NvmlGpu, NvmlInfo
from topoagent.collectors.pci import PciDevice, PciTree
from topoagent.node.derive import PathLinks, expected_for_pair, nvlink_levels, pcie_level
from topoagent.node.fabric import build_fabric
from topoagent.node.facts import GPU, NVSWITCH, CpuFacts, PeerMemory, PortNeighbour
from topoagent.node.findings import (
    collector_findings,
    fabric_findings,
    ib_findings,
    nvlink_findings,
    pcie_findings,
    unleasable_findings,
    witness_findings,
)
from topoagent.node.levels import LinkLevel, nv, nvlink_generation_for_model
from topoagent.node.model import (
    DECLARED,
    DERIVED,
    CollectorStatus,
    Finding,
    GpuTopo,
    InterfaceTopo,
    NicTopo,
    NodeTopology,
    NvlinkDomain,
    Pair,
)
from topoagent.vocabulary import FindingKind, Severity


def _status(result: CollectorResult[Any]) -> CollectorStatus:
    return CollectorStatus(result.name, result.status, result.message, result.seconds, result.warnings, result.bug)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def _data(results: Mapping[str, CollectorResult[Any]], name: str) -> Any:
    """A collector's facts, or None when it did not run, found nothing or failed."""
    result = results.get(name)
    return result.data if result is not None and result.ok else None


@dataclass(frozen=True, slots=True)
class _Facts:
    """What the sources saw, by what it is: the one place results are read by source name."""

    numa: NumaTopology | None
    tree: PciTree | None
    hcas: tuple[Hca, ...]
    nvml: NvmlInfo | None
    declared: TopoMatrix | None  # nvidia-smi's matrix
    cpu: CpuFacts | None
    minors: dict[str, int]  # the driver's minor numbers by PCI address
    interfaces: tuple[NetInterface, ...]
    peer_memory: PeerMemory | None
    neighbours: tuple[PortNeighbour, ...]  # every source of port neighbours, in table order

    @staticmethod
    def of(results: Mapping[str, CollectorResult[Any]]) -> _Facts:
        return _Facts(
            numa=_data(results, "numa"), tree=_data(results, "pci"), hcas=_data(results, "infiniband") or (),
            nvml=_data(results, "nvml"), declared=_data(results, "nvidia_smi"), cpu=_data(results, "cpu"),
            minors=_data(results, "nvidia_driver") or {}, interfaces=_data(results, "interfaces") or (),
            peer_memory=_data(results, "gpudirect"),
            neighbours=(_data(results, "ib_neighbours") or ()) + (_data(results, "lldp") or ()),
        )

    def device(self, address: str | None) -> PciDevice | None:
        """The PCI function a bus id names, where sysfs shows it."""
        return self.tree.get(address) if self.tree is not None and address else None

    def node_cpus(self, node: int | None) -> str | None:
        if self.numa is None or node is None:
            return None
        n = self.numa.node(node)
        return n.cpulist if n and n.cpus else None


# A device of the node with the PCI function its bus id names (None: sysfs does not show it).
Attached = tuple[GpuTopo, PciDevice | None]


def merge(results: Mapping[str, CollectorResult[Any]], hostname: str | None = None) -> NodeTopology:
    """One NodeTopology from the collectors' results, by collector name (any may be missing).

    Passes, each its own function: the devices, each attached to the PCI function its bus
    id names (GPUs, NICs); their links (NVLink, link health); then every pair's level, from
    the attached functions alone; then what hangs off them (interfaces, the fabric)."""
    facts = _Facts.of(results)
    findings: list[Finding] = collector_findings(results.values())
    if facts.nvml is not None:
        nvml, dropped = _unique_gpus(facts.nvml, facts.tree)
        findings.extend(dropped)
        facts = replace(facts, nvml=nvml)

    attached = _nvml_gpus(facts, findings) if facts.nvml is not None else _sysfs_gpus(facts)
    gpu_pci = {gpu.name: dev for gpu, dev in attached if dev is not None}
    gpus = [gpu for gpu, _ in attached] + _declared_only_gpus(facts, {gpu.name for gpu, _ in attached}, findings)
    gpus.sort(key=lambda g: g.index)
    gpus = [replace(g, device_minor=facts.minors.get(g.pci_address or "")) for g in gpus]
    nics, nic_pci = _nics(facts)
    declared_nic_name = _declared_nics(facts, nics)

    nv_counts = _nvlinks(facts, findings)
    findings.extend(pcie_findings(facts.tree, gpu_pci, nic_pci))
    findings.extend(ib_findings(nics))
    findings.extend(unleasable_findings(gpus))  # a GPU the lease store cannot name
    findings.extend(witness_findings(facts.tree, results, len(gpus), sum(1 for n in nics if n.ports), facts.peer_memory))
    pairs = _pairs(facts, gpus, nics, {**gpu_pci, **nic_pci}, nv_counts, declared_nic_name, findings)

    interfaces = _interfaces(facts.interfaces, facts.hcas, facts.tree, gpu_pci)
    socket_of = _socket_interfaces(interfaces, facts.tree, gpu_pci)
    gpus = [replace(g, socket_interfaces=socket_of.get(g.name, ())) for g in gpus]
    node = NodeTopology(
        hostname=hostname,
        numa=facts.numa,
        pci=facts.tree,
        gpus=tuple(gpus),
        nics=tuple(nics),
        pairs=tuple(pairs),
        findings=tuple(findings),
        collectors=tuple(_status(r) for r in results.values()),
        declared=facts.declared,
        cpu=facts.cpu,
        peer_memory=facts.peer_memory.module if facts.peer_memory is not None else None,
        interfaces=interfaces,
        nvlink_domain=_nvlink_domain(facts.nvml),
        driver_version=facts.nvml.driver_version if facts.nvml is not None else None,
    )
    return _with_unknown_links(_with_fabric(node, facts.neighbours))


def _nvml_gpus(facts: _Facts, findings: list[Finding]) -> list[Attached]:
    """NVML's GPUs by its indices, each with the PCI function of its bus id; where NVML and
    sysfs place it on different NUMA nodes, sysfs wins and a finding says so."""
    assert facts.nvml is not None
    out: list[Attached] = []
    for g in facts.nvml.gpus:
        dev = facts.device(g.pci_address)
        sysfs_numa = dev.numa_node if dev is not None else None
        numa_node = sysfs_numa if sysfs_numa is not None else g.numa_node
        if sysfs_numa is not None and g.numa_node is not None and g.numa_node != sysfs_numa:
            findings.append(Finding(
                FindingKind.NUMA_DISAGREEMENT, Severity.WARNING, f"GPU{g.index}",
                f"NVML places {g.pci_address} on NUMA node {g.numa_node} but sysfs says {sysfs_numa}; "
                f"using sysfs's (the kernel's) node {sysfs_numa}",
            ))
        gpu = GpuTopo(
            index=g.index,
            name=f"GPU{g.index}",
            uuid=g.uuid,
            model=g.name,
            pci_address=g.pci_address,
            numa_node=numa_node,
            cpus=g.cpu_affinity or (dev.local_cpulist if dev else None) or facts.node_cpus(numa_node),
            memory_bytes=g.memory_total_bytes,
            link=dev.link if dev else None,
            nvlink_generation=nvlink_generation_for_model(g.name)
            or max((l.version or 0 for l in g.nvlinks), default=0)
            or None,
            nvlinks=g.nvlinks,
            utilization_percent=g.utilization_percent,
            processes=g.processes,
        )
        out.append((gpu, dev))
    return out


def _sysfs_gpus(facts: _Facts) -> list[Attached]:
    """Without NVML: the GPUs sysfs shows, in PCI bus order like nvidia-smi."""
    devices = facts.tree.of_kind(GPU) if facts.tree else ()
    return [(GpuTopo(index=index, name=f"GPU{index}", pci_address=dev.address, numa_node=dev.numa_node,
                     cpus=dev.local_cpulist or facts.node_cpus(dev.numa_node), link=dev.link), dev)
            for index, dev in enumerate(devices)]


def _declared_only_gpus(facts: _Facts, known: set[str], findings: list[Finding]) -> list[GpuTopo]:
    """GPUs nvidia-smi lists that neither NVML nor sysfs shows (a finding where sysfs was read)."""
    out: list[GpuTopo] = []
    for d in facts.declared.gpus if facts.declared is not None else ():
        if d.name in known:
            continue
        out.append(GpuTopo(index=int(d.name[3:]), name=d.name, cpus=d.cpu_affinity, numa_node=first_numa_node(d.numa_affinity)))
        if facts.tree is not None:
            findings.append(Finding(FindingKind.GPU_NOT_IN_SYSFS, Severity.WARNING, d.name,
                                    "nvidia-smi lists this GPU but sysfs/NVML do not show it"))
    return out


def _nics(facts: _Facts) -> tuple[list[NicTopo], dict[str, PciDevice]]:
    """RDMA devices in name order, named NIC<k> as nvidia-smi's legend does, and the PCI
    function of each one's bus id."""
    nics: list[NicTopo] = []
    nic_pci: dict[str, PciDevice] = {}
    for k, hca in enumerate(sorted(facts.hcas, key=lambda h: _natural(h.name))):
        dev = facts.device(hca.pci_address)
        nics.append(NicTopo(name=f"NIC{k}", device=hca.name, pci_address=hca.pci_address, numa_node=dev.numa_node if dev else None,
                            netdevs=hca.netdevs, ports=hca.ports, link=dev.link if dev else None, node_guid=hca.node_guid))
        if dev is not None:
            nic_pci[nics[-1].name] = dev
    return nics, nic_pci


def _declared_nics(facts: _Facts, nics: list[NicTopo]) -> dict[str, str]:
    """nvidia-smi's NIC names -> ours, matched by RDMA device; a NIC only it lists is added."""
    declared_nic_name: dict[str, str] = {}
    if facts.declared is None:
        return declared_nic_name
    ours = {n.device: n.name for n in nics}
    for d in facts.declared.nics:
        if d.device in ours:
            declared_nic_name[d.name] = ours[d.device]
        else:
            name = f"NIC{len(nics)}"
            nics.append(NicTopo(name=name, device=d.device))
            declared_nic_name[d.name] = name
    return declared_nic_name


def _nvlinks(facts: _Facts, findings: list[Finding]) -> dict[tuple[int, int], int]:
    """NVLinks between GPU indices (from NVML); where only nvidia-smi speaks of NVLink, a
    finding says its levels stand alone."""
    if facts.nvml is not None:
        switches = {d.address for d in facts.tree.of_kind(NVSWITCH)} if facts.tree else set()
        nv_counts, fabric, per_gpu = nvlink_levels(facts.nvml, switches)
        findings.extend(nvlink_findings(facts.nvml, fabric, per_gpu, len(switches)))
        findings.extend(fabric_findings(facts.nvml, len(switches)))
        return nv_counts
    declared = facts.declared
    if declared is not None and any(lvl is not None and lvl.is_nvlink for row in declared.levels for lvl in row):
        findings.append(Finding(FindingKind.NVLINK_UNKNOWN, Severity.INFO, "nvml",
                                "NVML gave no NVLink state; NVLink levels are nvidia-smi's alone"))
    return {}


def _pairs(
    facts: _Facts, gpus: list[GpuTopo], nics: list[NicTopo], pci_of: dict[str, PciDevice],
    nv_counts: dict[tuple[int, int], int], declared_nic_name: dict[str, str], findings: list[Finding],
) -> list[Pair]:
    """Every pair of devices with its level: derived (NVLink, else the PCIe path between the
    functions attached to them) where we can, else nvidia-smi's; a disagreement is a finding."""
    names = [g.name for g in gpus] + [n.name for n in nics]
    gpu_by_name = {g.name: g for g in gpus}
    nic_by_name = {n.name: n for n in nics}
    ours_to_declared = {v: k for k, v in declared_nic_name.items()}
    # A 128-GPU node has 32,640 pairs but a few distinct levels: each pair points at one
    # shared LinkLevel, which pickle sends once and the agent keeps once (the generated
    # 128-GPU node held 8,391 LinkLevel objects, 0.4 MiB; now 264).
    shared_levels: dict[LinkLevel, LinkLevel] = {}
    paths = PathLinks(facts.tree) if facts.tree is not None else None
    pairs: list[Pair] = []
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            declared_level = _declared_level(facts.declared, ours_to_declared.get(a, a), ours_to_declared.get(b, b))
            derived = _derived_level(facts, gpu_by_name.get(a), gpu_by_name.get(b), pci_of.get(a), pci_of.get(b), nv_counts, declared_level)
            level: LinkLevel | None
            if derived is not None:
                level, source = derived, DERIVED
                if declared_level is not None and declared_level != derived:
                    findings.append(Finding(
                        FindingKind.LEVEL_DISAGREEMENT, Severity.WARNING, f"{a}/{b}",
                        f"derived {derived} from sysfs/NVML but nvidia-smi declares {declared_level}",
                    ))
            else:
                level, source = declared_level, DECLARED
            expected = expected_for_pair(level, a, b, gpu_by_name, nic_by_name, pci_of, paths)
            if level is not None:
                level = shared_levels.setdefault(level, level)
            if declared_level is not None:
                declared_level = shared_levels.setdefault(declared_level, declared_level)
            pairs.append(Pair(a, b, level, source, declared_level, expected))
    return pairs


def _declared_level(declared: TopoMatrix | None, a: str, b: str) -> LinkLevel | None:
    if declared is None:
        return None
    try:
        return declared.level(a, b)
    except KeyError:
        return None


def _derived_level(
    facts: _Facts, ga: GpuTopo | None, gb: GpuTopo | None, da: PciDevice | None, db: PciDevice | None,
    nv_counts: dict[tuple[int, int], int], declared_level: LinkLevel | None,
) -> LinkLevel | None:
    """NVLink between two GPUs, else the PCIe level between the two functions; None where
    we cannot see (no NVML while nvidia-smi declares NVLink: we do not call the driver wrong;
    no NVML and no nvidia-smi: two GPUs may share NVLink that no witness saw, so their PCIe
    path is not their level)."""
    if ga and gb and facts.nvml is not None:
        links = nv_counts.get((min(ga.index, gb.index), max(ga.index, gb.index)), 0)
        if links:
            return nv(links)
    if da is None or db is None:
        return None
    nvlink_unknown = ga is not None and gb is not None and facts.nvml is None
    if nvlink_unknown and (declared_level is None or declared_level.is_nvlink):
        return None
    return pcie_level(da, db)


def _with_fabric(node: NodeTopology, neighbours: tuple[PortNeighbour, ...]) -> NodeTopology:
    """The rails the ports' neighbours make, where any neighbour is known."""
    if not neighbours:
        return node
    nic_ports = [(n.name, n.device, n.netdevs) for n in node.nics]
    return replace(node, fabric=build_fabric(neighbours, nic_ports, [g.name for g in node.gpus], node.level))


def _with_unknown_links(node: NodeTopology) -> NodeTopology:
    unknown = node.gpus_with_unknown_links()
    if not unknown:
        return node
    shown = {g.name for g in node.gpus if node.pci is not None and g.pci_address and node.pci.get(g.pci_address)}
    return replace(node, findings=node.findings + tuple(
        Finding(FindingKind.LINKS_UNKNOWN, Severity.WARNING, name,
                "levels to other GPUs are unknown ("
                + ("neither NVML nor nvidia-smi says whether NVLink joins it to them" if name in shown
                   else "sysfs does not show the GPU and nvidia-smi did not say")
                + "); placement takes it only after every GPU whose links are known")
        for name in unknown
    ))


def _unique_gpus(nvml: NvmlInfo, tree: PciTree | None) -> tuple[NvmlInfo, list[Finding]]:
    """NVML's GPUs with no UUID, PCI address or index twice (see the module's note on
    which is kept), and a finding for each one dropped."""
    def shown(g: NvmlGpu) -> bool:
        return tree is not None and g.pci_address is not None and tree.get(g.pci_address) is not None

    order = sorted(range(len(nvml.gpus)), key=lambda i: (not shown(nvml.gpus[i]), i))
    kept: dict[int, NvmlGpu] = {}
    holders: dict[tuple[str, object], NvmlGpu] = {}  # ("uuid", value) ... -> the GPU kept with it
    findings: list[Finding] = []
    for i in order:
        g = nvml.gpus[i]
        identity = [("UUID", g.uuid), ("PCI address", (g.pci_address or "").lower() or None), ("index", g.index)]
        clashes = [(what, value, holders[(what, value)]) for what, value in identity if value is not None and (what, value) in holders]
        if not clashes:
            kept[i] = g
            holders.update(((what, value), g) for what, value in identity if value is not None)
            continue
        other = clashes[0][2]
        same_gpu = (
            g.uuid is not None and g.uuid == other.uuid
            and (g.pci_address or "").lower() == (other.pci_address or "").lower()
        )
        shared = " and ".join(what for what, _, _ in clashes)
        findings.append(Finding(
            FindingKind.DUPLICATE_GPU, Severity.WARNING if same_gpu else Severity.CRITICAL, f"GPU{g.index}",
            f"NVML lists GPU{g.index} ({g.pci_address or 'no PCI address'}, {g.uuid or 'no UUID'}) with the same "
            f"{shared} as GPU{other.index} ({other.pci_address or 'no PCI address'}): "
            f"{'the same GPU twice' if same_gpu else 'two GPUs cannot share one'}; kept "
            f"GPU{other.index} ({'the one sysfs shows' if shown(other) and not shown(g) else 'listed first'}), dropped this entry",
        ))
    gpus = tuple(kept[i] for i in sorted(kept))
    return (nvml if len(gpus) == len(nvml.gpus) else replace(nvml, gpus=gpus)), findings


def _interfaces(
    found: tuple[NetInterface, ...], hcas: tuple[Hca, ...], tree: PciTree | None, gpu_pci: dict[str, PciDevice]
) -> tuple[InterfaceTopo, ...]:
    """Every interface with its NUMA node, its RDMA device if any, and the GPUs nearest it."""
    rdma_of = {netdev: hca.name for hca in hcas for netdev in hca.netdevs}
    out = []
    for i in found:
        dev = tree.get(i.pci_address) if tree and i.pci_address else None
        nearest: tuple[str, ...] = ()
        if dev is not None and gpu_pci:
            levels = {name: pcie_level(dev, gpu) for name, gpu in gpu_pci.items()}
            best = min(levels.values())
            nearest = tuple(sorted((n for n, lvl in levels.items() if lvl == best), key=_natural))
        out.append(InterfaceTopo(i.name, i.pci_address, dev.numa_node if dev else None, i.speed_mbps,
                                 i.operstate, rdma_of.get(i.name), nearest))
    return tuple(out)


def _socket_interfaces(
    interfaces: tuple[InterfaceTopo, ...], tree: PciTree | None, gpu_pci: dict[str, PciDevice]
) -> dict[str, tuple[str, ...]]:
    """GPU name -> the plain interfaces (up, not RDMA) at the closest PCIe level to it."""
    candidates = [(i.name, tree.get(i.pci_address)) for i in interfaces if i.socket_candidate and tree and i.pci_address]
    devices = [(name, dev) for name, dev in candidates if dev is not None]
    out: dict[str, tuple[str, ...]] = {}
    for gpu, gdev in gpu_pci.items():
        if not devices:
            break
        levels = [(pcie_level(gdev, dev), name) for name, dev in devices]
        best = min(level for level, _ in levels)
        out[gpu] = tuple(name for level, name in levels if level == best)
    return out


def _nvlink_domain(nvml: NvmlInfo | None) -> NvlinkDomain | None:
    """The (cluster UUID, clique id) most of the node's GPUs completed registration in."""
    if nvml is None:
        return None
    members: dict[tuple[str, int | None], list[str]] = {}
    for g in nvml.gpus:
        if g.fabric is not None and g.fabric.registered and g.fabric.cluster_uuid is not None:
            members.setdefault((g.fabric.cluster_uuid, g.fabric.clique_id), []).append(f"GPU{g.index}")
    if not members:
        return None
    (uuid, clique), gpus = max(members.items(), key=lambda kv: len(kv[1]))
    return NvlinkDomain(uuid, clique, tuple(gpus))
