"""PCIe Advanced Error Reporting counters from sysfs, for the PCIe devices we track.

``/sys/bus/pci/devices/<addr>/aer_dev_{correctable,nonfatal,fatal}`` each hold one
"Name count" line per error type and a ``TOTAL_ERR_COR`` / ``TOTAL_ERR_NONFATAL`` /
``TOTAL_ERR_FATAL`` line (drivers/pci/pcie/aer.c).  We export the totals.
"""

from __future__ import annotations

from collections.abc import Iterable

from topoagent.collectors.base import NoData
from topoagent.collectors.counters import COUNTER, Context, CounterSource, Family, Series, Threshold, label_is
from topoagent.node.host import Host
from topoagent.vocabulary import FindingKind, MetricsDetail, Severity

PCI_DEVICES = "/sys/bus/pci/devices"
SEVERITIES = {"aer_dev_correctable": "correctable", "aer_dev_nonfatal": "nonfatal", "aer_dev_fatal": "fatal"}

Raw = dict[str, str]  # "0000:07:00.0/aer_dev_fatal" -> the file's text

# Correctable errors were corrected: counted, never judged; served with [metrics] detail
# "errors" only (series budget), the judged non-fatal and fatal ones always.
ERRORS = Family("pcie_aer_errors_total",
                "PCIe AER errors a tracked device (GPU, NIC, bridge above them) reported, by severity "
                "(correctable with [metrics] detail \"errors\").",
                COUNTER, ("device", "severity"), detail=MetricsDetail.ERRORS, default=(("severity", frozenset({"nonfatal", "fatal"})),))
FAMILIES = (ERRORS,)
THRESHOLDS = (
    Threshold("aer_nonfatal_per_s", ERRORS, label_is("severity", "nonfatal"), 0.0,
              FindingKind.PCIE_AER_ERRORS, Severity.WARNING, "PCIe AER non-fatal errors"),
    Threshold("aer_fatal_per_s", ERRORS, label_is("severity", "fatal"), 0.0,
              FindingKind.PCIE_AER_ERRORS, Severity.CRITICAL, "PCIe AER fatal errors"),
)


def tracked_pcie(context: Context) -> list[str]:
    """The PCIe devices whose AER counters we read: GPUs, NICs, and the bridges above them."""
    node = context.node
    if node is None:
        return []
    addresses = [g.pci_address for g in node.gpus if g.pci_address] + [n.pci_address for n in node.nics if n.pci_address]
    if node.pci is not None:
        for address in list(addresses):
            device = node.pci.get(address)
            addresses.extend(device.bridges if device else ())
    return addresses


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
            series.append((ERRORS.name, (("device", address), ("severity", SEVERITIES[name])), float(total)))
    return series


def read(context: Context) -> Raw:
    return read_raw(context.host, tracked_pcie(context))


SOURCE = CounterSource("pcie_aer", read, parse, FAMILIES, THRESHOLDS)
