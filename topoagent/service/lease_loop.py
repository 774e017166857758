"""The leases loop: the lease book (topoagent/service/leases.py) opened on the state directory,
swept for expired leases and changes other processes made, and changed by reserve and
release; publishes the leases it last read, so reads never touch disk or its lock."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

from topoagent.log import log_event
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Live, NoFit, Placement, Request
from topoagent.service.leases import Lease, LeaseStore, quarantine_report, state_unwritable
from topoagent.service.loop import LoopHealth
from topoagent.service.served import Board, LeaseQuarantine, LeaseRecovery

Answer = Placement | NoFit


class StateUnavailable(OSError):
    """The state directory failed under a change (read-only, full, gone); the message
    names it and says nothing was changed."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class LeaseLoop:
    def __init__(self, board: Board, ended: Callable[[Lease], Awaitable[None]]) -> None:
        self.board = board
        self._ended = ended  # a lease expired: its GPUs are probed before the next job
        self.store: LeaseStore | None = None
        self._said_corrupt: Path | None = None  # the moved-aside state file already logged
        self._said_quarantine: str | None = None  # the quarantine file's problem already logged
        self._published = -1  # the number of the store's read last published (numbered_leases)

    def open(self, state_dir: str, health: LoopHealth) -> None:
        """The book at start-up.  A disk error is the sweeper's to retry: serve meanwhile."""
        self.store = store = LeaseStore(state_dir)
        self.board.publish(lease_clock=store.monotonic)  # lifetimes run on the boot clock, not the wall clock
        self._took((0, ()))
        self._say_if_corrupt()
        try:
            leases = self._took(store.numbered_leases())
        except OSError as exc:
            health.failed(exc)
        else:
            log_event("leases_loaded", count=len(leases), path=store.path)

    def _took(self, read: tuple[int, tuple[Lease, ...]]) -> tuple[Lease, ...]:
        """Publish what the store held at that read (and whether its file was found corrupt),
        unless a newer read is already published: a sweep's thread that read the book before a
        reserve finished must not publish the book without that lease after it."""
        store = self.store
        assert store is not None
        number, leases = read
        if number < self._published:
            return self.board.served.leases or ()
        self._published = number
        recovery = None
        if store.recovered_from is not None:
            recovery = LeaseRecovery(str(store.path), str(store.recovered_from), store.recovery_error)
        quarantine = LeaseQuarantine(str(store.quarantine_path), tuple(quarantine_report(store)), store.quarantine_error)
        self.board.publish(leases=leases, lease_recovery=recovery, lease_quarantine=quarantine)
        if store.quarantine_error != self._said_quarantine:  # once per problem, not per read
            self._said_quarantine = store.quarantine_error
            if store.quarantine_error is not None:
                log_event("lease_quarantine_unreadable", logging.ERROR, file=store.quarantine_path, error=store.quarantine_error)
        return leases

    def _know_node(self, store: LeaseStore) -> None:
        """Tell the store where each GPU sits now, from the latest discovery: how it tells a
        lease by UUID and one by index alone apart on loading (one GPU, one lease)."""
        snapshot = self.board.served.snapshot
        if snapshot is not None:
            store.gpus_now = {g.uuid: g.index for g in snapshot.matrix.gpus if g.uuid}

    async def sweep(self) -> None:
        """Drop expired leases from the file and take up what other processes sharing the
        state directory changed.  On a disk error this raises and the leases stay."""
        assert self.store is not None
        store = self.store
        self._know_node(store)
        before = {lease.id: lease for lease in self.board.served.leases or ()}
        leases = self._took(await asyncio.to_thread(lambda: (store.expire(), store.numbered_leases())[1]))
        self._say_if_corrupt()
        now_ids = {lease.id for lease in leases}
        for lid, lease in before.items():
            if lid not in now_ids and lease.deadline <= store.monotonic():
                log_event("lease_expired", lease=lid[:6], owner=lease.owner)
                await self._ended(lease)

    async def reserve(
        self, matrix: DistanceMatrix, request: Request, owner: str, ttl_s: float, running: frozenset[int], live: Live,
    ) -> tuple[Answer, Lease | None]:
        """Place and lease in one step under the store's lock (so no GPU is leased
        twice), durable on disk before this returns."""
        assert self.store is not None
        store = self.store

        def work() -> tuple[Answer, Lease | None, tuple[int, tuple[Lease, ...]]]:
            answer = store.reserve_placement(matrix, request, owner, ttl_s, running, live)
            if isinstance(answer, NoFit):
                return answer, None, store.numbered_leases()
            lease, placement = answer
            return placement, lease, store.numbered_leases()

        answer, lease, leases = await asyncio.to_thread(work)
        self._took(leases)
        if lease:
            log_event("lease_granted", lease=lease.id[:6], owner=owner, gpus=",".join(map(str, lease.gpus)), ttl_s=ttl_s)
        return answer, lease

    async def release(self, lease_id: str) -> Lease | None:
        assert self.store is not None
        store = self.store
        self._know_node(store)

        def work() -> tuple[Lease | None, tuple[int, tuple[Lease, ...]]]:
            held = {lease.id: lease for lease in store.leases()}
            released = held.get(lease_id) if store.release(lease_id) else None
            return released, store.numbered_leases()

        lease, leases = await asyncio.to_thread(work)
        self._took(leases)
        if lease:
            log_event("lease_released", lease=lease_id[:6], owner=lease.owner)
            await self._ended(lease)
        return lease

    def unavailable(self, exc: OSError) -> StateUnavailable:
        """What a change that failed on the state directory tells its caller."""
        assert self.store is not None
        return StateUnavailable(state_unwritable(self.store, exc))

    def _say_if_corrupt(self) -> None:
        """One line for each state file moved aside (at start-up, or found later)."""
        store = self.store
        if store is not None and store.recovered_from is not None and store.recovered_from != self._said_corrupt:
            self._said_corrupt = store.recovered_from
            log_event(
                "leases_corrupt", logging.ERROR, file=store.path, moved_to=store.recovered_from,
                error=store.recovery_error, action="the leases in it are no longer held; see docs/service.md (Leases)",
            )
