"""The one way a service loop runs: every so often, for the life of the agent, and
never stopped for good by a failure (counted and logged by its LoopHealth)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from topoagent.log import log_event

# A background loop that keeps failing says so at most this often (the log is on a disk too).
LOOP_LOG_EVERY_S = 60.0
# ... and tries again at most this often, whatever its interval.
LOOP_RETRY_MIN_S = 1.0


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


async def keep_running(health: LoopHealth, iteration: Callable[[], Awaitable[Any]], every: Callable[[], float], *, wait_first: bool = False) -> None:
    """Run ``iteration`` every ``every()`` seconds for the life of the agent.  One that
    fails -- a read-only or full disk, no file descriptors left, a bug -- is counted
    and logged by its LoopHealth, what it serves stays as it was, and the next runs
    as usual: a transient error must never stop a background task for good."""
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


def run_in_daemon_thread(fn: Callable[[], Any], name: str) -> asyncio.Future:
    """Run blocking work where a hang cannot hold the process hostage.

    asyncio.to_thread's pool threads are joined at exit, so one read stuck on a dead
    device would stop the agent from ever exiting; a daemon thread is simply abandoned.
    (Discovery does not run here: a thread cannot be stopped, so it runs in a child
    process that a timeout kills; see topoagent.node.discovery_process.)  ``name`` names the
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
