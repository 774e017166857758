"""The CPU side of the node: what the CPU is (/proc/cpuinfo) and which OS CPUs are
threads of one physical core (/sys/devices/system/cpu/cpu<N>/topology).

Level derivation does not need these facts; the NCCL topology file (``<cpu arch vendor
familyid modelid>``) and Slurm's gres.conf (``Cores=``, counted in physical cores) do, and
they read them from the discovered NodeTopology.  The readers go through ``Host`` so they
work on a recorded node (and ``topoagent snapshot`` records what they read), and say when a
fact is missing instead of guessing silently.
"""

from __future__ import annotations

import re

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.collectors.numa import NumaTopology
from topoagent.node.cpulist import CpuListError, parse_cpulist
from topoagent.node.facts import ASSUMED_NO_SMT, ASSUMED_SMT2, SYSFS, CoreMap, CpuFacts, CpuModel
from topoagent.node.host import Host

CPU_DIR = "/sys/devices/system/cpu"
_CPU_NAME = re.compile(r"cpu(\d+)")


def parse_cpuinfo(text: str) -> CpuModel | None:
    """The first processor's identity from /proc/cpuinfo; None when the text says nothing."""
    fields: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if fields:
                break  # the first processor block is enough: sockets are alike on GPU nodes
            continue
        key, sep, value = line.partition(":")
        if sep:
            fields.setdefault(key.strip().lower(), value.strip())
    if not fields:
        return None

    def number(key: str) -> int | None:
        value = fields.get(key)
        if value is None:
            return None
        try:
            return int(value, 0)
        except ValueError:
            return None

    if "vendor_id" in fields:
        return CpuModel("x86_64", fields["vendor_id"], number("cpu family"), number("model"),
                        fields.get("model name"))
    if "cpu implementer" in fields:
        return CpuModel("arm64", None, None, None, fields.get("model name"))
    cpu = fields.get("cpu", "")
    if cpu.upper().startswith("POWER"):
        return CpuModel("ppc64", None, None, None, cpu)
    return None


def abstract_cores(groups: list[frozenset[int]], packages: dict[int, int]) -> dict[int, int]:
    """Number physical cores the way Slurm (and lstopo's logical index) does.

    ``groups`` are the thread sets of each physical core; ``packages`` maps a CPU to its
    socket.  Sockets in order of their lowest CPU, cores within a socket in order of their
    lowest CPU: core 0 is the first core of the first socket.
    """
    socket_first: dict[int, int] = {}
    for cpu, pkg in packages.items():
        socket_first[pkg] = min(cpu, socket_first.get(pkg, cpu))
    ordered = sorted(groups, key=lambda g: (socket_first.get(packages.get(min(g), -1), -1), min(g)))
    return {cpu: index for index, group in enumerate(ordered) for cpu in group}


def read_core_map(host: Host, numa: NumaTopology | None) -> CoreMap | None:
    """Exact from sysfs when the node shows its CPU topology; else a stated assumption."""
    exact = _read_sysfs_cores(host)
    if exact is not None:
        return exact
    if numa is None or not numa.all_cpus:
        return None
    return assume_core_map(numa)


def assume_core_map(numa: NumaTopology) -> CoreMap:
    """Without sysfs topology: Linux's x86 enumeration puts the second thread of core c at
    c + (threads / 2).  We assume SMT-2 only when every NUMA node's CPUs come in two such
    halves (``0-15,128-143`` on a 256-thread DGX A100); otherwise one thread per core.
    """
    cpus = sorted(numa.all_cpus)
    total = len(cpus)
    half = total // 2
    contiguous = cpus == list(range(total))
    smt2 = contiguous and total % 2 == 0 and total > 1
    if smt2:
        for node in numa.nodes:
            if not node.cpus:
                continue
            low = {c for c in node.cpus if c < half}
            high = {c - half for c in node.cpus if c >= half}
            if not low or low != high:
                smt2 = False
                break
    if smt2:
        return CoreMap({c: c % half for c in cpus}, ASSUMED_SMT2)
    return CoreMap({c: i for i, c in enumerate(cpus)}, ASSUMED_NO_SMT)


def _read_sysfs_cores(host: Host) -> CoreMap | None:
    online_text = host.read_optional(f"{CPU_DIR}/online")
    try:
        online = parse_cpulist(online_text) if online_text else None
    except CpuListError:
        online = None
    names = [m for m in map(_CPU_NAME.fullmatch, host.listdir(CPU_DIR)) if m]
    if not names:
        return None
    groups: dict[frozenset[int], None] = {}
    packages: dict[int, int] = {}
    for match in names:
        cpu = int(match.group(1))
        if online is not None and cpu not in online:
            continue
        base = f"{CPU_DIR}/cpu{cpu}/topology"
        package = host.read_optional(f"{base}/physical_package_id")
        siblings = host.read_optional(f"{base}/core_cpus_list") or host.read_optional(
            f"{base}/thread_siblings_list")
        if package is None or siblings is None:
            return None  # a partial topology would number cores wrongly; fall back whole
        try:
            packages[cpu] = int(package)
            group = parse_cpulist(siblings)
        except ValueError:
            return None
        if online is not None:
            group = group & online
        groups[group or frozenset({cpu})] = None
    if not packages:
        return None
    return CoreMap(abstract_cores(list(groups), packages), SYSFS)


def read_cpu_model(host: Host) -> CpuModel | None:
    text = host.read_optional("/proc/cpuinfo")
    return parse_cpuinfo(text) if text else None


def read_cpu(host: Host, numa: NumaTopology | None) -> tuple[CpuFacts, tuple[str, ...]]:
    model, core_map = read_cpu_model(host), read_core_map(host, numa)
    if model is None and core_map is None:
        raise NoData("neither /proc/cpuinfo nor the CPU topology says anything")
    return CpuFacts(model, core_map), ()


async def collect(host: Host, numa: CollectorResult[NumaTopology] | None = None) -> CollectorResult[CpuFacts]:
    """The CPU's identity and core map; NUMA's CPUs stand in when sysfs shows no topology."""
    numa_topology = numa.data if numa is not None and numa.ok else None

    async def read() -> tuple[CpuFacts, tuple[str, ...]]:
        return await off_loop(read_cpu, host, numa_topology)

    return await run_collector("cpu", read)


__all__ = [
    "ASSUMED_NO_SMT", "ASSUMED_SMT2", "SYSFS", "CoreMap", "CpuFacts", "CpuModel", "abstract_cores",
    "assume_core_map", "collect", "parse_cpuinfo", "read_core_map", "read_cpu", "read_cpu_model",
]
