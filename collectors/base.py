"""What every collector returns: its facts plus how the read went (ok / no data / error)."""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from topoagent.errors import TopoagentError
from topoagent.vocabulary import Status

T = TypeVar("T")

# Kept as names for the collectors that compare with them.
OK = Status.OK
NO_DATA = Status.NO_DATA
ERROR = Status.ERROR


class SourceError(TopoagentError):
    """A source exists but cannot be read as expected; the message names file and reason."""


class NoData(TopoagentError):
    """The source is simply absent on this node (no NVML, no /sys/class/infiniband)."""


def command_missing(on_node: bool, tool: str, hint: str = "") -> NoData:
    """No answer from ``tool``: the node lacks it (live, or recorded so: ``hint`` says what
    to install, and what for), or a recording simply holds no output of it -- then an
    install hint would send the reader to fix the machine replaying it."""
    if on_node:
        return NoData(f"{tool} not found{f' ({hint})' if hint else ''}")
    return NoData(f"the recording holds no {tool} output (not recorded on its node)")


def command_failed(argv: list[str], returncode: int, stdout: str, stderr: str, hint: str = "") -> SourceError:
    """A command that exited non-zero, named with its code and the last line it said
    (stderr, else stdout: the diagnostic tools end with the failure, e.g. smpquery's
    "iberror: failed: ..."); ``hint`` says what to check."""
    lines = (stderr.strip() or stdout.strip()).splitlines()
    said = lines[-1][:200] if lines else "no output"
    return SourceError(f"{' '.join(argv)}: exit code {returncode}: {said}{f' ({hint})' if hint else ''}")


@dataclass(frozen=True, slots=True)
class CollectorResult(Generic[T]):
    """What one collector saw: its status, its data (None unless ok) and how long it took."""

    name: str
    status: Status
    data: T | None = None
    message: str | None = None
    seconds: float = 0.0
    # Problems with single files that did not stop the collector ("numa_node of X: 'abc'").
    warnings: tuple[str, ...] = ()
    # An optional source (the fabric's neighbours): its failure is a warning, not a fault
    # of the node's facts.
    optional: bool = False
    # The read raised what no read means to raise: a fault of topoagent's, never a fact
    # about the node (no finding may read it as the machine's).
    bug: bool = False

    @property
    def ok(self) -> bool:
        return self.status == OK


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` in a worker thread under a running event loop (the service), else here.

    One-shot commands (`discover`, `place --root`) drive collectors without an event loop
    so they need not import asyncio (and with it ssl): a third of their start-up time.
    No loop can be running while asyncio was never imported.
    """
    asyncio = sys.modules.get("asyncio")
    if asyncio is not None and asyncio._get_running_loop() is not None:
        result: T = await asyncio.to_thread(fn, *args)
        return result
    return fn(*args)


async def run_collector(
    name: str, read: Callable[[], Awaitable[tuple[Any, tuple[str, ...]]]], *, optional: bool = False
) -> CollectorResult[Any]:
    """Run ``read`` and turn what happens into a CollectorResult.

    The errors a read means to raise (the project's own: a source that cannot be read, a
    parse error naming its file; and the OS's) become an ``error`` result with their
    message.  Anything else is a bug met on odd input (a parser that trusted a JSON
    field's type): it becomes an ``error`` result too, named as such (``crashed``), so one
    source's bug never stops discovery; the traceback goes to the debug log.
    """
    started = time.perf_counter()
    try:
        data, warnings = await read()
    except NoData as exc:
        return CollectorResult(name, NO_DATA, None, str(exc) or None, time.perf_counter() - started, optional=optional)
    except (TopoagentError, OSError) as exc:  # SourceError, HostError, parsers' typed errors
        return CollectorResult(name, ERROR, None, str(exc), time.perf_counter() - started, optional=optional)
    except Exception as exc:
        return crashed(name, exc, time.perf_counter() - started, optional=optional)
    return CollectorResult(name, OK, data, None, time.perf_counter() - started, warnings, optional)


def crashed(name: str, exc: Exception, seconds: float = 0.0, *, optional: bool = False) -> CollectorResult[Any]:
    """The ``error`` result of a collector that raised what no read means to raise (a bug)."""
    return CollectorResult(name, ERROR, None, report_bug(name, exc), seconds, optional=optional, bug=True)


# The bugs whose traceback was logged at error level, by (source, its one-line message): a
# counter source that crashes at every read repeats it at debug level only.  Bounded.
_REPORTED: dict[tuple[str, str], None] = {}
_MAX_REPORTED = 256


def report_bug(source: str, exc: Exception) -> str:
    """Log a source's exception that no read means to raise (a fault of ours), with its
    traceback at error level the first time, and say it in one line.

    The line names the exception's type and where it was raised (its notes: "in
    pynvml.nvmlDeviceGetGpuFabricInfoV"), so a finding says "a bug", not "a damaged file"
    or "the GPU said no".
    """
    import logging
    import traceback

    from topoagent.log import log_event

    said = str(exc).splitlines()[0][:200] if str(exc) else ""
    where = "; ".join(getattr(exc, "__notes__", ()))
    line = (f"collector crashed ({type(exc).__name__}{f': {said}' if said else ''}{f', {where}' if where else ''}); "
            "this is a topoagent bug, please report it")
    first = (source, line) not in _REPORTED
    if first:
        if len(_REPORTED) >= _MAX_REPORTED:
            _REPORTED.pop(next(iter(_REPORTED)))
        _REPORTED[(source, line)] = None
    log_event("collector_crashed", logging.ERROR if first else logging.DEBUG, collector=source, error=type(exc).__name__,
              traceback="".join(traceback.format_exception(exc)))
    return line
