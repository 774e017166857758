"""What the agent serves: one immutable snapshot of the node, swapped whole, and beside
it (``Served``) what the service's loops publish for the doors: busy GPUs, leases,
capacity figures, probe and request counts.

The snapshot *is* discovery's typed ``NodeTopology`` plus the agent's own state (the
matrix with the probes' measurements overlaid, their figures and findings, how each
collector fared, staleness); there is no second set of types for serving.  Readers (HTTP
handlers, the Prometheus collector) take the service's ``served()`` once and read only that
value, so they never see half of one discovery and half of the next.  The JSON body, its ETag and
the nvidia-smi-style text are computed once per snapshot, not per request.
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from topoagent.node.findings import placement_blockers, placement_refusals
from topoagent.node.matrix import DistanceMatrix
from topoagent.node.model import CollectorStatus, Finding, NodeTopology
from topoagent.probes.figures import ProbeFigure
from topoagent.service.leases import Holding, Lease, boot_clock
from topoagent.service.telemetry import Telemetry

if TYPE_CHECKING:
    from topoagent.probes.runner import ProbeRound
    from topoagent.service.capacity import Capacity


@dataclass(frozen=True)
class Snapshot:
    version: int  # increases with every swap
    node: NodeTopology  # discovery's value
    matrix: DistanceMatrix  # the node's matrix, measurements overlaid (placement reads it)
    built_at: float  # Unix time the node's facts were collected
    # How each source fared in the latest run, which may be newer than ``node`` (stale).
    collectors: tuple[CollectorStatus, ...]
    last_success_at: Mapping[str, float | None]  # collector name -> Unix time
    probe_figures: tuple[ProbeFigure, ...] = ()  # newest figure per measurement
    probe_findings: tuple[Finding, ...] = ()
    # GPU sets of the probe targets whose newest figures were taken under load (not judged).
    probes_under_load: frozenset[frozenset[int]] = frozenset()
    stale: bool = False  # the last discovery failed; these facts are older
    error: str | None = None  # why the last discovery failed
    failed_at: float | None = None
    # The counters' last read (telemetry loop), swapped in every [telemetry] interval_s.
    telemetry: Telemetry | None = None
    _cache: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def marked_stale(self, version: int, error: str, failed_at: float, collectors: tuple[CollectorStatus, ...]) -> Snapshot:
        return replace(self, version=version, stale=True, error=error, failed_at=failed_at, collectors=collectors, _cache={})

    def with_probes(
        self, version: int, matrix: DistanceMatrix, figures: tuple[ProbeFigure, ...], findings: tuple[Finding, ...],
        under_load: frozenset[frozenset[int]] | None = None,
    ) -> Snapshot:
        """The same discovery state with new measurements overlaid."""
        loaded = self.probes_under_load if under_load is None else under_load
        return replace(
            self, version=version, matrix=matrix, probe_figures=figures, probe_findings=findings, probes_under_load=loaded, _cache={},
        ).with_health()

    def taken_under_load(self, figure: ProbeFigure) -> bool:
        """Whether this figure was taken under load (so it was not judged)."""
        from topoagent.probes.overlay import target_gpus

        return target_gpus(figure) in self.probes_under_load

    def with_telemetry(self, version: int, telemetry: Telemetry) -> Snapshot:
        """The same discovery state with the counters' latest read."""
        return replace(self, version=version, telemetry=telemetry, _cache={}).with_health()

    def with_health(self) -> Snapshot:
        """The matrix marks unhealthy every GPU a critical finding names -- discovery's,
        the probes' and the counters' -- so placement keeps off it (unless included).
        Unchanged health keeps the matrix, and with it placement's tables."""
        unhealthy = self.node.unhealthy_gpus(self.probe_findings + (self.telemetry.findings if self.telemetry else ()))
        if all(g.unhealthy == unhealthy.get(g.name) for g in self.matrix.gpus):
            return self
        gpus = tuple(replace(g, unhealthy=unhealthy.get(g.name)) for g in self.matrix.gpus)
        return replace(self, matrix=replace(self.matrix, gpus=gpus), _cache={})

    @property
    def findings(self) -> tuple[Finding, ...]:
        telemetry = self.telemetry.findings if self.telemetry else ()
        return self.node.findings + self.probe_findings + telemetry

    @property
    def placement_blockers(self) -> tuple[Finding, ...]:
        """The findings that leave this snapshot's answers untrustworthy: the one readiness
        rule GET /readyz and ``topoagent_ready`` both read (topoagent.node.findings)."""
        return placement_blockers(self.findings)

    def cached(self, key: str, make: Callable[[], Any]) -> Any:
        """What a door renders from this snapshot once (the JSON, the text matrix, the
        picture at /): computed on first use, dropped with the snapshot."""
        got = self._cache.get(key)
        if got is None:
            got = self._cache[key] = make()
        return got

    def rendered(self, key: str) -> bool:
        """Whether ``cached(key, ...)`` would answer without rendering."""
        return key in self._cache

    def _json(self) -> tuple[bytes | None, bytes, str]:
        """The document as held: as is when small (None when not), gzipped, its ETag."""
        from topoagent.documents.agent import topology_document

        body = json.dumps(topology_document(self), indent=1).encode()
        packed = gzip.compress(body, 6, mtime=0)
        return (body if len(body) <= PLAIN_BODY_BYTES else None), packed, etag_of(body)

    @property
    def held_body(self) -> bytes | None:
        """The JSON document, when it is held as is (see PLAIN_BODY_BYTES); else None."""
        return self.cached("json", self._json)[0]

    @property
    def body(self) -> bytes:
        """The JSON document (unpacked anew when only its gzipped form is held)."""
        plain, packed, _ = self.cached("json", self._json)
        return plain if plain is not None else gzip.decompress(packed)

    @property
    def body_gzip(self) -> bytes:
        return self.cached("json", self._json)[1]

    @property
    def etag(self) -> str:
        return self.cached("json", self._json)[2]

    @property
    def matrix_text(self) -> str:
        """The derived matrix printed the way `nvidia-smi topo -m` does (?format=matrix)."""
        from topoagent.collectors.nvidia_smi import render_topo_matrix

        return self.cached("matrix", lambda: render_topo_matrix(self.node.topo_matrix()))


# A /topology document larger than this is held gzipped only, unpacked for a client that
# takes no gzip: a 128-GPU node's is about 7.3 MiB as is and 145 KiB gzipped.  A smaller one
# (dgx-a100's: 90 KiB) is held both ways, so the common answer costs no unpacking.
PLAIN_BODY_BYTES = 1 << 20


def etag_of(body: bytes) -> str:
    return '"' + hashlib.sha256(body).hexdigest()[:32] + '"'


@dataclass(frozen=True)
class ServedCapacity:
    """One computed /capacity: the figures, their JSON and its ETag."""

    key: tuple  # (snapshot version, leased GPUs, GPUs running processes, unverified GPUs)
    capacity: Capacity
    body: bytes
    etag: str
    stale: bool = False  # served while the figures of the current key were still being computed
    _stale: list[ServedCapacity] = field(default_factory=list, repr=False, compare=False)  # as_stale, built once

    @classmethod
    def of(cls, key: tuple, figures: Capacity, stale: bool = False) -> ServedCapacity:
        from topoagent.documents.agent import capacity_document

        body = json.dumps(capacity_document(key[0], figures, stale), indent=1).encode()
        return cls(key, figures, body, etag_of(body), stale)

    def as_stale(self) -> ServedCapacity:
        if self.stale:
            return self
        if not self._stale:
            self._stale.append(ServedCapacity.of(self.key, self.capacity, stale=True))
        return self._stale[0]


NO_COUNTS: Mapping[str, int] = MappingProxyType({})


def counted(counts: Mapping[str, int], outcome: str) -> Mapping[str, int]:
    """``counts`` with one more ``outcome``: a new value, the published one left as it was."""
    return MappingProxyType({**counts, outcome: counts.get(outcome, 0) + 1})


@dataclass(frozen=True, slots=True)
class LeaseRecovery:
    """The lease state file was unreadable and moved aside: leases granted before may be lost."""

    file: str
    moved_to: str
    error: str | None


@dataclass(frozen=True, slots=True)
class LeaseQuarantine:
    """Lease state entries the store refused on loading, kept aside (the GPUs they named stay held)."""

    file: str
    entries: tuple[dict[str, Any], ...]  # as topoagent.service.leases.quarantine_report gives them
    unreadable: str | None = None  # why the file could not be read (a FIFO, a link ...), else None


@dataclass(frozen=True, slots=True)
class ProbeState:
    """What the probe loop publishes: its counts and where its worker stands."""

    enabled: bool = False  # [probes] enabled
    rounds: Mapping[str, int] = field(default_factory=lambda: NO_COUNTS)  # by outcome: "ok" or the failure kind
    seconds_total: float = 0.0
    latest_round: ProbeRound | None = None
    consecutive_failures: int | None = None  # None until the probe service exists (first discovery)
    in_progress: bool = False


@dataclass(frozen=True, slots=True)
class DiscoveryRetry:
    """The last discovery run failed: why, how many in a row, and when the next one runs
    (the discovery loop's back-off; GET /readyz says it)."""

    error: str
    failures: int  # runs failed in a row
    failed_at: float  # Unix time
    retry_at: float  # Unix time of the next run


@dataclass(frozen=True)
class Served:
    """Everything the doors serve, one immutable value: the node's snapshot and what the
    loops publish beside it.  A loop publishes by building a new value (``Board.publish``);
    a door takes one and renders only from it."""

    snapshot: Snapshot | None = None
    running: frozenset[int] = frozenset()  # GPUs NVML saw running another's processes (activity loop)
    leases: tuple[Lease, ...] | None = None  # as the lease loop last read the store; None: no store open yet
    lease_clock: Callable[[], float] = boot_clock  # the clock lease lifetimes run on
    lease_recovery: LeaseRecovery | None = None
    lease_quarantine: LeaseQuarantine | None = None  # None: no store open yet
    unverified: frozenset[int] = frozenset()  # GPUs given back, not probed since (probe loop)
    probes: ProbeState = ProbeState()
    placement_requests: Mapping[str, int] = field(default_factory=lambda: NO_COUNTS)  # by outcome
    discovery_runs: Mapping[str, int] = field(default_factory=lambda: NO_COUNTS)  # by outcome
    discovery_retry: DiscoveryRetry | None = None  # None: the last run succeeded, or none failed yet
    latest_capacity: ServedCapacity | None = None  # the latest computed, of whatever key

    def active_leases(self) -> list[Lease]:
        """The leases not yet past their deadline now (the sweeper drops them later)."""
        if self.leases is None:
            return []
        now = self.lease_clock()
        return [lease for lease in self.leases if lease.deadline > now]

    def holding(self) -> Holding:
        """Which GPU of the node as it is now each live lease holds (by UUID), and the
        leases one of whose GPUs left the node (they still hold the ones left)."""
        if self.snapshot is None:  # nothing discovered yet: the leases as granted
            return Holding({g: lease for lease in self.active_leases() for g in lease.gpus}, ())
        return Holding.of(self.active_leases(), self.snapshot.matrix.gpus)

    def busy(self) -> frozenset[int]:
        """Leased GPUs and GPUs running processes: placement keeps off both."""
        return frozenset(self.holding().holder) | self.running

    def capacity_key(self) -> tuple | None:
        """What the capacity figures depend on; None when there are none to compute: before
        the first snapshot, and while a finding blocks placement (no door serves them)."""
        if self.snapshot is None or placement_refusals(self.snapshot.findings):
            return None
        # The counters' rates are the snapshot's (a read swaps a new version in); unverified GPUs are not.
        return (self.snapshot.version, frozenset(self.holding().holder), self.running, self.unverified)

    @property
    def capacity(self) -> ServedCapacity | None:
        """The latest capacity figures computed, marked stale unless they are of this
        value's key; None before the first."""
        latest = self.latest_capacity
        if latest is None or latest.key == self.capacity_key():
            return latest
        return latest.as_stale()


class Board:
    """Where the loops publish: the current ``Served`` value, replaced whole, never changed
    in place, so a reader holding one sees it consistent."""

    def __init__(self) -> None:
        self.served = Served()
        self.version = 0  # the newest snapshot version handed out
        self.has_snapshot = asyncio.Event()  # set at the first snapshot (serve's banner waits for it)

    def publish(self, **parts: Any) -> Served:
        self.served = replace(self.served, **parts)
        if self.served.snapshot is not None:
            self.has_snapshot.set()
        return self.served
