"""Leases: GPUs reserved for an owner until a deadline, persisted so a crash loses none.

Every change is written to ``<state_dir>/leases.json`` atomically (temporary file, fsync,
rename, fsync of the directory) *before* the call returns, so an acknowledged lease
survives a SIGKILL or a power cut.  Changes are serialised by a thread lock and an
``flock`` on ``<state_dir>/leases.lock``, and each change re-reads the file under that
lock, so concurrent reserve calls -- threads, asyncio tasks via ``asyncio.to_thread``,
or several processes sharing the directory -- never lease a GPU twice.

A state file that cannot be read is moved aside (``leases.json.corrupt-<time>``) with an
error logged and recorded in ``LeaseStore.recovered_from``; the store never crashes on
it and never silently pretends it was empty.
"""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from topoagent.matrix import DistanceMatrix
from topoagent.placement import NoFit, Placement, Request, place
from topoagent.schema import lease_document

STATE_FILE = "leases.json"
LOCK_FILE = "leases.lock"
SCHEMA = 1


class LeaseError(Exception):
    """A lease request that cannot be granted (the message says why)."""


class LeaseConflict(LeaseError):
    """A requested GPU is already leased."""


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    owner: str
    gpus: tuple[int, ...]  # GPU indices, in rank order when from a placement
    created_at: float
    expires_at: float

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> Lease:
        gpus = obj["gpus"]
        if not isinstance(obj["id"], str) or not isinstance(obj["owner"], str):
            raise ValueError("lease id and owner must be strings")
        if not isinstance(gpus, list) or not all(isinstance(g, int) and not isinstance(g, bool) for g in gpus):
            raise ValueError("lease gpus must be a list of GPU indices")
        return cls(obj["id"], obj["owner"], tuple(gpus), float(obj["created_at"]), float(obj["expires_at"]))


class LeaseStore:
    def __init__(self, state_dir: str | os.PathLike[str], clock: Callable[[], float] = time.time):
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / STATE_FILE
        self.clock = clock
        self.recovered_from: Path | None = None  # where a corrupt state file was moved
        self.recovery_error: str | None = None  # why it could not be read (the owner logs it)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        with self._locked():
            pass  # loads (and moves aside a corrupt file) once, at start

    # --- reading and writing the state file ---------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            fd = os.open(self.state_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._leases = self._load()
                yield
            finally:
                os.close(fd)  # closing drops the flock

    def _load(self) -> dict[str, Lease]:
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return {}
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("schema") != SCHEMA:
                raise ValueError(f"expected schema {SCHEMA}")
            leases = [Lease.from_json(item) for item in data["leases"]]
        except (ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time() * 1000)}")
            os.replace(self.path, aside)
            _fsync_dir(self.state_dir)
            self.recovered_from = aside
            # Not logged here: the service writes one structured line (event=leases_corrupt).
            self.recovery_error = " ".join(f"{type(exc).__name__}: {exc}".split())
            return {}
        return {lease.id: lease for lease in leases}

    def _save(self) -> None:
        data = {"schema": SCHEMA, "leases": [lease_document(lease) for lease in self._leases.values()]}
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump(data, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, self.path)
        _fsync_dir(self.state_dir)

    def _expire(self, now: float) -> bool:
        gone = [lid for lid, lease in self._leases.items() if lease.expires_at <= now]
        for lid in gone:
            del self._leases[lid]
        return bool(gone)

    # --- the API --------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        with self._locked():
            now = self.clock()
            return sorted(
                (lease for lease in self._leases.values() if lease.expires_at > now),
                key=lambda lease: (lease.created_at, lease.id),
            )

    def leased_gpus(self) -> set[int]:
        return {g for lease in self.leases() for g in lease.gpus}

    def reserve(self, owner: str, gpus: Iterable[int], ttl_s: float) -> Lease:
        """Lease exactly these GPUs; LeaseConflict if any is leased already."""
        gpus = tuple(gpus)
        self._check(owner, gpus, ttl_s)
        with self._locked():
            return self._grant(owner, gpus, ttl_s)

    def reserve_placement(
        self,
        matrix: DistanceMatrix,
        request: Request,
        owner: str,
        ttl_s: float,
        gpus_with_processes: Iterable[int] = (),
    ) -> tuple[Lease, Placement] | NoFit:
        """Place ``request`` around what is leased or running, and lease the answer --
        one step under the lock, so two callers cannot get the same GPU."""
        self._check(owner, (), ttl_s)
        with self._locked():
            now = self.clock()
            self._expire(now)
            # A lease or process on a GPU the node no longer shows blocks nothing here.
            on_node = {g.index for g in matrix.gpus}
            busy = ({g for lease in self._leases.values() for g in lease.gpus} | set(gpus_with_processes)) & on_node
            answer = place(matrix, request, busy)
            if isinstance(answer, NoFit):
                return answer
            return self._grant(owner, answer.indices, ttl_s), answer

    def release(self, lease_id: str) -> bool:
        with self._locked():
            if lease_id not in self._leases:
                return False
            del self._leases[lease_id]
            self._save()
            return True

    def expire(self) -> int:
        """Drop expired leases from the file; returns how many are left."""
        with self._locked():
            if self._expire(self.clock()):
                self._save()
            return len(self._leases)

    def busy(self, gpus_with_processes: Iterable[int] = ()) -> set[int]:
        """Busy GPUs: leased ones and those running processes (from NVML, when known)."""
        return self.leased_gpus() | set(gpus_with_processes)

    # --- helpers ----------------------------------------------------------------------------

    @staticmethod
    def _check(owner: str, gpus: tuple, ttl_s: float) -> None:
        if not isinstance(owner, str) or not owner.strip():
            raise LeaseError("owner must be a non-empty string")
        if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not ttl_s > 0:
            raise LeaseError(f"ttl must be a positive number of seconds, got {ttl_s!r}")
        if len(set(gpus)) != len(gpus):
            raise LeaseError("a GPU is listed twice")

    def _grant(self, owner: str, gpus: tuple[int, ...], ttl_s: float) -> Lease:
        now = self.clock()
        self._expire(now)
        taken = {g: lease for lease in self._leases.values() for g in lease.gpus}
        clash = sorted(set(gpus) & set(taken))
        if clash:
            holder = taken[clash[0]]
            raise LeaseConflict(f"GPU {clash[0]} is leased to {holder.owner} (lease {holder.id})")
        lease = Lease(secrets.token_hex(8), owner, gpus, now, now + float(ttl_s))
        self._leases[lease.id] = lease
        self._save()  # durable before anyone hears of it
        return lease


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
