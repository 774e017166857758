"""The NVIDIA driver's own view of its GPUs: /proc/driver/nvidia/gpus/<bus id>/information.

What we take from it is the device minor number, the N of ``/dev/nvidiaN`` that Slurm's
gres.conf ``File=`` names; it need not equal the GPU's index.  A node without the driver
(or a recording made without it) has no such directory: no data, quietly.
"""

from __future__ import annotations

import re

from topoagent.collectors.base import CollectorResult, NoData, off_loop, run_collector
from topoagent.collectors.pci import PciParseError, normalize_address
from topoagent.node.host import Host

GPUS_DIR = "/proc/driver/nvidia/gpus"
_MINOR = re.compile(r"^Device Minor:\s*(\d+)", re.MULTILINE)


def parse_device_minor(text: str) -> int | None:
    """``Device Minor: 3`` in an information file -> 3; None when the line is missing."""
    match = _MINOR.search(text)
    return int(match.group(1)) if match else None


def read_device_minors(host: Host) -> tuple[dict[str, int], tuple[str, ...]]:
    """PCI address -> /dev/nvidia minor number, for every GPU the driver lists."""
    names = host.listdir(GPUS_DIR)
    if not names:
        raise NoData(f"{GPUS_DIR}: no GPUs listed by the driver")
    minors: dict[str, int] = {}
    warnings: list[str] = []
    for name in sorted(names):
        path = f"{GPUS_DIR}/{name}/information"
        try:
            address = normalize_address(name)
        except PciParseError:
            warnings.append(f"{GPUS_DIR}/{name}: not a PCI address, skipped")
            continue
        minor = parse_device_minor(host.read_optional(path) or "")
        if minor is None:
            warnings.append(f"{path}: no 'Device Minor' line; minor number unknown")
            continue
        minors[address] = minor
    return minors, tuple(warnings)


async def collect(host: Host) -> CollectorResult[dict[str, int]]:
    async def read() -> tuple[dict[str, int], tuple[str, ...]]:
        return await off_loop(read_device_minors, host)

    return await run_collector("nvidia_driver", read)


__all__ = ["GPUS_DIR", "collect", "parse_device_minor", "read_device_minors"]
