"""InfiniBand / RoCE HCAs from ``/sys/class/infiniband``: PCI function, ports, interfaces."""

from __future__ import annotations

import re
from dataclasses import dataclass

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.collectors.pci import _PCI_ADDRESS, normalize_address
from topoagent.node.host import Host

IB_CLASS = "/sys/class/infiniband"
_RATE = re.compile(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec(?:\s*\((.*)\))?")
_STATE = re.compile(r"\s*(\d+)\s*:\s*(\S+)")


@dataclass(frozen=True, slots=True)
class IbPort:
    """One port of an RDMA device, from /sys/class/infiniband/<dev>/ports/<n>."""

    number: int
    state: str | None  # "ACTIVE", "DOWN", "INIT", "ARMED"
    phys_state: str | None  # "LinkUp", "Disabled", "Polling"
    rate_gbps: float | None  # Gb/s (bits), e.g. 200.0
    rate_text: str | None  # "4X HDR"
    link_layer: str | None  # "InfiniBand" or "Ethernet" (RoCE)
    lid: int | None
    subnet_prefix: str | None  # "fe80:0000:0000:0000"

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"

    @property
    def roce(self) -> bool:
        return self.link_layer == "Ethernet"


@dataclass(frozen=True, slots=True)
class Hca:
    """An RDMA device (InfiniBand or RoCE) with its ports and network interfaces."""

    name: str  # "mlx5_0"
    pci_address: str | None
    ports: tuple[IbPort, ...]
    netdevs: tuple[str, ...]
    node_guid: str | None = None  # "0x4885b8933c4c5d93", as NCCL writes a net's guid


def parse_rate(text: str | None) -> tuple[float | None, str | None]:
    """``200 Gb/sec (4X HDR)`` -> (200.0, "4X HDR"); unknown -> (None, None)."""
    if not text:
        return None, None
    match = _RATE.match(text)
    if not match:
        return None, None
    return float(match.group(1)), match.group(2)


def parse_state(text: str | None) -> str | None:
    """``4: ACTIVE`` -> ``ACTIVE``; ``5: LinkUp`` -> ``LinkUp``."""
    if not text:
        return None
    match = _STATE.match(text)
    return match.group(2) if match else text.strip() or None


def parse_lid(text: str | None) -> int | None:
    if not text:
        return None
    try:
        return int(text.strip(), 16 if text.strip().lower().startswith("0x") else 10)
    except ValueError:
        return None


def parse_subnet_prefix(gid: str | None) -> str | None:
    """The upper 64 bits of a GID ``fe80:0000:0000:0000:0015:...`` -> ``fe80:0000:0000:0000``."""
    if not gid:
        return None
    groups = gid.strip().split(":")
    if len(groups) != 8:
        return None
    return ":".join(groups[:4]).lower()


def parse_node_guid(text: str | None) -> str | None:
    """sysfs ``node_guid`` ``4885:b893:3c4c:5d93`` -> ``0x4885b8933c4c5d93``; junk -> None."""
    if not text:
        return None
    digits = text.strip().replace(":", "").lower()
    if not re.fullmatch(r"[0-9a-f]{1,16}", digits):
        return None
    return f"0x{int(digits, 16):016x}"


def _is_port_number(name: str) -> bool:
    # ASCII and short: str.isdigit() also passes '²', which int() refuses, and a
    # recorded tree may hold any name.
    return name.isascii() and name.isdigit() and len(name) <= 6


def _port_sort_key(name: str) -> int:
    return int(name) if _is_port_number(name) else 1 << 30


def read_hcas(host: Host) -> tuple[tuple[Hca, ...], tuple[str, ...]]:
    names = host.listdir(IB_CLASS)
    if not names:
        raise NoData(f"{IB_CLASS}: no RDMA devices")
    hcas = []
    warnings: list[str] = []
    for name in sorted(names, key=_natural):
        base = f"{IB_CLASS}/{name}"
        if not host.is_dir(base):
            warnings.append(f"{base}: dangling link to {host.realpath(base)}; skipped")
            continue
        address = None
        device_path = host.realpath(f"{base}/device")
        last = device_path.rstrip("/").rsplit("/", 1)[-1]
        if _PCI_ADDRESS.fullmatch(last):
            address = normalize_address(last)
        else:
            warnings.append(f"{base}/device: not a PCI function ({device_path})")
        ports = []
        for port in sorted(host.listdir(f"{base}/ports"), key=_port_sort_key):
            if not _is_port_number(port):
                continue
            p = f"{base}/ports/{port}"
            rate, rate_text = parse_rate(host.read_optional(f"{p}/rate"))
            ports.append(
                IbPort(
                    number=int(port),
                    state=parse_state(host.read_optional(f"{p}/state")),
                    phys_state=parse_state(host.read_optional(f"{p}/phys_state")),
                    rate_gbps=rate,
                    rate_text=rate_text,
                    link_layer=host.read_optional(f"{p}/link_layer"),
                    lid=parse_lid(host.read_optional(f"{p}/lid")),
                    subnet_prefix=parse_subnet_prefix(host.read_optional(f"{p}/gids/0")),
                )
            )
        netdevs = tuple(host.listdir(f"{base}/device/net"))
        guid = parse_node_guid(host.read_optional(f"{base}/node_guid"))
        hcas.append(Hca(name, address, tuple(ports), netdevs, guid))
    return tuple(hcas), tuple(warnings)


def _natural(name: str) -> tuple:
    """mlx5_2 before mlx5_10.  Digit runs compare by length, then text: no int(), so a
    recorded name of 5,000 digits sorts rather than passing Python's int digit limit."""
    parts = re.split(r"([0-9]+)", name)  # text, digits, text, ...: same types at each place
    return tuple((len(t.lstrip("0")), t.lstrip("0")) if i % 2 else t for i, t in enumerate(parts))


async def collect(host: Host) -> CollectorResult[tuple[Hca, ...]]:
    async def read() -> tuple[tuple[Hca, ...], tuple[str, ...]]:
        return await off_loop(read_hcas, host)

    return await run_collector("infiniband", read)
