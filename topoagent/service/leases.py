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

**What a lease may be** is one set of rules (``lease_problem`` and the field rules it
calls), used when a lease is granted and again when it is loaded: the store never writes
a lease it would refuse to read back.  A TTL is from ``TTL_MIN_S`` to ``TTL_MAX_S``
seconds; an owner is printable text (``str.isprintable``: no control, format, separator
or surrogate code points) of at most ``OWNER_MAX_LEN`` characters; a GPU UUID is the same
kind of text, at most ``UUID_MAX_LEN`` long.  A GPU whose identity from the node breaks
these rules (``gpu_id_problem``) is never leased: discovery says so with a critical
``gpu-unleasable`` finding.

**One bad entry costs one entry.**  A state file whose whole cannot be read -- not JSON,
nested too deep, larger than ``MAX_STATE_BYTES``, a non-finite constant (``NaN``,
``Infinity``), not an object of our schema -- is moved aside (``leases.json.corrupt-<ms>``)
with the reason recorded in ``LeaseStore.recovered_from`` and ``recovery_error`` (the
owner logs it): that is disk corruption, not one bad input.  An *entry* that breaks a rule
(a field of the wrong type or out of range, an id listed twice, a GPU listed twice or already
in an earlier lease, by UUID or by index: ``gpu_now``) is quarantined alone: it is appended
to ``leases.quarantine.json`` beside the state file with the reason, logged
(``event=lease_quarantined``), listed in ``GET /leases`` under ``quarantined`` and counted
by ``topoagent_leases_quarantined``; every other lease is kept.

Fail-closed: the GPUs a quarantined entry names that can still be read (indices in range,
with their UUIDs where those are valid) and that no valid lease holds stay held, by a lease
of owner ``topoagent-quarantine`` that replaces the entry: until the entry's own
``expires_at`` where that is a readable time (nothing is held when it has passed), else for
``TTL_MAX_S``.  An operator who knows the GPUs are free releases it with ``DELETE
/leases/{id}`` like any lease.  So no input to the file frees a GPU another job may hold.

The store never crashes on a bad file and never silently pretends it was empty.  An I/O
error (a read-only or full disk, no descriptors left) is not corruption: the call raises
``OSError``, nothing is moved, and the next call tries again (the service answers 503
naming the state directory).  Temporary files a killed writer left
(``.leases.json.<random>.tmp``) are removed at start, under the lock, when no writer
can be using one.

**The directory is the agent's alone.**  It is refused at start when it is not owned by the
agent's user (or root) or when others may write it (``topoagent.statefile.state_dir_problem``).
Every file in it is opened without blocking and without following a link, checked to be a
regular file and read to a bound (``topoagent.smallfile``); a FIFO, link or device in a
file's place is refused, never waited on.  An unreadable quarantine file is said
(``quarantine_error``, logged ``event=lease_quarantine_unreadable``) and the book works on.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import math
import os
import secrets
import threading
import time
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from topoagent.documents.agent import lease_document
from topoagent.documents.lease import (
    LEASE_ID,
    TTL_MAX_S,
    TTL_MIN_S,
    gpu_id_problem,
    gpus_problem,
    lease_problem,
    uuid_problem,
)
from topoagent.log import log_event
from topoagent.node.matrix import DistanceMatrix, GpuInfo
from topoagent.placement import Live, NoFit, Placement, Request, place
from topoagent.placement.live import NO_LIVE
from topoagent.placement.request import REQUEST_LIMITS
from topoagent.smallfile import NotRegularFile, file_kind, open_no_link, read_small_file
from topoagent.statefile import state_dir_problem, write_json_atomically

STATE_FILE = "leases.json"
LOCK_FILE = "leases.lock"
QUARANTINE_FILE = "leases.quarantine.json"  # entries the loader refused, beside the state file
QUARANTINE_OWNER = "topoagent-quarantine"  # holds the GPUs a refused entry named (fail-closed)
QUARANTINE_KEEP = 100  # newest records kept in the quarantine file
QUARANTINE_ENTRY_MAX_CHARS = 64 * 1024  # a refused entry larger than this is kept as text, cut
TEMP_FILES = ".leases.*.tmp"  # what _write_atomically leaves behind when killed mid-write
SCHEMA = 1  # boot_id and deadline_boottime_s were added beside it: older agents ignore them

# What loading forgives of a persisted TTL: a float's rounding at Unix-time scale (~2e-7 s).
TTL_SLACK_S = 1e-3
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

    def named(self) -> list[tuple[int, str | None]]:
        """This lease's GPUs as (index, UUID or None) pairs."""
        return list(zip(self.gpus, self.uuids or (None,) * len(self.gpus)))

    def gpus_now(self, index_of_uuid: Mapping[str, int], indices: Collection[int]) -> tuple[tuple[int, ...], bool]:
        """This lease's GPUs the node shows now, by their indices (``gpu_now``), and whether
        one of them has left the node (an orphaned lease: it still holds the ones left,
        since its job may still run on them)."""
        now, left = [], False
        for index, uuid in self.named():
            found = gpu_now(index, uuid, index_of_uuid)
            if isinstance(found, int) and found in indices:
                now.append(found)
            else:
                left = True
        return tuple(now), left

    @property
    def ttl_s(self) -> float:
        return self.expires_at - self.created_at


def gpu_now(index: int, uuid: str | None, index_of_uuid: Mapping[str, int] | None) -> int | str:
    """Which GPU a lease's entry (index, UUID) names: the rule by which leases hold GPUs.
    A GPU named by UUID is that GPU wherever it sits now (its index in ``index_of_uuid``);
    one named by index alone is whatever GPU has that index now.  A UUID the node does not
    show, or any UUID while the node is not known (``index_of_uuid`` None), names no index:
    the UUID itself is returned, equal only to itself."""
    if not uuid:
        return index
    return uuid if index_of_uuid is None else index_of_uuid.get(uuid, uuid)


@dataclass(frozen=True, slots=True)
class Holding:
    """Who holds which GPU of the node as it is now."""

    holder: dict[int, Lease]  # GPU index now -> its lease
    orphaned: tuple[Lease, ...]  # leases one of whose GPUs left the node

    @classmethod
    def of(cls, leases: Iterable[Lease], gpus: Iterable[GpuInfo]) -> Holding:
        gpus = tuple(gpus)
        index_of_uuid = {g.uuid: g.index for g in gpus if g.uuid}
        indices = {g.index for g in gpus}
        holder: dict[int, Lease] = {}
        orphaned = []
        for lease in leases:
            now, left = lease.gpus_now(index_of_uuid, indices)
            holder.update(dict.fromkeys(now, lease))
            if left:
                orphaned.append(lease)
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
        self.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        problem = state_dir_problem(self.state_dir)
        if problem:  # whoever else may write it may replace the lease book
            raise StateUnusable(self.state_dir, f"state directory: {problem}")
        self.path = self.state_dir / STATE_FILE
        self.clock = clock
        self.monotonic = monotonic
        self.boot_id = boot_id if boot_id is not None else current_boot_id()
        self.recovered_from: Path | None = None  # where a corrupt state file was moved
        self.recovery_error: str | None = None  # why it could not be read (the owner logs it)
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        # Counts the times the lock was taken: each time re-reads the file, so a read with a
        # higher number saw the book at least as new (see numbered_leases).
        self._reads = 0
        self._unsaved = False  # loading applied a clock step or a reboot: write it back
        self.quarantine_path = self.state_dir / QUARANTINE_FILE
        self.quarantine_error: str | None = None  # why the quarantine file cannot be read (the owner logs it)
        # The node's GPUs, UUID -> index, as the owner last saw them (None: not known yet):
        # how a lease by UUID and one by index alone are told to name the same GPU or not.
        self.gpus_now: Mapping[str, int] | None = None
        # What the quarantine file holds (newest last), for /leases and /metrics to report.
        self.quarantined: list[dict[str, Any]] = self._read_quarantine()
        try:
            with self._locked():
                # Under the lock no writer is between its temporary file and the rename:
                # any temporary file left is a killed writer's, and nobody's to finish.
                for stale in self.state_dir.glob(TEMP_FILES):
                    with contextlib.suppress(OSError):
                        stale.unlink()
        except StateUnusable:
            raise  # no disk error: nothing will make it work but removing the file
        except OSError:
            pass  # a disk error is no reason not to start: every call re-reads, and raises it

    # --- reading and writing the state file ---------------------------------------------

    @contextmanager
    def _locked(self) -> Iterator[None]:
        with self._lock:
            self._reads += 1
            lock_path = self.state_dir / LOCK_FILE
            # Without blocking: a FIFO put in the lock's place must not hang the agent in open();
            # nor following a link, which would lock (or create) a file elsewhere.
            try:
                fd = open_no_link(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise StateUnusable(lock_path, "a symbolic link, not a regular file; remove it (the agent creates the lock file)") from None
                fd = open_no_link(lock_path, os.O_RDONLY)  # a read-only directory: reading still works
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
        # Without blocking or following a link (smallfile): a FIFO in the file's place must not
        # hang the agent in open(); a link's target is not the agent's book.
        kind = None
        try:
            raw, _ = read_small_file(self.path, MAX_STATE_BYTES, follow_links=False)
        except FileNotFoundError:
            return {}
        except NotRegularFile as exc:
            kind, raw = exc.kind, b""
        try:
            if kind is not None:  # a directory, a FIFO: no leases can be read from it; as corrupt
                raise StateCorrupt(f"{kind}, not a regular file")
            leases, self._unsaved, refused = self._parse(raw)
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
        if refused:
            self._quarantine(leases, refused)
        return leases

    def _parse(self, raw: bytes) -> tuple[dict[str, Lease], bool, list[tuple[Any, str]]]:
        """The leases in ``raw`` with their deadlines on our boot clock (the rule is in
        the module docstring), whether a clock step or a reboot changed any, and the
        entries refused (each with why)."""
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
        claims = _Claims(self.gpus_now)
        refused: list[tuple[Any, str]] = []
        changed = False
        for n, item in enumerate(items):
            try:
                lease, persisted = _lease_from_json(item, n)
                _claim(lease, n, leases, claims)
            except (StateCorrupt, KeyError, TypeError, OverflowError) as exc:
                refused.append((item, " ".join(str(exc).split())[:500]))
                continue
            # Same boot: the persisted deadline.  Another boot: what the wall clock says is left.
            deadline = persisted if same_boot and persisted is not None else mono + (lease.expires_at - wall)
            deadline = min(deadline, mono + lease.ttl_s)  # never longer than its TTL from now
            step = (deadline + wall - mono) - lease.expires_at  # when it ends by the wall clock now, less what it says
            stepped = abs(step) > CLOCK_STEP_TOLERANCE_S
            if stepped:
                lease = replace(lease, created_at=lease.created_at + step, expires_at=lease.expires_at + step)
            lease = replace(lease, deadline=deadline)
            changed |= stepped or not same_boot or deadline != persisted
            leases[lease.id] = lease
        return leases, changed, refused

    def _quarantine(self, leases: dict[str, Lease], refused: list[tuple[Any, str]]) -> None:
        """Set each refused entry aside in the quarantine file and hold the GPUs it still
        names legibly (the module docstring says how long), then write the state file
        without it.  The quarantine file is written first: a crash between the two
        quarantines the entry again, never loses it.  A disk error raises, changing nothing."""
        wall, mono = self.clock(), self.monotonic()
        claims = _Claims(self.gpus_now)
        for lease in leases.values():
            claims.hold(lease.named(), lease.id)
        records = []
        for item, reason in refused:
            gpus = [(g, u) for g, u in _readable_gpus(item) if claims.clash([(g, u)]) is None]
            hold = None
            left = _readable_number(item, "expires_at")
            ttl = TTL_MAX_S if left is None else min(left - wall, TTL_MAX_S)
            if gpus and ttl > 0:
                ttl = max(ttl, TTL_MIN_S)
                hold = Lease(secrets.token_hex(8), QUARANTINE_OWNER, tuple(g for g, _ in gpus), wall, wall + ttl,
                             mono + ttl, None, tuple(u for _, u in gpus) if any(u for _, u in gpus) else ())
                leases[hold.id] = hold
                claims.hold(gpus, hold.id)
            try:
                entry_text = json.dumps(item, allow_nan=False)
                whole = len(entry_text) <= QUARANTINE_ENTRY_MAX_CHARS
            except ValueError:  # 1e999 was read as inf: kept as text, so the file stays JSON
                entry_text, whole = json.dumps(item), False
            records.append({
                "quarantined_at": wall,
                "error": reason,
                "held_by": hold.id if hold else None,
                "gpus": list(hold.gpus) if hold else [],
                # The entry as it was; as text (cut to a bound) where it is too large or not JSON.
                **({"entry": item} if whole else {"entry_text": entry_text[:QUARANTINE_ENTRY_MAX_CHARS]}),
            })
        kept = (self._read_quarantine() + records)[-QUARANTINE_KEEP:]
        write_json_atomically(self.quarantine_path, {"schema": SCHEMA, "entries": kept}, readable=False)
        self.quarantined, self.quarantine_error = kept, None  # a regular file of ours now stands there
        self._leases = leases
        self._save()
        for record in records:
            log_event("lease_quarantined", logging.ERROR, file=self.quarantine_path, error=record["error"],
                      held_by=record["held_by"] or "none", gpus=",".join(map(str, record["gpus"])) or "none")

    def _read_quarantine(self) -> list[dict[str, Any]]:
        """The quarantine file's records; none when it is absent or unreadable (it is a
        report: the GPUs its entries named are held in the state file itself).  What makes
        it unreadable -- a FIFO, a link, a directory in its place, a disk error -- is kept in
        ``quarantine_error`` for the owner to say; it is never waited on."""
        self.quarantine_error = None
        try:
            raw, _ = read_small_file(self.quarantine_path, MAX_STATE_BYTES * 2, follow_links=False)
        except FileNotFoundError:
            return []
        except OSError as exc:
            self.quarantine_error = f"{exc.strerror or exc}; its records are not shown (the GPUs they named stay held)"
            return []
        try:
            data = json.loads(raw, parse_constant=_refuse_constant)
        except (ValueError, RecursionError):
            return []
        entries = data.get("entries") if isinstance(data, dict) else None
        return [e for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []

    def _save(self) -> None:
        data = {
            "schema": SCHEMA,
            "boot_id": self.boot_id,
            "leases": [self._document(lease) for lease in self._leases.values()],
        }
        write_json_atomically(self.path, data, readable=False)
        self._unsaved = False

    @staticmethod
    def _document(lease: Lease) -> dict[str, Any]:
        return {**lease_document(lease), "deadline_boottime_s": lease.deadline}

    def _expire(self, now: float) -> bool:
        gone = [lid for lid, lease in self._leases.items() if lease.deadline <= now]
        for lid in gone:
            del self._leases[lid]
        return bool(gone)

    # --- the API --------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        return list(self.numbered_leases()[1])

    def numbered_leases(self) -> tuple[int, tuple[Lease, ...]]:
        """The live leases, and the number of the read that saw them.  Reads run in several
        threads and finish in any order; of two answers the higher number is the newer book,
        so a caller publishing them can keep an older one from replacing a newer."""
        with self._locked():
            now = self.monotonic()
            return self._reads, tuple(sorted(
                (lease for lease in self._leases.values() if lease.deadline > now),
                key=lambda lease: (lease.created_at, lease.id),
            ))

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
        # The grant reads the node placement read (the loop may tell the store a newer one meanwhile).
        where = self.gpus_now = {g.uuid: g.index for g in matrix.gpus if g.uuid}
        with self._locked():
            self._expire(self.monotonic())
            # Leases hold GPUs by UUID: a GPU that left the node is held by no lease here (the
            # lease keeps the ones left), and a process on it blocks nothing.
            held = Holding.of(self._leases.values(), matrix.gpus).holder
            on_node = {g.index for g in matrix.gpus}
            # A GPU whose identity cannot be stored is never leased (discovery's gpu-unleasable finding).
            unleasable = {g.index for g in matrix.gpus if gpu_id_problem(g.index, g.uuid)}
            busy = ((set(held) | set(gpus_with_processes)) & on_node) | unleasable
            answer = place(matrix, request, busy, live=live)
            if isinstance(answer, NoFit):
                return answer
            uuid_of = {g.index: g.uuid or None for g in matrix.gpus}  # "" is no UUID
            uuids = tuple(uuid_of.get(i) for i in answer.indices)
            return self._grant(owner, answer.indices, ttl_s, answer.satisfaction, uuids, where), answer

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
            if self.quarantine_error is not None:  # until someone removes what stands there
                self.quarantined = self._read_quarantine()
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
        where: Mapping[str, int] | None = None,
    ) -> Lease:
        """Grant the lease unless one of its GPUs is held: by the node ``where`` says (UUID ->
        index; default: the store's latest, ``gpus_now``)."""
        problem = gpus_problem(gpus)
        if problem:
            raise LeaseError(problem)
        wall, mono = self.clock(), self.monotonic()
        self._expire(mono)
        lease = Lease(secrets.token_hex(8), owner, gpus, wall, wall + float(ttl_s), mono + float(ttl_s), satisfaction, uuids)
        # The book's own rule as loading applies it: never write what the next read would
        # quarantine as a GPU in two leases.  While the node is not known, a lease by UUID
        # is where it was recorded: a grant refuses on what may be stale (fail-closed).
        where = self.gpus_now if where is None else where
        if where is None:
            where = {uuid: gpu for other in self._leases.values() for gpu, uuid in other.named() if uuid}
        claims = _Claims(where)
        for other in self._leases.values():
            claims.hold(other.named(), other.id)
        clash = claims.clash(lease.named())
        if clash:
            holder = self._leases[clash[1]]
            raise LeaseConflict(f"GPU {clash[0]} is leased to {holder.owner} (lease {holder.id})")
        try:  # the loader's own rules, on exactly what will be written and read back
            _lease_from_json(json.loads(json.dumps(self._document(lease))), 0)
        except StateCorrupt as exc:
            raise LeaseError(str(exc).removeprefix("leases[0]: ")) from None
        self._leases[lease.id] = lease
        self._save()  # durable before anyone hears of it
        return lease


# --- what a lease may be (the rules: topoagent.documents.lease) ------------------------------


def _check(owner: str, ttl_s: float) -> None:
    problem = lease_problem(owner, [0], ttl_s)  # the GPUs are checked when granted
    if problem:
        raise LeaseError(problem)


def _lease_from_json(obj: object, n: int) -> tuple[Lease, float | None]:
    """One persisted lease, every field checked, and its deadline as persisted (None:
    none); the Lease's own deadline is left for the caller to decide (NaN until then)."""
    where = f"leases[{n}]"
    if not isinstance(obj, dict):
        raise StateCorrupt(f"{where}: expected an object")
    lid = obj.get("id")
    if not isinstance(lid, str) or not LEASE_ID.fullmatch(lid):
        raise StateCorrupt(f"{where}.id: expected 1 to 64 letters, digits, '-' or '_'")
    created, expires = _finite(obj, "created_at", where), _finite(obj, "expires_at", where)
    # The TTL as persisted carries a float's rounding at Unix-time scale: the rule is
    # applied to it brought back within that rounding of the limits.
    span = expires - created
    if TTL_MIN_S - TTL_SLACK_S <= span <= TTL_MAX_S + TTL_SLACK_S:
        span = min(max(span, TTL_MIN_S), TTL_MAX_S)
    uuids = obj.get("gpu_uuids", [])  # absent in files of older agents
    problem = lease_problem(obj.get("owner"), obj.get("gpus"), span, uuids)
    if problem:
        raise StateCorrupt(f"{where}: {problem}")
    deadline = _finite(obj, "deadline_boottime_s", where) if "deadline_boottime_s" in obj else None
    satisfaction = obj.get("satisfaction")
    if satisfaction is not None:  # absent in files of older agents
        satisfaction = _finite(obj, "satisfaction", where)
        if not 0 <= satisfaction <= 1:
            raise StateCorrupt(f"{where}.satisfaction: expected a share from 0 to 1")
    return Lease(lid, obj["owner"], tuple(obj["gpus"]), created, expires, math.nan, satisfaction, tuple(uuids)), deadline


def _readable_gpus(obj: object) -> list[tuple[int, str | None]]:
    """The GPUs a refused entry still names legibly: each index in range, with its UUID
    where that is valid (else held by index).  Fail-closed: what can be read is held."""
    if not isinstance(obj, dict) or not isinstance(obj.get("gpus"), list):
        return []
    uuids = obj.get("gpu_uuids")
    uuids = uuids if isinstance(uuids, list) else []
    found: list[tuple[int, str | None]] = []
    for n, gpu in enumerate(obj["gpus"][: REQUEST_LIMITS["gpu_index_max"] + 1]):
        if gpus_problem([gpu]) is None:
            uuid = uuids[n] if n < len(uuids) else None
            uuid = uuid if uuid and uuid_problem(uuid) is None else None
            if all(gpu != g and (uuid is None or uuid != u) for g, u in found):  # each GPU once: the hold must load
                found.append((gpu, uuid))
    return found


def _finite(obj: dict[str, Any], key: str, where: str) -> float:
    value = obj.get(key)
    try:
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        number = math.nan
    if not math.isfinite(number):
        raise StateCorrupt(f"{where}.{key}: expected a finite number, got {str(value)[:40]}")
    return number


def _readable_number(obj: object, key: str) -> float | None:
    """``obj[key]`` as a finite number, or None where that cannot be read."""
    if not isinstance(obj, dict):
        return None
    try:
        return _finite(obj, key, "")
    except StateCorrupt:
        return None


class _Claims:
    """Which lease holds which GPU in a book being read or written, so that one GPU is in one
    lease; which GPU an entry names is ``gpu_now``'s rule, ``where`` its UUID -> index map.
    While the node is not known (``where`` None: at start-up, before discovery) a UUID and an
    index never name the same GPU: a recorded index is no fact about the node now (a GPU
    renumbered, or gone, leaves its lease's index behind), and refusing on it would drop a
    lease whose GPU no other lease holds."""

    def __init__(self, where: Mapping[str, int] | None) -> None:
        self.where = where
        self.holders: dict[int | str, str] = {}  # gpu_now -> the id of the lease that holds it

    def clash(self, gpus: Iterable[tuple[int, str | None]]) -> tuple[int, str] | None:
        """The first of these GPUs a lease already claimed holds, and that lease's id; None if none."""
        for gpu, uuid in gpus:
            holder = self.holders.get(gpu_now(gpu, uuid, self.where))
            if holder is not None:
                return gpu, holder
        return None

    def hold(self, gpus: Iterable[tuple[int, str | None]], lease_id: str) -> None:
        for gpu, uuid in gpus:
            self.holders[gpu_now(gpu, uuid, self.where)] = lease_id


def _claim(lease: Lease, n: int, leases: Mapping[str, Lease], claims: _Claims) -> None:
    """Refuse a lease listed twice or holding a GPU an earlier one holds (``_Claims``); else
    note its GPUs in ``claims``.  (A GPU named twice in one lease is ``lease_problem``'s.)"""
    if lease.id in leases:
        raise StateCorrupt(f"leases[{n}]: lease {lease.id} is listed twice")
    clash = claims.clash(lease.named())
    if clash:
        raise StateCorrupt(f"leases[{n}]: GPU {clash[0]} is also in lease {clash[1]}")
    claims.hold(lease.named(), lease.id)


def state_unwritable(store: LeaseStore, exc: OSError) -> str:
    """What a caller is told when the state directory fails under a change."""
    return (f"the lease state directory {store.state_dir} cannot be written or read "
            f"({exc.strerror or exc}); nothing was changed, retry later")


def quarantine_report(store: LeaseStore) -> list[dict[str, Any]]:
    """The quarantine file's records as the service reports them: the refused entry
    itself stays in the file (it may be large, and it is what was refused)."""
    return [{key: record.get(key) for key in ("quarantined_at", "error", "held_by", "gpus")} for record in store.quarantined]


def _refuse_constant(name: str) -> float:
    raise StateCorrupt(f"non-finite number {name}")


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
