"""The discovery loop: runs discovery (in a child process) on a timer, on udev hotplug
events (debounced; live root only) and on demand, and publishes each new snapshot.

A run that hangs is cut off by its timeout; a run that fails leaves the last good
snapshot in place, marked stale, with the error recorded, and is tried again soon (a
back-off from RETRY_FIRST_S, doubling, up to RETRY_MAX_S) until one succeeds; then the
timer's schedule alone runs it again."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace

from topoagent.config import Config
from topoagent.errors import TopoagentError
from topoagent.log import log_event
from topoagent.node.discovery_process import DiscoveryFailed
from topoagent.node.host import Host
from topoagent.node.model import CollectorStatus, NodeTopology
from topoagent.placement import warm_answers
from topoagent.placement.search import warm as warm_tables
from topoagent.service.activity_loop import ActivityLoop
from topoagent.service.memory import release_free_memory
from topoagent.service.probe_loop import ProbeLoop
from topoagent.service.served import Board, DiscoveryRetry, Snapshot, counted
from topoagent.vocabulary import Status

Discover = Callable[[Host], Awaitable[NodeTopology]]

# After a failed run the next one comes this soon, then twice as late after each failure in
# a row, up to RETRY_MAX_S (and never later than the timer would run it anyway).  A minute:
# a node whose start-up discovery failed (a driver still loading, a device wedged for a
# while) is ready within a minute of the cause going away, and a cause that stays costs one
# run a minute -- a run takes under a second on a real node, and at most [discovery] timeout_s.
RETRY_FIRST_S = 2.0
RETRY_MAX_S = 60.0


def retry_delay(failures: int, interval_s: float) -> float:
    """How long after the ``failures``-th failed run in a row the next one starts."""
    return min(RETRY_FIRST_S * 2 ** min(failures - 1, 16), RETRY_MAX_S, interval_s)


def _log_warm_failure(done: asyncio.Future) -> None:
    if not done.cancelled() and done.exception() is not None:  # a bug: requests still build what they need
        log_event("placement_warm_failed", logging.ERROR, error=f"{type(done.exception()).__name__}: {done.exception()}")


class DiscoveryLoop:
    def __init__(
        self, board: Board, config: Callable[[], Config], host: Callable[[], Host | None], discover: Discover,
        probes: ProbeLoop, activity: ActivityLoop,
    ) -> None:
        self.board = board
        self.config = config
        self.host = host
        self._discover = discover
        self._probes = probes  # told of each new node; overlays its figures on it
        self._activity = activity  # takes what discovery saw each GPU run
        self.discovered: NodeTopology | None = None  # discovery's facts before any overlay
        self._last_success: dict[str, float] = {}  # collector name -> Unix time of its last good run
        self._refresh_task: asyncio.Task | None = None
        self._refresh_again = False
        self._debounce: asyncio.TimerHandle | None = None
        self._retry: asyncio.TimerHandle | None = None  # the next run after a failure
        self._warming: asyncio.Future | None = None  # the latest snapshot's answers being built
        self._stopping = threading.Event()  # ends a warming thread: exit would wait for it

    def request_refresh(self, reason: str) -> asyncio.Task:
        """Start a discovery run, or join the one running (then run once more after it)."""
        if self._refresh_task and not self._refresh_task.done():
            self._refresh_again = True
            return self._refresh_task
        self._refresh_task = asyncio.create_task(self._refresh(reason), name="discovery")
        return self._refresh_task

    async def on_timer(self) -> None:
        await self.request_refresh("timer" if self.board.served.snapshot else "startup")

    def on_device_event(self, subsystem: str, action: str, name: str) -> None:
        """A udev event: refresh once things settle (a NIC reset fires dozens)."""
        log_event("device_event", subsystem=subsystem, action=action, device=name)
        if self._debounce:
            self._debounce.cancel()
        loop = asyncio.get_running_loop()
        self._debounce = loop.call_later(self.config().udev_debounce_s, self.request_refresh, "udev")

    def pending(self) -> list[asyncio.Task]:
        """What stop() must end besides the loops."""
        self._stopping.set()
        if self._debounce:
            self._debounce.cancel()
        self._cancel_retry()
        return [self._refresh_task] if self._refresh_task else []

    async def _refresh(self, reason: str) -> Snapshot | None:
        while True:
            self._refresh_again = False
            await self._refresh_once(reason)
            if not self._refresh_again:
                return self.board.served.snapshot
            reason = "coalesced"

    def _cancel_retry(self) -> None:
        if self._retry:
            self._retry.cancel()
            self._retry = None

    async def _refresh_once(self, reason: str) -> None:
        self._cancel_retry()  # this run is the retry, whatever started it
        host = self.host()
        assert host is not None
        started = time.time()
        timeout = self.config().timeout_s
        try:
            node = await asyncio.wait_for(self._discover(host), timeout)
        except TimeoutError:  # the run's process was killed: nothing of it is left behind
            return self._failed(f"discovery timed out after {timeout:g}s", started, reason)
        except asyncio.CancelledError:
            raise
        except DiscoveryFailed as exc:  # already "Type: message", as the child saw it
            return self._failed(str(exc), started, reason)
        except (TopoagentError, OSError) as exc:  # the node (or its recording) could not be read
            return self._failed(f"{type(exc).__name__}: {exc}", started, reason)
        except Exception as exc:  # our bug: it must not take the agent down, and is logged with its traceback
            from topoagent.collectors.base import report_bug

            return self._failed(report_bug("discovery", exc), started, reason)
        now = time.time()
        for c in node.collectors:
            if c.status is not Status.ERROR:  # node_exporter's rule: absent is quiet, not failed
                self._last_success[c.name] = now
        previous = self.board.served.snapshot
        if previous is not None:
            # A source that worked before and fails now would make the new facts poorer
            # (an nvidia-smi timeout drops every declared level): keep the old facts.
            # A source that answered before and is gone now (no_data) counts as lost too.
            worked = {c.name for c in previous.node.collectors if c.status is Status.OK}
            lost = [c for c in node.collectors if c.status is not Status.OK and c.name in worked]
            if lost:
                error = "; ".join(f"collector {c.name}: {c.status}: {c.message}" for c in lost)
                return self._failed(error, started, reason, node.collectors)
        self.discovered = node
        self._probes.note_topology(node)
        self._activity.take_from_node(node)
        current = self.board.served.snapshot
        matrix, figures, probe_findings, under_load = await self._probes.overlay(node, current.matrix if current is not None else None)
        snapshot = Snapshot(
            version=self.board.version + 1, node=node, matrix=matrix, built_at=now, collectors=node.collectors,
            last_success_at=dict(self._last_success), probe_figures=figures, probe_findings=probe_findings,
            probes_under_load=under_load, telemetry=previous.telemetry if previous else None,
        ).with_health()
        await asyncio.to_thread(lambda: snapshot.etag)  # serialise (and gzip) off the loop, once
        await asyncio.to_thread(warm_tables, snapshot.matrix)  # the first /place is as fast as the rest
        self.board.version += 1
        self.board.publish(snapshot=snapshot, discovery_runs=counted(self.board.served.discovery_runs, "success"), discovery_retry=None)
        self.warm_answers(snapshot)
        log_event("discovery_ok", reason=reason, version=self.board.version, gpus=len(node.gpus), findings=len(snapshot.findings),
                  seconds=f"{time.time() - started:.3f}")

    def warm_answers(self, snapshot: Snapshot) -> None:
        """Build the new matrix's answers in the background: requests need not wait for
        it (they build what is missing), and the swap did not."""
        self._warming = asyncio.ensure_future(asyncio.to_thread(warm_answers, snapshot.matrix, stopped=self._stopping.is_set))
        self._warming.add_done_callback(_log_warm_failure)
        # The swap's peak is over once the answers are warm: give back what it freed.
        self._warming.add_done_callback(lambda _: release_free_memory())

    def _failed(self, error: str, started: float, reason: str, statuses: tuple[CollectorStatus, ...] | None = None) -> None:
        last = self.board.served.discovery_retry
        failures = (last.failures if last else 0) + 1
        delay = retry_delay(failures, self.config().interval_s)
        now = time.time()
        self._retry = asyncio.get_running_loop().call_later(delay, self.request_refresh, "retry")
        self.board.publish(discovery_runs=counted(self.board.served.discovery_runs, "failure"),
                           discovery_retry=DiscoveryRetry(error, failures, now, now + delay))
        elapsed = now - started
        log_event("discovery_failed", logging.ERROR, reason=reason, error=error, seconds=f"{elapsed:.3f}",
                  failures=failures, retry_in_s=f"{delay:g}")
        current = self.board.served.snapshot
        if current is None:
            return
        if statuses is None:  # the whole run failed: no source answered this time
            statuses = tuple(replace(c, status=Status.ERROR, message=error, seconds=elapsed, warnings=()) for c in current.collectors)
        self.board.version += 1
        stale = current.marked_stale(self.board.version, error, time.time(), statuses)
        self.board.publish(snapshot=replace(stale, last_success_at=dict(self._last_success)))


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
