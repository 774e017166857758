"""The agent runtime: the service's loops, composed, and their life cycle.

Each loop owns its state and publishes into one immutable served value (``Served``, on
the ``Board``): discovery the node's snapshot, telemetry the counters' rates, activity
the GPUs running processes, probes the figures and their counts, leases the leases held,
capacity what fits now; exports writes files from it.  Snapshots are immutable and
swapped by one assignment, so readers never lock.  The doors (exporters/) see the agent
only through the narrow ``Service`` interface (topoagent/service/interface.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from topoagent.config import Config
from topoagent.log import log_event
from topoagent.node.discovery_process import discover_in_child
from topoagent.node.host import Host, HostError
from topoagent.placement import Live, Request, place
from topoagent.service.activity_loop import ActivityLoop
from topoagent.service.capacity_loop import CapacityLoop
from topoagent.service.counter_loop import CounterLoop
from topoagent.service.discovery_loop import Discover, DiscoveryLoop, start_udev_watch
from topoagent.service.exports import EXPORT_CHECK_S, ExportsLoop
from topoagent.service.lease_loop import Answer, LeaseLoop, StateUnavailable
from topoagent.service.leases import Holding, Lease
from topoagent.service.loop import LoopHealth, keep_running
from topoagent.service.probe_loop import ProbeLoop
from topoagent.service.served import Board, Served, ServedCapacity, Snapshot, counted
from topoagent.service.telemetry import Telemetry, nic_traffic

if TYPE_CHECKING:
    from topoagent.probes.service import ProbeService


class RootError(ValueError):
    """--root is neither "/", a snapshot directory nor a snapshot tarball."""


def open_root(root: str) -> Host:
    """The node to read; a tarball is unpacked once, for the life of the agent."""
    try:
        return Host(root)
    except HostError as exc:
        raise RootError(f"--root {exc}") from None


class Agent:
    def __init__(self, config: Config, *, discover: Discover = discover_in_child) -> None:
        self.config = config
        self.started_at = time.time()
        self.host: Host | None = None
        self.board = Board()
        self._tasks: list[asyncio.Task] = []
        self._udev_close: Callable[[], None] | None = None
        self.abandoned_runs = 0
        self._stopping = asyncio.Event()  # set when the agent starts to stop
        self._nic_traffic: tuple[Telemetry | None, dict[str, float]] = (None, {})  # per read, for placement
        self.loops = {name: LoopHealth(name) for name in ("discovery", "lease_sweep", "gpu_activity", "probes", "telemetry", "exports")}
        # The pauses and settings are read from self.config each time: a reload may change them.
        settings, host = (lambda: self.config), (lambda: self.host)
        self.activity = ActivityLoop(self.board, settings, host, processes_ended=lambda gpus: self.probe_loop.processes_ended(gpus))
        self.probe_loop = ProbeLoop(
            self.board, settings, discovered=lambda: self.discovery.discovered, activity=lambda: self.activity.readings,
            read_activity=self.activity.read, holding=self.holding, on_swap=lambda snapshot: self.discovery.warm_answers(snapshot),
        )
        self.discovery = DiscoveryLoop(self.board, settings, host, discover, self.probe_loop, self.activity)
        self.counters = CounterLoop(self.board, settings, host)
        self.leases = LeaseLoop(self.board, ended=self.probe_loop.lease_ended)
        self.capacity_loop = CapacityLoop(self.board, settings, self.live, self._stopping)
        self.exports = ExportsLoop(self.board, settings)
        self.probe_loop.publish()

    # -- what the doors read (the Service interface) ------------------------------------
    def served(self) -> Served:
        """The current served value: take it once per request and read only it."""
        return self.board.served

    @property
    def snapshot(self) -> Snapshot | None:
        return self.board.served.snapshot

    @snapshot.setter
    def snapshot(self, snapshot: Snapshot) -> None:
        self.board.publish(snapshot=snapshot)

    @property
    def probes(self) -> ProbeService | None:
        """The probe service, made at the first discovery (None before, or probes off)."""
        return self.probe_loop.service

    @probes.setter
    def probes(self, service: ProbeService | None) -> None:
        self.probe_loop.service = service
        self.probe_loop.publish()

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self.host = open_root(self.config.root)
        self.leases.open(self.config.state_dir, self.loops["lease_sweep"])
        self._tasks = [
            asyncio.create_task(self._keep_running("discovery", self.discovery.on_timer, lambda: self.config.interval_s), name="discovery-timer"),
            asyncio.create_task(
                self._keep_running("lease_sweep", self.leases.sweep, lambda: self.config.lease_sweep_s, wait_first=True), name="lease-sweeper"
            ),
            asyncio.create_task(
                self._keep_running("gpu_activity", self.activity.read, lambda: self.config.activity_interval_s, wait_first=True), name="gpu-activity"
            ),
        ]
        self._tasks.append(asyncio.create_task(self._keep_running("exports", self.exports.update, lambda: EXPORT_CHECK_S), name="exports"))
        if self.config.telemetry_enabled:
            self._tasks.append(asyncio.create_task(
                self._keep_running("telemetry", self.counters.read, lambda: self.config.telemetry_interval_s), name="telemetry"))
        if self.config.probes_enabled:
            # A probe step waits by itself (on its schedule); after a failure, the retry pause.
            self._tasks.append(asyncio.create_task(self._keep_running("probes", self.probe_loop.step, lambda: 0.0), name="probes"))
            log_event("probes_enabled", backend=self.config.probe_backend, duty_cycle=self.config.probe_duty_cycle)
        if self.config.udev and self.config.live:
            self._udev_close = start_udev_watch(self.on_device_event)

    async def stop(self) -> None:
        self.begin_stop()
        if self._udev_close:
            self._udev_close()
        pending = {t for t in [*self._tasks, *self.discovery.pending(), self.capacity_loop.task] if t and not t.done()}
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
        self.counters.close()

    def begin_stop(self) -> None:
        """SIGTERM: requests waiting for capacity figures answer now (drain starts)."""
        self._stopping.set()

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

    async def _keep_running(self, name: str, iteration: Callable[[], Awaitable[Any]], every: Callable[[], float], *, wait_first: bool = False) -> None:
        await keep_running(self.loops[name], iteration, every, wait_first=wait_first)

    # -- discovery and probes on demand ------------------------------------------------
    def request_refresh(self, reason: str) -> asyncio.Task:
        """Start a discovery run, or join the one running (then run once more after it)."""
        return self.discovery.request_refresh(reason)

    def on_device_event(self, subsystem: str, action: str, name: str) -> None:
        self.discovery.on_device_event(subsystem, action, name)

    def request_probe_round(self) -> dict[str, Any]:
        """POST /probe: every target due now, busy GPUs and the duty cap overridden."""
        return self.probe_loop.request_round()

    # -- placement and leases -----------------------------------------------------------
    def holding(self) -> Holding:
        return self.board.served.holding()

    def unverified_gpus(self) -> frozenset[int]:
        return self.probe_loop.unverified()

    def live(self) -> Live:
        """What placement weighs at equal merit (placement.live): GPUs a job gave back that
        the probes have not checked since, and the traffic each NIC carries now."""
        snapshot = self.board.served.snapshot
        telemetry = snapshot.telemetry if snapshot is not None else None
        if self._nic_traffic[0] is not telemetry:  # once per counters' read, not per request
            self._nic_traffic = (telemetry, nic_traffic(telemetry))
        return Live(self.unverified_gpus(), self._nic_traffic[1])

    async def current_capacity(self) -> ServedCapacity | None:
        """GET /capacity and /metrics: the figures of the current (snapshot, busy set),
        waiting a bounded time for them (see CapacityLoop)."""
        return await self.capacity_loop.current()

    def _with_deadline(self, request: Request) -> Request:
        """The request with the service's deadline when it names none."""
        if request.deadline_ms is not None:
            return request
        return replace(request, deadline_ms=self.config.placement_deadline_ms)

    def _count(self, outcome: str) -> None:
        self.board.publish(placement_requests=counted(self.board.served.placement_requests, outcome))

    def count_invalid_request(self) -> None:
        """A /place request refused as malformed (400): counted with the others."""
        self._count("invalid")

    async def place(self, request: Request, holder_lease: str | None = None) -> Answer:
        """A dry run.  ``request`` was parsed against this snapshot's GPUs.  The search runs
        off the event loop, as a reservation's does: for as long as its deadline allows, a
        search on the loop held /healthz and every other request (15 s at 64 GPUs).  The
        GPUs of ``holder_lease`` are free to it: a pod's own lease is no conflict for its bindings."""
        served = self.board.served
        assert served.snapshot is not None
        matrix = served.snapshot.matrix
        own = {gpu for gpu, lease in served.holding().holder.items() if lease.id == holder_lease} if holder_lease else set()
        busy = (served.busy() - own) & {g.index for g in matrix.gpus}
        answer = await asyncio.to_thread(place, matrix, self._with_deadline(request), busy, live=self.live())
        self._count("placed" if answer.fit else "nofit")
        return answer

    async def reserve(self, request: Request, owner: str, ttl_s: float) -> tuple[Answer, Lease | None]:
        """Place and lease in one step under the store's lock (so no GPU is leased
        twice), durable on disk before this returns."""
        served = self.board.served
        assert served.snapshot is not None
        try:
            answer, lease = await self.leases.reserve(
                served.snapshot.matrix, self._with_deadline(request), owner, ttl_s, served.running, self.live())
            self._count("reserved" if lease else "nofit")
            if lease:
                await self.probe_loop.lease_granted(lease)
        except StateUnavailable:
            raise
        except OSError as exc:  # the state directory failed under the change: nothing was granted
            raise self.leases.unavailable(exc) from exc
        return answer, lease

    async def release(self, lease_id: str) -> Lease | None:
        try:
            return await self.leases.release(lease_id)
        except StateUnavailable:
            raise
        except OSError as exc:
            raise self.leases.unavailable(exc) from exc
