"""Discovery: run every collector listed here and merge their facts into a NodeTopology.

``COLLECTORS`` is the one list of sources (node_exporter's registerCollector idea).  Adding
a source is one new module under ``collectors/`` with an async ``collect(host, *needed)``
and one line here; ``merge`` decides what its facts become in the model.

Collectors run concurrently; one that ``needs`` others waits for their results and gets
them, in the order it names them, after ``host`` (PCI needs NUMA's CPUs to place devices
whose numa_node is -1).  A collector never raises: a failure is its result's status, and
a collector that raises anyway (a bug) gets an ``error`` status of its own (base.crashed).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from topoagent.collectors import (
    cpu,
    gpudirect,
    ib_neighbours,
    infiniband,
    lldp,
    netdev,
    numa,
    nvidia_driver,
    nvidia_smi,
    nvml,
    pci,
)
from topoagent.collectors.base import CollectorResult, crashed
from topoagent.node.host import Host
from topoagent.node.merge import merge
from topoagent.node.model import NodeTopology

if TYPE_CHECKING:
    import asyncio

    from topoagent.telemetry import Context, CounterSource

    COUNTER_SOURCES: tuple[CounterSource, ...]  # built on first use, see __getattr__ below

Collect = Callable[..., Coroutine[Any, Any, CollectorResult[Any]]]


@dataclass(frozen=True, slots=True)
class Collector:
    """One source in the table: its name, its collect function and the sources it needs."""

    name: str  # the name its CollectorResult carries, the key merge reads it by
    collect: Collect  # collect(host, *results of ``needs``)
    needs: tuple[str, ...] = ()
    optional: bool = False  # its failure is a warning (as its collect() says to run_collector)


# In the order the node's collector statuses are reported; a collector comes after
# those it needs.
COLLECTORS: tuple[Collector, ...] = (
    Collector("numa", numa.collect),
    Collector("cpu", cpu.collect, needs=("numa",)),
    Collector("pci", pci.collect, needs=("numa",)),
    Collector("infiniband", infiniband.collect),
    Collector("interfaces", netdev.collect),
    Collector("gpudirect", gpudirect.collect),
    Collector("nvml", nvml.collect),
    Collector("nvidia_driver", nvidia_driver.collect),
    Collector("nvidia_smi", nvidia_smi.collect),
    # Optional: what is at the other end of each port (the leaf switches, the rails).
    Collector(ib_neighbours.NAME, ib_neighbours.collect, needs=("infiniband",), optional=True),
    Collector(lldp.NAME, lldp.collect, optional=True),
)


def _tracked_pcie(context: Context) -> list[str]:
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


def _nvml_counters(context: Context) -> Any:
    if context.host.live:
        return context.nvml.read()
    from topoagent.collectors.base import NoData

    raise NoData(nvml.NO_NVML + " (this recording has no telemetry.json)")


# Counter sources, read by the agent's telemetry loop on their own interval (not
# discovery: see topoagent/telemetry.py).  Each is a raw read and a pure parser.  Built on
# first use (module __getattr__): one-shot commands never read counters, and need not
# import the telemetry module nor the counter readers (aer, ib_counters).
def _counter_sources() -> tuple[CounterSource, ...]:
    from topoagent.collectors import aer, ib_counters
    from topoagent.telemetry import CounterSource

    return (
        CounterSource("infiniband_counters", lambda c: ib_counters.read_raw(c.host), ib_counters.parse),
        CounterSource("pcie_aer", lambda c: aer.read_raw(c.host, _tracked_pcie(c)), aer.parse),
        CounterSource("nvml_counters", _nvml_counters, nvml.parse_counters),
    )


def __getattr__(name: str) -> Any:
    if name == "COUNTER_SOURCES":
        globals()[name] = sources = _counter_sources()
        return sources
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_order(collectors: tuple[Collector, ...]) -> None:
    """Refuse a table where a collector needs one that is missing or listed after it."""
    seen: set[str] = set()
    for entry in collectors:
        missing = [name for name in entry.needs if name not in seen]
        if missing:
            raise ValueError(f"collector {entry.name} needs {', '.join(missing)}, not listed before it")
        if entry.name in seen:
            raise ValueError(f"collector {entry.name} is listed twice")
        seen.add(entry.name)


check_order(COLLECTORS)


async def run_collectors(
    host: Host, collectors: tuple[Collector, ...] = COLLECTORS
) -> dict[str, CollectorResult[Any]]:
    """Every collector's result by name, in table order; each starts once its needs are done."""
    import asyncio  # the service's path; one-shot commands use discover_sync

    tasks: dict[str, asyncio.Task[CollectorResult[Any]]] = {}

    async def run(entry: Collector) -> CollectorResult[Any]:
        needed = [await tasks[name] for name in entry.needs]
        try:
            return await entry.collect(host, *needed)
        except Exception as exc:  # raised outside run_collector's read: still this source's failure alone
            return crashed(entry.name, exc, optional=entry.optional)

    for entry in collectors:
        tasks[entry.name] = asyncio.ensure_future(run(entry))
    await asyncio.gather(*tasks.values())
    return {name: task.result() for name, task in tasks.items()}


async def discover(host: Host) -> NodeTopology:
    """Run every collector and merge what they saw into one NodeTopology."""
    results = await run_collectors(host)
    return merge(results, hostname=host.hostname())


def discover_sync(host: Host) -> NodeTopology:
    """``discover`` without an event loop, for one-shot commands.

    Importing asyncio (and the ssl it pulls in) took a third of `topoagent discover`'s
    start-up.  Collectors run one after another, in table order, each doing its reads in
    place (``off_loop``): on a replayed node that is as fast as threads, which on a busy
    2-core box spent more time handing over the interpreter lock than reading.
    """
    results = run_collectors_sync(host)
    return merge(results, hostname=host.hostname())


def run_collectors_sync(
    host: Host, collectors: tuple[Collector, ...] = COLLECTORS
) -> dict[str, CollectorResult[Any]]:
    """``run_collectors`` one collector at a time; the table lists needs before their users."""
    results: dict[str, CollectorResult[Any]] = {}
    for entry in collectors:
        try:
            results[entry.name] = finish(entry.collect(host, *[results[name] for name in entry.needs]))
        except Exception as exc:  # as run_collectors: one source's bug never stops discovery
            results[entry.name] = crashed(entry.name, exc, optional=entry.optional)
    return results


def finish(coroutine: Coroutine[Any, Any, CollectorResult[Any]]) -> CollectorResult[Any]:
    """Run a collector's coroutine that never suspends (no event loop: it reads in place)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        result: CollectorResult[Any] = done.value
        return result
    coroutine.close()
    raise RuntimeError("a collector waited on an event loop; use discover() under asyncio")


__all__ = ["COLLECTORS", "COUNTER_SOURCES", "Collector", "check_order", "discover", "discover_sync", "run_collectors", "run_collectors_sync"]
