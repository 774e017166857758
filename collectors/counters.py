"""What a counter source declares: its read, its pure parser, the metric families it owns
and the thresholds that turn their rates into findings.

A collector owns its descriptors (node_exporter's habit): each counter module writes a
metric's name, help, type, labels and unit once, beside the reads that fill it, and its
parser emits series of those families only.  The Prometheus exporter walks the families
the sources declare; the telemetry loop takes its thresholds from them
(``topoagent.collectors.registry`` gathers both from the one table of sources).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from topoagent.vocabulary import FindingKind, Severity

if TYPE_CHECKING:
    from topoagent.collectors.nvml import LiveCounterReader
    from topoagent.node.host import Host
    from topoagent.node.model import NodeTopology

Labels = tuple[tuple[str, str], ...]
Series = tuple[str, Labels, float]  # (metric without the topoagent_ prefix, labels, value)

COUNTER = "counter"  # only goes up; Prometheus computes its rate (the name ends in _total)
GAUGE = "gauge"


@dataclass(frozen=True, slots=True)
class Family:
    """One metric family a counter source owns, as /metrics exposes it (after ``topoagent_``)."""

    name: str  # after topoagent_; its first word is its subsystem (infiniband, nvlink, pcie, gpu)
    help: str
    type: str  # COUNTER or GAUGE
    labels: tuple[str, ...]  # in the order the parser writes them
    unit: str = ""  # the base unit the name carries ("bytes", "celsius"); "" for a count
    # The agent counts it since it started (Xid events): a series that appears later
    # started at zero, so its first event is a rise.
    from_zero: bool = False
    # The /metrics series budget (issue #29): a family with a ``detail`` (a MetricsDetail
    # value) is served whole only when ``[metrics] detail`` names it; otherwise only its
    # series ``default`` matches (label -> values; none when empty): the counters the agent
    # judges, which its alert rules read.  The telemetry loop reads and judges every series.
    detail: str = ""
    default: tuple[tuple[str, frozenset[str]], ...] = ()

    @property
    def subsystem(self) -> str:
        return self.name.split("_", 1)[0]

    def served(self, labels: Labels, detail: frozenset[str]) -> bool:
        """Whether /metrics serves this series of the family with ``[metrics] detail``."""
        if not self.detail or self.detail in detail:
            return True
        have = dict(labels)
        return bool(self.default) and all(have.get(k) in v for k, v in self.default)


@dataclass(frozen=True, slots=True)
class Threshold:
    """A rule: a series of ``family`` whose labels match, rising faster than ``per_s``
    (or, for a gauge, above it), raises a finding of ``kind`` and ``severity``."""

    key: str  # its [telemetry] config key
    family: Family
    match: Mapping[str, frozenset[str]]  # label -> values it must have
    per_s: float  # default; 0 means any rise
    kind: FindingKind
    severity: Severity
    what: str
    # Where the judged family is served only with [metrics] detail: the family the default
    # page serves the same events in (the Xids by class for the Xids one by one).
    summed_in: Family | None = None

    @property
    def metric(self) -> str:
        return self.family.name

    def matches(self, metric: str, labels: Labels) -> bool:
        have = dict(labels)
        return metric == self.family.name and all(have.get(k) in v for k, v in self.match.items())


# Where counters stop: the IB PMA counters saturate at their maximum instead of wrapping
# (IBA 16.1.3), 32-bit on old HCAs (qib), 64-bit in the kernel's extended data counters.
SATURATED_AT = (2**32 - 1, 2**64 - 1)


@dataclass(frozen=True, slots=True)
class Stuck:
    """A counter that cannot move, said as a finding naming it: saturated (its series reads
    ``factor`` x 2^32-1 or 2^64-1), or frozen while ``witness`` on the same labels rises
    (packets sent while the data counter stands still)."""

    family: Family
    counter: str  # its name where it is read ("port_xmit_data")
    factor: int = 1  # the series is the counter times this (4-byte words -> bytes)
    witness: Family | None = None

    def saturated_at(self, value: float) -> int | None:
        """The counter's maximum it stands at (2^32-1 or 2^64-1), or None.  Series are
        floats: exact at 32 bits, within float precision (2^11 counts) at 64."""
        for top in SATURATED_AT:
            if value == float(top * self.factor):
                return top
        return None


def label_is(label: str, *values: str) -> Mapping[str, frozenset[str]]:
    """A threshold's ``match``: ``label`` has one of ``values``."""
    return {label: frozenset(values)}


@dataclass(frozen=True, slots=True)
class Context:
    """What a counter source may read: the node (which devices we track) and NVML."""

    host: Host
    node: NodeTopology | None
    nvml: LiveCounterReader


@dataclass(frozen=True, slots=True)
class CounterSource:
    """A source the telemetry loop reads on its own interval (not discovery)."""

    name: str  # its collector_success label, and its key in telemetry.json
    read: Callable[[Context], Any]  # live: the source's raw answer (JSON-able), blocking
    parse: Callable[[Any], list[Series]]  # raw answer -> series of its families (pure)
    families: tuple[Family, ...]
    thresholds: tuple[Threshold, ...] = ()
    stuck: tuple[Stuck, ...] = ()  # its counters that can saturate or freeze


__all__ = ["COUNTER", "GAUGE", "SATURATED_AT", "Context", "CounterSource", "Family", "Labels", "Series", "Stuck", "Threshold",
           "label_is"]
