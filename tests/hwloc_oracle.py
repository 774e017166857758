"""Read what hwloc's lstopo says about a node, in the terms `topoagent discover` uses."""

from __future__ import annotations

import os
import shutil
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import dataclass

LSTOPO = shutil.which("lstopo-no-graphics")
_IO_TYPES = {"Bridge", "PCIDev", "OSDev"}
_OSDEV_NET, _OSDEV_OPENFABRICS = "2", "3"


@dataclass
class HwlocView:
    numa_cpus: dict[int, frozenset[int]]
    numa_memory: dict[int, int]
    distances: dict[int, list[int]]  # node -> distances in node-id order
    all_cpus: frozenset[int]
    pci_depth: dict[str, int]  # address -> number of PCI bridges above it
    pci_locality: dict[str, frozenset[int]]  # address -> CPUs it is local to
    interfaces: dict[str, str]  # net / IB interface name -> PCI address it sits on
    net_interfaces: dict[str, str]  # network interface (Linux netdev) name -> PCI address


def run_lstopo(root: str | None) -> str:
    env = dict(os.environ, LC_ALL="C", HWLOC_COMPONENTS="linux,stop",
               # Keep GPU-memory NUMA nodes (POWER9/Grace), which we report, marked.
               HWLOC_KEEP_NVIDIA_GPU_NUMA_NODES="1")
    if root is not None:
        env["HWLOC_FSROOT"] = root
    # The oracle is required, not optional: scripts/test installs Debian's hwloc-nox.
    assert LSTOPO is not None, "lstopo-no-graphics not found: install Debian's hwloc-nox (scripts/test does)"
    done = subprocess.run([LSTOPO, "--whole-io", "--disallowed", "--of", "xml", "-"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


def parse_hwloc_cpuset(text: str) -> frozenset[int]:
    """hwloc bitmap '0x000000ff,0xff000000,,0x0' (32-bit words, high first)."""
    value = 0
    for word in text.split(","):
        word = word.strip()
        value = (value << 32) | (int(word, 16) if word else 0)
    return frozenset(i for i in range(value.bit_length()) if value >> i & 1)


def read_view(xml_text: str) -> HwlocView:
    tree = ET.fromstring(xml_text)
    numa_cpus: dict[int, frozenset[int]] = {}
    numa_memory: dict[int, int] = {}
    pci_depth: dict[str, int] = {}
    pci_locality: dict[str, frozenset[int]] = {}
    interfaces: dict[str, str] = {}
    net_interfaces: dict[str, str] = {}
    machine = tree.find("object")
    assert machine is not None
    all_cpus = parse_hwloc_cpuset(machine.get("cpuset", "0x0"))

    def walk(node: ET.Element, locality: frozenset[int], bridges: int, pci_parent: str | None) -> None:
        for child in node.findall("object"):
            kind = child.get("type")
            if kind == "NUMANode":
                idx = int(child.get("os_index", "-1"))
                numa_cpus[idx] = parse_hwloc_cpuset(child.get("cpuset", "0x0"))
                numa_memory[idx] = int(child.get("local_memory", "0"))
            if kind not in _IO_TYPES:
                cpus = parse_hwloc_cpuset(child.get("cpuset")) if child.get("cpuset") else locality
                walk(child, cpus, 0, None)
                continue
            busid = child.get("pci_busid")
            if kind == "OSDev":
                if child.get("osdev_type") in (_OSDEV_NET, _OSDEV_OPENFABRICS) and pci_parent:
                    interfaces[child.get("name", "")] = pci_parent
                if child.get("osdev_type") == _OSDEV_NET and pci_parent:
                    net_interfaces[child.get("name", "")] = pci_parent
                continue
            if busid:
                pci_depth[busid] = bridges
                pci_locality[busid] = locality
            below = bridges + 1 if kind == "Bridge" and busid else bridges
            walk(child, locality, below, busid or pci_parent)

    walk(tree, all_cpus, 0, None)
    distances: dict[int, list[int]] = {}
    for dist in tree.findall("distances2"):
        if dist.get("name") not in (None, "NUMALatency") or dist.get("type") != "NUMANode":
            continue
        indexes = [int(v) for v in " ".join(e.text or "" for e in dist.findall("indexes")).split()]
        values = [int(v) for v in " ".join(e.text or "" for e in dist.findall("u64values")).split()]
        n = len(indexes)
        order = sorted(range(n), key=lambda k: indexes[k])
        for a in range(n):
            distances[indexes[a]] = [values[a * n + b] for b in order]
    return HwlocView(numa_cpus, numa_memory, distances, all_cpus, pci_depth, pci_locality, interfaces, net_interfaces)
