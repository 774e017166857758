"""The agent runtime: owns the loop that keeps a current snapshot of the node.

Discovery runs on a timer, on udev hotplug events (debounced; live root only) and on
demand.  A run that hangs is cut off by its timeout; a run that fails leaves the last
good snapshot in place, marked stale, with the error recorded.  Snapshots are immutable
and swapped by one assignment, so readers never lock.

The three things this module needs from other parts of topoagent -- discovery, the
placement core and the lease book -- are reached only through the adapters in the
"Adapters" section below, so wiring the real modules in is a few lines there.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import tarfile
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Awaitable, Callable

from topoagent.collectors.nvidia_smi import parse_topo_matrix, render_topo_matrix
from topoagent.config import Config
from topoagent.matrix import DistanceMatrix
from topoagent.served import CollectorStatus, NodeFacts, Snapshot

log = logging.getLogger("topoagent")


def log_event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    """One line per event, `event key=value ...`, which journald and grep both read."""
    parts = [f"event={event}"]
    for key, value in fields.items():
        text = str(value)
        if not text or any(c in text for c in ' "='):
            text = json.dumps(text)
        parts.append(f"{key}={text}")
    log.log(level, " ".join(parts))


class RootError(ValueError):
    """--root is neither "/", a snapshot directory nor a snapshot tarball."""


def open_root(root: str) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """The directory to read the node from; a tarball is unpacked once into a temp dir."""
    path = Path(root)
    if root == "/" or path.is_dir():
        return path, None
    if path.is_file():
        if not tarfile.is_tarfile(path):
            raise RootError(f"--root {root}: not a directory and not a tar archive")
        holder = tempfile.TemporaryDirectory(prefix="topoagent-root-")
        with tarfile.open(path) as archive:
            archive.extractall(holder.name, filter="data")  # refuses links out, devices
        entries = [p for p in Path(holder.name).iterdir()]
        # `tar czf x.tar.gz dgx-a100/` wraps the snapshot in one top directory
        inner = entries[0] if len(entries) == 1 and entries[0].is_dir() else Path(holder.name)
        return inner, holder
    raise RootError(f"--root {root}: no such file or directory")


# ---------------------------------------------------------------------------------------
# Adapters.  INTERIM until discovery (topoagent/host.py + model.py) and the placement
# core (topoagent/placement.py + leases.py) are merged: discovery here reads only the
# recorded `nvidia-smi topo -m`, placement takes the first free GPUs by index, and the
# lease book is a small JSON file.  Replace the bodies, keep the signatures.
# ---------------------------------------------------------------------------------------

TOPO_COMMAND = ("nvidia-smi", "topo", "-m")
TOPO_RECORDING = "commands/nvidia-smi_topo_-m.out"


def run_in_daemon_thread(fn: Callable[[], Any]) -> asyncio.Future:
    """Run a blocking read where a hang cannot hold the process hostage.

    asyncio.to_thread's pool threads are joined at exit, so one read stuck on a dead
    device would stop the agent from ever exiting; a daemon thread is simply abandoned.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def work() -> None:
        try:
            value = fn()
        except BaseException as exc:  # noqa: BLE001 -- handed to the awaiting task
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=work, name="topoagent-read", daemon=True).start()
    return future


async def _read_topo_text(root: Path) -> str:
    if str(root) == "/":
        proc = await asyncio.create_subprocess_exec(
            *TOPO_COMMAND, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
        )
        try:
            out, err = await proc.communicate()
        except asyncio.CancelledError:
            proc.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"nvidia-smi topo -m exited {proc.returncode}: {err.decode()[:200]}")
        return out.decode()
    recording = root / TOPO_RECORDING
    return await run_in_daemon_thread(lambda: recording.read_text(encoding="utf-8", errors="replace"))


def _topology_json(matrix: DistanceMatrix) -> dict[str, Any]:
    gpus = [asdict(g) for g in matrix.gpus]
    nics = [asdict(n) for n in matrix.nics]
    pairs = []
    for i in range(matrix.size):
        for j in range(i + 1, matrix.size):
            pairs.append(
                {
                    "a": matrix.gpus[i].index,
                    "b": matrix.gpus[j].index,
                    "level": str(matrix.level(i, j)),
                    "expected_gbps": matrix.gpu_expected_gbps[i][j],
                }
            )
    gpu_nic = []
    for i, row in enumerate(matrix.gpu_nic_levels):
        for j, level in enumerate(row):
            if level is not None:
                gpu_nic.append({"gpu": matrix.gpus[i].index, "nic": matrix.nics[j].name, "level": str(level)})
    return {"schema": 1, "gpus": gpus, "nics": nics, "gpu_pairs": pairs, "gpu_nic": gpu_nic}


async def discover_facts(root: Path) -> NodeFacts:
    """Adapter over discovery: the node's facts, or an exception saying why not."""
    started = time.time()
    try:
        text = await _read_topo_text(root)
        topo = parse_topo_matrix(text)
        matrix = DistanceMatrix.from_topo_matrix(topo)
    except Exception as exc:
        exc.add_note(f"collector nvidia_smi after {time.time() - started:.3f}s")
        raise
    status = CollectorStatus("nvidia_smi", True, time.time() - started, time.time())
    return NodeFacts(
        topology=_topology_json(matrix),
        matrix=matrix,
        matrix_text=render_topo_matrix(topo),
        collectors=(status,),
    )


@dataclass(frozen=True, slots=True)
class PlaceRequest:
    gpus: int
    pattern: str = "allreduce"
    min_level: str | None = None
    single_numa: bool = False
    include: tuple[int, ...] = ()
    exclude: tuple[int, ...] = ()
    nics: int = 0


@dataclass(frozen=True, slots=True)
class PlaceOutcome:
    fits: bool
    gpus: tuple[int, ...]  # nvidia-smi indices in rank order; () when it does not fit
    body: dict[str, Any]  # the Placement or NoFit JSON


def place_gpus(matrix: DistanceMatrix, request: PlaceRequest, busy: frozenset[int]) -> PlaceOutcome:
    """Adapter over `topoagent.placement.place` (INTERIM: first free GPUs by index)."""
    free = [g.index for g in matrix.gpus if g.index not in busy and g.index not in request.exclude]
    blocked = [g for g in request.include if g not in free]
    if blocked:
        return PlaceOutcome(False, (), {"reason": "include_busy", "detail": f"GPUs {blocked} are busy or excluded", "free": free})
    chosen = list(request.include) + [g for g in free if g not in request.include]
    chosen = chosen[: request.gpus]
    if len(chosen) < request.gpus:
        return PlaceOutcome(
            False, (), {"reason": "not_enough_gpus", "detail": f"{request.gpus} GPUs asked, {len(free)} free", "free": free}
        )
    by_index = {g.index: g for g in matrix.gpus}
    body = {
        "gpus": [
            {"index": i, "uuid": by_index[i].uuid, "pci_address": by_index[i].pci_address} for i in chosen
        ],
        "env": {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in chosen)},
        "explain": ["interim first-free placement: topoagent.placement is not wired in yet"],
    }
    return PlaceOutcome(True, tuple(chosen), body)


@dataclass(frozen=True, slots=True)
class Lease:
    id: str  # unguessable: whoever holds it can name the lease
    owner: str
    gpus: tuple[int, ...]
    created_at: float
    expires_at: float

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "owner": self.owner, "gpus": list(self.gpus), "created_at": self.created_at, "expires_at": self.expires_at}


class LeaseBook:
    """Adapter over `topoagent.leases` (INTERIM): leases persisted as one JSON file.

    Written temp + fsync + rename + fsync(dir) before a lease is acknowledged, so a
    crash after the answer never loses it.
    """

    FILE = "leases.json"

    def __init__(self, state_dir: Path) -> None:
        self.state_dir = state_dir
        self.path = state_dir / self.FILE
        self.leases: dict[str, Lease] = {}

    def load(self) -> None:
        self.state_dir.mkdir(parents=True, exist_ok=True)
        try:
            raw = self.path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return
        try:
            self.leases = {d["id"]: Lease(d["id"], d["owner"], tuple(d["gpus"]), d["created_at"], d["expires_at"]) for d in json.loads(raw)["leases"]}
        except (ValueError, KeyError, TypeError) as exc:
            aside = self.path.with_suffix(f".corrupt-{int(time.time())}")
            self.path.rename(aside)
            log_event("leases_corrupt", logging.ERROR, moved_to=aside, error=exc)

    def busy(self, now: float) -> frozenset[int]:
        return frozenset(g for lease in self.leases.values() if lease.expires_at > now for g in lease.gpus)

    def persist(self, leases: dict[str, Lease]) -> None:
        doc = {"schema": 1, "leases": [lease.to_json() for lease in leases.values()]}
        fd, tmp = tempfile.mkstemp(dir=self.state_dir, prefix=".leases-", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as handle:
                json.dump(doc, handle)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        dir_fd = os.open(self.state_dir, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


# ---------------------------------------------------------------------------------------
# Runtime
# ---------------------------------------------------------------------------------------

Discover = Callable[[Path], Awaitable[NodeFacts]]


class Agent:
    def __init__(self, config: Config, *, discover: Discover = discover_facts) -> None:
        self.config = config
        self._discover = discover
        self.snapshot: Snapshot | None = None
        self.started_at = time.time()
        self.placement_requests: Counter[str] = Counter()
        self.refreshes: Counter[str] = Counter()  # by outcome
        self.leases = LeaseBook(Path(config.state_dir))
        self._lease_lock = asyncio.Lock()
        self._refresh_task: asyncio.Task | None = None
        self._refresh_again = False
        self._root: Path | None = None
        self._root_holder: tempfile.TemporaryDirectory | None = None
        self._tasks: list[asyncio.Task] = []
        self._udev_close: Callable[[], None] | None = None
        self._debounce: asyncio.TimerHandle | None = None
        self._version = 0

    # -- life cycle -------------------------------------------------------------------
    async def start(self) -> None:
        self._root, self._root_holder = open_root(self.config.root)
        self.leases.load()
        log_event("leases_loaded", count=len(self.leases.leases), path=self.leases.path)
        self._tasks = [
            asyncio.create_task(self._timer_loop(), name="discovery-timer"),
            asyncio.create_task(self._lease_sweeper(), name="lease-sweeper"),
        ]
        if self.config.udev and self.config.live:
            self._udev_close = start_udev_watch(self.on_device_event)

    async def stop(self) -> None:
        if self._udev_close:
            self._udev_close()
        if self._debounce:
            self._debounce.cancel()
        for task in [*self._tasks, self._refresh_task]:
            if task and not task.done():
                task.cancel()
        await asyncio.gather(*[t for t in self._tasks if t], return_exceptions=True)
        if self._root_holder:
            self._root_holder.cleanup()

    def reload(self, config: Config) -> list[str]:
        """Apply a re-read configuration; returns the settings that need a restart."""
        needs_restart = [k for k in ("listen", "state_dir") if getattr(config, k) != getattr(self.config, k)]
        root_changed = config.root != self.config.root
        self.config = replace(config, **{k: getattr(self.config, k) for k in needs_restart})
        if root_changed:
            try:
                root, holder = open_root(config.root)
            except RootError as exc:
                log_event("reload_root_refused", logging.ERROR, error=exc)
            else:
                if self._root_holder:
                    self._root_holder.cleanup()
                self._root, self._root_holder = root, holder
        self.request_refresh("reload")
        return needs_restart

    # -- discovery ----------------------------------------------------------------------
    def request_refresh(self, reason: str) -> asyncio.Task:
        """Start a discovery run, or join the one running (then run once more after it)."""
        if self._refresh_task and not self._refresh_task.done():
            self._refresh_again = True
            return self._refresh_task
        self._refresh_task = asyncio.create_task(self._refresh(reason), name="discovery")
        return self._refresh_task

    async def _refresh(self, reason: str) -> Snapshot | None:
        while True:
            self._refresh_again = False
            await self._refresh_once(reason)
            if not self._refresh_again:
                return self.snapshot
            reason = "coalesced"

    async def _refresh_once(self, reason: str) -> None:
        assert self._root is not None
        started = time.time()
        timeout = self.config.timeout_s
        try:
            facts = await asyncio.wait_for(self._discover(self._root), timeout)
        except asyncio.TimeoutError:
            self._failed(f"discovery timed out after {timeout:g}s", started, reason)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a collector's bug must not take the agent down
            notes = "; ".join(getattr(exc, "__notes__", []))
            self._failed(f"{type(exc).__name__}: {exc}" + (f" ({notes})" if notes else ""), started, reason)
        else:
            self._version += 1
            self.snapshot = Snapshot(version=self._version, facts=facts, built_at=time.time())
            self.refreshes["success"] += 1
            log_event("discovery_ok", reason=reason, version=self._version, gpus=facts.matrix.size, seconds=f"{time.time() - started:.3f}")

    def _failed(self, error: str, started: float, reason: str) -> None:
        self.refreshes["failure"] += 1
        self.last_failure = (error, time.time() - started)
        log_event("discovery_failed", logging.ERROR, reason=reason, error=error, seconds=f"{time.time() - started:.3f}")
        if self.snapshot is not None:
            self._version += 1
            self.snapshot = self.snapshot.marked_stale(self._version, error, time.time())

    async def _timer_loop(self) -> None:
        while True:
            task = self.request_refresh("timer" if self.snapshot else "startup")
            try:
                await task
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # never expected: _refresh catches; keep looping
                log_event("discovery_crashed", logging.ERROR, error=exc)
            await asyncio.sleep(self.config.interval_s)

    def on_device_event(self, subsystem: str, action: str, name: str) -> None:
        """A udev event: refresh once things settle (a NIC reset fires dozens)."""
        log_event("device_event", subsystem=subsystem, action=action, device=name)
        if self._debounce:
            self._debounce.cancel()
        loop = asyncio.get_running_loop()
        self._debounce = loop.call_later(self.config.udev_debounce_s, self.request_refresh, "udev")

    # -- placement and leases -----------------------------------------------------------
    def busy(self) -> frozenset[int]:
        return self.leases.busy(time.time())

    def place(self, request: PlaceRequest) -> PlaceOutcome:
        assert self.snapshot is not None
        outcome = place_gpus(self.snapshot.facts.matrix, request, self.busy())
        self.placement_requests["placed" if outcome.fits else "nofit"] += 1
        return outcome

    async def reserve(self, request: PlaceRequest, owner: str, ttl_s: float) -> tuple[PlaceOutcome, Lease | None]:
        # One reservation at a time, from reading `busy` to the fsync'd write: two
        # concurrent requests can never both see a GPU free.
        async with self._lease_lock:
            assert self.snapshot is not None
            now = time.time()
            outcome = place_gpus(self.snapshot.facts.matrix, request, self.leases.busy(now))
            if not outcome.fits:
                self.placement_requests["nofit"] += 1
                return outcome, None
            lease = Lease(secrets.token_urlsafe(18), owner, outcome.gpus, now, now + ttl_s)
            updated = {**self.leases.leases, lease.id: lease}
            await asyncio.to_thread(self.leases.persist, updated)
            self.leases.leases = updated
            self.placement_requests["reserved"] += 1
        log_event("lease_granted", lease=lease.id[:6], owner=owner, gpus=",".join(map(str, lease.gpus)), ttl_s=ttl_s)
        return outcome, lease

    async def release(self, lease_id: str) -> Lease | None:
        async with self._lease_lock:
            lease = self.leases.leases.get(lease_id)
            if lease is None:
                return None
            updated = {k: v for k, v in self.leases.leases.items() if k != lease_id}
            await asyncio.to_thread(self.leases.persist, updated)
            self.leases.leases = updated
        log_event("lease_released", lease=lease_id[:6], owner=lease.owner)
        return lease

    def active_leases(self) -> list[Lease]:
        now = time.time()
        return sorted((l for l in self.leases.leases.values() if l.expires_at > now), key=lambda l: l.created_at)

    async def _lease_sweeper(self) -> None:
        while True:
            await asyncio.sleep(self.config.lease_sweep_s)
            async with self._lease_lock:
                now = time.time()
                expired = [l for l in self.leases.leases.values() if l.expires_at <= now]
                if expired:
                    updated = {k: v for k, v in self.leases.leases.items() if v.expires_at > now}
                    await asyncio.to_thread(self.leases.persist, updated)
                    self.leases.leases = updated
            for lease in expired:
                log_event("lease_expired", lease=lease.id[:6], owner=lease.owner)


def start_udev_watch(on_event: Callable[[str, str, str], None]) -> Callable[[], None] | None:
    """Watch PCI, InfiniBand and net add/remove/change; None when udev is unavailable."""
    try:
        import pyudev

        context = pyudev.Context()
        monitor = pyudev.Monitor.from_netlink(context)
        for subsystem in ("pci", "infiniband", "net"):
            monitor.filter_by(subsystem)
        monitor.start()
    except Exception as exc:  # no netlink in a container, no udev: keep the timer
        log_event("udev_unavailable", logging.WARNING, error=exc)
        return None
    loop = asyncio.get_running_loop()

    def readable() -> None:
        while (device := monitor.poll(timeout=0)) is not None:
            if device.action in ("add", "remove", "change"):
                on_event(device.subsystem or "?", device.action, device.sys_name)

    loop.add_reader(monitor.fileno(), readable)
    log_event("udev_watching", subsystems="pci,infiniband,net")

    def close() -> None:
        loop.remove_reader(monitor.fileno())

    return close
