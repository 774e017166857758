"""What discovery says about the node beyond its levels: links down or slow, GPUs off
the fabric, ports down, sources that failed, witnesses that are missing.  Pure functions over the collectors' facts."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from topoagent.collectors.base import CollectorResult
from topoagent.collectors.nvml import FABRIC_COMPLETED, FABRIC_NOT_SUPPORTED, FABRIC_UNKNOWN, UNNAMED_STATE, NvmlInfo
from topoagent.collectors.pci import PciDevice, PciTree
from topoagent.documents.lease import gpu_id_problem
from topoagent.node.derive import faces_down
from topoagent.node.facts import BRIDGE, GPU, PeerMemory
from topoagent.node.model import Finding, GpuTopo, NicTopo, NodeTopology
from topoagent.vocabulary import PLACEMENT_BLOCKERS, FindingKind, Severity, Status


def collector_findings(results: Iterable[CollectorResult[Any]]) -> list[Finding]:
    """A source that failed is critical: the facts it would give are missing.  An optional
    source's failure (no permission to ask the fabric, no lldpd) is a warning."""
    return [
        Finding(FindingKind.COLLECTOR_ERROR, Severity.WARNING if r.optional else Severity.CRITICAL, r.name, r.message or "failed")
        for r in results
        if r.status == Status.ERROR
    ]


def nvlink_findings(nvml: NvmlInfo, fabric: set[int], per_gpu: dict[int, int], nvswitches: int) -> list[Finding]:
    """Links down per GPU, GPUs off the switch fabric; and, where NVSwitches are on the PCI
    bus but no GPU has an active NVLink, the one finding that says the fabric is down
    (``nvswitch-no-nvlink``) in place of a per-GPU one on every GPU."""
    no_nvlink = _nvswitch_no_nvlink(nvml, nvswitches)
    if no_nvlink is not None:
        return [no_nvlink]
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


# Subjects of the findings about the NVLink fabric as a whole (no one GPU is at fault).
NVSWITCHES = "nvswitch"
NVLINK_FABRIC = "nvlink-fabric"
NVSWITCH_REMEDY = ("start the fabric manager (systemctl start nvidia-fabricmanager; its version must be the driver's) "
                 "and check that the nvidia-nvswitch driver is bound to every NVSwitch (lspci -k -d 10de:)")


def _nvswitch_no_nvlink(nvml: NvmlInfo, nvswitches: int) -> Finding | None:
    """NVSwitches on the PCI bus, GPUs NVML answers for, and not one active NVLink among
    them: the links to the switches were never trained (on A100 and H100 the fabric
    manager trains them), so every GPU pair is the PCIe path the witnesses saw.  Where NVML
    reports no link at all, their state was not seen: nothing is said."""
    links = sum(len(g.nvlinks) for g in nvml.gpus)
    if not nvswitches or not links or any(l.active for g in nvml.gpus for l in g.nvlinks):
        return None
    return Finding(
        FindingKind.NVSWITCH_NO_NVLINK, Severity.CRITICAL, NVSWITCHES,
        f"{nvswitches} NVSwitch(es) on the PCI bus but none of the {len(nvml.gpus)} GPUs has an active NVLink "
        f"(0 of {links} links active): GPUs reach each other over PCIe only and CUDA may refuse to start. "
        f"Remedy: {NVSWITCH_REMEDY}",
    )


def on_nvlink_fabric(nvml: NvmlInfo, nvswitches: int) -> bool:
    """Whether the GPUs sit on an NVLink fabric that a fabric manager brings up: NVSwitches
    on the PCI bus (HGX, DGX), an NVLink to a switch (the switches of an NVL72 rack are in
    other trays), or NVML saying a fabric exists (any state but not supported)."""
    if nvswitches:
        return True
    for g in nvml.gpus:
        if any(link.remote_type == "switch" for link in g.nvlinks):
            return True
        if g.fabric is not None and g.fabric.state not in (None, FABRIC_NOT_SUPPORTED, FABRIC_UNKNOWN):
            return True
    return False


def fabric_findings(nvml: NvmlInfo, nvswitches: int) -> list[Finding]:
    """GPUs whose NVLink fabric registration (NVML's GPU fabric state) has not completed, or
    completed with an error: CUDA does not start on them until it does.  Judged only where
    the GPUs sit on such a fabric (``on_nvlink_fabric``): a PCIe or single GPU answers "not
    supported", or nothing, and its fabric state is no fact its placement needs.  There, a
    GPU whose state nobody can read (``unknown``: an NVML error, a number nvml.h does not
    name) is not taken as completed."""
    if not on_nvlink_fabric(nvml, nvswitches):
        return []
    pending: dict[str, list[str]] = {}
    nvml_errors: list[str] = []
    unnamed_states: list[str] = []
    for g in nvml.gpus:
        f = g.fabric
        if f is None or f.state is None or f.state == FABRIC_NOT_SUPPORTED:
            continue
        if f.state == FABRIC_UNKNOWN:
            unnamed = f.unknown is not None and f.unknown.kind == UNNAMED_STATE
            (unnamed_states if unnamed else nvml_errors).append(f"GPU{g.index} ({f.unknown or 'no detail'})")
        elif f.state != FABRIC_COMPLETED:
            pending.setdefault(f.state, []).append(f"GPU{g.index}")
        elif f.status is not None and f.status != 0:
            pending.setdefault(f"completed with error {f.status}", []).append(f"GPU{g.index}")
    said = []  # one finding for the fabric, naming each kind of trouble with its own remedy
    total = len(nvml.gpus)
    if pending:
        count = sum(len(gpus) for gpus in pending.values())
        states = "; ".join(f"{state}: {', '.join(gpus)}" for state, gpus in pending.items())
        said.append(
            f"NVLink fabric registration not completed on {count} of {total} GPUs ({states}): CUDA fails on them with "
            "'system not yet initialized' until it completes. Remedy: check that the fabric manager runs (systemctl status "
            "nvidia-fabricmanager; its version must be the driver's) and, if the state stays in_progress, read its log "
            "(/var/log/fabricmanager.log)")
    if nvml_errors:
        said.append(
            f"NVLink fabric state unreadable on {len(nvml_errors)} of {total} GPUs ({', '.join(nvml_errors)}): NVML answered "
            "an error, so the GPUs are not known to be registered and are judged not ready. Remedy: nvidia-smi -q (the "
            "Fabric section) and the kernel log (dmesg: Xid, NVRM) show what the driver says; check the fabric manager "
            "(systemctl status nvidia-fabricmanager)")
    if unnamed_states:
        said.append(
            f"NVLink fabric state unreadable on {len(unnamed_states)} of {total} GPUs ({', '.join(unnamed_states)}): a state "
            "number this topoagent does not know (from a newer driver), so judged not ready. Remedy: upgrade topoagent; "
            "nvidia-smi -q (Fabric) says what the driver means by it")
    return [Finding(FindingKind.FABRIC_NOT_READY, Severity.CRITICAL, NVLINK_FABRIC, ". ".join(said))] if said else []


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


# Subjects of the findings about the node as a whole (no one device is at fault).
GPU_STACK = "gpu-stack"
NODE = "node"


def witness_findings(
    tree: PciTree | None,
    results: Mapping[str, CollectorResult[Any]],
    gpus: int,
    rdma_nics: int,
    peer_memory: PeerMemory | None,
) -> list[Finding]:
    """What the node cannot see, each with its one-line remedy: NVIDIA GPUs on the PCI bus
    that neither NVML nor nvidia-smi answers for (critical: link levels, NVLink and GPU
    identities are unknown), a node that shows no GPU at all (critical: the agent runs on
    GPU nodes), RDMA NICs beside GPUs without a peer-memory module (a warning: NCCL may
    still use DMA-BUF, which no file shows)."""
    found: list[Finding] = []
    on_bus = tree.of_kind(GPU) if tree is not None else ()
    answered = [results[name] for name in ("nvml", "nvidia_smi") if name in results]
    # A source that crashed (our bug: its collector-error says so) is no witness that the
    # stack is missing: one of our faults must not read as the machine's.
    if on_bus and answered and not any(r.ok or r.bug for r in answered):
        said = "; ".join(f"{r.name}: {r.message or r.status}" for r in answered)
        unbound = [d for d in on_bus if d.driver is None]
        if len(unbound) == len(on_bus):
            cause = "and no driver is bound to them (the NVIDIA driver is not loaded)"
            remedy = "load the NVIDIA driver (modprobe nvidia; nvidia-smi must list the GPUs)"
        else:
            cause = "but neither NVML nor nvidia-smi answers"
            remedy = ("make nvidia-smi work where the agent runs (the NVIDIA container runtime for a pod, "
                      "a working driver on the host)")
        found.append(Finding(
            FindingKind.GPU_STACK_MISSING, Severity.CRITICAL, GPU_STACK,
            f"{len(on_bus)} NVIDIA GPU(s) on the PCI bus {cause} ({said}): link levels between GPUs, "
            f"NVLink and GPU identities are unknown. Remedy: {remedy}",
        ))
    # "No GPU" needs every witness to have looked: one that crashed (our bug) saw nothing.
    looked = not any(r.bug for name, r in results.items() if name in ("pci", "nvml", "nvidia_smi"))
    if not gpus and not on_bus and looked:
        found.append(Finding(
            FindingKind.NO_GPUS, Severity.CRITICAL, NODE,
            "no GPU found: none on the PCI bus, none from NVML or nvidia-smi. Remedy: run topoagent on GPU nodes "
            "only (deploy/: its nodeSelector), or check the GPUs are seated and powered (lspci -d 10de:)",
        ))
    if gpus and rdma_nics and peer_memory is not None and peer_memory.module is None:
        found.append(Finding(
            FindingKind.GPUDIRECT_MISSING, Severity.WARNING, "gpudirect",
            f"{rdma_nics} RDMA NIC(s) but no GPUDirect peer-memory module loaded (nvidia_peermem): NCCL's GPUDirect "
            "RDMA falls back to staging through host memory unless DMA-BUF works. Remedy: modprobe nvidia_peermem "
            "(and load it at boot)",
        ))
    return found


def placement_blockers(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    """The findings that make the node's answers untrustworthy, in the order given (the
    readiness rule, pure: the HTTP door and the exports call it)."""
    return tuple(f for f in findings if f.severity is Severity.CRITICAL and f.kind in PLACEMENT_BLOCKERS)


def placement_refusals(findings: Iterable[Finding]) -> tuple[Finding, ...]:
    """The blockers the placement doors (POST /place, ``place``) refuse a request for: all
    but ``no-gpus``, where the core's own answer already says it ("no GPUs found on this
    node", a request that cannot fit) the same way at every door."""
    return tuple(f for f in placement_blockers(findings) if f.kind is not FindingKind.NO_GPUS)


# The formats that state every GPU pair's link (NVLink counts): NCCL and Slurm would take
# a link no witness classified for "no NVLink", so they are not written while one is.
STATE_LINKS = frozenset({"nccl-xml", "gres"})


def held_back(fmt: str, topology: NodeTopology) -> str | None:
    """Why ``fmt`` is not written for this node (a finding that leaves its links unseen), or None."""
    blockers = placement_blockers(topology.findings)
    if fmt in STATE_LINKS and blockers:
        return f"{blockers[0].kind}: {blockers[0].message}"
    return None
