"""Counters and health, read on their own interval: samples, rates, and the findings
the rates support.

Counters are not topology, so they are not discovery: the agent's telemetry loop asks
each counter source (``topoagent.collectors.registry.COUNTER_SOURCES``) every
``[telemetry] interval_s``, each in its own thread with its own timeout, so one slow or failing
source never holds up the others.  What the loop keeps is a ``History``: the last two
values of every series with the monotonic time of their sample.  The served value is a
``Telemetry`` (latest values, rates, how each source fared, findings); ``/metrics``
renders only that, never NVML or sysfs.

A recorded node replays its ``telemetry.json`` (docs/snapshot-format.md): every
recorded sample, with its recorded times, so a replay reproduces the recorded rates.

The thresholds are the sources' own (each counter module declares its families and
thresholds beside its reads); this module names no metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from topoagent.collectors import ib_counters
from topoagent.collectors.base import report_bug
from topoagent.collectors.counters import (
    GAUGE,
    Context,  # where the agent and snapshot take it from
    CounterSource,
    Family,
    Labels,
    Series,
)
from topoagent.collectors.registry import COUNTER_SOURCES, FAMILIES, STUCK, THRESHOLDS
from topoagent.errors import TopoagentError
from topoagent.node.host import HostError
from topoagent.node.model import CollectorStatus, Finding
from topoagent.text import machine_json
from topoagent.vocabulary import FindingKind, Severity, Status

if TYPE_CHECKING:
    from topoagent.node.host import Host
    from topoagent.node.model import NodeTopology

Key = tuple[str, Labels]

TELEMETRY_FILE = "/telemetry.json"
MAX_TELEMETRY_BYTES = 16 << 20
# Counters NVIDIA does not keep, we do (Xid events since the agent started): a series
# that appears later started at zero (its first event is a rise).
COUNTED_FROM_ZERO = frozenset(f.name for f in FAMILIES if f.from_zero)


@dataclass(frozen=True, slots=True)
class Sample:
    source: str
    taken_at: float  # time.monotonic() of the read (a recording keeps its own)
    raw: Any = None  # None: the read failed
    error: str | None = None
    seconds: float = 0.0
    absent: bool = False  # the source is not on this node (no HCA, no NVML): quiet, not failed
    bug: bool = False  # the read failed through a fault of topoagent's own (report_bug logged it)


def rate(previous: float, current: float, seconds: float) -> float | None:
    """Per-second rise of a counter between two samples; never negative.

    A counter that went down is taken as *reset*, never as wrapped: the IB PMA counters
    saturate at their maximum rather than wrap (IBA 16.1.3; the kernel's data counters are
    64-bit), and NVML's are 64-bit; a decrease means it was cleared (``perfquery -R``, a
    driver reload, a GPU reset, a reboot).  We cannot know how much it rose before the
    reset, so that interval has no rate (None), and the next interval has one again.  A
    saturated 32-bit counter stays at its maximum: its rate reads 0, its value says why.
    """
    if seconds <= 0 or current < previous:
        return None
    return (current - previous) / seconds


@dataclass(frozen=True, slots=True)
class Reading:
    metric: str
    labels: Labels
    value: float
    rate_per_s: float | None  # None: a gauge, a first sample, or a reset


# A counter source whose last this many reads all failed, and none succeeded since the
# agent started, is a finding (``collector-error``): its collector_success 0 was the only
# trace of an NVML whose every counter read failed.  Three: one bad read (a timeout under
# load) is no finding, and at the default 10 s interval it is said within half a minute.
FAILING_READS = 3


class History:
    """The last two samples of every series, by source, with their monotonic times, and
    the failed reads of each source in a row."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, dict[Key, float]]] = {}
        self._previous: dict[str, tuple[float, dict[Key, float]]] = {}
        self.statuses: dict[str, CollectorStatus] = {}
        self.failed_in_row: dict[str, int] = {}  # source -> reads failed in a row, up to the latest

    def _failed(self, source: str, error: str | None, seconds: float, bug: bool = False) -> None:
        self.statuses[source] = CollectorStatus(source, Status.ERROR, error, seconds, bug=bug)
        self.failed_in_row[source] = self.failed_in_row.get(source, 0) + 1

    def add(self, sample: Sample, parse: Callable[[Any], list[Series]]) -> None:
        if sample.raw is None:
            # Failed: its collector_success goes to 0; the last values stay as they were.
            if sample.absent:  # not on this node: quiet, not failed
                self.statuses[sample.source] = CollectorStatus(sample.source, Status.NO_DATA, sample.error, sample.seconds)
                self.failed_in_row.pop(sample.source, None)
            else:
                self._failed(sample.source, sample.error, sample.seconds, sample.bug)
            return
        latest = self._latest.get(sample.source)
        if latest is not None and sample.taken_at <= latest[0]:
            return  # a replayed sample already taken in
        try:
            values = {(metric, labels): value for metric, labels, value in parse(sample.raw)}
        except TopoagentError as exc:  # a damaged recording: this source fails alone
            self._failed(sample.source, f"{type(exc).__name__}: {exc}", sample.seconds)
            return
        except Exception as exc:  # the parser's bug (met on odd input): this source fails alone, loudly
            self._failed(sample.source, report_bug(sample.source, exc), sample.seconds, bug=True)
            return
        if latest is not None:
            if list(values) == list(latest[1]):
                # The same series as the last sample (as nearly always): their label tuples
                # are held once, by both samples, not twice (a 128-GPU node has 22,784).
                values = dict(zip(latest[1], values.values()))
            self._previous[sample.source] = latest
        self._latest[sample.source] = (sample.taken_at, values)
        self.statuses[sample.source] = CollectorStatus(sample.source, Status.OK, None, sample.seconds)
        self.failed_in_row[sample.source] = 0

    def never_read(self) -> dict[str, int]:
        """The sources whose every read failed since the start, at least FAILING_READS of
        them: source -> how many."""
        return {source: n for source, n in self.failed_in_row.items() if n >= FAILING_READS and source not in self._latest}

    def readings(self) -> list[Reading]:
        out: list[Reading] = []
        for source, (now, values) in sorted(self._latest.items()):
            before = self._previous.get(source)
            for (metric, labels), value in values.items():
                per_s = None
                if before is not None and metric.endswith("_total"):
                    old = before[1].get((metric, labels))
                    if old is None and metric in COUNTED_FROM_ZERO:
                        old = 0.0
                    if old is not None:
                        per_s = rate(old, value, now - before[0])
                out.append(Reading(metric, labels, value, per_s))
        return out


# --- findings ------------------------------------------------------------------------


# The one list of thresholds, gathered from the sources that declare them (docs/telemetry.md,
# "Telemetry"; each key settable in [telemetry]).  Critical: placement avoids the GPU or
# link (issue #9's health flag).
THRESHOLD_KEYS = tuple(t.key for t in THRESHOLDS)


def _subject(reading: Reading, gpu_by_address: Mapping[str, str]) -> str:
    labels = dict(reading.labels)
    if "link" in labels:
        return f"GPU{labels['gpu']} NVLink {labels['link']}"
    if "gpu" in labels:
        return f"GPU{labels['gpu']}"
    if "port" in labels:
        return f"{labels['device']} port {labels['port']}"
    device = labels.get("device", "?")
    return gpu_by_address.get(device, device)


def findings_from(readings: Iterable[Reading], overrides: Mapping[str, float], gpu_by_address: Mapping[str, str]) -> tuple[Finding, ...]:
    """The findings the latest rates (and gauge values) support, one per rule and subject."""
    found: list[Finding] = []
    for rule in THRESHOLDS:
        limit = overrides.get(rule.key, rule.per_s)
        for reading in readings:
            if not rule.matches(reading.metric, reading.labels):
                continue
            gauge = rule.family.type == GAUGE
            figure = reading.value if gauge else reading.rate_per_s
            if figure is None or figure <= limit:
                continue
            subject = _subject(reading, gpu_by_address)
            extra = "".join(f" {k}={v}" for k, v in reading.labels if k in ("counter", "xid"))
            message = (f"{rule.what}:{extra} at {reading.value:g}" if gauge
                       else f"{rule.what}:{extra} rising at {figure:.3g}/s (threshold {limit:g}/s; total {reading.value:g})")
            found.append(Finding(rule.kind, rule.severity, subject, message, source="telemetry",
                                 rate_per_s=None if gauge else figure))
    return tuple(found)


def stuck_findings(readings: Iterable[Reading], gpu_by_address: Mapping[str, str]) -> tuple[Finding, ...]:
    """A warning per counter that cannot move (the sources' ``stuck`` rules): one at its
    maximum counts nothing more (its rate reads 0 however busy the port), one frozen while
    its witness rises has stopped counting.  Either way its rates mislead."""
    latest = {(r.metric, r.labels): r for r in readings}
    counter_of = {rule.family.name: rule.counter for rule in STUCK}  # a witness named as sysfs names it
    found: list[Finding] = []
    for rule in STUCK:
        for reading in latest.values():
            if reading.metric != rule.family.name:
                continue
            subject = _subject(reading, gpu_by_address)
            top = rule.saturated_at(reading.value)
            if top is not None:
                bits = 32 if top == 2**32 - 1 else 64
                found.append(Finding(
                    FindingKind.COUNTER_STUCK, Severity.WARNING, subject,
                    f"{rule.counter} is saturated at {top} (2^{bits}-1): it counts no more, so its rate reads 0 whatever "
                    f"the port carries; clear it (perfquery -R) to count again",
                    source="telemetry",
                ))
                continue
            witness = latest.get((rule.witness.name, reading.labels)) if rule.witness is not None else None
            if reading.rate_per_s == 0 and witness is not None and witness.rate_per_s:
                found.append(Finding(
                    FindingKind.COUNTER_STUCK, Severity.WARNING, subject,
                    f"{rule.counter} is frozen at {reading.value / rule.factor:.0f} while "
                    f"{counter_of.get(witness.metric, witness.metric)} rises at "
                    f"{witness.rate_per_s:.3g}/s: the counter no longer counts",
                    source="telemetry", rate_per_s=0.0,
                ))
    return tuple(found)


@dataclass(frozen=True, slots=True)
class Telemetry:
    """What the telemetry loop serves: read once per interval, rendered by /metrics."""

    read_at: float  # Unix time of the last read
    readings: tuple[Reading, ...]
    sources: tuple[CollectorStatus, ...]
    findings: tuple[Finding, ...] = ()
    families: tuple[Family, ...] = FAMILIES  # what the readings are of, as the sources declare them
    _rates: dict[Key, float | None] = field(default_factory=dict, repr=False, compare=False)

    def rate_of(self, metric: str, labels: Labels) -> float | None:
        if not self._rates:
            self._rates.update({(r.metric, r.labels): r.rate_per_s for r in self.readings})
        return self._rates.get((metric, labels))


# The IB data counters, already in bytes.
PORT_TRAFFIC = (ib_counters.TRANSMITTED_BYTES.name, ib_counters.RECEIVED_BYTES.name)


def nic_traffic(telemetry: Telemetry | None) -> dict[str, float]:
    """RDMA device -> the bytes per second its ports carry now: per port the busier
    direction, ports summed (what placement.live weighs).  Empty before two reads."""
    ports: dict[tuple[str, str], float] = {}
    for r in telemetry.readings if telemetry is not None else ():
        if r.metric in PORT_TRAFFIC and r.rate_per_s is not None:
            labels = dict(r.labels)
            port = (labels.get("device", "?"), labels.get("port", "?"))
            ports[port] = max(ports.get(port, 0.0), r.rate_per_s)
    out: dict[str, float] = {}
    for (device, _port), per_s in ports.items():
        out[device] = out.get(device, 0.0) + per_s
    return out


def failing_sources(history: History) -> tuple[Finding, ...]:
    """A warning per counter source whose every read failed (History.never_read): its
    series are missing from /metrics, and nothing else would say so.  Not critical: no
    placement needs a counter."""
    return tuple(
        Finding(FindingKind.COLLECTOR_ERROR, Severity.WARNING, source,
                f"every read of this counter source has failed ({n} in a row since the agent started), so its series "
                f"are missing; last error: {history.statuses[source].message or 'failed'}", source="telemetry")
        for source, n in sorted(history.never_read().items())
    )


def served(history: History, overrides: Mapping[str, float], node: NodeTopology | None) -> Telemetry:
    readings = tuple(history.readings())
    gpus = {g.pci_address: g.name for g in node.gpus if g.pci_address} if node else {}
    return Telemetry(time.time(), readings, tuple(history.statuses[k] for k in sorted(history.statuses)),
                     findings_from(readings, overrides, gpus) + stuck_findings(readings, gpus) + failing_sources(history))


# --- reading: live, or from a recording ------------------------------------------------


def read_live(source: CounterSource, context: Context) -> Sample:
    """One read of one source; a failure is the sample's error (never raised)."""
    from topoagent.collectors.base import NoData

    started = time.perf_counter()
    taken_at = time.monotonic()
    try:
        raw = source.read(context)
    except NoData as exc:
        return Sample(source.name, taken_at, None, str(exc), time.perf_counter() - started, absent=True)
    except (TopoagentError, OSError) as exc:  # the source could not be read: it fails alone
        return Sample(source.name, taken_at, None, f"{type(exc).__name__}: {exc}", time.perf_counter() - started)
    except Exception as exc:  # a fault of ours (a wrong NVML call): it fails alone, loudly
        return Sample(source.name, taken_at, None, report_bug(source.name, exc), time.perf_counter() - started, bug=True)
    return Sample(source.name, taken_at, raw, None, time.perf_counter() - started)


def recorded_samples(host: Host) -> list[Sample] | None:
    """A recording's telemetry.json as samples, in order; None when it has none."""
    if host.live or not host.exists(TELEMETRY_FILE):
        return None
    try:
        document = machine_json(host.read_bytes(TELEMETRY_FILE, MAX_TELEMETRY_BYTES))
        samples: list[Sample] = []
        for entry in document.get("samples", []):
            taken_at = float(entry["monotonic_s"])
            for name, raw in sorted((entry.get("sources") or {}).items()):
                samples.append(Sample(name, taken_at, raw))
            for name, error in sorted((entry.get("errors") or {}).items()):
                samples.append(Sample(name, taken_at, None, str(error)))
            for name, why in sorted((entry.get("no_data") or {}).items()):
                samples.append(Sample(name, taken_at, None, str(why), absent=True))
    except (OSError, ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
        # A FIFO, a truncated file, a list where an object goes: the recording's fault,
        # said as such (a one-shot command prints it; the agent's loop counts it).
        raise HostError(f"{TELEMETRY_FILE.lstrip('/')}: unreadable counter recording: {type(exc).__name__}: {str(exc)[:200]}") from None
    if host.recording is not None:
        host.recording.telemetry = document  # re-recording a recording keeps its samples
    return samples


def replayed(host: Host, node: NodeTopology | None, overrides: Mapping[str, float] | None = None) -> Telemetry | None:
    """A recording's telemetry as the agent serves it after replaying every sample (its
    recorded rates): what one-shot commands on a snapshot read.  None without one."""
    samples = recorded_samples(host)
    if samples is None:
        return None
    parsers = {s.name: s.parse for s in COUNTER_SOURCES}
    history = History()
    for sample in samples:
        if sample.source in parsers:
            history.add(sample, parsers[sample.source])
    return served(history, overrides or {}, node)


def sample_document(rounds: list[list[Sample]]) -> dict:
    """Rounds of live samples -> telemetry.json (what ``topoagent snapshot`` writes)."""
    out = []
    for samples in rounds:
        taken = min((s.taken_at for s in samples), default=0.0)
        out.append({
            "monotonic_s": round(taken, 6),
            "sources": {s.source: s.raw for s in samples if s.raw is not None},
            "errors": {s.source: s.error for s in samples if s.raw is None and not s.absent},
            "no_data": {s.source: s.error for s in samples if s.raw is None and s.absent},
        })
    return {"schema": 1, "samples": out}
