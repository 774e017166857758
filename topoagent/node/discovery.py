"""Discovery: run every collector of the table and merge their facts into a NodeTopology.

The table of sources is ``topoagent.collectors.registry.SOURCES``, one list for
discovery's collectors and the telemetry loop's counter sources (node_exporter's
registerCollector idea): adding a source is one new module under ``collectors/`` and one
line there; ``merge`` decides what a collector's facts become in the model.

Collectors run concurrently; one that ``needs`` others waits for their results and gets
them, in the order it names them, after ``host`` (PCI needs NUMA's CPUs to place devices
whose numa_node is -1).  A collector never raises: a failure is its result's status, and
a collector that raises anyway (a bug) gets an ``error`` status of its own (base.crashed).
"""

from __future__ import annotations

from collections.abc import Coroutine
from typing import Any

from topoagent.collectors.base import CollectorResult, crashed
from topoagent.collectors.registry import COLLECTORS, COUNTER_SOURCES, Collector, check_order
from topoagent.node.host import Host
from topoagent.node.merge import merge
from topoagent.node.model import NodeTopology


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
