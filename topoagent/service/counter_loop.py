"""The counters loop (telemetry): reads every counter source, keeps the last samples of
each series and swaps in a snapshot with the new rates and findings."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from topoagent.config import Config
from topoagent.node.host import Host
from topoagent.service.loop import run_in_daemon_thread
from topoagent.service.memory import release_free_memory
from topoagent.service.served import Board
from topoagent.service.telemetry import History

if TYPE_CHECKING:
    from topoagent.collectors.nvml import LiveCounterReader

FIRST_SNAPSHOT_POLL_S = 0.05  # how often the first read looks for discovery's first snapshot


class CounterLoop:
    def __init__(self, board: Board, config: Callable[[], Config], host: Callable[[], Host | None]) -> None:
        self.board = board
        self.config = config
        self.host = host
        self.history = History()  # the last two samples of each series (rates)
        self._reader: LiveCounterReader | None = None  # NVML kept open for the counters
        self._replayed: Host | None = None  # the recording whose samples were all taken in
        self._reads: dict[str, asyncio.Future] = {}  # source -> its last read, maybe still running

    async def read(self) -> None:
        """Read every counter source (each in its own thread, under its own timeout), take
        the samples into the history and serve the new rates and findings.  A recorded node
        gives all its recorded samples at the first read, then nothing new."""
        from topoagent.collectors.nvml import LiveCounterReader
        from topoagent.collectors.registry import COUNTER_SOURCES  # not via node.discovery: a child discovers
        from topoagent.service.telemetry import Context, Sample, read_live, recorded_samples, served

        # The AER source reads the devices discovery found: the first read waits for the first
        # snapshot, not an interval after it (the first scrapes carried no counters for 10 s).
        while self.board.served.snapshot is None:
            await asyncio.sleep(FIRST_SNAPSHOT_POLL_S)
        host, snapshot = self.host(), self.board.served.snapshot
        if host is None or snapshot is None:
            return
        if host is self._replayed:
            # A recording gave all its samples at the first read: nothing new to read, and no
            # reason to parse its telemetry.json again (2.7 MB on the 128-GPU node) every interval.
            return
        config = self.config()
        parsers = {s.name: s.parse for s in COUNTER_SOURCES}
        samples: list[Sample] = []
        recorded = None if host.live else await asyncio.to_thread(recorded_samples, host)
        if recorded is not None:
            samples = recorded
            self._replayed = host
        else:
            if self._reader is None:
                self._reader = LiveCounterReader()
            context = Context(host, snapshot.node, self._reader)
            timeout = config.telemetry_timeout_s

            async def one(source: Any) -> Sample:
                stuck = self._reads.get(source.name)
                if stuck is not None and not stuck.done():
                    # A read that hung is abandoned, not killed: never start a second beside it.
                    return Sample(source.name, time.monotonic(), None, "the previous read has not returned")
                read = self._reads[source.name] = run_in_daemon_thread(lambda: read_live(source, context), "counters")
                try:
                    return await asyncio.wait_for(asyncio.shield(read), timeout)
                except TimeoutError:
                    return Sample(source.name, time.monotonic(), None, f"timed out after {timeout:g}s", timeout)

            samples = list(await asyncio.gather(*(one(s) for s in COUNTER_SOURCES)))
        if not samples:
            return  # a recording without samples: nothing new, so the snapshot (and its ETags) stand
        for sample in samples:
            if sample.source in parsers:
                self.history.add(sample, parsers[sample.source])
        telemetry = served(self.history, dict(self.config().telemetry_thresholds), snapshot.node)
        current = self.board.served.snapshot
        if current is not None:
            self.board.version += 1
            self.board.publish(snapshot=current.with_telemetry(self.board.version, telemetry))
        if recorded is not None:
            # A recording's samples are parsed once, all at once (its telemetry.json: 2.7 MB
            # on the 128-GPU node): give back that peak, which no warming's trim may follow --
            # once this read has returned, as the samples are held till then (by its locals,
            # and by the finished thread's future the loop is still waking it up from).
            asyncio.get_running_loop().call_soon(release_free_memory)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
