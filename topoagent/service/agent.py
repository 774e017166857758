"""The agent runtime: owns the loop that keeps a current snapshot of the node.

Discovery runs on a timer, on udev hotplug events (debounced; live root only) and on
demand.  A run that hangs is cut off by its timeout; a run that fails leaves the last
good snapshot in place, marked stale, with the error recorded.  Snapshots are immutable
and swapped by one assignment, so readers never lock.

It serves discovery's typed NodeTopology as it is (topoagent/service/served.py's Snapshot adds
the agent's own state: measurements, findings of probes and counters, staleness); the
few functions in the section below are the only places that combine discovery, probes,
placement and leases.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from topoagent.config import Config
from topoagent.discovery_process import DiscoveryFailed, discover_in_child
from topoagent.host import Host, HostError
from topoagent.leases import Holding, Lease, LeaseStore
from topoagent.log import log_event
from topoagent.matrix import DistanceMatrix
from topoagent.model import CollectorStatus, Finding, NodeTopology
from topoagent.placement import Live, NoFit, Placement, Request, place, warm_answers
from topoagent.placement.search import warm as warm_tables
from topoagent.service.capacity import Capacity, capacity
from topoagent.service.exports import Exports, node_with_all_findings
from topoagent.service.served import Snapshot, etag_of
from topoagent.telemetry import History, Telemetry, nic_traffic
from topoagent.vocabulary import Status

if TYPE_CHECKING:
    from topoagent.collectors.nvml import GpuActivityReading, LiveCounterReader
    from topoagent.probes.figures import ProbeFigure
    from topoagent.probes.runner import ProbeRound
    from topoagent.probes.service import ProbeService

# A background loop that keeps failing says so at most this often (the log is on a disk too).
LOOP_LOG_EVERY_S = 60.0
# ... and tries again at most this often, whatever its interval.
LOOP_RETRY_MIN_S = 1.0
# [exports]: how often the agent looks for a new snapshot to write the files from.
EXPORT_CHECK_S = 1.0


class LoopHealth:
    """How one background loop is doing: failures counted, the last error kept, and the
    log told at most once per LOOP_LOG_EVERY_S (``event=loop_failed``), then once when
    it works again (``event=loop_recovered``)."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.clock = clock
        self.failures = 0  # iterations that failed, since start
        self.streak = 0  # failed in a row, up to now
        self.last_error: str | None = None  # while failing
        self._said_at: float | None = None
        self._streak_said = False

    @property
    def failing(self) -> bool:
        return self.streak > 0

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        self.streak += 1
        self.last_error = " ".join(f"{type(exc).__name__}: {exc}".split())
        now = self.clock()
        if self._said_at is None or now - self._said_at >= LOOP_LOG_EVERY_S:
            self._said_at, self._streak_said = now, True
            log_event("loop_failed", logging.ERROR, loop=self.name, error=self.last_error, failures=self.streak, action="keeps running; retries")

    def ok(self) -> None:
        if self._streak_said:
            log_event("loop_recovered", loop=self.name, failures=self.streak)
        self.streak, self.last_error, self._streak_said = 0, None, False


class RootError(ValueError):
    """--root is neither "/", a snapshot directory nor a snapshot tarball."""


def open_root(root: str) -> Host:
    """The node to read; a tarball is unpacked once, for the life of the agent."""
    try:
        return Host(root)
    except HostError as exc:
        raise RootError(f"--root {exc}") from None


def run_in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run blocking work where a hang cannot hold the process hostage.

    asyncio.to_thread's pool threads are joined at exit, so one read stuck on a dead
    device would stop the agent from ever exiting; a daemon thread is simply abandoned.
    (Discovery does not run here: a thread cannot be stopped, so it runs in a child
    process that a timeout kills; see topoagent.discovery_process.)  ``name`` names the
    thread in stack dumps.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            result = (True, fn())
        except BaseException as exc:
            result = (False, exc)
        with contextlib.suppress(RuntimeError):  # the agent stopped while this run was stuck
            loop.call_soon_threadsafe(settle, *result)

    threading.Thread(target=work, name=f"topoagent-{name}", daemon=True).start()
    return future


# ---------------------------------------------------------------------------------------
# Where discovery, probes, placement and leases meet.
# ---------------------------------------------------------------------------------------


def overlay_probes(
    node: NodeTopology,
    figures: list[ProbeFigure],
    previous: DistanceMatrix | None = None,
    service: ProbeService | None = None,
) -> tuple[DistanceMatrix, tuple[Finding, ...]]:
    """Discovery's matrix with the probes' figures overlaid (a pair clearly below its
    level counts at what it achieves; ``previous``, the matrix served before, gives each
    pair's last verdict), GPUs with a critical finding of the probes' marked unhealthy,
    and the findings the measurements support; with the service, also what its history
    says (decay, figures under load, confirmed verdicts)."""
    from topoagent.probes.overlay import findings_for, overlay

    if service is not None:
        _, found = service.verdicts(node.distance_matrix(), figures, previous)
        matrix, _ = service.verdicts(node.distance_matrix(tuple(found)), figures, previous)
        return matrix, tuple(found)
    findings = tuple(findings_for(overlay(node.distance_matrix(), figures), figures))
    return overlay(node.distance_matrix(findings), figures, previous), findings


def _log_warm_failure(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:  # a bug: requests still build what they need
        log_event("placement_warm_failed", logging.ERROR, error=f"{type(done.exception()).__name__}: {done.exception()}")


def topology_signature(node: NodeTopology) -> tuple:
    """What, when it changes, makes old measurements meaningless: the GPUs, their
    levels, their active NVLinks.  (Not PCIe link speed: idle GPUs downtrain it.)"""
    gpus = {g.name for g in node.gpus}
    return (
        tuple((g.index, g.uuid, g.pci_address) for g in node.gpus),
        tuple(str(p.level) for p in node.pairs if p.a in gpus and p.b in gpus),
        tuple(sorted((g.index, link.link) for g in node.gpus for link in g.nvlinks if link.active)),
    )


def link_signatures(node: NodeTopology) -> dict[Any, tuple]:
    """Probe target -> the facts whose change makes that link's old figures meaningless:
    a GPU's identity and active NVLinks; for a pair, both GPUs' and their level."""
    from topoagent.probes.schedule import ProbeTarget, targets_for

    own = {g.index: (g.uuid, g.pci_address, tuple(sorted(link.link for link in g.nvlinks if link.active))) for g in node.gpus}
    names = {g.index: g.name for g in node.gpus}
    out: dict[Any, tuple] = {}
    for target in targets_for(names):
        if target.is_pair:
            a, b = target.gpus
            pair = node.pair(names[a], names[b])
            out[target] = (own[a], own[b], str(pair.level) if pair else None)
        else:
            out[ProbeTarget(target.gpus)] = own[target.gpus[0]]
    return out


def make_probe_service(config: Config, gpus: list[int]) -> ProbeService:
    from topoagent.probes.history import BaselineBook
    from topoagent.probes.plan import DEFAULTS
    from topoagent.probes.runner import ProbeRunner, torch_missing
    from topoagent.probes.schedule import ProbeSchedule, ScheduleConfig
    from topoagent.probes.service import ProbeService

    schedule = ProbeSchedule(
        gpus,
        ScheduleConfig(
            startup_delay_s=config.probe_startup_delay_s,
            change_delay_s=min(10.0, config.probe_startup_delay_s),
            min_interval_s=config.probe_min_interval_s,
            max_interval_s=config.probe_max_interval_s,
            duty_cycle=config.probe_duty_cycle,
            busy_utilization_percent=config.probe_busy_utilization_percent,
        ),
    )
    defaults = DEFAULTS[config.probe_backend]
    if config.probe_sizes_bytes is not None:
        defaults = replace(defaults, sizes_bytes=config.probe_sizes_bytes)
    if config.probe_repetitions is not None:
        defaults = replace(defaults, repetitions=config.probe_repetitions)
    return ProbeService(
        schedule, ProbeRunner(timeout_s=config.probe_timeout_s), backend=config.probe_backend, defaults=defaults,
        book=BaselineBook(config.state_dir), unavailable=torch_missing(),
    )


class ProbesOff(Exception):
    """POST /probe on an agent whose [probes] are not enabled."""


class ProbeRunning(Exception):
    """POST /probe while a probe is in flight or a forced round is still going."""


Answer = Placement | NoFit


@dataclass(frozen=True)
class ServedCapacity:
    """One computed /capacity: the figures, their JSON and its ETag."""

    key: tuple  # (snapshot version, leased GPUs, GPUs running processes, unverified GPUs)
    capacity: Capacity
    body: bytes
    etag: str
    stale: bool = False  # served while the figures of the current key were still being computed

    @classmethod
    def of(cls, key: tuple, figures: Capacity, stale: bool = False) -> ServedCapacity:
        from topoagent.agent_schema import capacity_document

        body = json.dumps(capacity_document(key[0], figures, stale), indent=1).encode()
        return cls(key, figures, body, etag_of(body), stale)

    def as_stale(self) -> ServedCapacity:
        return self if self.stale else ServedCapacity.of(self.key, self.capacity, stale=True)


# ---------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------

Discover = Callable[[Host], Awaitable[NodeTopology]]


class Agent:
    def __init__(self, config: Config, *, discover: Discover = discover_in_child) -> None:
        self.config = config
        self._discover = discover
        self.snapshot: Snapshot | None = None
        self.started_at = time.time()
        self.placement_requests: Counter[str] = Counter()
        self.refreshes: Counter[str] = Counter()  # by outcome
        self.lease_store: LeaseStore | None = None
        self._said_corrupt: Path | None = None  # the moved-aside state file already logged
        # What the store holds, kept here so reads (/leases, /metrics) never touch disk
        # or its lock from the event loop; refreshed after every change we make.
        self._leases: tuple[Lease, ...] = ()
        self._refresh_task: asyncio.Task | None = None
        self._refresh_again = False
        self.host: Host | None = None
        self._tasks: list[asyncio.Task] = []
        self._udev_close: Callable[[], None] | None = None
        self._debounce: asyncio.TimerHandle | None = None
        self._version = 0
        self.abandoned_runs = 0
        # Probes: discovery's facts before any overlay, the service (made at the first
        # discovery, when the GPUs are known), and what the rounds did.
        self._discovered: NodeTopology | None = None
        self._last_success: dict[str, float] = {}  # collector name -> Unix time of its last good run
        self._signature: tuple | None = None
        self._link_signatures: dict[Any, tuple] = {}
        self.probes: ProbeService | None = None
        self.probe_rounds: Counter[str] = Counter()  # by outcome: "ok" or the failure kind
        self.probe_seconds_total = 0.0
        self._probe_wake = asyncio.Event()
        # GPU index -> what NVML says it runs (refreshed every activity_interval_s).
        self.activity: dict[int, GpuActivityReading] = {}
        self.activity_read_at: float | None = None
        self.loops = {name: LoopHealth(name) for name in ("discovery", "lease_sweep", "gpu_activity", "probes", "telemetry", "exports")}
        # Counters: the last two samples of each series (rates), and NVML kept open for them.
        self.counter_history = History()
        self._counter_reader: LiveCounterReader | None = None
        self._replayed_counters = False
        self._nic_traffic: tuple[Telemetry | None, dict[str, float]] = (None, {})  # per read, for placement
        self._counter_reads: dict[str, asyncio.Future] = {}  # source -> its last read, maybe still running
        self._capacity: ServedCapacity | None = None  # the latest computed, of whatever key
        self._capacity_stale: ServedCapacity | None = None  # the same, marked stale (built once)
        self._capacity_task: asyncio.Task | None = None  # computing until the figures are current
        self._stopping = asyncio.Event()  # set when the agent starts to stop
        self._warming: asyncio.Future | None = None  # the latest snapshot's answers being built
        self.exports = Exports()
        self._exported: tuple | None = None  # (snapshot version, config) the files were last brought up to

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.host = open_root(self.config.root)
        self.lease_store = LeaseStore(self.config.state_dir)
        self._say_if_corrupt()
        try:
            self._leases = tuple(self.lease_store.leases())
        except OSError as exc:  # a disk error: serve, and let the sweeper load them when it can
            self.loops["lease_sweep"].failed(exc)
        else:
            log_event("leases_loaded", count=len(self._leases), path=self.lease_store.path)
        # The pauses are read from self.config each time: a reload may change them.
        self._tasks = [
            asyncio.create_task(self._keep_running("discovery", self._discover_now, lambda: self.config.interval_s), name="discovery-timer"),
            asyncio.create_task(
                self._keep_running("lease_sweep", self._sweep_leases, lambda: self.config.lease_sweep_s, wait_first=True), name="lease-sweeper"
            ),
            asyncio.create_task(
                self._keep_running("gpu_activity", self.read_activity, lambda: self.config.activity_interval_s, wait_first=True), name="gpu-activity"
            ),
        ]
        self._tasks.append(asyncio.create_task(self._keep_running("exports", self._update_exports, lambda: EXPORT_CHECK_S), name="exports"))
        if self.config.telemetry_enabled:
            self._tasks.append(asyncio.create_task(
                self._keep_running("telemetry", self.read_counters, lambda: self.config.telemetry_interval_s), name="telemetry"))
        if self.config.probes_enabled:
            # A probe step waits by itself (on its schedule); after a failure, the retry pause.
            self._tasks.append(asyncio.create_task(self._keep_running("probes", self._probe_step, lambda: 0.0), name="probes"))
            log_event("probes_enabled", backend=self.config.probe_backend, duty_cycle=self.config.probe_duty_cycle)
        if self.config.udev and self.config.live:
            self._udev_close = start_udev_watch(self.on_device_event)

    async def stop(self) -> None:
        self.begin_stop()
        if self._udev_close:
            self._udev_close()
        if self._debounce:
            self._debounce.cancel()
        pending = {t for t in [*self._tasks, self._refresh_task, self._capacity_task] if t and not t.done()}
        # Cancel until they finish: on Python 3.11 asyncio.wait_for can swallow a
        # cancellation that races its own timeout (a probe worker timing out as SIGTERM
        # arrives), and the loop then carries on.  Bounded, so SIGTERM always exits.
        for _ in range(50):
            if not pending:
                break
            for task in pending:
                task.cancel()
            _, pending = await asyncio.wait(pending, timeout=0.1)
        if pending:
            self.abandoned_runs += len(pending)
            log_event("stop_abandoned_tasks", logging.WARNING, tasks=",".join(t.get_name() for t in pending))
        if self.host:
            self.host.close()
        if self._counter_reader is not None:
            self._counter_reader.close()

    def reload(self, config: Config) -> list[str]:
        """Apply a re-read configuration; returns the settings that need a restart."""
        probe_keys = tuple(k for k in Config.__dataclass_fields__ if k.startswith("probe"))
        needs_restart = [k for k in ("listen", "state_dir", *probe_keys) if getattr(config, k) != getattr(self.config, k)]
        root_changed = config.root != self.config.root
        if root_changed:
            try:
                host = open_root(config.root)
            except RootError as exc:
                log_event("reload_root_refused", logging.ERROR, error=exc)
                needs_restart.append("root")
            else:
                old, self.host = self.host, host
                if old:
                    old.close()
        self.config = replace(config, **{k: getattr(self.config, k) for k in needs_restart})
        self.request_refresh("reload")
        return needs_restart

    # -- discovery ----------------------------------------------------------------------
    def request_refresh(self, reason: str) -> asyncio.Task:
        """Start a discovery run, or join the one running (then run once more after it)."""
        if self._refresh_task and not self._refresh_task.done():
            self._refresh_again = True
            return self._refresh_task
        self._refresh_task = asyncio.create_task(self._refresh(reason), name="discovery")
        return self._refresh_task

    async def _refresh(self, reason: str) -> Snapshot | None:
        while True:
            self._refresh_again = False
            await self._refresh_once(reason)
            if not self._refresh_again:
                return self.snapshot
            reason = "coalesced"

    async def _refresh_once(self, reason: str) -> None:
        assert self.host is not None
        started = time.time()
        timeout = self.config.timeout_s
        try:
            node = await asyncio.wait_for(self._discover(self.host), timeout)
        except TimeoutError:  # the run's process was killed: nothing of it is left behind
            return self._failed(f"discovery timed out after {timeout:g}s", started, reason)
        except asyncio.CancelledError:
            raise
        except DiscoveryFailed as exc:  # already "Type: message", as the child saw it
            return self._failed(str(exc), started, reason)
        except Exception as exc:  # a collector's bug must not take the agent down
            notes = "; ".join(getattr(exc, "__notes__", []))
            return self._failed(f"{type(exc).__name__}: {exc}" + (f" ({notes})" if notes else ""), started, reason)
        now = time.time()
        for c in node.collectors:
            if c.status is not Status.ERROR:  # node_exporter's rule: absent is quiet, not failed
                self._last_success[c.name] = now
        previous = self.snapshot
        if previous is not None:
            # A source that worked before and fails now would make the new facts poorer
            # (an nvidia-smi timeout drops every declared level): keep the old facts.
            # A source that answered before and is gone now (no_data) counts as lost too.
            worked = {c.name for c in previous.node.collectors if c.status is Status.OK}
            lost = [c for c in node.collectors if c.status is not Status.OK and c.name in worked]
            if lost:
                error = "; ".join(f"collector {c.name}: {c.status}: {c.message}" for c in lost)
                return self._failed(error, started, reason, node.collectors)
        self._discovered = node
        self._note_topology(node)
        self._set_activity_from_node(node)
        matrix = node.distance_matrix()
        probe_findings: tuple[Finding, ...] = ()
        figures: tuple[ProbeFigure, ...] = ()
        under_load: frozenset[frozenset[int]] = frozenset()
        if self.config.probes_enabled and self.probes is not None:
            figures, under_load = tuple(self.probes.figures()), frozenset(self.probes.under_load)
            served = self.snapshot.matrix if self.snapshot is not None else None
            matrix, probe_findings = await asyncio.to_thread(overlay_probes, node, list(figures), served, self.probes)
        snapshot = Snapshot(
            version=self._version + 1, node=node, matrix=matrix, built_at=now, collectors=node.collectors,
            last_success_at=dict(self._last_success), probe_figures=figures, probe_findings=probe_findings,
            probes_under_load=under_load, telemetry=previous.telemetry if previous else None,
        ).with_health()
        await asyncio.to_thread(lambda: snapshot.body)  # serialise off the loop, once
        await asyncio.to_thread(warm_tables, snapshot.matrix)  # the first /place is as fast as the rest
        self._version += 1
        self.snapshot = snapshot
        self._warm_answers(snapshot)
        self.refreshes["success"] += 1
        log_event("discovery_ok", reason=reason, version=self._version, gpus=len(node.gpus), findings=len(snapshot.findings), seconds=f"{time.time() - started:.3f}")

    def _warm_answers(self, snapshot: Snapshot) -> None:
        """Build the new matrix's answers in the background: requests need not wait for
        it (they build what is missing), and the swap did not."""
        self._warming = asyncio.ensure_future(asyncio.to_thread(warm_answers, snapshot.matrix))
        self._warming.add_done_callback(_log_warm_failure)

    def _failed(self, error: str, started: float, reason: str, statuses: tuple[CollectorStatus, ...] | None = None) -> None:
        self.refreshes["failure"] += 1
        elapsed = time.time() - started
        log_event("discovery_failed", logging.ERROR, reason=reason, error=error, seconds=f"{elapsed:.3f}")
        if self.snapshot is None:
            return
        if statuses is None:  # the whole run failed: no source answered this time
            statuses = tuple(replace(c, status=Status.ERROR, message=error, seconds=elapsed, warnings=()) for c in self.snapshot.collectors)
        self._version += 1
        self.snapshot = replace(
            self.snapshot.marked_stale(self._version, error, time.time(), statuses), last_success_at=dict(self._last_success)
        )

    async def _keep_running(self, name: str, iteration: Callable[[], Awaitable[Any]], every: Callable[[], float], *, wait_first: bool = False) -> None:
        """Run ``iteration`` every ``every()`` seconds for the life of the agent.  One that
        fails -- a read-only or full disk, no file descriptors left, a bug -- is counted
        and logged by its LoopHealth, what it serves stays as it was, and the next runs
        as usual: a transient error must never stop a background task for good."""
        health = self.loops[name]
        if wait_first:
            await asyncio.sleep(every())
        while True:
            try:
                await iteration()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                health.failed(exc)
                await asyncio.sleep(max(every(), LOOP_RETRY_MIN_S))
                continue
            health.ok()
            await asyncio.sleep(every())

    async def _discover_now(self) -> None:
        await self.request_refresh("timer" if self.snapshot else "startup")

    def on_device_event(self, subsystem: str, action: str, name: str) -> None:
        """A udev event: refresh once things settle (a NIC reset fires dozens)."""
        log_event("device_event", subsystem=subsystem, action=action, device=name)
        if self._debounce:
            self._debounce.cancel()
        loop = asyncio.get_running_loop()
        self._debounce = loop.call_later(self.config.udev_debounce_s, self.request_refresh, "udev")

    # -- exports ([exports]: files kept current) -----------------------------------------
    async def _update_exports(self) -> None:
        """Bring the configured files up to the served snapshot: rendered again only when
        the snapshot or the config changed (or NFD's expiry nears), written only where the
        text changed.  A failure raises: the loop logs it and the next check retries."""
        snapshot, config = self.snapshot, self.config
        if snapshot is None:
            return
        key = (snapshot.version, config)
        if key == self._exported and not self.exports.refresh_due():
            return
        node = node_with_all_findings(snapshot.node, snapshot.findings)
        written = await asyncio.to_thread(self.exports.update, config, node)
        self._exported = key
        for path in written:
            log_event("export_written", path=path, snapshot_version=snapshot.version)

    # -- placement and leases -----------------------------------------------------------
    def active_leases(self) -> list[Lease]:
        if self.lease_store is None:
            return []
        now = self.lease_store.monotonic()  # lifetimes run on the boot clock, not the wall clock
        return [lease for lease in self._leases if lease.deadline > now]

    def gpus_with_processes(self) -> frozenset[int]:
        """GPUs NVML last saw running compute processes (a job the agent did not place)."""
        own = os.getpid()
        return frozenset(i for i, seen in self.activity.items() if any(p != own for p in seen.processes))

    def holding(self) -> Holding:
        """Which GPU of the node as it is now each live lease holds (by UUID), and the
        leases whose GPU left the node."""
        if self.snapshot is None:  # nothing discovered yet: the leases as granted
            return Holding({g: lease for lease in self.active_leases() for g in lease.gpus}, ())
        return Holding.of(self.active_leases(), self.snapshot.matrix.gpus)

    def busy(self) -> frozenset[int]:
        """Leased GPUs and GPUs running processes: placement keeps off both."""
        return frozenset(self.holding().holder) | self.gpus_with_processes()

    def capacity_key(self) -> tuple | None:
        """What the capacity figures depend on; None before the first snapshot."""
        snapshot = self.snapshot
        if snapshot is None:
            return None
        # The counters' rates are the snapshot's (a read swaps a new version in); unverified GPUs are not.
        return (snapshot.version, frozenset(self.holding().holder), self.gpus_with_processes(), self.live().unverified)

    def capacity(self) -> ServedCapacity | None:
        """The latest capacity figures computed, current or not (``stale`` says which);
        None before the first.  Never computes: see ``current_capacity``."""
        served = self._capacity
        if served is None or served.key == self.capacity_key():
            return served
        if self._capacity_stale is None or self._capacity_stale.key != served.key:
            self._capacity_stale = served.as_stale()
        return self._capacity_stale

    def capacity_wait_s(self) -> float:
        """How long a request waits for current figures: one computation already under
        way for an older key, then its own, each keeping to the budget, and a margin."""
        return 2 * self.config.placement_capacity_budget_ms / 1000 + 0.25

    async def current_capacity(self) -> ServedCapacity | None:
        """GET /capacity and /metrics: the figures of the current (snapshot, busy set),
        computed once per key in a daemon thread, off the event loop, under the
        ``[placement] capacity_budget_ms`` budget; requests arriving meanwhile share that
        computation.  Past ``capacity_wait_s`` the latest figures are served marked stale
        (None when there are none yet); the computation goes on for the next request."""
        served = self._capacity
        if served is not None and served.key == self.capacity_key():
            return served
        task = self._capacity_task
        if task is None or task.done():
            task = self._capacity_task = asyncio.create_task(self._compute_capacity(), name="capacity")
        # A request given up does not cancel the computation; a stopping agent ends the
        # wait at once, so SIGTERM's drain never waits for figures.
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, timeout=self.capacity_wait_s(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        return self.capacity()

    def begin_stop(self) -> None:
        """SIGTERM: requests waiting for capacity figures answer now (drain starts)."""
        self._stopping.set()

    async def _compute_capacity(self) -> None:
        """Compute the figures until they are of the current key (a lease granted during a
        computation makes one more); one computation at a time, whoever asks."""
        while (key := self.capacity_key()) is not None:
            served = self._capacity
            if served is not None and served.key == key:
                return
            snapshot = self.snapshot
            assert snapshot is not None
            matrix, (_, leased, running, _) = snapshot.matrix, key
            live, budget = self.live(), self.config.placement_capacity_budget_ms
            started = time.monotonic()
            try:
                self._capacity = await run_in_daemon_thread(
                    lambda: ServedCapacity.of(key, capacity(matrix, leased, running, live, budget_ms=budget)), "capacity")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: the latest figures stay served; say it and stop
                log_event("capacity_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
                return
            fits = self._capacity.capacity.fits
            log_event("capacity_computed", logging.DEBUG, snapshot_version=key[0], gpus=len(fits),
                      not_proven=sum(not f.proven_optimal for f in fits), seconds=f"{time.monotonic() - started:.3f}")

    def _with_deadline(self, request: Request) -> Request:
        """The request with the service's deadline when it names none."""
        if request.deadline_ms is not None:
            return request
        return replace(request, deadline_ms=self.config.placement_deadline_ms)

    def live(self) -> Live:
        """What placement weighs at equal merit (placement.live): GPUs a job gave back that
        the probes have not checked since, and the traffic each NIC carries now."""
        telemetry = self.snapshot.telemetry if self.snapshot is not None else None
        if self._nic_traffic[0] is not telemetry:  # once per counters' read, not per request
            self._nic_traffic = (telemetry, nic_traffic(telemetry))
        return Live(self.unverified_gpus(), self._nic_traffic[1])

    def place(self, request: Request) -> Answer:
        """A dry run.  ``request`` was parsed against this snapshot's GPUs."""
        assert self.snapshot is not None
        matrix = self.snapshot.matrix
        answer = place(matrix, self._with_deadline(request), self.busy() & {g.index for g in matrix.gpus}, live=self.live())
        self.placement_requests["placed" if answer.fit else "nofit"] += 1
        return answer

    async def reserve(self, request: Request, owner: str, ttl_s: float) -> tuple[Answer, Lease | None]:
        """Place and lease in one step under the store's lock (so no GPU is leased
        twice), durable on disk before this returns."""
        assert self.snapshot is not None and self.lease_store is not None
        matrix, store = self.snapshot.matrix, self.lease_store
        running, live = self.gpus_with_processes(), self.live()

        def work() -> tuple[Answer, Lease | None, tuple[Lease, ...]]:
            answer = store.reserve_placement(matrix, self._with_deadline(request), owner, ttl_s, running, live)
            if isinstance(answer, NoFit):
                return answer, None, tuple(store.leases())
            lease, placement = answer
            return placement, lease, tuple(store.leases())

        answer, lease, self._leases = await asyncio.to_thread(work)
        self.placement_requests["reserved" if lease else "nofit"] += 1
        if lease:
            log_event("lease_granted", lease=lease.id[:6], owner=owner, gpus=",".join(map(str, lease.gpus)), ttl_s=ttl_s)
            if self.probes is not None:
                await asyncio.to_thread(self.probes.on_lease_granted, lease.id, lease.gpus)
        return answer, lease

    async def release(self, lease_id: str) -> Lease | None:
        assert self.lease_store is not None
        store = self.lease_store

        def work() -> tuple[Lease | None, tuple[Lease, ...]]:
            held = {lease.id: lease for lease in store.leases()}
            released = held.get(lease_id) if store.release(lease_id) else None
            return released, tuple(store.leases())

        lease, self._leases = await asyncio.to_thread(work)
        if lease:
            log_event("lease_released", lease=lease_id[:6], owner=lease.owner)
            await self._probe_after_lease(lease)
        return lease

    # -- GPU activity (busy GPUs) ----------------------------------------------------------
    def _set_activity_from_node(self, node: NodeTopology) -> None:
        from topoagent.collectors.nvml import GpuActivityReading

        self.activity = {g.index: GpuActivityReading(g.index, g.utilization_percent, g.processes) for g in node.gpus}
        self.activity_read_at = time.time()

    async def read_activity(self) -> None:
        """Ask NVML (or the recording) what each GPU runs; on failure keep what we had."""
        from topoagent.collectors.nvml import read_activity

        host = self.host
        if host is None:
            return
        try:
            readings = await asyncio.wait_for(run_in_daemon_thread(lambda: read_activity(host), "activity"), self.config.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NVML hung or failed: busy stays as last seen
            log_event("gpu_activity_failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            return
        if readings is not None:
            running_before = self.gpus_with_processes()
            self.activity = {r.index: r for r in readings}
            self.activity_read_at = time.time()
            self._probe_when_processes_end(running_before - self.gpus_with_processes())

    # -- counters (telemetry) ---------------------------------------------------------------
    async def read_counters(self) -> None:
        """Read every counter source (each in its own thread, under its own timeout), take
        the samples into the history and serve the new rates and findings.  A recorded node
        gives all its recorded samples at the first read, then nothing new."""
        from topoagent.collectors.nvml import LiveCounterReader
        from topoagent.discovery import COUNTER_SOURCES
        from topoagent.telemetry import Context, Sample, read_live, recorded_samples, served

        host, snapshot = self.host, self.snapshot
        if host is None or snapshot is None:
            return  # the AER source reads the devices discovery found: after the first one
        parsers = {s.name: s.parse for s in COUNTER_SOURCES}
        samples: list[Sample] = []
        recorded = None if host.live else await asyncio.to_thread(recorded_samples, host)
        if recorded is not None:
            samples = [] if self._replayed_counters else recorded
            self._replayed_counters = True
        else:
            if self._counter_reader is None:
                self._counter_reader = LiveCounterReader()
            context = Context(host, snapshot.node, self._counter_reader)
            timeout = self.config.telemetry_timeout_s

            async def one(source: Any) -> Sample:
                stuck = self._counter_reads.get(source.name)
                if stuck is not None and not stuck.done():
                    # A read that hung is abandoned, not killed: never start a second beside it.
                    return Sample(source.name, time.monotonic(), None, "the previous read has not returned")
                read = self._counter_reads[source.name] = run_in_daemon_thread(lambda: read_live(source, context), "counters")
                try:
                    return await asyncio.wait_for(asyncio.shield(read), timeout)
                except TimeoutError:
                    return Sample(source.name, time.monotonic(), None, f"timed out after {timeout:g}s", timeout)

            samples = list(await asyncio.gather(*(one(s) for s in COUNTER_SOURCES)))
        for sample in samples:
            if sample.source in parsers:
                self.counter_history.add(sample, parsers[sample.source])
        telemetry = served(self.counter_history, dict(self.config.telemetry_thresholds), snapshot.node)
        current = self.snapshot
        if current is not None:
            self._version += 1
            self.snapshot = current.with_telemetry(self._version, telemetry)

    # -- probes -----------------------------------------------------------------------------
    def _note_topology(self, node: NodeTopology) -> None:
        """A new discovery: start probing (first time) or tell the schedule what changed."""
        signature = topology_signature(node)
        changed = self._signature is not None and signature != self._signature
        self._signature = signature
        if not self.config.probes_enabled:
            return
        from topoagent.probes.paths import probe_paths

        gpus = [g.index for g in node.gpus]
        links, old_links = link_signatures(node), self._link_signatures
        self._link_signatures = links
        if self.probes is None:
            self.probes = make_probe_service(self.config, gpus)
            if self.probes.unavailable is not None:  # said once, now, not at the first round's failure
                log_event("probes_unavailable", logging.WARNING, backend=self.config.probe_backend, error=self.probes.unavailable)
        elif changed:
            rearmed = [t for t, sig in links.items() if old_links.get(t) != sig]
            self.probes.on_topology_change(gpus, rearmed)
            log_event("probe_topology_changed", gpus=len(gpus), rearmed=",".join(t.key for t in rearmed) or "none")
        self.probes.matrix = node.distance_matrix()
        self.probes.schedule.paths, self.probes.schedule.footprints = probe_paths(node)
        self._probe_wake.set()

    async def _probe_after_lease(self, lease: Lease) -> None:
        """A lease ended: its GPUs are probed (and unverified) before the next placement."""
        if self.probes is None:
            return
        await asyncio.to_thread(self.probes.on_lease_ended, lease.id, lease.gpus)
        log_event("probe_gpus_released", lease=lease.id[:6], gpus=",".join(map(str, lease.gpus)))
        self._probe_wake.set()

    def _probe_when_processes_end(self, gpus: frozenset[int]) -> None:
        """NVML saw a GPU's processes end: a job left it; probe it before the next one."""
        if self.probes is None or not gpus:
            return
        self.probes.on_gpus_released(gpus)
        log_event("probe_gpus_released", reason="processes_ended", gpus=",".join(map(str, sorted(gpus))))
        self._probe_wake.set()

    def unverified_gpus(self) -> frozenset[int]:
        """GPUs a job gave back and the probes have not checked since: placement prefers
        the others at equal merit (placement.live)."""
        return self.probes.unverified if self.probes is not None else frozenset()

    def probe_activity(self) -> dict[int, Any]:
        from topoagent.probes.schedule import GpuActivity

        own = os.getpid()
        activity = {
            i: GpuActivity(seen.utilization_percent, sum(1 for p in seen.processes if p != own))
            for i, seen in self.activity.items()
        }
        for gpu in self.holding().holder:
            # A leased GPU belongs to a job that may start any moment: leave it alone.
            seen = activity.get(gpu, GpuActivity())
            activity[gpu] = GpuActivity(seen.utilization_percent, seen.other_processes + 1)
        return activity

    def request_probe_round(self) -> dict[str, Any]:
        """POST /probe: every target due now, busy GPUs and the duty cap overridden."""
        service = self.probes
        if not self.config.probes_enabled:
            raise ProbesOff("probes are off on this agent ([probes] enabled = false)")
        if service is None:
            raise ProbeRunning("the first discovery has not finished; probes start after it")
        schedule = service.schedule
        # A requested round is running while any of its targets is still forced; a
        # background probe in flight is no conflict: the forced targets go next.
        forced = [t for t, st in schedule.states.items() if st.forced]
        if forced:
            running = schedule.in_flight.key if schedule.in_flight else "none"
            raise ProbeRunning(f"a requested probe round is running: {len(forced)} target(s) left (in flight: {running})")
        schedule.request_round(force=True)
        self._probe_wake.set()
        targets = sorted(schedule.states, key=lambda t: (not t.is_pair, t))  # the order they run in
        log_event("probe_round_requested", targets=len(targets))
        return {"backend": service.backend, "forced": True, "targets": [t.key for t in targets]}

    async def _probe_step(self) -> None:
        """One turn of the probe loop: run what is due, or wait until something may be."""
        service = self.probes
        if service is None or self.snapshot is None:
            await self._wait_probe_wake(1.0)
            return
        await self.read_activity()
        self._probe_wake.clear()
        try:
            probe_round = await service.step(self.probe_activity())
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the probe glue must not stop the agent
            log_event("probe_crashed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
            service.schedule.in_flight = None
            await self._wait_probe_wake(self.config.activity_interval_s)
            return
        if probe_round is not None:
            self._account_probe(probe_round)
            if probe_round.results:
                try:
                    await self._publish_probes()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the figures stay with the service; the next round retries
                    log_event("probe_publish_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
            return
        wakeup = service.schedule.next_wakeup()
        delay = self.config.activity_interval_s if wakeup is None else wakeup - service.schedule.clock()
        # Due but not allowed (busy GPUs, duty cap): look again when activity is re-read.
        await self._wait_probe_wake(min(max(delay, 0.05), self.config.activity_interval_s) if delay > 0 else self.config.activity_interval_s)

    async def _wait_probe_wake(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._probe_wake.wait(), timeout)

    def _account_probe(self, probe_round: ProbeRound) -> None:
        outcome = "ok" if probe_round.failure is None else probe_round.failure.kind
        self.probe_rounds[outcome] += 1
        self.probe_seconds_total += probe_round.duration_s
        verdict = self.probes.last_verdict if self.probes else None
        target = verdict.target.key if verdict else "?"
        if probe_round.failure is None:
            log_event("probe_ok", target=target, results=len(probe_round.results), seconds=f"{probe_round.duration_s:.3f}", verdict=verdict.outcome if verdict else "-")
        elif probe_round.failure.kind != "backoff":
            log_event("probe_failed", logging.WARNING, target=target, kind=probe_round.failure.kind, error=probe_round.failure.message)

    def latest_probe_round(self) -> ProbeRound | None:
        return self.probes.runner.latest_round() if self.probes else None

    async def _publish_probes(self) -> None:
        """Swap in a snapshot with the newest figures overlaid on the last discovery."""
        while self.probes is not None:
            based_on, discovered = self.snapshot, self._discovered
            if based_on is None or discovered is None:
                return
            figures = tuple(self.probes.figures())
            matrix, findings = await asyncio.to_thread(overlay_probes, discovered, list(figures), based_on.matrix, self.probes)
            loaded = frozenset(self.probes.under_load)
            snapshot = based_on.with_probes(self._version + 1, matrix, figures, findings, loaded)
            await asyncio.to_thread(lambda: snapshot.body)
            await asyncio.to_thread(warm_tables, snapshot.matrix)
            if self.snapshot is based_on:  # else a discovery swapped meanwhile: redo on it
                self._version += 1
                self.snapshot = snapshot
                self._warm_answers(snapshot)
                return

    async def _sweep_leases(self) -> None:
        """Drop expired leases from the file and take up what other processes sharing the
        state directory changed.  On a disk error this raises and ``_leases`` stays."""
        assert self.lease_store is not None
        store = self.lease_store
        before = {lease.id: lease for lease in self._leases}
        self._leases = await asyncio.to_thread(lambda: (store.expire(), tuple(store.leases()))[1])
        self._say_if_corrupt()
        now_ids = {lease.id for lease in self._leases}
        for lid, lease in before.items():
            if lid not in now_ids and lease.deadline <= store.monotonic():
                log_event("lease_expired", lease=lid[:6], owner=lease.owner)
                await self._probe_after_lease(lease)

    def _say_if_corrupt(self) -> None:
        """One line for each state file moved aside (at start-up, or found later)."""
        store = self.lease_store
        if store is not None and store.recovered_from is not None and store.recovered_from != self._said_corrupt:
            self._said_corrupt = store.recovered_from
            log_event(
                "leases_corrupt", logging.ERROR, file=store.path, moved_to=store.recovered_from,
                error=store.recovery_error, action="the leases in it are no longer held; see README (Leases)",
            )


def start_udev_watch(on_event: Callable[[str, str, str], None]) -> Callable[[], None] | None:
    """Watch PCI, InfiniBand and net add/remove/change; None when udev is unavailable."""
    try:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        for subsystem in ("pci", "infiniband", "net"):
            monitor.filter_by(subsystem)
        monitor.start()
    except Exception as exc:  # no netlink in a container, no udev: keep the timer
        log_event("udev_unavailable", logging.WARNING, error=exc)
        return None
    loop = asyncio.get_running_loop()

    def readable() -> None:
        while (device := monitor.poll(timeout=0)) is not None:
            if device.action in ("add", "remove", "change"):
                on_event(device.subsystem or "?", device.action, device.sys_name)

    loop.add_reader(monitor.fileno(), readable)
    log_event("udev_watching", subsystems="pci,infiniband,net")

    def close() -> None:
        loop.remove_reader(monitor.fileno())

    return close
