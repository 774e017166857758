"""Leases: GPUs reserved for an owner until a deadline, persisted so a crash loses none.

Every change is written to ``<state_dir>/leases.json`` atomically (temporary file, fsync,
rename, fsync of the directory) *before* the call returns, so an acknowledged lease
survives a SIGKILL or a power cut.  Changes are serialised by a thread lock and an
``flock`` on ``<state_dir>/leases.lock``, and each change re-reads the file under that
lock, so concurrent reserve calls -- threads, asyncio tasks via ``asyncio.to_thread``,
or several processes sharing the directory -- never lease a GPU twice.

**Clocks.**  A lease's lifetime runs on the kernel's boot clock (``CLOCK_BOOTTIME``:
seconds since boot, suspend included), which no wall-clock step moves and which every
process on the node reads alike.  Each lease is persisted with its deadline on that
clock (``deadline_boottime_s``) and the file with the boot it belongs to (``boot_id``,
from ``/proc/sys/kernel/random/boot_id``).  ``created_at`` and ``expires_at`` are Unix
times for people and schedulers to read; they never decide whether a lease is held.
So, on loading the file (at start-up and under the lock before every change):

- same boot: the persisted deadline holds as it is.  A clock step while the agent runs,
  or between two runs, or between two processes sharing the directory, neither frees
  nor extends a lease.  When the wall clock has stepped, ``created_at`` and
  ``expires_at`` are moved by the step, so ``expires_at`` still says when, by the
  node's clock now, the lease ends.
- another boot (or no boot clock recorded: a file from an older agent): the boot clock
  started again, so the remaining time is ``expires_at`` minus the wall clock now,
  never more than the lease's TTL (``expires_at - created_at``).  A clock set back
  while the node was down can therefore make a lease last at most its full TTL again;
  a clock set forward ends it early.  There is no better clock across a reboot.

Such a change (a step seen, a reboot) is written back with the next change or sweep.

A state file that cannot be read -- not JSON, nested too deep, larger than
``MAX_STATE_BYTES``, a non-finite number, a field of the wrong type or out of range, a
GPU in two leases -- is moved aside (``leases.json.corrupt-<ms>``) with the reason
recorded in ``LeaseStore.recovered_from`` and ``recovery_error`` (the owner logs it);
the store never crashes on it and never silently pretends it was empty.  An I/O error
(a read-only or full disk, no descriptors left) is not corruption: the call raises
``OSError``, nothing is moved, and the next call tries again.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import math
import os
import re
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from topoagent.documents.agent import lease_document
from topoagent.node.matrix import DistanceMatrix, GpuInfo
from topoagent.placement import Live, NoFit, Placement, Request, place
from topoagent.placement.live import NO_LIVE
from topoagent.placement.request import REQUEST_LIMITS
from topoagent.smallfile import file_kind

STATE_FILE = "leases.json"
LOCK_FILE = "leases.lock"
SCHEMA = 1  # boot_id and deadline_boottime_s were added beside it: older agents ignore them

# What a lease may be: the store grants nothing it would refuse to load.
TTL_MAX_S = 7 * 24 * 3600
OWNER_MAX_LEN = 128
UUID_MAX_LEN = 128  # NVML's are 40 characters (GPU-8-4-4-4-12)
LEASE_ID = re.compile(r"[0-9A-Za-z_-]{1,64}")
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
# Every GPU of the largest node leased one by one, owners at their longest, is ~300 KB.
MAX_STATE_BYTES = 4 * 1024 * 1024
# The wall clock and the boot clock drift apart slowly (NTP slews at most 0.5 ms/s); a
# larger gap between what a lease says and what its deadline means is a clock step.
CLOCK_STEP_TOLERANCE_S = 1.0


def boot_clock() -> float:
    """Seconds since boot, suspend included; the same for every process on the node."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def current_boot_id() -> str | None:
    """This boot's id (a fresh UUID each boot), or None where /proc does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as handle:
            text = handle.read(100).decode("ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


class LeaseError(Exception):
    """A lease request that cannot be granted (the message says why)."""


class LeaseConflict(LeaseError):
    """A requested GPU is already leased."""


class StateCorrupt(ValueError):
    """The state file's contents cannot be trusted (the message says why)."""


class StateUnusable(OSError):
    """A state file that is no regular file (a directory, a FIFO, a device) and cannot be
    moved aside: the store cannot work until someone removes it.  An OSError, so the
    service refuses to start with the one line its ``str()`` gives."""

    def __init__(self, path: Path, problem: str):
        super().__init__(errno.EINVAL, problem, str(path))


@dataclass(frozen=True, slots=True)
class Lease:
    id: str
    owner: str
    gpus: tuple[int, ...]  # GPU indices, in rank order when from a placement
    created_at: float  # Unix time, for display
    expires_at: float  # Unix time, for display
    deadline: float  # on the boot clock: the lease is held while boot_clock() < deadline
    # The topology satisfaction of the placement it holds (None: GPUs named by hand).
    satisfaction: float | None = None
    # The same GPUs by UUID, where known: what the lease really holds.  Indices are for
    # display; a re-numbering must not move a lease onto other GPUs.
    uuids: tuple[str | None, ...] = ()

    def gpus_now(self, index_of_uuid: Mapping[str, int], indices: Collection[int]) -> tuple[int, ...] | None:
        """This lease's GPUs by their indices on the node as it is now (found by UUID where
        known), or None when one of them has left the node: an orphaned lease, which
        blocks nothing."""
        now = []
        for n, index in enumerate(self.gpus):
            uuid = self.uuids[n] if n < len(self.uuids) else None
            found = index_of_uuid.get(uuid) if uuid else (index if index in indices else None)
            if found is None:
                return None
            now.append(found)
        return tuple(now)

    @property
    def ttl_s(self) -> float:
        return self.expires_at - self.created_at


@dataclass(frozen=True, slots=True)
class Holding:
    """Who holds which GPU of the node as it is now."""

    holder: dict[int, Lease]  # GPU index now -> its lease
    orphaned: tuple[Lease, ...]  # leases whose GPU left the node

    @classmethod
    def of(cls, leases: Iterable[Lease], gpus: Iterable[GpuInfo]) -> Holding:
        gpus = tuple(gpus)
        index_of_uuid = {g.uuid: g.index for g in gpus if g.uuid}
        indices = {g.index for g in gpus}
        holder: dict[int, Lease] = {}
        orphaned = []
        for lease in leases:
            now = lease.gpus_now(index_of_uuid, indices)
            if now is None:
                orphaned.append(lease)
            else:
                holder.update(dict.fromkeys(now, lease))
        return cls(holder, tuple(orphaned))


class LeaseStore:
    def __init__(
        self,
        state_dir: str | os.PathLike[str],
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = boot_clock,
        boot_id: str | None = None,
    ):
        """``clock`` gives Unix time (for display), ``monotonic`` the clock lifetimes run
        on and ``boot_id`` the boot it counts from (read from /proc when not given);
        tests pass their own to step one without the other."""
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.state_dir / STATE_FILE
        self.clock = clock
        self.monotonic = monotonic
        self.boot_id = boot_id if boot_id is not None else current_boot_id()
        self.recovered_from: Path | None = None  # where a corrupt state file was moved
        self.recovery_error: str | None = None  # why it could not be read (the owner logs it)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._unsaved = False  # loading applied a clock step or a reboot: write it back
        try:
            with self._locked():
                pass  # loads (and moves aside a corrupt file) once, at start
        except StateUnusable:
            raise  # no disk error: nothing will make it work but removing the file
        except OSError:
            pass  # a disk error is no reason not to start: every call re-reads, and raises it

    # --- reading and writing the state file ---------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            lock_path = self.state_dir / LOCK_FILE
            # Without blocking: a FIFO put in the lock's place must not hang the agent in open().
            flags = os.O_NONBLOCK | os.O_CLOEXEC
            try:
                fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | flags, 0o600)
            except OSError:
                fd = os.open(lock_path, os.O_RDONLY | flags)  # a read-only directory: reading still works
            try:
                kind = file_kind(os.fstat(fd).st_mode)
                if kind is not None:  # flock on it would lock nothing another agent shares reliably
                    raise StateUnusable(lock_path, f"{kind}, not a regular file; remove it (the agent creates the lock file)")
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._leases = self._load()
                yield
            finally:
                os.close(fd)  # closing drops the flock

    def _load(self) -> dict[str, Lease]:
        try:
            # Without blocking: a FIFO in the file's place must not hang the agent in open().
            fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except FileNotFoundError:
            return {}
        try:
            kind = file_kind(os.fstat(fd).st_mode)
        except OSError:
            os.close(fd)
            raise
        if kind is not None:
            os.close(fd)  # fdopen() refuses a directory: never hand it one
            raw = b""
        else:
            with os.fdopen(fd, "rb") as handle:
                raw = handle.read(MAX_STATE_BYTES + 1)
        try:
            if kind is not None:  # a directory, a FIFO: no leases can be read from it; as corrupt
                raise StateCorrupt(f"{kind}, not a regular file")
            leases, self._unsaved = self._parse(raw)
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as exc:
            aside = self.path.with_name(f"{STATE_FILE}.corrupt-{int(time.time() * 1000)}")
            try:
                os.replace(self.path, aside)
            except OSError as moving:
                if kind is None:
                    raise  # a disk error: the next call tries again
                raise StateUnusable(self.path, f"{kind}, not a regular file, and it cannot be moved aside "
                                    f"({moving.strerror or moving}); remove it") from None
            _fsync_dir(self.state_dir)
            self.recovered_from = aside
            # Not logged here: the service writes one structured line (event=leases_corrupt).
            self.recovery_error = " ".join(f"{type(exc).__name__}: {exc}".split())[:500]
            return {}
        return leases

    def _parse(self, raw: bytes) -> tuple[dict[str, Lease], bool]:
        """The leases in ``raw`` with their deadlines on our boot clock (the rule is in
        the module docstring), and whether a clock step or a reboot changed any."""
        if len(raw) > MAX_STATE_BYTES:
            raise StateCorrupt(f"larger than {MAX_STATE_BYTES} bytes")
        data = json.loads(raw, parse_constant=_refuse_constant)
        if not isinstance(data, dict) or data.get("schema") != SCHEMA:
            raise StateCorrupt(f"expected schema {SCHEMA}")
        items, file_boot = data.get("leases"), data.get("boot_id")
        if not isinstance(items, list):
            raise StateCorrupt("leases: expected a list")
        same_boot = self.boot_id is not None and file_boot == self.boot_id
        wall, mono = self.clock(), self.monotonic()
        leases: dict[str, Lease] = {}
        holders: dict[str, str] = {}
        changed = False
        for n, item in enumerate(items):
            lease, persisted = _lease_from_json(item, n)
            # Same boot: the persisted deadline.  Another boot: what the wall clock says is left.
            deadline = persisted if same_boot and persisted is not None else mono + (lease.expires_at - wall)
            deadline = min(deadline, mono + lease.ttl_s)  # never longer than its TTL from now
            step = (deadline + wall - mono) - lease.expires_at  # when it ends by the wall clock now, less what it says
            stepped = abs(step) > CLOCK_STEP_TOLERANCE_S
            if stepped:
                lease = replace(lease, created_at=lease.created_at + step, expires_at=lease.expires_at + step)
            lease = replace(lease, deadline=deadline)
            changed |= stepped or not same_boot or deadline != persisted
            if lease.id in leases:
                raise StateCorrupt(f"leases[{n}]: lease {lease.id} is listed twice")
            # A GPU is held once: by UUID where known (an orphaned lease may keep an index
            # that a new GPU has since taken), else by index.
            for gpu, uuid in zip(lease.gpus, lease.uuids or (None,) * len(lease.gpus)):
                key = uuid or f"index {gpu}"
                if key in holders:
                    raise StateCorrupt(f"leases[{n}]: GPU {gpu} is also in lease {holders[key]}")
                holders[key] = lease.id
            leases[lease.id] = lease
        return leases, changed

    def _save(self) -> None:
        data = {
            "schema": SCHEMA,
            "boot_id": self.boot_id,
            "leases": [{**lease_document(lease), "deadline_boottime_s": lease.deadline} for lease in self._leases.values()],
        }
        tmp = self.path.with_name(f".{STATE_FILE}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as handle:
                json.dump(data, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()  # a full disk: do not leave half a file to fill it further
            raise
        _fsync_dir(self.state_dir)
        self._unsaved = False

    def _expire(self, now: float) -> bool:
        gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in gone:
            del self._leases[lid]
        return bool(gone)

    # --- the API --------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        with self._locked():
            now = self.monotonic()
            return sorted(
                (lease for lease in self._leases.values() if lease.deadline > now),
                key=lambda lease: (lease.created_at, lease.id),
            )

    def leased_gpus(self) -> set[int]:
        return {g for lease in self.leases() for g in lease.gpus}

    def reserve(self, owner: str, gpus: Iterable[int], ttl_s: float) -> Lease:
        """Lease exactly these GPUs; LeaseConflict if any is leased already."""
        gpus = tuple(gpus)
        _check(owner, ttl_s)
        with self._locked():
            return self._grant(owner, gpus, ttl_s)

    def reserve_placement(
        self,
        matrix: DistanceMatrix,
        request: Request,
        owner: str,
        ttl_s: float,
        gpus_with_processes: Iterable[int] = (),
        live: Live = NO_LIVE,
    ) -> tuple[Lease, Placement] | NoFit:
        """Place ``request`` around what is leased or running, and lease the answer --
        one step under the lock, so two callers cannot get the same GPU."""
        _check(owner, ttl_s)
        with self._locked():
            self._expire(self.monotonic())
            # Leases hold GPUs by UUID: one whose GPU left the node blocks nothing here, and
            # neither does a process on a GPU the node no longer shows.
            held = Holding.of(self._leases.values(), matrix.gpus).holder
            on_node = {g.index for g in matrix.gpus}
            busy = (set(held) | set(gpus_with_processes)) & on_node
            answer = place(matrix, request, busy, live=live)
            if isinstance(answer, NoFit):
                return answer
            uuid_of = {g.index: g.uuid for g in matrix.gpus}
            uuids = tuple(uuid_of.get(i) for i in answer.indices)
            return self._grant(owner, answer.indices, ttl_s, answer.satisfaction, uuids, held), answer

    def release(self, lease_id: str) -> bool:
        with self._locked():
            if lease_id not in self._leases:
                return False
            del self._leases[lease_id]
            self._save()
            return True

    def expire(self) -> int:
        """Drop expired leases from the file (and write back a clock step or reboot seen
        on loading); returns how many are left."""
        with self._locked():
            if self._expire(self.monotonic()) or self._unsaved:
                self._save()
            return len(self._leases)

    def busy(self, gpus_with_processes: Iterable[int] = ()) -> set[int]:
        """Busy GPUs: leased ones and those running processes (from NVML, when known)."""
        return self.leased_gpus() | set(gpus_with_processes)

    # --- helpers ----------------------------------------------------------------------------

    def _grant(
        self,
        owner: str,
        gpus: tuple[int, ...],
        ttl_s: float,
        satisfaction: float | None = None,
        uuids: tuple[str | None, ...] = (),
        held: Mapping[int, Lease] | None = None,
    ) -> Lease:
        """``held``: who holds which GPU index now (by UUID), when the caller knows the node;
        else the leases' own indices."""
        problem = _gpus_problem(gpus)
        if problem:
            raise LeaseError(problem)
        wall, mono = self.clock(), self.monotonic()
        self._expire(mono)
        taken = held if held is not None else {g: lease for lease in self._leases.values() for g in lease.gpus}
        clash = sorted(set(gpus) & set(taken))
        if clash:
            holder = taken[clash[0]]
            raise LeaseConflict(f"GPU {clash[0]} is leased to {holder.owner} (lease {holder.id})")
        lease = Lease(secrets.token_hex(8), owner, gpus, wall, wall + float(ttl_s), mono + float(ttl_s), satisfaction, uuids)
        self._leases[lease.id] = lease
        self._save()  # durable before anyone hears of it
        return lease


# --- what a lease may be: checked when granted and again when loaded ---------------------------


def _check(owner: str, ttl_s: float) -> None:
    problem = _owner_problem(owner)
    if problem:
        raise LeaseError(problem)
    if isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not 0 < ttl_s <= TTL_MAX_S:
        raise LeaseError(f"ttl must be a number of seconds above 0 and at most {TTL_MAX_S}, got {ttl_s!r}")


def _owner_problem(owner: object) -> str | None:
    if not isinstance(owner, str) or not owner.strip() or len(owner) > OWNER_MAX_LEN or CONTROL.search(owner):
        return f"owner must be a non-empty string of at most {OWNER_MAX_LEN} characters, without control characters"
    return None


def _gpus_problem(gpus: object) -> str | None:
    top = REQUEST_LIMITS["gpu_index_max"]
    if not isinstance(gpus, (list, tuple)) or not gpus:
        return "gpus must be a non-empty list of GPU indices"
    if not all(isinstance(g, int) and not isinstance(g, bool) and 0 <= g <= top for g in gpus):
        return f"gpus must be GPU indices from 0 to {top}"
    if len(set(gpus)) != len(gpus):
        return "a GPU is listed twice"
    return None


def _lease_from_json(obj: object, n: int) -> tuple[Lease, float | None]:
    """One persisted lease, every field checked, and its deadline as persisted (None:
    none); the Lease's own deadline is left for the caller to decide (NaN until then)."""
    where = f"leases[{n}]"
    if not isinstance(obj, dict):
        raise StateCorrupt(f"{where}: expected an object")
    lid = obj.get("id")
    if not isinstance(lid, str) or not LEASE_ID.fullmatch(lid):
        raise StateCorrupt(f"{where}.id: expected 1 to 64 letters, digits, '-' or '_'")
    problem = _owner_problem(obj.get("owner")) or _gpus_problem(obj.get("gpus"))
    if problem:
        raise StateCorrupt(f"{where}: {problem}")
    created, expires = _finite(obj, "created_at", where), _finite(obj, "expires_at", where)
    # A TTL at the limit may come back a little over it: a float's rounding at Unix-time scale.
    if not 0 < expires - created <= TTL_MAX_S + 1e-3:
        raise StateCorrupt(f"{where}: expires_at - created_at must be above 0 and at most {TTL_MAX_S} s")
    deadline = _finite(obj, "deadline_boottime_s", where) if "deadline_boottime_s" in obj else None
    satisfaction = obj.get("satisfaction")
    if satisfaction is not None:  # absent in files of older agents
        satisfaction = _finite(obj, "satisfaction", where)
        if not 0 <= satisfaction <= 1:
            raise StateCorrupt(f"{where}.satisfaction: expected a share from 0 to 1")
    uuids = obj.get("gpu_uuids", [])  # absent in files of older agents
    if not isinstance(uuids, list) or (uuids and len(uuids) != len(obj["gpus"])) or not all(
        u is None or (isinstance(u, str) and 0 < len(u) <= UUID_MAX_LEN and not CONTROL.search(u)) for u in uuids
    ):
        raise StateCorrupt(f"{where}.gpu_uuids: expected one UUID (or null) per GPU")
    return Lease(lid, obj["owner"], tuple(obj["gpus"]), created, expires, math.nan, satisfaction, tuple(uuids)), deadline


def _finite(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.nan
    if not math.isfinite(number):
        raise StateCorrupt(f"{where}.{key}: expected a finite number, got {str(value)[:40]}")
    return number


def _refuse_constant(name: str) -> float:
    raise StateCorrupt(f"non-finite number {name}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
