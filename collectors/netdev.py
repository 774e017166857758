"""Every network interface in ``/sys/class/net``, RDMA or not: its PCI function, speed, state.

Clouds carry GPU traffic over plain Ethernet (GPUDirect-TCPX-style NICs, NCCL's socket
transport), so the interfaces the infiniband collector never sees matter to placement too.
Virtual interfaces (``lo``, bridges, veths) have no ``device`` link and are reported with
no PCI function.
"""

from __future__ import annotations

from dataclasses import dataclass

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.collectors.pci import _PCI_ADDRESS, normalize_address
from topoagent.node.host import Host

NET_CLASS = "/sys/class/net"
_MAX_MBPS = 10_000_000  # 10 Tb/s: a larger figure in ``speed`` is junk, not a link


@dataclass(frozen=True, slots=True)
class NetInterface:
    """A network interface from /sys/class/net."""

    name: str  # "ens1f0"
    pci_address: str | None  # the PCI function it sits on; None for a virtual interface
    speed_mbps: int | None  # None: the kernel says -1 (no link) or the file is unreadable
    operstate: str | None  # "up", "down", "unknown", ...


def parse_speed(text: str | None) -> int | None:
    """sysfs ``speed`` (Mb/s) -> int; ``-1``, junk or absent -> None (unknown)."""
    if text is None:
        return None
    text = text.strip()
    if not (text.isascii() and text.isdigit()) or len(text) > 8:
        return None
    value = int(text)
    return value if 0 < value <= _MAX_MBPS else None


def read_interfaces(host: Host) -> tuple[tuple[NetInterface, ...], tuple[str, ...]]:
    names = host.listdir(NET_CLASS)
    if not names:
        raise NoData(f"{NET_CLASS}: no network interfaces")
    found = []
    for name in names:
        base = f"{NET_CLASS}/{name}"
        address = None
        if host.exists(f"{base}/device"):
            # The nearest PCI function on the device's path: a virtio NIC's ``device`` is
            # ``virtio0``, a child of the function it sits on.
            parts = host.realpath(f"{base}/device").split("/")
            addresses = [p for p in parts if _PCI_ADDRESS.fullmatch(p)]
            if addresses:
                address = normalize_address(addresses[-1])
        state = host.read_optional(f"{base}/operstate")
        found.append(NetInterface(name, address, parse_speed(host.read_optional(f"{base}/speed")), state or None))
    return tuple(found), ()


async def collect(host: Host) -> CollectorResult[tuple[NetInterface, ...]]:
    async def read() -> tuple[tuple[NetInterface, ...], tuple[str, ...]]:
        return await off_loop(read_interfaces, host)

    return await run_collector("interfaces", read)


__all__ = ["NET_CLASS", "NetInterface", "collect", "parse_speed", "read_interfaces"]
