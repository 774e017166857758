"""What the probe worker reports, typed: one figure per result line, one skip record.

The worker (``topoagent.probes.worker``) builds these values and writes them as JSON
lines with ``to_record()``; the runner reads each line back once with
``parse_record`` and hands typed values to everything downstream (overlay, schedule,
/topology, /metrics, ``topoagent probe``).  A line's field names are the dataclass
fields below (``WIRE_NAMES`` where the wire spells one differently), so the two sides
cannot drift apart.  Nothing here imports torch: the agent imports this module.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

from topoagent.errors import TopoagentError
from topoagent.vocabulary import ProbeKind, Unit


class RecordType(enum.StrEnum):
    """The ``type`` of each line the worker writes."""

    HELLO = "hello"  # first line: backend, torch version, devices
    RESULT = "result"  # one figure
    SKIPPED = "skipped"  # a measurement this node cannot do
    FAILURE = "failure"  # last line of a failed run
    DONE = "done"  # last line of a good run


class FailureKind(enum.StrEnum):
    """Why a probe round ended early: what the worker reports, then what the runner adds."""

    CRASH = "crash"
    OOM = "oom"
    CUDA_ERROR = "cuda_error"
    UNAVAILABLE = "unavailable"  # no torch, no CUDA, the worker would not start
    PLAN_ERROR = "plan_error"
    TIMEOUT = "timeout"  # the runner killed it
    BACKOFF = "backoff"  # not started: failed rounds in a row


class FigureKey(NamedTuple):
    """What one figure measures; the newest figure per key is the one served."""

    kind: ProbeKind
    src: int | None
    dst: int | None
    device: int | None
    numa_node: int | None


class MalformedRecord(TopoagentError, ValueError):
    """A line from the worker that does not have the shape of its type."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeFigure:
    """One result line: a measured figure (median and spread over repetitions) or, for
    ``peer_access``, whether P2P is available.

    GPU numbers (``src``, ``dst``, ``device``) are CUDA indices in PCI bus order, the
    same numbers nvidia-smi and NVML use.  ``median`` .. ``maximum`` are in ``unit``.
    """

    measurement_id: int  # the plan's measurement this came from
    kind: ProbeKind
    src: int | None = None  # pair kinds: copied from this GPU
    dst: int | None = None  # pair kinds: to this GPU
    device: int | None = None  # local_copy, h2d, d2h: the one GPU
    numa_node: int | None = None  # h2d, d2h: the host memory's NUMA node
    direction: str | None = None  # "0->1", "node0->3", "3->node0", "3"
    concurrent: bool | None = None  # p2p_bidir: measured while the other direction ran
    size_bytes: int | None = None  # bytes per copy
    repetitions: int | None = None  # samples behind median and spread
    warmup: int | None = None  # batches run and thrown away first
    loop: int | None = None  # copies per timed sample
    unit: Unit | None = None
    median: float | None = None
    p10: float | None = None
    p90: float | None = None
    minimum: float | None = None
    maximum: float | None = None
    available: bool | None = None  # peer_access: P2P possible
    duration_s: float | None = None  # wall time of this measurement in the worker
    backend: str | None = None  # "cuda" or "cpu"
    received_at: float | None = None  # Unix time the agent read the line (not on the wire from the worker)

    @property
    def key(self) -> FigureKey:
        return FigureKey(self.kind, self.src, self.dst, self.device, self.numa_node)

    @property
    def median_gbps(self) -> float | None:
        """The median when it is a bandwidth, else None."""
        return self.median if self.unit is Unit.GBPS else None

    @property
    def median_latency_s(self) -> float | None:
        """The median when it is a latency, in seconds, else None."""
        return self.median * 1e-6 if self.unit is Unit.MICROSECONDS and self.median is not None else None

    def to_record(self) -> dict[str, Any]:
        """The worker's line for this figure (``received_at`` added once the agent has it)."""
        return {"type": RecordType.RESULT.value, **_present_fields(self)}


@dataclass(frozen=True, slots=True, kw_only=True)
class ProbeSkip:
    """A measurement this node cannot do (no such device, a NUMA node without CPUs)."""

    measurement_id: int
    kind: ProbeKind
    reason: str

    def to_record(self) -> dict[str, Any]:
        return {"type": RecordType.SKIPPED.value, **_present_fields(self)}


@dataclass(frozen=True, slots=True)
class WorkerFailure:
    """The worker's last line when its run failed."""

    failure: FailureKind
    message: str

    def to_record(self) -> dict[str, Any]:
        return {"type": RecordType.FAILURE.value, **_present_fields(self)}


# Where the wire's name differs from the field's (short names there, clear names here).
WIRE_NAMES = {"measurement_id": "id", "minimum": "min", "maximum": "max"}


def _present_fields(value: ProbeFigure | ProbeSkip | WorkerFailure) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in dataclasses.fields(value):
        item = getattr(value, f.name)
        if item is not None:
            out[WIRE_NAMES.get(f.name, f.name)] = item.value if isinstance(item, enum.Enum) else item
    return out


# --- reading a line back -------------------------------------------------------------

_INT_FIELDS = ("src", "dst", "device", "numa_node", "size_bytes", "repetitions", "warmup", "loop")
_FLOAT_FIELDS = ("median", "p10", "p90", "minimum", "maximum", "duration_s", "received_at")
_BOOL_FIELDS = ("concurrent", "available")
_STR_FIELDS = ("direction", "backend")


def _wire(name: str) -> str:
    return WIRE_NAMES.get(name, name)


def _int(record: Mapping[str, Any], name: str) -> int | None:
    return None if record.get(_wire(name)) is None else _required_int(record, name)


def _required_int(record: Mapping[str, Any], name: str) -> int:
    value = record.get(_wire(name))
    if isinstance(value, bool) or not isinstance(value, int):
        raise MalformedRecord(f"{_wire(name)} must be an integer, not {value!r}")
    return value


def _float(record: Mapping[str, Any], name: str) -> float | None:
    value = record.get(_wire(name))
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise MalformedRecord(f"{_wire(name)} must be a number, not {value!r}")
    return float(value)


def _bool(record: Mapping[str, Any], name: str) -> bool | None:
    value = record.get(_wire(name))
    if value is not None and not isinstance(value, bool):
        raise MalformedRecord(f"{_wire(name)} must be true or false, not {value!r}")
    return value


def _str(record: Mapping[str, Any], name: str) -> str | None:
    value = record.get(_wire(name))
    if value is not None and not isinstance(value, str):
        raise MalformedRecord(f"{_wire(name)} must be a string, not {value!r}")
    return value


def _kind(record: Mapping[str, Any]) -> ProbeKind:
    value = record.get("kind")
    if value not in set(ProbeKind):
        raise MalformedRecord(f"kind must be one of {', '.join(ProbeKind)}, not {value!r}")
    return ProbeKind(value)


def parse_figure(record: Mapping[str, Any]) -> ProbeFigure:
    """A ``result`` line as a figure; MalformedRecord names the first thing wrong."""
    measurement_id = _required_int(record, "measurement_id")
    kind = _kind(record)
    values: dict[str, Any] = {name: _int(record, name) for name in _INT_FIELDS}
    values |= {name: _float(record, name) for name in _FLOAT_FIELDS}
    values |= {name: _bool(record, name) for name in _BOOL_FIELDS}
    values |= {name: _str(record, name) for name in _STR_FIELDS}
    unit = record.get("unit")
    if unit is not None:
        try:
            values["unit"] = Unit(unit)
        except ValueError:
            raise MalformedRecord(f"unit must be one of {', '.join(Unit)}, not {unit!r}") from None
    needed: tuple[str, ...] = ("src", "dst") if kind.is_pair else ("device", "numa_node") if kind.is_host else ("device",)
    needed += ("available",) if kind is ProbeKind.PEER_ACCESS else ("median",)
    for name in needed:
        if values.get(name) is None:
            raise MalformedRecord(f"a {kind} result needs {_wire(name)}")
    return ProbeFigure(measurement_id=measurement_id, kind=kind, **values)


def parse_skip(record: Mapping[str, Any]) -> ProbeSkip:
    """A ``skipped`` line; MalformedRecord names the first thing wrong."""
    measurement_id = _required_int(record, "measurement_id")
    reason = _str(record, "reason")
    if reason is None:
        raise MalformedRecord("a skipped line needs a reason")
    return ProbeSkip(measurement_id=measurement_id, kind=_kind(record), reason=reason)


def parse_failure(record: Mapping[str, Any]) -> WorkerFailure:
    """A ``failure`` line; a kind this agent does not know reads as a crash."""
    kind = record.get("failure")
    message = record.get("message")
    return WorkerFailure(
        FailureKind(kind) if kind in set(FailureKind) else FailureKind.CRASH,
        message if isinstance(message, str) else "",
    )
