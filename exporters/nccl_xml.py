"""An NCCL topology file (``NCCL_TOPO_FILE``) for this node, in the shape NCCL itself dumps.

What NCCL's own dump (``NCCL_TOPO_DUMP_FILE``) holds, and how we fill each part:

- ``<system version="1">``, one ``<cpu>`` per NUMA node holding GPUs or NICs: ``numaid``,
  ``affinity`` (the node's ``cpumap``: 32-bit hex words, high word first), and ``arch``,
  ``vendor``, ``familyid``, ``modelid`` from /proc/cpuinfo (discovery's ``cpu`` collector).  When a recording has no
  cpuinfo those four are left out; NCCL fills missing CPU attributes from the CPU it runs on.
- ``<pci>`` for each PCIe switch on the way down and for each GPU/NIC, nested the way NCCL
  walks sysfs: from a device it climbs *two* path components at a time (skipping the switch's
  downstream port, or the root port) until it reaches the root complex, which becomes the
  ``<cpu>``.  Children are sorted by bus id, as NCCL keeps them.  ``link_speed`` and
  ``link_width`` are the lower of the device's and its upstream port's maximum, the speed
  in sysfs's words (``"16.0 GT/s PCIe"``).
- ``<gpu dev sm rank>``: ``dev`` is the NVML index, ``sm`` the compute capability ×10
  (from the model; left out when the model is unknown, NCCL then asks the GPU), ``rank``
  the index (NCCL sets ``rank`` itself at init).  ``gdr`` is left out: NCCL keeps a file's
  ``gdr`` (src/graph/topo.cc, ``xmlInitAttrInt``) and only fills it when absent, from
  CUDA's ``cudaDevAttrGPUDirectRDMASupported``, which nothing outside CUDA can read.
- ``<nvlink target count tclass>``: one per remote end of the GPU's active links, ``count``
  links to it, ``tclass`` the remote's PCI class (NVSwitch ``0x068000``, GPU ``0x030200``).
  A remote NVML cannot see (a VM) is NCCL's ``fffffff:ff:ff.0``, taken for an NVSwitch.
- ``<nic><net name dev speed port latency gdr/></nic>`` per active RDMA port: ``dev``
  numbers the active ports in device order as the IB plugin does (NCCL renumbers it
  anyway), ``speed`` is Mb/s from sysfs ``rate``, the same number the IB plugin computes.
  NCCL keeps every other ``net`` attribute a file gives (``xmlInitAttr*``) instead of
  asking the plugin, so we write only what we know:  ``gdr="1"`` only when a GPUDirect
  peer-memory module is loaded (the files NCCL's IB plugin tests); otherwise ``gdr`` is
  left out and NCCL detects it, DMA-BUF included.  ``guid`` is left out: NCCL's is the
  HCA's ``sys_image_guid`` as verbs returns it (bytes reversed from sysfs on x86), and it
  uses guid+port to decide which nets share a port's bandwidth, so sysfs's per-function
  ``node_guid`` would mean something else.  ``maxconn`` (a verbs query) is left out too.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from dataclasses import dataclass

from topoagent.errors import TopoagentError
from topoagent.node.facts import NVSWITCH
from topoagent.node.model import GpuTopo, NicTopo, NodeTopology, PciDevice
from topoagent.text import machine_text

NVSWITCH_CLASS = "0x068000"
GPU_CLASS = "0x030200"
CPU_NVLINK_CLASS = "0x068001"  # POWER9 / Grace on the far end of an NVLink
HIDDEN_REMOTE = "fffffff:ff:ff.0"  # NCCL's name for a remote NVLink end it cannot see

# Compute capability ×10 by model, longest names first so "GH200" is not read as "H200".
_SM_BY_MODEL = (
    ("GB300", 103), ("GB200", 100), ("B300", 103), ("B200", 100), ("B100", 100),
    ("GH200", 90), ("H200", 90), ("H100", 90), ("H800", 90), ("H20", 90),
    ("L40S", 89), ("L40", 89), ("L4", 89), ("RTX 6000 ADA", 89), ("RTX 4090", 89),
    ("RTX 5090", 120), ("RTX PRO 6000", 120),
    ("A100", 80), ("A800", 80), ("A30", 80),
    ("A40", 86), ("A10", 86), ("A16", 86), ("A2", 86), ("RTX A6000", 86), ("RTX 3090", 86),
    ("V100", 70), ("TITAN V", 70), ("T4", 75), ("RTX 2080", 75), ("P100", 60),
)


class NcclXmlError(TopoagentError):
    """The topology lacks what an NCCL topology file needs (no PCI tree)."""


def sm_for_model(model: str | None) -> int | None:
    if not model:
        return None
    upper = model.upper().replace("NVIDIA ", "")
    for name, sm in sorted(_SM_BY_MODEL, key=lambda item: -len(item[0])):
        # A model name is followed by '-', ' ', or the end: "A100-SXM4", "L40S", "H100 PCIe".
        index = upper.find(name)
        while index >= 0:
            before = upper[index - 1] if index else " "
            after = upper[index + len(name)] if index + len(name) < len(upper) else " "
            if not before.isalnum() and not after.isalnum():
                return sm
            index = upper.find(name, index + 1)
    return None


def cpumap(cpus: frozenset[int], total: int) -> str:
    """CPU set as sysfs ``cpumap`` prints it: 32-bit words, high first, comma-separated."""
    words = max(1, (total + 31) // 32)
    value = sum(1 << c for c in cpus)
    return ",".join(f"{(value >> (32 * w)) & 0xFFFFFFFF:08x}" for w in reversed(range(words)))


def link_speed_text(gts: float | None) -> str:
    return "" if gts is None else f"{gts:.1f} GT/s PCIe"


@dataclass(frozen=True, slots=True)
class _Net:
    nic: NicTopo
    port: int
    dev: int
    mbps: int


def _active_nets(nics: tuple[NicTopo, ...]) -> list[_Net]:
    nets: list[_Net] = []
    for nic in nics:  # already in device-name order, as the IB plugin enumerates them
        for port in nic.ports:
            if port.active:
                mbps = round(port.rate_gbps * 1000) if port.rate_gbps else 0
                nets.append(_Net(nic, port.number, len(nets), mbps))
    return nets


def xml_parent_chain(device: PciDevice) -> list[str]:
    """Bus ids of the ``<pci>`` ancestors NCCL puts above a device, top first."""
    path = list(device.bridges)
    chain: list[str] = []
    index = len(path) - 2  # path[len] would be the device itself; climb two at a time
    while index >= 0:
        chain.append(path[index])
        index -= 2
    return list(reversed(chain))


def build_nccl_xml(topology: NodeTopology) -> ET.Element:
    tree = topology.pci
    cpu = topology.cpu.model if topology.cpu is not None else None
    if tree is None:
        raise NcclXmlError("no PCI tree was discovered; NCCL's topology file is built on it")
    by_address = {d.address: d for d in tree.devices}
    numa = topology.numa
    total_cpus = (max(numa.all_cpus) + 1) if numa and numa.all_cpus else 0

    system = ET.Element("system", {"version": "1"})
    cpus: dict[int, ET.Element] = {}
    pcis: dict[str, ET.Element] = {}

    def cpu_element(numa_id: int | None) -> ET.Element:
        key = -1 if numa_id is None else numa_id
        if key not in cpus:
            attrs = {"numaid": str(key)}
            node = numa.node(key) if numa is not None and key >= 0 else None
            if node is not None and node.cpus and total_cpus:
                attrs["affinity"] = cpumap(node.cpus, total_cpus)
            if cpu is not None:
                for name, value in (("arch", cpu.arch), ("vendor", cpu.vendor),
                                    ("familyid", cpu.family), ("modelid", cpu.model)):
                    if value is not None:
                        attrs[name] = str(value)
            cpus[key] = ET.Element("cpu", attrs)
        return cpus[key]

    def pci_element(address: str, parent: ET.Element) -> ET.Element:
        if address not in pcis:
            dev = by_address.get(address)
            pcis[address] = ET.SubElement(parent, "pci", _pci_attrs(address, dev, by_address))
        return pcis[address]

    def place(device: PciDevice, numa_id: int | None) -> ET.Element:
        parent = cpu_element(numa_id)
        for bridge in xml_parent_chain(device):
            parent = pci_element(bridge, parent)
        return pci_element(device.address, parent)

    for gpu in topology.gpus:
        dev = by_address.get(gpu.pci_address or "")
        if dev is None:
            continue  # nvidia-smi saw it, sysfs did not: NCCL could not place it either
        pci = place(dev, gpu.numa_node if gpu.numa_node is not None else dev.numa_node)
        _gpu_element(pci, gpu, by_address)

    nets = _active_nets(topology.nics)
    for nic in topology.nics:
        dev = by_address.get(nic.pci_address or "")
        mine = [n for n in nets if n.nic is nic]
        if dev is None or not mine:
            continue  # no PCI function or no active port: NCCL would not use it
        pci = place(dev, nic.numa_node if nic.numa_node is not None else dev.numa_node)
        nic_el = pci.find("nic")
        if nic_el is None:
            nic_el = ET.SubElement(pci, "nic")
        for net in mine:
            attrs = {"name": nic.device or nic.name, "dev": str(net.dev), "speed": str(net.mbps),
                     "port": str(net.port), "latency": "0.000000"}
            if topology.peer_memory is not None:
                attrs["gdr"] = "1"
            ET.SubElement(nic_el, "net", attrs)

    for key in sorted(cpus):
        system.append(cpus[key])
    _sort_by_busid(system)
    return system


def _pci_attrs(address: str, dev: PciDevice | None, by_address: dict[str, PciDevice]) -> dict[str, str]:
    attrs = {"busid": address}
    if dev is None:
        attrs.update({"class": "0x060400", "link_speed": "", "link_width": "0"})
        return attrs
    for name, value in (("class", dev.class_code), ("vendor", dev.vendor), ("device", dev.device),
                        ("subsystem_vendor", dev.subsystem_vendor),
                        ("subsystem_device", dev.subsystem_device)):
        if value is not None:
            attrs[name] = f"0x{value:06x}" if name == "class" else f"0x{value:04x}"
    if "class" not in attrs:
        attrs["class"] = "0x060400"
    # NCCL takes the lower of the device's and its upstream port's maximum link.
    port = by_address.get(dev.parent) if dev.parent else None
    speeds = [d.link.max_gts for d in (dev, port) if d and d.link and d.link.max_gts]
    widths = [d.link.max_width for d in (dev, port) if d and d.link and d.link.max_width]
    attrs["link_speed"] = link_speed_text(min(speeds)) if speeds else ""
    attrs["link_width"] = str(min(widths)) if widths else "0"
    return attrs


def _gpu_element(pci: ET.Element, gpu: GpuTopo, by_address: dict[str, PciDevice]) -> None:
    attrs = {"dev": str(gpu.index)}
    sm = sm_for_model(gpu.model)
    if sm is not None:
        attrs["sm"] = str(sm)
    attrs["rank"] = str(gpu.index)
    element = ET.SubElement(pci, "gpu", attrs)
    counts: dict[str, int] = {}
    classes: dict[str, str] = {}
    for link in gpu.nvlinks:
        if not link.active:
            continue
        target = link.remote_pci_address or HIDDEN_REMOTE
        counts[target] = counts.get(target, 0) + 1  # dicts keep first-seen order, as NCCL does
        classes[target] = _remote_class(target, link.remote_type, by_address)
    for target, count in counts.items():
        ET.SubElement(element, "nvlink", {"target": target, "count": str(count),
                                          "tclass": classes[target]})


def _remote_class(target: str, remote_type: str | None, by_address: dict[str, PciDevice]) -> str:
    dev = by_address.get(target)
    if dev is not None and dev.class_code is not None:
        if dev.kind == NVSWITCH:
            return NVSWITCH_CLASS
        return f"0x{dev.class_code:06x}"
    return {"gpu": GPU_CLASS, "cpu": CPU_NVLINK_CLASS}.get(remote_type or "", NVSWITCH_CLASS)


def _sort_by_busid(element: ET.Element) -> None:
    children = list(element)
    if all(c.tag == "pci" for c in children) and children:
        children.sort(key=lambda c: c.get("busid", ""))
        for child in list(element):
            element.remove(child)
        element.extend(children)
    for child in element:
        _sort_by_busid(child)


def render_nccl_xml(topology: NodeTopology) -> str:
    root = build_nccl_xml(topology)
    ET.indent(root, space="  ")
    # NCCL writes empty elements as `<x a="1"/>`; ElementTree puts a space before the slash.
    # XML 1.0 allows no control character but tab and line ends, not even escaped.
    return machine_text(ET.tostring(root, encoding="unicode").replace(" />", "/>")) + "\n"


__all__ = ["NcclXmlError", "build_nccl_xml", "cpumap", "render_nccl_xml", "sm_for_model",
           "xml_parent_chain"]
