"""Slurm ``gres.conf`` lines for the node's GPUs, in Slurm's own numbering.

gres.conf(5), as Slurm documents it:

- ``File=/dev/nvidiaN``: N is the driver's *minor number*, which need not equal the GPU's
  index.  Discovery reads it from /proc/driver/nvidia/gpus/<bus id>/information when the
  node shows it (``GpuTopo.device_minor``); otherwise we assume minor = index (said in a
  comment line).
- ``Cores=``: *logical core indices*, not OS CPU numbers: core 0 is the first core of the
  first socket, core 1 the second (lstopo's ``Core L#``).  Hyperthread siblings are one
  core.  We map the GPU's close CPUs to cores with sysfs's CPU topology when the node has
  it, else by the assumption `collectors.cpu.assume_core_map` states (said in a comment);
  discovery's ``cpu`` collector gives the map (``NodeTopology.cpu``).
  A GPU close to every core gets no ``Cores=``: Slurm asks not to set it then.  But Slurm
  wants ``Cores=`` on all of a node's GPUs or on none (slurmctld logs "has CPUs configured
  for only some of the records" at every registration otherwise), so when some GPUs name
  their cores, one close to every core (or of unknown CPUs) names them all.
- ``Links=``: one number per GPU *in PCI bus id order* (Slurm numbers devices that way):
  -1 for the GPU itself, the NVLink count to that peer, 0 for none.  Through an NVSwitch
  every pair counts the links each GPU has into the fabric (nvidia-smi's NV<n>).
- ``Type=``: the model as Slurm's NVML autodetection spells it (lower case, spaces as
  underscores), so a ``Type`` here also matches ``AutoDetect=nvml``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from topoagent.errors import TopoagentError
from topoagent.node.cpulist import CpuListError, format_cpulist, parse_cpulist
from topoagent.node.facts import ASSUMED_SMT2, CoreMap
from topoagent.node.model import GpuTopo, NodeTopology


class GresError(TopoagentError):
    """The node has nothing to write a gres.conf about, or a node name Slurm cannot read."""


# A Slurm node name or hostlist expression (gpu01, gpu[01-16]): no spaces, no comment sign.
NODE_NAME = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.\[\],]*$")


def check_node_name(name: str) -> str:
    if len(name) > 256 or not NODE_NAME.match(name):
        raise GresError(f"node name {name!r} is not a Slurm node name or hostlist (letters, digits, -_.[],)")
    return name


@dataclass(frozen=True, slots=True)
class GresLine:
    gpu: str  # "GPU3"
    type: str | None
    file: str
    cores: frozenset[int] | None  # None: any core
    links: tuple[int, ...]

    def render(self) -> str:
        parts = ["Name=gpu"]
        if self.type:
            parts.append(f"Type={self.type}")
        parts.append(f"File={self.file}")
        if self.cores is not None:
            parts.append(f"Cores={format_cpulist(self.cores)}")
        if self.links:
            parts.append("Links=" + ",".join(str(n) for n in self.links))
        return " ".join(parts)


def slurm_type(model: str | None) -> str | None:
    """NVML's name as Slurm's autodetection spells it, restricted to ``[a-z0-9_.-]``: gres.conf
    has no quoting, and a NUL ends Slurm's string there.  Any other character becomes ``_``."""
    if not model:
        return None
    return re.sub(r"[^a-z0-9_.-]", "_", re.sub(r"\s+", "_", model.strip()).lower()) or None


def bus_order(gpus: tuple[GpuTopo, ...]) -> list[GpuTopo]:
    """Slurm's device numbering: by PCI bus id (GPUs without one last, by index)."""
    return sorted(gpus, key=lambda g: (g.pci_address is None, g.pci_address or "", g.index))


def _core_map(topology: NodeTopology) -> CoreMap | None:
    return topology.cpu.core_map if topology.cpu is not None else None


def gres_lines(topology: NodeTopology) -> list[GresLine]:
    if not topology.gpus:
        raise GresError("no GPUs found; nothing to put in gres.conf")
    cores = _core_map(topology)
    ordered = bus_order(topology.gpus)
    rows: list[tuple[GpuTopo, frozenset[int] | None, list[int]]] = []
    for gpu in ordered:
        links = []
        for peer in ordered:
            if peer is gpu:
                links.append(-1)
                continue
            level = topology.level(gpu.name, peer.name)
            links.append(level.nvlinks if level is not None and level.is_nvlink else 0)
        gpu_cores = None
        if cores is not None and gpu.cpus:
            try:
                mine = cores.cores(parse_cpulist(gpu.cpus))
            except CpuListError:
                mine = frozenset()
            if mine and mine != cores.all_cores:
                gpu_cores = mine
        rows.append((gpu, gpu_cores, links))
    if cores is not None and any(gpu_cores is not None for _, gpu_cores, _ in rows):
        # Cores= on all GPUs or on none (the module's docstring says why)
        rows = [(gpu, cores.all_cores if gpu_cores is None else gpu_cores, links) for gpu, gpu_cores, links in rows]
    lines = []
    for gpu, gpu_cores, links in rows:
        minor = gpu.device_minor if gpu.device_minor is not None else gpu.index
        lines.append(GresLine(gpu.name, slurm_type(gpu.model), f"/dev/nvidia{minor}",
                              gpu_cores, tuple(links) if len(ordered) > 1 else ()))
    return lines


def render_gres(topology: NodeTopology, node_name: str | None = None) -> str:
    """The node's gres.conf; with ``node_name`` each line starts ``NodeName=<name>``, so
    the lines of many nodes can live in one gres.conf shared by the cluster."""
    lines = gres_lines(topology)
    prefix = f"NodeName={check_node_name(node_name)} " if node_name is not None else ""
    cores = _core_map(topology)
    head = [f"# gres.conf for {topology.hostname or 'this node'}, written by topoagent export gres",
            "# Links= lists NVLink counts to each GPU in PCI bus id order (-1 = itself)."]
    if cores is None:
        head.append("# Cores= left out: the node's CPUs are unknown.")
    elif cores.assumed and any(line.cores is not None for line in lines):
        how = ("SMT-2 with thread c+N/2 the sibling of c" if cores.source == ASSUMED_SMT2
               else "one thread per core")
        head.append(f"# Cores= assume {how} (sysfs CPU topology not available); check with lstopo -l.")
    if any(gpu.device_minor is None for gpu in topology.gpus):
        head.append("# File= assumes /dev/nvidia minor numbers equal the GPU indices.")
    return "\n".join(head + [prefix + line.render() for line in lines]) + "\n"


__all__ = ["GresError", "GresLine", "bus_order", "check_node_name", "gres_lines", "render_gres", "slurm_type"]
