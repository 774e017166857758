"""NUMA nodes from sysfs: CPUs, memory and the distance matrix.

Nodes without CPUs (GPU memory exposed as NUMA nodes on POWER9 and Grace, CXL memory)
and nodes whose CPU sets are identical are reported as they are, and marked.  A kernel
without NUMA support has no ``node*`` directories: the node is then one node 0 holding
every online CPU and all memory, as hwloc reports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from topoagent.collectors.base import CollectorResult, SourceError, off_loop, run_collector
from topoagent.node.cpulist import MAX_CPUS, CpuListError, format_cpulist, parse_cpulist, parse_cpumask
from topoagent.node.host import Host, HostError

NODE_DIR = "/sys/devices/system/node"
# Linux's MAX_NUMNODES (NODES_SHIFT is at most 10); more node directories than that is a
# poisoned recording, refused before thousands of CPU lists are read.
MAX_NODES = 1024
_NODE_NAME = re.compile(r"node(\d+)")
_MEMTOTAL = re.compile(r"^(?:Node\s+\d+\s+)?MemTotal:\s*(\d+)\s*kB", re.MULTILINE)


@dataclass(frozen=True, slots=True)
class NumaNode:
    """One NUMA node from /sys/devices/system/node: its CPUs, memory and SLIT distances."""

    id: int
    cpus: frozenset[int]
    memory_bytes: int | None
    distances: tuple[int, ...]  # to every node, in node-id order; () when unknown
    same_cpus_as: tuple[int, ...] = ()  # other nodes with exactly these CPUs

    @property
    def cpulist(self) -> str:
        return format_cpulist(self.cpus)

    @property
    def cpuless(self) -> bool:
        return not self.cpus


@dataclass(frozen=True, slots=True)
class NumaTopology:
    """The node's NUMA nodes, or one assumed node when the kernel exposes none."""

    nodes: tuple[NumaNode, ...]
    synthesized: bool = False  # True: the kernel exposes no NUMA nodes; one node assumed

    def cpus_by_node(self) -> dict[int, frozenset[int]]:
        return {n.id: n.cpus for n in self.nodes}

    def node(self, node_id: int) -> NumaNode | None:
        for n in self.nodes:
            if n.id == node_id:
                return n
        return None

    @property
    def all_cpus(self) -> frozenset[int]:
        return frozenset().union(*(n.cpus for n in self.nodes)) if self.nodes else frozenset()


def parse_meminfo_total(text: str, what: str) -> int:
    """Bytes of ``MemTotal`` in a node's ``meminfo`` or in ``/proc/meminfo``."""
    match = _MEMTOTAL.search(text)
    if not match:
        raise SourceError(f"{what}: no MemTotal line")
    return int(match.group(1)) * 1024


def parse_distances(text: str, what: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split())
    except ValueError:
        raise SourceError(f"{what}: {text.strip()!r} is not a list of distances") from None


def mark_identical_cpusets(nodes: list[NumaNode]) -> tuple[NumaNode, ...]:
    marked = []
    for node in nodes:
        twins = tuple(o.id for o in nodes if o.id != node.id and o.cpus and o.cpus == node.cpus)
        marked.append(replace(node, same_cpus_as=twins))
    return tuple(marked)


def read_numa(host: Host) -> tuple[NumaTopology, tuple[str, ...]]:
    warnings: list[str] = []
    ids = sorted(
        int(m.group(1)) for m in map(_NODE_NAME.fullmatch, host.listdir(NODE_DIR)) if m
    )
    if not ids:
        return _single_node(host), tuple(warnings)
    if len(ids) > MAX_NODES:
        raise SourceError(f"{NODE_DIR}: {len(ids):,} NUMA nodes; Linux has at most {MAX_NODES:,}")
    usable = _online_cpus(host)
    nodes: list[NumaNode] = []
    memberships = 0
    for node_id in ids:
        base = f"{NODE_DIR}/node{node_id}"
        cpus = _node_cpus(host, base)
        # A CPU sits in one node, so the lists add up to the CPU count on a real kernel
        # (firmware that repeats a set on a few nodes stays far below this): many nodes
        # each naming 65,536 CPUs is a poisoned recording, not a bigger machine.
        memberships += len(cpus)
        if memberships > MAX_CPUS:
            raise SourceError(f"{NODE_DIR}: the nodes' CPU lists name more than {MAX_CPUS:,} CPUs together")
        memory = None
        meminfo = host.read_optional(f"{base}/meminfo")
        if meminfo is None:
            warnings.append(f"{base}/meminfo: missing; memory unknown")
        else:
            try:
                memory = parse_meminfo_total(meminfo, f"{base}/meminfo")
            except SourceError as exc:
                warnings.append(str(exc))
        distances: tuple[int, ...] = ()
        text = host.read_optional(f"{base}/distance")
        if text is None:
            warnings.append(f"{base}/distance: missing; distances unknown")
        else:
            distances = parse_distances(text, f"{base}/distance")
            if len(distances) != len(ids):
                warnings.append(
                    f"{base}/distance: {len(distances)} values for {len(ids)} nodes; ignored"
                )
                distances = ()
        if usable is not None:
            cpus = cpus & usable
        nodes.append(NumaNode(node_id, cpus, memory, distances))
    return NumaTopology(mark_identical_cpusets(nodes)), tuple(warnings)


def _node_cpus(host: Host, base: str) -> frozenset[int]:
    """A node's CPUs from ``cpulist``, or from the ``cpumap`` mask older kernels expose alone."""
    for name, parse in (("cpulist", parse_cpulist), ("cpumap", parse_cpumask)):
        try:
            text = host.read_text(f"{base}/{name}")
        except FileNotFoundError:
            continue
        except (OSError, HostError) as exc:  # too large, outside the root, unreadable
            raise SourceError(f"{base}/{name}: {exc}") from None
        try:
            return parse(text)
        except CpuListError as exc:
            raise SourceError(f"{base}/{name}: {exc}") from None
    raise SourceError(f"{base}/cpulist: missing (and no cpumap)")


CPU_ONLINE = "/sys/devices/system/cpu/online"


def _read_online(host: Host) -> frozenset[int] | None:
    """The CPUs the kernel has online, or None when the file is missing."""
    text = host.read_optional(CPU_ONLINE)
    if text is None:
        return None
    try:
        return parse_cpulist(text)
    except CpuListError as exc:
        raise SourceError(f"{CPU_ONLINE}: {exc}") from None


def _online_cpus(host: Host) -> frozenset[int] | None:
    """CPUs the kernel has online: a node's cpulist can name CPUs that are not there."""
    try:
        return _read_online(host)
    except SourceError:
        return None  # only a filter here; the node cpulists still stand


def _single_node(host: Host) -> NumaTopology:
    cpus = _read_online(host)
    if cpus is None:
        raise SourceError(f"{NODE_DIR}: no NUMA nodes and {CPU_ONLINE} missing")
    meminfo = host.read_optional("/proc/meminfo")
    memory = parse_meminfo_total(meminfo, "/proc/meminfo") if meminfo else None
    return NumaTopology((NumaNode(0, cpus, memory, (10,)),), synthesized=True)


async def collect(host: Host) -> CollectorResult[NumaTopology]:
    async def read() -> tuple[NumaTopology, tuple[str, ...]]:
        return await off_loop(read_numa, host)

    return await run_collector("numa", read)


__all__ = ["NumaNode", "NumaTopology", "collect", "parse_distances", "parse_meminfo_total", "read_numa"]
