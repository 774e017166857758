"""What discovery says about the node beyond its levels: links down or slow, GPUs off
the fabric, ports down, sources that failed.  Pure functions over the collectors' facts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from topoagent.collectors.base import CollectorResult
from topoagent.collectors.nvml import NvmlInfo
from topoagent.collectors.pci import PciDevice, PciTree
from topoagent.documents.lease import gpu_id_problem
from topoagent.node.derive import faces_down
from topoagent.node.facts import BRIDGE, GPU
from topoagent.node.model import Finding, GpuTopo, NicTopo
from topoagent.vocabulary import FindingKind, Severity, Status


def collector_findings(results: Iterable[CollectorResult[Any]]) -> list[Finding]:
    """A source that failed is critical: the facts it would give are missing.  An optional
    source's failure (no permission to ask the fabric, no lldpd) is a warning."""
    return [
        Finding(FindingKind.COLLECTOR_ERROR, Severity.WARNING if r.optional else Severity.CRITICAL, r.name, r.message or "failed")
        for r in results
        if r.status == Status.ERROR
    ]


def nvlink_findings(nvml: NvmlInfo, fabric: set[int], per_gpu: dict[int, int]) -> list[Finding]:
    found = []
    for g in nvml.gpus:
        down = [l.link for l in g.nvlinks if not l.active]
        if down:
            # Every link down: the GPU is off its NVLink peers; placement keeps off it.
            severity = Severity.CRITICAL if len(down) == len(g.nvlinks) else Severity.WARNING
            found.append(Finding(
                FindingKind.NVLINK_DOWN, severity, f"GPU{g.index}",
                f"NVLink {', '.join(map(str, down))} down ({len(g.nvlinks) - len(down)} of "
                f"{len(g.nvlinks)} links active)",
            ))
    if fabric:
        for g in nvml.gpus:
            if g.index not in fabric:
                found.append(Finding(
                    FindingKind.GPU_OUTSIDE_FABRIC, Severity.CRITICAL, f"GPU{g.index}",
                    "GPU has no active link to the NVSwitch fabric the other GPUs are on; "
                    "its peers reach it over PCIe",
                ))
    return found



def pcie_findings(
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
        port_address = port.address if port is not None else None
        # Functions of one card share the link: key it by the port above when known.
        key = port_address or d.address
        if key in seen:
            continue
        label = names.get(d.address, d.address)
        seen_here = False
        if link.width_below_max:
            seen_here = True
            port_width = port_link.max_width if port_link is not None else None
            capped = port_width is not None and port_width <= (link.current_width or 0)
            note = ""
            if capped:
                note = f" (the port above, {port_address}, has only x{port_width})"
            elif port_link is not None and port_link.current_width == link.current_width:
                note = f" (the port above, {port_address}, sees the same)"
            found.append(Finding(
                FindingKind.PCIE_DEGRADED, Severity.INFO if capped else Severity.WARNING, label,
                f"{d.address} link runs x{link.current_width} of x{link.max_width}{note}",
            ))
        if link.speed_below_max:
            seen_here = True
            port_gts = port_link.max_gts if port_link is not None else None
            capped = port_gts is not None and port_gts <= (link.current_gts or 0)
            idle = d.kind in (GPU, BRIDGE)
            if capped:
                note = f" (the port above, {port_address}, tops out at {port_gts:g} GT/s)"
            elif idle:
                note = " (GPUs slow their link when idle; check under load)"
            else:
                note = ""
            found.append(Finding(
                FindingKind.PCIE_SLOW, Severity.INFO if idle or capped else Severity.WARNING, label,
                f"{d.address} link runs at {link.current_gts:g} GT/s of {link.max_gts:g} GT/s{note}",
            ))
        if seen_here:
            seen.add(key)
    return found


def unleasable_findings(gpus: Iterable[GpuTopo]) -> list[Finding]:
    """A GPU the lease store cannot name (a UUID too long or not printable text, an index
    out of range) is never leased: critical, so placement keeps off it too.  The rule is
    the store's own (``topoagent.documents.lease.gpu_id_problem``)."""
    found = []
    for g in gpus:
        problem = gpu_id_problem(g.index, g.uuid)
        if problem:
            found.append(Finding(FindingKind.GPU_UNLEASABLE, Severity.CRITICAL, g.name, f"GPU cannot be leased: {problem}"))
    return found


def ib_findings(nics: list[NicTopo]) -> list[Finding]:
    found = []
    for n in nics:
        for p in n.ports:
            if not p.active:
                found.append(Finding(
                    FindingKind.IB_PORT_DOWN, Severity.WARNING, f"{n.device} port {p.number}",
                    f"{n.device} port {p.number} is {p.state or 'unknown'}"
                    f" ({p.phys_state or 'physical state unknown'})",
                ))
    return found
