"""The capacity figures (GET /capacity, /metrics): computed once per (snapshot, busy set)
in a daemon thread, off the event loop, under ``[placement] capacity_budget_ms``, and
published; requests arriving meanwhile share one computation."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from topoagent.config import Config
from topoagent.log import log_event
from topoagent.placement import Live
from topoagent.service.capacity import capacity
from topoagent.service.loop import run_in_daemon_thread
from topoagent.service.served import Board, ServedCapacity


class CapacityLoop:
    def __init__(self, board: Board, config: Callable[[], Config], live: Callable[[], Live], stopping: asyncio.Event) -> None:
        self.board = board
        self.config = config
        self.live = live  # what /place weighs at equal merit, so each k's GPUs are the ones /place gives
        self._stopping = stopping  # set when the agent starts to stop
        self.task: asyncio.Task | None = None  # computing until the figures are current

    def wait_s(self) -> float:
        """How long a request waits for current figures: one computation already under
        way for an older key, then its own, each keeping to the budget, and a margin."""
        return 2 * self.config().placement_capacity_budget_ms / 1000 + 0.25

    async def current(self) -> ServedCapacity | None:
        """The figures of the current (snapshot, busy set).  Past ``wait_s`` the latest
        figures are served marked stale (None when there are none yet); the computation
        goes on for the next request."""
        served = self.board.served
        key = served.capacity_key()
        if key is None:  # nothing to compute (no snapshot, or a node not ready for placement)
            return None
        if served.latest_capacity is not None and served.latest_capacity.key == key:
            return served.latest_capacity
        task = self.task
        if task is None or task.done():
            task = self.task = asyncio.create_task(self._compute(), name="capacity")
        # A request given up does not cancel the computation; a stopping agent ends the
        # wait at once, so SIGTERM's drain never waits for figures.
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            await asyncio.wait({task, stopping}, timeout=self.wait_s(), return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopping.cancel()
        return self.board.served.capacity

    async def _compute(self) -> None:
        """Compute the figures until they are of the current key (a lease granted during a
        computation makes one more); one computation at a time, whoever asks."""
        while (key := self.board.served.capacity_key()) is not None:
            latest = self.board.served.latest_capacity
            if latest is not None and latest.key == key:
                return
            snapshot = self.board.served.snapshot
            assert snapshot is not None
            matrix, (_, leased, running, _) = snapshot.matrix, key
            live, budget = self.live(), self.config().placement_capacity_budget_ms
            log_event("capacity_computing", logging.DEBUG, snapshot_version=key[0], budget_ms=budget)
            started = time.monotonic()
            try:
                computed = await run_in_daemon_thread(
                    lambda: ServedCapacity.of(key, capacity(matrix, leased, running, live, budget_ms=budget)), "capacity")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug: the latest figures stay served; say it and stop
                log_event("capacity_failed", logging.ERROR, error=f"{type(exc).__name__}: {exc}")
                return
            self.board.publish(latest_capacity=computed)
            fits = computed.capacity.fits
            log_event("capacity_computed", logging.DEBUG, snapshot_version=key[0], gpus=len(fits),
                      not_proven=sum(not f.proven_optimal for f in fits), seconds=f"{time.monotonic() - started:.3f}")
