"""The one table of data sources: discovery's collectors and the telemetry loop's counter
sources alike (node_exporter's registerCollector idea).

Adding a source is one new module under ``collectors/`` and one line in ``SOURCES``:
- a discovery collector has an async ``collect(host, *needed)``; one that ``needs``
  others is listed after them and gets their results, in the order it names them
  (PCI needs NUMA's CPUs to place devices whose numa_node is -1); ``merge`` decides what
  its facts become in the model;
- a counter source is a ``CounterSource`` (collectors/counters.py): a raw read, a pure
  parser, the metric families it owns and its thresholds, declared in its own module.

``topoagent.node.discovery`` runs the collectors, ``topoagent.service.telemetry`` reads the counter
sources and applies the thresholds, and the Prometheus exporter walks ``FAMILIES``; none
of them lists a source or names a metric of its own.  This module imports only the
sources, so neither of those imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any

from topoagent.collectors import (
    aer,
    cpu,
    gpudirect,
    ib_counters,
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
from topoagent.collectors.base import CollectorResult
from topoagent.collectors.counters import COUNTER, GAUGE, CounterSource, Family, Stuck, Threshold
from topoagent.vocabulary import MetricsDetail

Collect = Callable[..., Coroutine[Any, Any, CollectorResult[Any]]]


@dataclass(frozen=True, slots=True)
class Collector:
    """A discovery source: its name, its collect function and the sources it needs."""

    name: str  # the name its CollectorResult carries, the key merge reads it by
    collect: Collect  # collect(host, *results of ``needs``)
    needs: tuple[str, ...] = ()
    optional: bool = False  # its failure is a warning (as its collect() says to run_collector)


Source = Collector | CounterSource

# Discovery's collectors in the order the node's collector statuses are reported (a
# collector comes after those it needs), then the counter sources: the first to declare a
# subsystem's families places that subsystem on /metrics (see ``by_subsystem``).
SOURCES: tuple[Source, ...] = (
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
    # Counter sources, read by the agent's telemetry loop on their own interval.
    ib_counters.SOURCE,
    nvml.COUNTERS,
    aer.SOURCE,
)


def check_order(collectors: Iterable[Collector]) -> None:
    """Refuse a table where a collector needs one that is missing or listed after it."""
    seen: set[str] = set()
    for entry in collectors:
        missing = [name for name in entry.needs if name not in seen]
        if missing:
            raise ValueError(f"collector {entry.name} needs {', '.join(missing)}, not listed before it")
        if entry.name in seen:
            raise ValueError(f"collector {entry.name} is listed twice")
        seen.add(entry.name)


def check_declarations(sources: Iterable[CounterSource]) -> None:
    """Refuse two owners of one family or threshold key, a threshold (or stuck-counter rule)
    on a family its source does not own, and a family whose type and name disagree (a
    counter ends in _total)."""
    owner: dict[str, str] = {}
    keys: set[str] = set()
    for source in sources:
        for family in source.families:
            if family.name in owner:
                raise ValueError(f"metric family {family.name} is declared by {owner[family.name]} and {source.name}")
            owner[family.name] = source.name
            if family.type not in (COUNTER, GAUGE) or (family.type == COUNTER) != family.name.endswith("_total"):
                raise ValueError(f"metric family {family.name}: a {family.type} (a counter's name, and only a counter's, ends in _total)")
            if family.unit and f"_{family.unit}" not in family.name:
                raise ValueError(f"metric family {family.name}: its name does not carry its unit {family.unit}")
            if family.detail and family.detail not in {d.value for d in MetricsDetail}:
                raise ValueError(f"metric family {family.name}: detail {family.detail!r} is no [metrics] detail")
            if any(label not in family.labels for label, _ in family.default) or (family.default and not family.detail):
                raise ValueError(f"metric family {family.name}: its default series are chosen by labels it lacks, or it has no detail")
        for rule in source.thresholds:
            if rule.family not in source.families:
                raise ValueError(f"threshold {rule.key} of {source.name} is on {rule.family.name}, a family {source.name} does not declare")
            # What the agent judges is served by default (its alert rules read it): a family
            # served by default only in part (``default``) must cover every judged series, and
            # one served only with a detail needs a default family that sums its events.
            default = dict(rule.family.default)
            if default and not all(values <= default.get(label, frozenset()) for label, values in rule.match.items()):
                raise ValueError(f"threshold {rule.key} judges series of {rule.family.name} that /metrics does not serve by default")
            if rule.family.detail and not default and (rule.summed_in is None or rule.summed_in.detail
                                                        or rule.summed_in not in source.families):
                raise ValueError(f"threshold {rule.key} judges {rule.family.name}, which /metrics serves only with a detail, "
                                 "and names no family of its source served by default that sums it")
            if rule.key in keys:
                raise ValueError(f"threshold key {rule.key} is declared twice")
            keys.add(rule.key)
        for stuck in source.stuck:
            if stuck.family not in source.families or (stuck.witness is not None and stuck.witness not in source.families):
                raise ValueError(f"stuck-counter rule {stuck.counter} of {source.name} is on a family {source.name} does not declare")


def by_subsystem(families: Iterable[Family]) -> tuple[Family, ...]:
    """Families grouped by subsystem (their name's first word), subsystems in the order they
    first appear: /metrics keeps a subsystem's families together whichever source declares
    them (PCIe replays from NVML beside PCIe AER from sysfs)."""
    listed = list(families)
    rank: dict[str, int] = {}
    for family in listed:
        rank.setdefault(family.subsystem, len(rank))
    return tuple(sorted(listed, key=lambda f: rank[f.subsystem]))  # stable: declared order within one


COLLECTORS: tuple[Collector, ...] = tuple(s for s in SOURCES if isinstance(s, Collector))
COUNTER_SOURCES: tuple[CounterSource, ...] = tuple(s for s in SOURCES if isinstance(s, CounterSource))
check_order(COLLECTORS)
if len({s.name for s in SOURCES}) != len(SOURCES):  # one collector_success label each
    raise ValueError("two sources share a name")
check_declarations(COUNTER_SOURCES)

# Every metric family a counter source owns, in /metrics order.
FAMILIES: tuple[Family, ...] = by_subsystem(f for s in COUNTER_SOURCES for f in s.families)
_RANK = {family.subsystem: n for n, family in reversed(list(enumerate(FAMILIES)))}
# Every threshold, applied (and its findings listed) by subsystem as the families are.
THRESHOLDS: tuple[Threshold, ...] = tuple(
    sorted((t for s in COUNTER_SOURCES for t in s.thresholds), key=lambda t: _RANK[t.family.subsystem])
)

# Every counter that can saturate or freeze, as its source declares it.
STUCK: tuple[Stuck, ...] = tuple(rule for s in COUNTER_SOURCES for rule in s.stuck)

__all__ = ["COLLECTORS", "COUNTER_SOURCES", "FAMILIES", "SOURCES", "STUCK", "THRESHOLDS", "Collector", "Source", "by_subsystem",
           "check_declarations", "check_order"]
