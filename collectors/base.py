"""What every collector returns: its facts plus how the read went (ok / no data / error)."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from topoagent.host import HostError
from topoagent.vocabulary import Status

T = TypeVar("T")

# Kept as names for the collectors that compare with them.
OK = Status.OK
NO_DATA = Status.NO_DATA
ERROR = Status.ERROR


class SourceError(Exception):
    """A source exists but cannot be read as expected; the message names file and reason."""


class NoData(Exception):
    """The source is simply absent on this node (no NVML, no /sys/class/infiniband)."""


@dataclass(frozen=True, slots=True)
class CollectorResult(Generic[T]):
    name: str
    status: Status
    data: T | None = None
    message: str | None = None
    seconds: float = 0.0
    # Problems with single files that did not stop the collector ("numa_node of X: 'abc'").
    warnings: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.status == OK


async def run_collector(
    name: str, read: Callable[[], Awaitable[tuple[Any, tuple[str, ...]]]]
) -> CollectorResult[Any]:
    """Run ``read`` and turn what happens into a CollectorResult; never raises."""
    started = time.perf_counter()
    try:
        data, warnings = await read()
    except NoData as exc:
        return CollectorResult(name, NO_DATA, None, str(exc) or None, time.perf_counter() - started)
    except (SourceError, HostError, OSError, ValueError) as exc:
        return CollectorResult(name, ERROR, None, str(exc), time.perf_counter() - started)
    return CollectorResult(name, OK, data, None, time.perf_counter() - started, warnings)
