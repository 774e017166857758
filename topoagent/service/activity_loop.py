"""The activity loop: what NVML says each GPU runs, re-read every activity_interval_s;
publishes the GPUs running another's processes (placement keeps off them)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from topoagent.config import Config
from topoagent.log import log_event
from topoagent.node.host import Host
from topoagent.node.model import NodeTopology
from topoagent.service.loop import run_in_daemon_thread
from topoagent.service.served import Board

if TYPE_CHECKING:
    from topoagent.collectors.nvml import GpuActivityReading


class ActivityLoop:
    def __init__(
        self, board: Board, config: Callable[[], Config], host: Callable[[], Host | None],
        processes_ended: Callable[[frozenset[int]], None],
    ) -> None:
        self.board = board
        self.config = config
        self.host = host
        self._processes_ended = processes_ended  # a job left these GPUs (the probes check them)
        self.readings: dict[int, GpuActivityReading] = {}  # GPU index -> what it runs
        self.read_at: float | None = None

    def running(self) -> frozenset[int]:
        """GPUs NVML last saw running compute processes (a job the agent did not place)."""
        own = os.getpid()
        return frozenset(i for i, seen in self.readings.items() if any(p != own for p in seen.processes))

    def take(self, readings: dict[int, GpuActivityReading]) -> None:
        self.readings = readings
        self.read_at = time.time()
        self.board.publish(running=self.running())

    def take_from_node(self, node: NodeTopology) -> None:
        """What discovery saw: the readings until the loop's next."""
        from topoagent.collectors.nvml import GpuActivityReading

        self.take({g.index: GpuActivityReading(g.index, g.utilization_percent, g.processes) for g in node.gpus})

    async def read(self) -> None:
        """Ask NVML (or the recording) what each GPU runs; on failure keep what we had."""
        from topoagent.collectors.nvml import read_activity

        host = self.host()
        if host is None:
            return
        try:
            readings = await asyncio.wait_for(run_in_daemon_thread(lambda: read_activity(host), "activity"), self.config().timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # NVML hung or failed: busy stays as last seen
            log_event("gpu_activity_failed", logging.WARNING, error=f"{type(exc).__name__}: {exc}")
            return
        if readings is not None:
            running_before = self.running()
            self.take({r.index: r for r in readings})
            self._processes_ended(running_before - self.running())
