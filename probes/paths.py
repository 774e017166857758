"""Which shared links a probe's copies cross, and which a busy GPU's traffic may load.

Derived from discovery's PCIe tree (``NodeTopology.pci``: each device's chain of
``bridges`` from its root complex down, and its ``root_complex``) and the NUMA sockets.
A path is a set of *segments*, each a link more than one device may use:

- ``uplink:<bridge>``: the link above a PCIe bridge or switch port (and ``uplink:<gpu>``,
  the GPU's own slot link);
- ``host-bridge:<root complex>``: the root complex a copy enters or leaves;
- ``socket-link:<socket>``: the socket interconnect, on the side of that socket.

A **pair** on NVLink crosses none of them (its copies stay on NVLink).  A pair on PCIe
crosses, like ``topoagent.node.derive.PathLinks``, the links above each device and bridge
below the deepest bridge the two share; the host bridge unless they share a switch
below it (both host bridges when their root complexes differ); and the socket link of
both sockets when their NUMA nodes sit on different sockets.  A **GPU alone** (its host
link probe) crosses its links up to its host bridge.

A busy GPU's **footprint** is what its job may load: every link up to its host bridge
(host memory is the usual other end of its traffic: data loading, checkpoints, staged
copies) and its socket's side of the socket link.  NVML cannot tell where a job's
traffic goes, so this is the conservative guess: a probe sharing any segment with a
busy GPU's footprint would read congestion as a degraded link.
"""

from __future__ import annotations

from topoagent.collectors.pci import PciDevice, PciTree
from topoagent.node.derive import shared_bridges
from topoagent.node.model import NodeTopology
from topoagent.probes.schedule import ProbeTarget, targets_for


def _upstream(device: PciDevice, below: int = 0) -> set[str]:
    """The links from the device up to (not including) its ``below``-th bridge from the top."""
    return {f"uplink:{device.address}"} | {f"uplink:{b}" for b in device.bridges[below:]}


def pair_path(a: PciDevice, b: PciDevice, socket_a: int | None, socket_b: int | None) -> frozenset[str]:
    common = shared_bridges(a, b)
    segments = _upstream(a, common) | _upstream(b, common)
    if common == 0:  # no shared switch: up through the host bridge(s)
        segments |= {f"host-bridge:{rc}" for rc in (a.root_complex, b.root_complex) if rc is not None}
    if socket_a is not None and socket_b is not None and socket_a != socket_b:
        segments |= {f"socket-link:{socket_a}", f"socket-link:{socket_b}"}
    return frozenset(segments)


def gpu_path(device: PciDevice) -> frozenset[str]:
    return frozenset(_upstream(device) | ({f"host-bridge:{device.root_complex}"} if device.root_complex else set()))


def probe_paths(node: NodeTopology) -> tuple[dict[ProbeTarget, frozenset[str]], dict[int, frozenset[str]]]:
    """(target -> the segments its copies cross, GPU index -> its busy footprint).

    GPUs the PCIe tree does not describe get no segments: no contention is assumed for
    them (the busy rule on their own GPUs still holds).
    """
    tree: PciTree | None = node.pci
    devices: dict[int, PciDevice] = {}
    for gpu in node.gpus:
        found = tree.get(gpu.pci_address) if tree is not None and gpu.pci_address else None
        if found is not None:
            devices[gpu.index] = found
    socket_of = node.host_layout().socket_of
    sockets: dict[int, int | None] = {}
    for gpu in node.gpus:
        numa = gpu.numa_node if gpu.numa_node is not None else getattr(devices.get(gpu.index), "numa_node", None)
        sockets[gpu.index] = None if numa is None else socket_of.get(numa, numa)
    names = {g.index: g.name for g in node.gpus}
    paths: dict[ProbeTarget, frozenset[str]] = {}
    for target in targets_for(names):
        if not all(g in devices for g in target.gpus):
            continue
        if not target.is_pair:
            paths[target] = gpu_path(devices[target.gpus[0]])
            continue
        a, b = target.gpus
        pair = node.pair(names[a], names[b])
        if pair is not None and pair.level is not None and pair.level.is_nvlink:
            continue  # NVLink: no PCIe segment is crossed
        paths[target] = pair_path(devices[a], devices[b], sockets[a], sockets[b])
    footprints = {
        index: gpu_path(device) | ({f"socket-link:{sockets[index]}"} if sockets[index] is not None else frozenset())
        for index, device in devices.items()
    }
    return paths, footprints
