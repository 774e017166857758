"""The one interface the doors (exporters/: HTTP, Prometheus, the page) have to the
service: the current served value to render from, and the few requests that change
something.  A door renders only from what these return; it never reaches into a loop."""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from topoagent.config import Config
from topoagent.placement import NoFit, Placement, Request
from topoagent.service.lease_loop import StateUnavailable
from topoagent.service.leases import Lease
from topoagent.service.probe_loop import ProbeRunning, ProbesOff
from topoagent.service.served import Served, ServedCapacity

__all__ = ["ProbeRunning", "ProbesOff", "Service", "StateUnavailable"]

Answer = Placement | NoFit


class Service(Protocol):
    @property
    def config(self) -> Config:
        """The settings in force (a reload may swap them)."""
        ...

    def served(self) -> Served:
        """The current served value: take it once per request and read only it."""
        ...

    async def current_capacity(self) -> ServedCapacity | None:
        """The capacity figures of the current served value, waiting a bounded time
        (then the latest, marked stale; None before the first, and while a finding blocks
        placement)."""
        ...

    async def place(self, request: Request, holder_lease: str | None = None) -> Answer:
        """A dry run, counted by outcome; the GPUs of ``holder_lease`` count as free (its holder asks)."""
        ...

    async def reserve(self, request: Request, owner: str, ttl_s: float) -> tuple[Answer, Lease | None]:
        """Place and lease at once; raises StateUnavailable when the state directory fails."""
        ...

    async def release(self, lease_id: str) -> Lease | None:
        """The lease released (None: no such lease); raises StateUnavailable as reserve does."""
        ...

    def count_invalid_request(self) -> None:
        """A /place request refused as malformed, counted with the answered ones."""
        ...

    def request_refresh(self, reason: str) -> asyncio.Task:
        """Run discovery now (or join the run under way)."""
        ...

    def request_probe_round(self) -> dict[str, Any]:
        """Probe every target now; raises ProbesOff or ProbeRunning."""
        ...

    async def start(self) -> None: ...

    async def stop(self) -> None: ...
