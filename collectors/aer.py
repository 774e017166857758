"""PCIe Advanced Error Reporting counters from sysfs, for the PCIe devices we track.

``/sys/bus/pci/devices/<addr>/aer_dev_{correctable,nonfatal,fatal}`` each hold one
"Name count" line per error type and a ``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` /
``TOTAL_ERR_FATAL`` line (drivers/pci/pcie/aer.c).  We export the totals.
"""

from __future__ import annotations

from collections.abc import Iterable

from topoagent.collectors.base import NoData
from topoagent.node.host import Host

PCI_DEVICES = "/sys/bus/pci/devices"
SEVERITIES = {"aer_dev_correctable": "correctable", "aer_dev_nonfatal": "nonfatal", "aer_dev_fatal": "fatal"}

Raw = dict[str, str]  # "0000:07:00.0/aer_dev_fatal" -> the file's text
Series = tuple[str, tuple[tuple[str, str], ...], float]


def read_raw(host: Host, addresses: Iterable[str]) -> Raw:
    raw: Raw = {}
    for address in sorted(set(addresses)):
        for name in SEVERITIES:
            text = host.read_optional(f"{PCI_DEVICES}/{address}/{name}")
            if text is not None:
                raw[f"{address}/{name}"] = text
    if not raw:
        raise NoData("no AER counters in sysfs (kernel without CONFIG_PCIEAER, or no PCIe devices tracked)")
    return raw


def parse_total(text: str) -> int | None:
    """The TOTAL_ERR_* line of one aer_dev_* file; without one, the sum of the others."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        name, _, count = line.strip().rpartition(" ")
        try:
            counts[name.strip()] = int(count)
        except ValueError:
            continue
    totals = [v for k, v in counts.items() if k.startswith("TOTAL_ERR_")]
    if totals:
        return totals[0]
    return sum(counts.values()) if counts else None


def parse(raw: Raw) -> list[Series]:
    series: list[Series] = []
    for key, text in sorted(raw.items()):
        address, _, name = key.partition("/")
        total = parse_total(text)
        if total is not None and name in SEVERITIES:
            series.append(("pcie_aer_errors_total", (("device", address), ("severity", SEVERITIES[name])), float(total)))
    return series
