"""The PCIe tree from sysfs: every device, the chain of bridges above it, its link and NUMA node.

Each ``/sys/bus/pci/devices/<addr>`` is a link to ``/sys/devices/pci<dom>:<bus>/.../<addr>``;
the PCI addresses on that path are the bridges above the device.  A bridge can be on the
path yet absent from the device list (hidden by the platform, or cut from a recording):
it is kept, read from its own directory.  Old hwloc recordings hold plain directories
instead of links: such devices have no known parent.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field, replace

from topoagent.collectors.base import CollectorResult, NoData, SourceError, off_loop, run_collector
from topoagent.collectors.numa import NumaTopology
from topoagent.errors import TopoagentError
from topoagent.node.cpulist import CpuListError, format_cpulist, parse_cpulist, parse_cpumask
from topoagent.node.facts import BRIDGE, DISPLAY, GPU, NIC, NVME, NVSWITCH, OTHER
from topoagent.node.host import Host, HostError
from topoagent.node.levels import PCIE_GT_S_TO_GEN, pcie_gbps

PCI_DEVICES = "/sys/bus/pci/devices"
# A GPU node lists a few hundred PCI functions, a few thousand with SR-IOV virtual
# functions; one PCI domain holds at most 65,536.  More entries than that is a poisoned
# recording: refused before each is read (about 15 files apiece).
MAX_PCI_DEVICES = 65_536
_PCI_ADDRESS = re.compile(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.[0-7]")
_ROOT_COMPLEX = re.compile(r"pci[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}")
_SPEED = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*GT/s")
_NO_LINK = re.compile(r"\s*(?:Unknown(?: speed)?|0)\s*", re.IGNORECASE)

NVIDIA = 0x10DE



@dataclass(frozen=True, slots=True)
class PciLink:
    """A PCIe link's speed and width, now and at most, from sysfs."""

    current_gts: float | None  # transfer rate, GT/s
    current_width: int | None
    max_gts: float | None
    max_width: int | None

    @property
    def current_gen(self) -> int | None:
        return PCIE_GT_S_TO_GEN.get(self.current_gts) if self.current_gts else None

    @property
    def max_gen(self) -> int | None:
        return PCIE_GT_S_TO_GEN.get(self.max_gts) if self.max_gts else None

    @property
    def below_max(self) -> bool:
        return self.width_below_max or self.speed_below_max

    @property
    def width_below_max(self) -> bool:
        return bool(self.current_width and self.max_width and self.current_width < self.max_width)

    @property
    def speed_below_max(self) -> bool:
        return bool(self.current_gts and self.max_gts and self.current_gts < self.max_gts)

    def gbps(self, *, assume_max_speed: bool = False) -> float | None:
        """Per-direction bandwidth of the link as trained (None when unknown)."""
        gen = self.max_gen if assume_max_speed and self.max_gen else self.current_gen
        width = self.current_width
        if not gen or not width:
            return None
        return pcie_gbps(gen, width)


@dataclass(frozen=True, slots=True)
class PciDevice:
    """One PCI function from /sys/bus/pci/devices, with its place in the tree."""

    address: str  # "0000:3b:00.0", lower case
    class_code: int | None  # 0x030200
    vendor: int | None
    device: int | None
    subsystem_vendor: int | None
    subsystem_device: int | None
    numa_node: int | None  # None = unknown
    numa_source: str | None  # "sysfs", "local_cpus" (located like hwloc) or None
    local_cpulist: str | None
    link: PciLink | None
    driver: str | None
    parent: str | None  # the bridge right above; None at a root complex
    bridges: tuple[str, ...]  # every bridge above, from the root complex down
    root_complex: str | None  # "pci0000:3a"; None when the recording has no path
    kind: str
    listed: bool = True  # False: on a path but not in /sys/bus/pci/devices
    interfaces: tuple[str, ...] = ()  # net and RDMA devices on this function

    @property
    def depth(self) -> int:
        return len(self.bridges)


@dataclass(frozen=True, slots=True)
class PciTree:
    """The node's PCI functions, and the bridges on their paths, looked up by address."""

    devices: tuple[PciDevice, ...]
    _by_address: dict[str, PciDevice] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Pair derivation looks devices up thousands of times on a big node.
        self._by_address.update((d.address, d) for d in self.devices)

    def get(self, address: str) -> PciDevice | None:
        return self._by_address.get(address)

    def of_kind(self, kind: str) -> tuple[PciDevice, ...]:
        return tuple(d for d in self.devices if d.kind == kind)


# --- pure parsers ---------------------------------------------------------------------


class PciParseError(TopoagentError, ValueError):  # ValueError: callers predating the type
    """A PCI address or a sysfs hex field that does not read as one."""


def normalize_address(text: str) -> str:
    """``0000:3B:00.0`` / ``00000000:3B:00.0`` (NVML) / ``3b:00.0`` -> ``0000:3b:00.0``."""
    value = text.strip().lower()
    parts = value.split(":")
    if len(parts) == 2:
        parts = ["0000"] + parts
    if len(parts) != 3:
        raise PciParseError(f"{text!r} is not a PCI address")
    domain = parts[0].lstrip("0").rjust(4, "0")
    address = f"{domain}:{parts[1]}:{parts[2]}"
    if not _PCI_ADDRESS.fullmatch(address):
        raise PciParseError(f"{text!r} is not a PCI address")
    return address


def parse_hex(text: str, what: str) -> int:
    try:
        return int(text.strip(), 16)
    except ValueError:
        raise PciParseError(f"{what}: {text.strip()!r} is not a hexadecimal number") from None


def parse_link_speed(text: str | None) -> float | None:
    """``16.0 GT/s PCIe`` / ``8 GT/s`` -> 16.0 / 8.0; ``Unknown speed`` -> None."""
    if not text:
        return None
    match = _SPEED.match(text)
    return float(match.group(1)) if match else None


def parse_link_width(text: str | None) -> int | None:
    if not text:
        return None
    try:
        width = int(text.strip())
    except ValueError:
        return None
    return width or None


def parse_device_path(real_path: str) -> tuple[str | None, tuple[str, ...]]:
    """Root complex and bridges above a device, from its resolved sysfs path.

    ``/sys/devices/pci0000:17/0000:17:00.0/0000:18:00.0/0000:1a:00.0`` ->
    (``pci0000:17``, (``0000:17:00.0``, ``0000:18:00.0``)).  A path without a
    ``pci<dom>:<bus>`` component (plain directory in an old recording) gives (None, ()).
    """
    parts = [p for p in real_path.split("/") if p]
    root: str | None = None
    chain: list[str] = []
    for part in parts[:-1]:
        if _ROOT_COMPLEX.fullmatch(part):
            if root is None:
                root = part.lower()
        elif root is not None and _PCI_ADDRESS.fullmatch(part):
            chain.append(normalize_address(part))
    return root, tuple(chain)


def classify(class_code: int | None, vendor: int | None) -> str:
    if class_code is None:
        return OTHER
    base, sub = class_code >> 16, (class_code >> 8) & 0xFF
    if base == 0x03:
        return GPU if vendor == NVIDIA else DISPLAY
    if base == 0x02 and sub in (0x00, 0x07):
        return NIC
    if base == 0x06 and sub == 0x80 and vendor == NVIDIA:
        return NVSWITCH
    if base == 0x01 and sub == 0x08:
        return NVME
    if base == 0x06 and sub == 0x04:
        return BRIDGE
    return OTHER


def locate_numa_node(
    device_cpus: frozenset[int], numa_cpus: dict[int, frozenset[int]]
) -> int | None:
    """The NUMA node of a device whose numa_node is unknown, from its local CPUs (as hwloc).

    A device whose local CPUs are exactly, or fall inside, one node's CPUs belongs to it;
    one local to several nodes (or to every CPU) stays unknown.
    """
    if not device_cpus:
        return None
    matches = [n for n, cpus in numa_cpus.items() if cpus and device_cpus <= cpus]
    if len(matches) == 1:
        return matches[0]
    exact = [n for n, cpus in numa_cpus.items() if cpus == device_cpus]
    return exact[0] if len(exact) == 1 else None


# --- reading through a Host -----------------------------------------------------------


def _read_device(
    host: Host,
    address: str,
    directory: str,
    parent: str | None,
    bridges: tuple[str, ...],
    root: str | None,
    listed: bool,
    numa_cpus: dict[int, frozenset[int]],
    warnings: list[str],
) -> PciDevice:
    def read(name: str) -> str | None:
        return host.read_optional(f"{directory}/{name}")

    def hex_field(name: str) -> int | None:
        text = read(name)
        if text is None:
            return None
        try:
            return parse_hex(text, f"{directory}/{name}")
        except PciParseError as exc:
            warnings.append(str(exc))
            return None

    class_code = hex_field("class")
    vendor = hex_field("vendor")
    numa_node: int | None = None
    numa_source: str | None = None
    text = read("numa_node")
    if text is not None:
        try:
            value = int(text)
        except ValueError:
            warnings.append(f"{directory}/numa_node: {text!r} is not a number")
        else:
            if value >= 0:
                numa_node, numa_source = value, "sysfs"
    # The mask is what hwloc reads; the list form is the fallback (they agree on real
    # kernels, but hand-trimmed recordings may keep only one of them right).
    local_cpulist: str | None = None
    local_cpus: frozenset[int] | None = None
    mask = read("local_cpus")
    try:
        if mask is not None:
            local_cpus = parse_cpumask(mask)
        else:
            text = read("local_cpulist")
            if text is not None:
                local_cpus = parse_cpulist(text)
    except CpuListError as exc:
        warnings.append(f"{directory}/local_cpus: {exc}")
    if local_cpus is not None:
        local_cpulist = format_cpulist(local_cpus)
    if numa_node is None and local_cpus:
        numa_node = locate_numa_node(local_cpus, numa_cpus)
        if numa_node is not None:
            numa_source = "local_cpus"
    link_files = ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width")
    texts = {n: read(n) for n in link_files}
    link = None
    if any(t is not None for t in texts.values()):
        speeds: dict[str, float | None] = {}
        widths: dict[str, int | None] = {}
        for n, t in texts.items():
            parsed: float | int | None
            if n.endswith("speed"):
                parsed = speeds[n] = parse_link_speed(t)
            else:
                parsed = widths[n] = parse_link_width(t)
            # 'Unknown speed' and width 0 mean no link trained; anything else unread is damage.
            if t is not None and parsed is None and not _NO_LINK.fullmatch(t):
                warnings.append(f"{directory}/{n}: {t!r} is not a link {n.rsplit('_', 1)[-1]}")
        link = PciLink(
            speeds["current_link_speed"],
            widths["current_link_width"],
            speeds["max_link_speed"],
            widths["max_link_width"],
        )
    driver = None
    with contextlib.suppress(OSError, HostError):
        # The link's own target names the driver; its directory need not be recorded.
        driver = host.readlink(f"{directory}/driver").rstrip("/").rsplit("/", 1)[-1] or None
    return PciDevice(
        address=address,
        class_code=class_code,
        vendor=vendor,
        device=hex_field("device"),
        subsystem_vendor=hex_field("subsystem_vendor"),
        subsystem_device=hex_field("subsystem_device"),
        numa_node=numa_node,
        numa_source=numa_source,
        local_cpulist=local_cpulist,
        link=link,
        driver=driver,
        parent=parent,
        bridges=bridges,
        root_complex=root,
        kind=classify(class_code, vendor),
        listed=listed,
    )


def _interfaces(host: Host) -> dict[str, list[str]]:
    """PCI address -> network and RDMA interfaces on it (from /sys/class/{net,infiniband})."""
    found: dict[str, list[str]] = {}
    for cls in ("net", "infiniband"):
        for name in host.listdir(f"/sys/class/{cls}"):
            real = host.realpath(f"/sys/class/{cls}/{name}")
            parts = [p for p in real.split("/") if p]
            # .../<pci address>/net/<ifname>: the function it sits on is right above.
            addresses = [p for p in parts[:-1] if _PCI_ADDRESS.fullmatch(p)]
            if addresses:
                found.setdefault(normalize_address(addresses[-1]), []).append(name)
    return found


def read_pci_tree(
    host: Host, numa_cpus: dict[int, frozenset[int]]
) -> tuple[PciTree, tuple[str, ...]]:
    names = host.listdir(PCI_DEVICES)
    if not names:
        raise NoData(f"{PCI_DEVICES} is empty or missing")
    if len(names) > MAX_PCI_DEVICES:
        raise SourceError(f"{PCI_DEVICES}: {len(names):,} entries; a node has at most {MAX_PCI_DEVICES:,} PCI functions")
    warnings: list[str] = []
    devices: dict[str, PciDevice] = {}
    paths: dict[str, str] = {}
    placement: dict[str, tuple[str | None, tuple[str, ...]]] = {}
    for name in names:
        try:
            address = normalize_address(name)
        except PciParseError:
            warnings.append(f"{PCI_DEVICES}/{name}: not a PCI address, skipped")
            continue
        real = host.realpath(f"{PCI_DEVICES}/{name}")
        if not host.is_dir(real):
            # A link to nowhere (device removed mid-read, or a damaged recording).
            warnings.append(f"{PCI_DEVICES}/{name}: dangling link to {real}; skipped")
            continue
        paths[address] = real
        placement[address] = parse_device_path(real)
    for address, real in paths.items():
        root, bridges = placement[address]
        devices[address] = _read_device(
            host, address, real, bridges[-1] if bridges else None, bridges, root, True,
            numa_cpus, warnings,
        )
    # Bridges on a path but missing from the list: read them from the path itself.
    for address, real in paths.items():
        root, bridges = placement[address]
        for depth, bridge in enumerate(bridges):
            if bridge in devices:
                continue
            cut = real.split("/" + bridge)[0] if "/" + bridge in real else None
            if cut is None:
                continue
            directory = f"{cut}/{bridge}"
            above = bridges[:depth]
            devices[bridge] = _read_device(
                host, bridge, directory, above[-1] if above else None, above, root, False,
                numa_cpus, warnings,
            )
    for address, names_here in _interfaces(host).items():
        if address in devices:
            d = devices[address]
            devices[address] = replace(d, interfaces=tuple(sorted(names_here)))
    ordered = tuple(sorted(devices.values(), key=lambda d: _address_key(d.address)))
    return PciTree(ordered), tuple(warnings)


def _address_key(address: str) -> tuple[int, int, int, int]:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return (int(domain, 16), int(bus, 16), int(slot, 16), int(function, 16))


async def collect(host: Host, numa: CollectorResult[NumaTopology] | None = None) -> CollectorResult[PciTree]:
    """Read the PCIe tree; NUMA's CPUs (when it read) place devices whose numa_node is -1."""
    numa_cpus = numa.data.cpus_by_node() if numa is not None and numa.ok and numa.data else {}

    async def read() -> tuple[PciTree, tuple[str, ...]]:
        # Blocking sysfs reads go to a thread so the agent's loop keeps serving.
        return await off_loop(read_pci_tree, host, numa_cpus)

    return await run_collector("pci", read)
