"""The agent runtime: owns the loop that keeps a current snapshot of the node.

Discovery runs on a timer, on udev hotplug events (debounced; live root only) and on
demand.  A run that hangs is cut off by its timeout; a run that fails leaves the last
good snapshot in place, marked stale, with the error recorded.  Snapshots are immutable
and swapped by one assignment, so readers never lock.

The three things this module needs from other parts of topoagent -- discovery, the
placement core and the lease book -- are reached only through the adapters in the
"Adapters" section below, so wiring the real modules in is a few lines there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from topoagent.collectors.base import ERROR, OK
from topoagent.collectors.nvidia_smi import render_topo_matrix
from topoagent.config import Config
from topoagent.host import Host, HostError
from topoagent.leases import Lease, LeaseStore
from topoagent.matrix import DistanceMatrix
from topoagent.model import NodeTopology, discover
from topoagent.placement import NoFit, Placement, Request, RequestError, place
from topoagent.served import CollectorStatus, Finding, NodeFacts, PcieLink, Snapshot
from topoagent.served import IbPort as IbPortFact
from topoagent.served import NvLink as NvLinkFact

log = logging.getLogger("topoagent")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One line per event, `event key=value ...`, which journald and grep both read."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "='):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    log.log(level, " ".join(parts))


class RootError(ValueError):
    """--root is neither "/", a snapshot directory nor a snapshot tarball."""


def open_root(root: str) -> Host:
    """The node to read; a tarball is unpacked once, for the life of the agent."""
    try:
        return Host(root)
    except HostError as exc:
        raise RootError(f"--root {exc}") from None


def run_in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run blocking work where a hang cannot hold the process hostage.

    asyncio.to_thread's pool threads are joined at exit, so one read stuck on a dead
    device would stop the agent from ever exiting; a daemon thread is simply abandoned.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            result = (True, fn())
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting task
            result = (False, exc)
        try:
            loop.call_soon_threadsafe(settle, *result)
        except RuntimeError:
            pass  # the agent stopped while this run was stuck; nobody is waiting

    threading.Thread(target=work, name="topoagent-discovery", daemon=True).start()
    return future


# ---------------------------------------------------------------------------------------
# Adapters: the only places that know discovery's, placement's and leases' shapes.
# ---------------------------------------------------------------------------------------


def facts_from_topology(topo: NodeTopology, now: float) -> NodeFacts:
    """Discovery's NodeTopology in the shape the exporters read."""
    pcie: list[PcieLink] = []
    for role, devices in (("gpu", topo.gpus), ("nic", topo.nics)):
        for dev in devices:
            if dev.link is not None and dev.pci_address:
                pcie.append(PcieLink(dev.pci_address, role, dev.link.current_gts, dev.link.max_gts, dev.link.current_width, dev.link.max_width))
    return NodeFacts(
        topology=topo.to_json(timings=True),
        matrix=topo.distance_matrix(),
        matrix_text=render_topo_matrix(topo.topo_matrix()),
        collectors=tuple(
            # node_exporter's rule: a source that is simply absent is quiet, not a failure
            CollectorStatus(c.name, c.status != ERROR, c.seconds, now if c.status != ERROR else None, c.message if c.status != OK else None, c.status)
            for c in topo.collectors
        ),
        findings=tuple(Finding(f.kind, f"{f.subject}: {f.message}", f.severity) for f in topo.findings),
        pcie_links=tuple(pcie),
        nvlinks=tuple(NvLinkFact(g.index, nl.link, nl.active) for g in topo.gpus for nl in g.nvlinks),
        ib_ports=tuple(
            IbPortFact(n.device or n.name, p.number, p.state or "UNKNOWN", p.rate_gbps) for n in topo.nics for p in n.ports
        ),
    )


async def discover_facts(host: Host) -> NodeFacts:
    """Run discovery on its own thread and loop: a read stuck in the kernel (or a
    replayed FIFO) blocks that thread, never the agent's loop, and the agent's timeout
    can walk away from it."""
    topo = await run_in_daemon_thread(lambda: asyncio.run(discover(host)))
    return facts_from_topology(topo, time.time())


@dataclass(frozen=True, slots=True)
class PlaceRequest:
    gpus: int
    pattern: str = "allreduce"
    min_level: str | None = None
    single_numa: bool = False
    include: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    nics: int = 0


@dataclass(frozen=True, slots=True)
class PlaceOutcome:
    fits: bool
    gpus: tuple[int, ...]  # nvidia-smi indices in rank order; () when it does not fit
    body: dict[str, Any]  # the Placement or NoFit JSON


def _placement_request(request: PlaceRequest) -> Request:
    return Request(request.gpus, request.pattern, request.min_level, request.single_numa, request.include, request.exclude, request.nics)


def _outcome(answer: Placement | NoFit) -> PlaceOutcome:
    if isinstance(answer, NoFit):
        return PlaceOutcome(False, (), answer.to_json())
    return PlaceOutcome(True, answer.indices, answer.to_json())


def _unsatisfiable(exc: RequestError) -> PlaceOutcome:
    # Well-formed JSON the node cannot satisfy (a GPU it lacks, include > gpus): a NoFit.
    return PlaceOutcome(False, (), {"fit": False, "reason": exc.message, "constraint": exc.field})


def place_gpus(matrix: DistanceMatrix, request: PlaceRequest, busy: frozenset[int]) -> PlaceOutcome:
    try:
        return _outcome(place(matrix, _placement_request(request), busy))
    except RequestError as exc:
        return _unsatisfiable(exc)


# ---------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------

Discover = Callable[[Host], Awaitable[NodeFacts]]


class Agent:
    def __init__(self, config: Config, *, discover: Discover = discover_facts) -> None:
        self.config = config
        self._discover = discover
        self.snapshot: Snapshot | None = None
        self.started_at = time.time()
        self.placement_requests: Counter[str] = Counter()
        self.refreshes: Counter[str] = Counter()  # by outcome
        self.lease_store: LeaseStore | None = None
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

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.host = open_root(self.config.root)
        self.lease_store = LeaseStore(self.config.state_dir)
        if self.lease_store.recovered_from:
            log_event("leases_corrupt", logging.ERROR, moved_to=self.lease_store.recovered_from)
        self._leases = tuple(self.lease_store.leases())
        log_event("leases_loaded", count=len(self._leases), path=self.lease_store.path)
        self._tasks = [
            asyncio.create_task(self._timer_loop(), name="discovery-timer"),
            asyncio.create_task(self._lease_sweeper(), name="lease-sweeper"),
        ]
        if self.config.udev and self.config.live:
            self._udev_close = start_udev_watch(self.on_device_event)

    async def stop(self) -> None:
        if self._udev_close:
            self._udev_close()
        if self._debounce:
            self._debounce.cancel()
        if self._refresh_task and not self._refresh_task.done():
            self.abandoned_runs += 1  # cancelled mid-read: its thread may never return
        for task in [*self._tasks, self._refresh_task]:
            if task and not task.done():
                task.cancel()
        await asyncio.gather(*[t for t in self._tasks if t], return_exceptions=True)
        if self.host:
            self.host.close()

    def reload(self, config: Config) -> list[str]:
        """Apply a re-read configuration; returns the settings that need a restart."""
        needs_restart = [k for k in ("listen", "state_dir") if getattr(config, k) != getattr(self.config, k)]
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
            facts = await asyncio.wait_for(self._discover(self.host), timeout)
        except asyncio.TimeoutError:
            self.abandoned_runs += 1  # its thread may stay stuck in a read for good
            return self._failed(f"discovery timed out after {timeout:g}s", started, reason)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a collector's bug must not take the agent down
            notes = "; ".join(getattr(exc, "__notes__", []))
            return self._failed(f"{type(exc).__name__}: {exc}" + (f" ({notes})" if notes else ""), started, reason)
        previous = self.snapshot
        statuses = self._with_last_success(facts.collectors)
        facts = replace(facts, collectors=statuses)
        if previous is not None:
            # A source that worked before and fails now would make the new facts poorer
            # (an nvidia-smi timeout drops every declared level): keep the old facts.
            # A source that answered before and is gone now (no_data) counts as lost too.
            worked = {c.name for c in previous.facts.collectors if c.status == "ok"}
            lost = [c for c in statuses if c.status != "ok" and c.name in worked]
            if lost:
                error = "; ".join(f"collector {c.name}: {c.status}: {c.error}" for c in lost)
                return self._failed(error, started, reason, statuses)
        snapshot = Snapshot(version=self._version + 1, facts=facts, built_at=time.time())
        await asyncio.to_thread(lambda: snapshot.body)  # serialise off the loop, once
        self._version += 1
        self.snapshot = snapshot
        self.refreshes["success"] += 1
        log_event("discovery_ok", reason=reason, version=self._version, gpus=facts.matrix.size, findings=len(facts.findings), seconds=f"{time.time() - started:.3f}")

    def _with_last_success(self, statuses: tuple[CollectorStatus, ...]) -> tuple[CollectorStatus, ...]:
        before = {c.name: c.last_success_at for c in (self.snapshot.collectors if self.snapshot else ())}
        return tuple(c if c.last_success_at is not None else replace(c, last_success_at=before.get(c.name)) for c in statuses)

    def _failed(self, error: str, started: float, reason: str, statuses: tuple[CollectorStatus, ...] | None = None) -> None:
        self.refreshes["failure"] += 1
        elapsed = time.time() - started
        log_event("discovery_failed", logging.ERROR, reason=reason, error=error, seconds=f"{elapsed:.3f}")
        if self.snapshot is None:
            return
        if statuses is None:  # the whole run failed: no source answered this time
            statuses = tuple(replace(c, success=False, duration_s=elapsed, error=error, status="error") for c in self.snapshot.collectors)
        self._version += 1
        self.snapshot = self.snapshot.marked_stale(self._version, error, time.time(), statuses)

    async def _timer_loop(self) -> None:
        while True:
            task = self.request_refresh("timer" if self.snapshot else "startup")
            try:
                await task
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never expected: _refresh catches; keep looping
                log_event("discovery_crashed", logging.ERROR, error=exc)
            await asyncio.sleep(self.config.interval_s)

    def on_device_event(self, subsystem: str, action: str, name: str) -> None:
        """A udev event: refresh once things settle (a NIC reset fires dozens)."""
        log_event("device_event", subsystem=subsystem, action=action, device=name)
        if self._debounce:
            self._debounce.cancel()
        loop = asyncio.get_running_loop()
        self._debounce = loop.call_later(self.config.udev_debounce_s, self.request_refresh, "udev")

    # -- placement and leases -----------------------------------------------------------
    def active_leases(self) -> list[Lease]:
        now = time.time()
        return [lease for lease in self._leases if lease.expires_at > now]

    def busy(self) -> frozenset[int]:
        return frozenset(g for lease in self.active_leases() for g in lease.gpus)

    def place(self, request: PlaceRequest) -> PlaceOutcome:
        assert self.snapshot is not None
        outcome = place_gpus(self.snapshot.facts.matrix, request, self.busy())
        self.placement_requests["placed" if outcome.fits else "nofit"] += 1
        return outcome

    async def reserve(self, request: PlaceRequest, owner: str, ttl_s: float) -> tuple[PlaceOutcome, Lease | None]:
        """Place and lease in one step under the store's lock (so no GPU is leased
        twice), durable on disk before this returns."""
        assert self.snapshot is not None and self.lease_store is not None
        matrix, store = self.snapshot.facts.matrix, self.lease_store

        def work() -> tuple[PlaceOutcome, Lease | None, tuple[Lease, ...]]:
            try:
                answer = store.reserve_placement(matrix, _placement_request(request), owner, ttl_s)
            except RequestError as exc:
                return _unsatisfiable(exc), None, tuple(store.leases())
            if isinstance(answer, NoFit):
                return _outcome(answer), None, tuple(store.leases())
            lease, placement = answer
            return _outcome(placement), lease, tuple(store.leases())

        outcome, lease, self._leases = await asyncio.to_thread(work)
        self.placement_requests["reserved" if lease else "nofit"] += 1
        if lease:
            log_event("lease_granted", lease=lease.id[:6], owner=owner, gpus=",".join(map(str, lease.gpus)), ttl_s=ttl_s)
        return outcome, lease

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
        return lease

    async def _lease_sweeper(self) -> None:
        assert self.lease_store is not None
        store = self.lease_store
        while True:
            await asyncio.sleep(self.config.lease_sweep_s)
            before = {lease.id: lease for lease in self._leases}
            store_now = await asyncio.to_thread(lambda: (store.expire(), tuple(store.leases()))[1])
            self._leases = store_now
            now_ids = {lease.id for lease in store_now}
            for lid, lease in before.items():
                if lid not in now_ids and lease.expires_at <= time.time():
                    log_event("lease_expired", lease=lid[:6], owner=lease.owner)


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
