"""The probes loop: measures the links on its schedule (in a child process, see
topoagent.probes) and publishes the figures overlaid on the last discovery, with its
counts (rounds by outcome, seconds spent) and where its worker stands."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from topoagent.config import Config
from topoagent.log import log_event
from topoagent.node.matrix import DistanceMatrix
from topoagent.node.model import Finding, NodeTopology
from topoagent.placement.search import warm as warm_tables
from topoagent.service.leases import Holding, Lease
from topoagent.service.served import Board, ProbeState, Snapshot

if TYPE_CHECKING:
    from topoagent.collectors.nvml import GpuActivityReading
    from topoagent.probes.figures import ProbeFigure
    from topoagent.probes.runner import ProbeRound
    from topoagent.probes.service import ProbeService


class ProbesOff(Exception):
    """POST /probe on an agent whose [probes] are not enabled."""


class ProbeRunning(Exception):
    """POST /probe while a probe is in flight or a forced round is still going."""


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


class ProbeLoop:
    """Owns the probe service (made at the first discovery, when the GPUs are known),
    its counts and its wake-up; publishes them, and swaps in snapshots with new figures."""

    def __init__(
        self, board: Board, config: Callable[[], Config], *,
        discovered: Callable[[], NodeTopology | None],
        activity: Callable[[], dict[int, GpuActivityReading]],
        read_activity: Callable[[], Any],
        holding: Callable[[], Holding],
        on_swap: Callable[[Snapshot], None],
    ) -> None:
        self.board = board
        self.config = config
        self._discovered = discovered
        self._activity = activity
        self._read_activity = read_activity  # refreshed before each step: the schedule weighs it
        self._holding = holding
        self._on_swap = on_swap  # a snapshot with new figures was swapped in
        self.service: ProbeService | None = None
        self.rounds: Counter[str] = Counter()  # by outcome: "ok" or the failure kind
        self.seconds_total = 0.0
        self.wake = asyncio.Event()
        self._signature: tuple | None = None
        self._link_signatures: dict[Any, tuple] = {}

    def publish(self, in_progress: bool | None = None) -> None:
        """Put the counts and the worker's state where the doors read them."""
        service = self.service
        running = service is not None and service.schedule.in_flight is not None
        self.board.publish(
            unverified=service.unverified if service is not None else frozenset(),
            probes=ProbeState(
                enabled=self.config().probes_enabled,
                rounds=MappingProxyType(dict(self.rounds)),
                seconds_total=self.seconds_total,
                latest_round=service.runner.latest_round() if service is not None else None,
                consecutive_failures=service.runner.consecutive_failures if service is not None else None,
                in_progress=running if in_progress is None else in_progress,
            ),
        )

    def unverified(self) -> frozenset[int]:
        """GPUs a job gave back and the probes have not checked since: placement prefers
        the others at equal merit (placement.live)."""
        return self.service.unverified if self.service is not None else frozenset()

    # -- what the other loops tell it ----------------------------------------------------
    def note_topology(self, node: NodeTopology) -> None:
        """A new discovery: start probing (first time) or tell the schedule what changed."""
        config = self.config()
        signature = topology_signature(node)
        changed = self._signature is not None and signature != self._signature
        self._signature = signature
        if not config.probes_enabled:
            return
        from topoagent.probes.paths import probe_paths

        gpus = [g.index for g in node.gpus]
        links, old_links = link_signatures(node), self._link_signatures
        self._link_signatures = links
        if self.service is None:
            self.service = make_probe_service(config, gpus)
            if self.service.unavailable is not None:  # said once, now, not at the first round's failure
                log_event("probes_unavailable", logging.WARNING, backend=config.probe_backend, error=self.service.unavailable)
        elif changed:
            rearmed = [t for t, sig in links.items() if old_links.get(t) != sig]
            self.service.on_topology_change(gpus, rearmed)
            log_event("probe_topology_changed", gpus=len(gpus), rearmed=",".join(t.key for t in rearmed) or "none")
        self.service.matrix = node.distance_matrix()
        self.service.schedule.paths, self.service.schedule.footprints = probe_paths(node)
        self.publish()
        self.wake.set()

    async def overlay(self, node: NodeTopology, previous: DistanceMatrix | None) -> tuple[
            DistanceMatrix, tuple[ProbeFigure, ...], tuple[Finding, ...], frozenset[frozenset[int]]]:
        """A new discovery's matrix with the figures so far overlaid (as is, probes off)."""
        if not (self.config().probes_enabled and self.service is not None):
            return node.distance_matrix(), (), (), frozenset()
        figures, under_load = tuple(self.service.figures()), frozenset(self.service.under_load)
        matrix, findings = await asyncio.to_thread(overlay_probes, node, list(figures), previous, self.service)
        return matrix, figures, findings, under_load

    async def lease_granted(self, lease: Lease) -> None:
        if self.service is not None:
            await asyncio.to_thread(self.service.on_lease_granted, lease.id, lease.gpus)
            self.publish()

    async def lease_ended(self, lease: Lease) -> None:
        """A lease ended: its GPUs are probed (and unverified) before the next placement."""
        if self.service is None:
            return
        await asyncio.to_thread(self.service.on_lease_ended, lease.id, lease.gpus)
        self.publish()
        log_event("probe_gpus_released", lease=lease.id[:6], gpus=",".join(map(str, lease.gpus)))
        self.wake.set()

    def processes_ended(self, gpus: frozenset[int]) -> None:
        """NVML saw a GPU's processes end: a job left it; probe it before the next one."""
        if self.service is None or not gpus:
            return
        self.service.on_gpus_released(gpus)
        self.publish()
        log_event("probe_gpus_released", reason="processes_ended", gpus=",".join(map(str, sorted(gpus))))
        self.wake.set()

    def gpu_activity(self) -> dict[int, Any]:
        from topoagent.probes.schedule import GpuActivity

        own = os.getpid()
        activity = {
            i: GpuActivity(seen.utilization_percent, sum(1 for p in seen.processes if p != own))
            for i, seen in self._activity().items()
        }
        for gpu in self._holding().holder:
            # A leased GPU belongs to a job that may start any moment: leave it alone.
            seen = activity.get(gpu, GpuActivity())
            activity[gpu] = GpuActivity(seen.utilization_percent, seen.other_processes + 1)
        return activity

    # -- POST /probe ---------------------------------------------------------------------
    def request_round(self) -> dict[str, Any]:
        """Every target due now, busy GPUs and the duty cap overridden."""
        service = self.service
        if not self.config().probes_enabled:
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
        self.wake.set()
        targets = sorted(schedule.states, key=lambda t: (not t.is_pair, t))  # the order they run in
        log_event("probe_round_requested", targets=len(targets))
        return {"backend": service.backend, "forced": True, "targets": [t.key for t in targets]}

    # -- the loop ------------------------------------------------------------------------
    async def step(self) -> None:
        """One turn of the probe loop: run what is due, or wait until something may be."""
        service = self.service
        config = self.config()
        if service is None or self.board.served.snapshot is None:
            await self._wait(1.0)
            return
        await self._read_activity()
        self.wake.clear()
        activity = self.gpu_activity()
        # Published as running before the step: seen only if the step waits, which it
        # does only when it claimed a target (nothing due returns at once).
        self.publish(in_progress=True)
        try:
            probe_round = await service.step(activity)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the probe glue must not stop the agent
            log_event("probe_crashed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
            service.schedule.in_flight = None
            self.publish()
            await self._wait(config.activity_interval_s)
            return
        self.publish()
        if probe_round is not None:
            self._account(probe_round)
            if probe_round.results:
                try:
                    await self._publish_figures()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the figures stay with the service; the next round retries
                    log_event("probe_publish_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
            return
        wakeup = service.schedule.next_wakeup()
        delay = config.activity_interval_s if wakeup is None else wakeup - service.schedule.clock()
        # Due but not allowed (busy GPUs, duty cap): look again when activity is re-read.
        await self._wait(min(max(delay, 0.05), config.activity_interval_s) if delay > 0 else config.activity_interval_s)

    async def _wait(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.wake.wait(), timeout)

    def _account(self, probe_round: ProbeRound) -> None:
        outcome = "ok" if probe_round.failure is None else probe_round.failure.kind
        self.rounds[outcome] += 1
        self.seconds_total += probe_round.duration_s
        self.publish()
        verdict = self.service.last_verdict if self.service else None
        target = verdict.target.key if verdict else "?"
        if probe_round.failure is None:
            log_event("probe_ok", target=target, results=len(probe_round.results), seconds=f"{probe_round.duration_s:.3f}", verdict=verdict.outcome if verdict else "-")
        elif probe_round.failure.kind != "backoff":
            log_event("probe_failed", logging.WARNING, target=target, kind=probe_round.failure.kind, error=probe_round.failure.message)

    async def _publish_figures(self) -> None:
        """Swap in a snapshot with the newest figures overlaid on the last discovery."""
        while self.service is not None:
            based_on, discovered = self.board.served.snapshot, self._discovered()
            if based_on is None or discovered is None:
                return
            figures = tuple(self.service.figures())
            matrix, findings = await asyncio.to_thread(overlay_probes, discovered, list(figures), based_on.matrix, self.service)
            loaded = frozenset(self.service.under_load)
            snapshot = based_on.with_probes(self.board.version + 1, matrix, figures, findings, loaded)
            await asyncio.to_thread(lambda: snapshot.etag)  # the JSON and its gzip, off the loop
            await asyncio.to_thread(warm_tables, snapshot.matrix)
            if self.board.served.snapshot is based_on:  # else a discovery swapped meanwhile: redo on it
                self.board.version += 1
                self.board.publish(snapshot=snapshot)
                self._on_swap(snapshot)
                return
