"""Host: the only door to the machine — the live node, or a recorded one replayed.

``Host("/")`` reads the live ``/sys`` and ``/proc`` and runs real commands.
``Host(path)`` replays a recorded node (docs/snapshot-format.md): a directory, or a
``.tar.gz`` / ``.tar.bz2`` of one, holding ``sys/``, ``proc/``, ``commands/`` and
``nvml.json``.  A directory made by ``hwloc-gather-topology`` works too.

Paths are always given as the node sees them (``/sys/bus/pci/devices/...``).  On a
replayed node every symlink is resolved by hand *inside* the root: a sysfs link such as
``../../../devices/pci0000:00/...`` (or an absolute one) can never reach the files of the
machine doing the replay.  Every read then opens the resolved path below the root,
refusing to follow any symlink the OS would meet, so a link planted after start-up
(``proc -> /``) is resolved inside the root too, never outside it: in one openat2(2)
call confined to the root where the kernel has it (Linux 5.6+), else one ``openat``
per component.

Every read is bounded (``MAX_FILE_BYTES`` and friends): a recording is data someone sent
us, and a 1 GB ``nvml.json`` must cost an error, not a gigabyte.
"""

from __future__ import annotations

import errno
import json
import os
import re
import stat
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, TypeVar

from topoagent.errors import TopoagentError
from topoagent.node import openat2  # a small module; ctypes itself only once a recording is read
from topoagent.smallfile import file_kind
from topoagent.text import REPLACEMENT, is_safe, machine_json, machine_text

if TYPE_CHECKING:
    import tempfile

    from topoagent.node.tarball import BoundedTarFile

_MAX_SYMLINK_HOPS = 40
# Components one resolution may walk, link targets included: PATH_MAX (4096) allows ~2,048
# in one path or link; a sysfs path has ~15.
_MAX_PATH_COMPONENTS = 4096
_T = TypeVar("_T")

# How much one read may bring in.  sysfs attributes are at most a page (4 KB); the largest
# file discovery reads is /proc/cpuinfo, ~1 MB on a 256-CPU x86 node (~4 KB of flags per
# CPU), so 8 MiB fits nodes of ~2,000 CPUs and bounds what a poisoned file can cost.
MAX_FILE_BYTES = 8 << 20
READ_CHUNK_BYTES = 64 << 10  # one read() of a node file (see Host.read_bytes)
# A recorded command's output: `nvidia-smi topo -m` is ~4 KB for 8 GPUs and grows with the
# square of the devices (~100 KB at 64 GPUs + 64 NICs).
MAX_COMMAND_BYTES = 1 << 20
# nvml.json: 22-31 KB for the 8- and 16-GPU recordings here, quadratic in GPUs (P2P).
# Parsed JSON costs ~10x its text in objects, hence a tighter cap than for plain files.
MAX_NVML_BYTES = 4 << 20
# A snapshot tarball, unpacked: the largest recorded node here is 6.7 MB in 1,703 entries;
# hwloc-gather-topology of a big node is a few tens of MB.  The caps are checked on the
# members' headers before anything is written.
MAX_TARBALL_BYTES = 256 << 20
MAX_TARBALL_MEMBERS = 200_000
_COMMAND_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class HostError(TopoagentError):
    """The host (or its recording) cannot answer; the message says what and where."""


class CommandNotFound(HostError):
    """The command does not exist on this node, or a recording holds no answer of it:
    ``on_node`` says which (False: the recording is silent, the node may well have it)."""

    def __init__(self, message: str, on_node: bool = True) -> None:
        super().__init__(message)
        self.on_node = on_node


class CommandTimeout(HostError):
    """The command ran past its timeout and was killed."""


class FileTooLarge(HostError):
    """A file (or recorded output) is larger than a node's would be; it was not read."""


class NotAFile(HostError):
    """A FIFO, socket or device where a file should be: unreadable, and never waited on."""


class _LinkMoved(Exception):
    """A symlink appeared where the cached resolution had none: resolve again."""


@dataclass(frozen=True, slots=True)
class CommandResult:
    """A command's answer, live or replayed from a recording: its output and exit code."""

    argv: tuple[str, ...]
    stdout: str
    stderr: str
    returncode: int


def command_file_stem(argv: list[str] | tuple[str, ...]) -> str:
    """The recorded name of a command: ``nvidia-smi topo -m`` -> ``nvidia-smi_topo_-m``."""
    return _COMMAND_NAME_UNSAFE.sub("-", "_".join(argv))


@dataclass
class Recording:
    """What a live Host was asked, so `topoagent snapshot` can write exactly that."""

    files: dict[str, bytes] = field(default_factory=dict)  # resolved path -> content
    symlinks: dict[str, str] = field(default_factory=dict)  # link path -> raw target
    dirs: dict[str, dict[str, str]] = field(default_factory=dict)  # dir -> name -> kind
    commands: dict[str, CommandResult] = field(default_factory=dict)
    missing_commands: set[str] = field(default_factory=set)  # stems of commands the node lacks
    nvml: dict | None = None
    telemetry: dict | None = None  # counter samples, written as telemetry.json


class Host:
    """A node to read: live when ``root`` is ``/``, else a recording to replay."""

    def __init__(self, root: str | os.PathLike[str] = "/", *, record: bool = False) -> None:
        self._tempdir: tempfile.TemporaryDirectory[str] | None = None
        root_path = Path(root)
        self.live = str(root) == "/"
        # A replayed node can be recorded too: that trims a recording to what discovery
        # reads, and lets tests check that record -> replay changes nothing.
        self.recording: Recording | None = Recording() if record else None
        if self.live:
            self.root = Path("/")
        elif root_path.is_dir():
            self.root = root_path.resolve()
        elif root_path.is_file() and _is_tarball(root_path):
            self.root = self._extract(root_path)
        elif root_path.exists():
            raise HostError(f"{root}: not a directory or a .tar.gz/.tar.bz2 snapshot")
        else:
            raise HostError(f"{root}: no such file or directory")
        self.description = "live node" if self.live else f"recording {root}"
        # A recording does not change while it is replayed: cache link lookups.
        self._root_text = str(self.root).rstrip("/")
        self._links: dict[str, str | None] = {}
        self._resolved: dict[str, str] = {}
        # The root, held open for openat2 (see _root_descriptor): None until first asked,
        # -1 where the kernel has no openat2 and reads walk the path (_open_dirs).
        self._root_fd: int | None = None

    # --- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        self._close_root()
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    def __del__(self) -> None:
        self._close_root()  # a Host dropped without close() keeps no descriptor

    def _close_root(self) -> None:
        fd, self._root_fd = getattr(self, "_root_fd", None), None
        if fd is not None and fd >= 0:
            os.close(fd)

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _extract(self, tarball: Path) -> Path:
        import tarfile  # only recordings given as tarballs need it (6 ms of every start-up)
        import tempfile  # likewise (1 ms: it brings random)

        from topoagent.node.tarball import HeadersTooLarge, open_bounded

        self._tempdir = tempfile.TemporaryDirectory(prefix="topoagent-root-")
        dest = Path(self._tempdir.name)
        try:
            with open_bounded(tarball) as archive:
                _check_tarball_size(tarball, archive)
                # The 'data' filter keeps relative symlinks and refuses members (or link
                # targets) that would land outside dest, absolute paths and devices.
                archive.extractall(dest, filter="data")
        except HostError:
            self.close()
            raise
        except HeadersTooLarge as exc:
            self.close()
            raise HostError(f"{tarball}: {exc}; not a recorded node") from None
        except tarfile.FilterError as exc:
            self.close()
            raise HostError(f"{tarball}: refusing unsafe member: {exc}") from None
        except (tarfile.TarError, OSError, EOFError, ValueError) as exc:
            # ValueError: tarfile's own, for a sparse map that is not numbers.
            self.close()
            raise HostError(f"{tarball}: cannot extract: {exc}") from None
        # hwloc's tarballs (and `tar czf x.tar.gz node/`) hold one top directory.
        if not (dest / "sys").exists() and not (dest / "proc").exists():
            entries = [p for p in dest.iterdir()]
            if len(entries) == 1 and entries[0].is_dir() and not entries[0].is_symlink():
                return entries[0]
        return dest

    # --- paths ------------------------------------------------------------------------

    def realpath(self, path: str) -> str:
        """The path with every symlink resolved, as the node sees it (never outside root)."""
        resolved = os.path.realpath(path) if self.live else self._resolve(path)
        if self.recording is not None:
            self._record_links(path)
        return resolved

    def _real(self, path: str) -> str:
        """realpath without recording (for the recorder's own bookkeeping)."""
        return os.path.realpath(path) if self.live else self._resolve(path)

    def _on_disk(self, node_path: Path) -> Path:
        """Where a node path that needs no further resolving lies on this machine."""
        return self.root / str(node_path).lstrip("/") if not self.live else node_path

    def _resolve(self, path: str) -> str:
        """Resolve inside the root, one component at a time, without recursion.

        A loop with a stack of components still to walk, not a call per component: a link
        whose target is thousands of components long (``./././…``, legal up to PATH_MAX)
        must cost a loop, not Python's recursion limit.  Plain strings and a cache keyed
        by every prefix of the path asked for: discovery resolves thousands of sysfs paths
        ten components deep, mostly in the same few hundred directories, so the walk starts
        at the nearest resolved ancestor.  At most _MAX_SYMLINK_HOPS links are followed and
        _MAX_PATH_COMPONENTS components walked (as the kernel's own limits, ELOOP and
        PATH_MAX, bound its walk); past either the path is unreadable (HostError).
        """
        cached = self._resolved.get(path)
        if cached is not None:
            return cached
        # (component, the prefix of ``path`` it completes, to cache; None inside a link's target)
        pending: list[tuple[str, str | None]] = []
        head = path.rstrip("/")
        current = "/"
        while head:
            found = self._resolved.get(head)
            if found is not None:
                current = found
                break
            parent, _, name = head.rpartition("/")
            pending.append((name, head))
            if len(pending) > _MAX_PATH_COMPONENTS:
                raise HostError(f"{path[:100]}...: path too deep (more than {_MAX_PATH_COMPONENTS:,} components)")
            head = parent
        hops = walked = 0
        while pending:
            name, key = pending.pop()
            walked += 1
            if walked > _MAX_PATH_COMPONENTS:
                raise HostError(f"{path[:100]}: path too deep (more than {_MAX_PATH_COMPONENTS:,} components)")
            prefix = "" if current == "/" else current
            if name in ("", "."):
                pass
            elif name == "..":
                current = current.rsplit("/", 1)[0] or "/"
            else:
                target = self._link_target(f"{prefix}/{name}")
                if target is None:
                    current = f"{prefix}/{name}"
                else:
                    hops += 1
                    if hops > _MAX_SYMLINK_HOPS:
                        raise HostError(f"{path[:100]}: too many levels of symbolic links")
                    if key is not None:  # cache this prefix once its link's target is walked
                        pending.append(("", key))
                        key = None
                    if target.startswith("/"):
                        current = "/"
                    pending.extend((part, None) for part in reversed(target.split("/")))
            if key is not None:
                self._resolved[key] = current
        self._resolved[path] = current
        return current

    def _link_target(self, node_path: str) -> str | None:
        """The target of a symlink in the recording; None when it is not one (or missing)."""
        try:
            return self._links[node_path]
        except KeyError:
            pass
        try:
            target: str | None = os.readlink(self._root_text + node_path)
        except OSError:  # not a link, or missing: then nothing below it is a link either
            target = None
        self._links[node_path] = target
        return target

    def _forget_links(self) -> None:
        self._links.clear()
        self._resolved.clear()

    def _inside(self, path: str, action: Callable[[int, str], _T], *, follow_last: bool = True) -> _T:
        """``action(dir_fd, name)`` on ``path`` in the recording, never outside the root.

        The path is resolved inside the root (cached), then its directories are opened
        one by one below the root without following symlinks; ``action`` must not follow
        one either.  Meeting a link means the recording changed since the cache was
        filled: resolve once more, afresh.  ``follow_last=False`` leaves the last
        component as it is (islink, readlink).
        """
        for _ in range(2):
            parent, _, name = path.rstrip("/").rpartition("/")
            if follow_last:
                parent, _, name = self._resolve(path).rpartition("/")
            else:
                parent = self._resolve(parent or "/")
            try:
                dir_fd = self._open_dirs(parent, path)
            except _LinkMoved:
                self._forget_links()
                continue
            try:
                return action(dir_fd, name or ".")
            except _LinkMoved:
                self._forget_links()
            finally:
                os.close(dir_fd)
        raise HostError(f"{path}: its symbolic links keep changing; not read")

    def _root_descriptor(self) -> int:
        """The root held open for openat2; -1 where the kernel has none (then walk)."""
        if self._root_fd is None:
            fd = os.open(self._root_text or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
            if not openat2.available(fd):
                os.close(fd)
                fd = -1
            self._root_fd = fd
        return self._root_fd

    def _open(self, path: str, flags: int) -> int:
        """``path`` of the recording opened with ``flags``, its symlinks resolved inside
        the root, none followed by the open itself: one openat2 call where the kernel has
        it, else a walk (_inside).  A link met means the recording changed: resolve
        afresh, once.  Errors name ``path``."""
        root_fd = self._root_descriptor()
        if root_fd < 0:

            def action(dir_fd: int, name: str) -> int:
                try:
                    fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
                except OSError as exc:
                    if exc.errno == errno.ELOOP:
                        raise _LinkMoved from None
                    raise type(exc)(exc.errno, exc.strerror, path) from None
                # O_PATH | O_NOFOLLOW opens a symlink itself rather than failing.
                if flags & os.O_PATH and stat.S_ISLNK(os.fstat(fd).st_mode):
                    os.close(fd)
                    raise _LinkMoved
                return fd

            return self._inside(path, action)
        guess = self._resolved_parent(path)
        if guess is not None:
            try:
                return openat2.open_in_root(root_fd, guess, flags)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.EAGAIN):
                    raise OSError(exc.errno, exc.strerror, path) from None
                # The last component is a link (or the recording changed): resolve it all.
        for _ in range(2):
            try:
                return openat2.open_in_root(root_fd, self._resolve(path).lstrip("/") or ".", flags)
            except OSError as exc:
                # ELOOP: a symlink where the cache had none; EAGAIN: a rename raced the walk.
                if exc.errno not in (errno.ELOOP, errno.EAGAIN):
                    raise OSError(exc.errno, exc.strerror, path) from None
                self._forget_links()
        raise HostError(f"{path}: its symbolic links keep changing; not read")

    def _resolved_parent(self, path: str) -> str | None:
        """``path`` below the root with its directories resolved and its last component as
        it is, for openat2 to try before that component is looked at: most reads end at a
        plain file, and openat2 itself refuses a link there (ELOOP), so asking readlink(2)
        about every file first would cost a system call per read for nothing.  None where
        the whole path must be resolved first: it is cached already, its last component is
        a known link, or it ends in ``.`` or ``..``."""
        resolved = self._resolved.get(path)
        if resolved is not None:
            return resolved.lstrip("/") or "."
        parent, _, name = path.rstrip("/").rpartition("/")
        if name in ("", ".", ".."):
            return None
        leaf = f"{self._resolve(parent or '/').rstrip('/')}/{name}"
        if self._links.get(leaf) is not None:
            return None
        return leaf.lstrip("/")

    def _open_dirs(self, resolved: str, path: str) -> int:
        """An O_PATH descriptor for a resolved directory, opened without following links."""
        root_fd = self._root_descriptor()
        if root_fd >= 0:
            try:
                return openat2.open_in_root(root_fd, resolved.lstrip("/") or ".", os.O_PATH | os.O_DIRECTORY)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EAGAIN):
                    raise _LinkMoved from None
                raise OSError(exc.errno, exc.strerror, path) from None
        fd = os.open(self._root_text or "/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for part in resolved.split("/"):
                if not part:
                    continue
                try:
                    next_fd = os.open(part, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
                except NotADirectoryError:  # a file, or a symlink O_NOFOLLOW would not enter
                    if stat.S_ISLNK(os.stat(part, dir_fd=fd, follow_symlinks=False).st_mode):
                        raise _LinkMoved from None
                    raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), path) from None
                os.close(fd)
                fd = next_fd
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _stat(self, path: str) -> os.stat_result:
        """stat() of a node path (symlinks resolved inside the root)."""
        if self.live:
            return os.stat(path)
        fd = self._open(path, os.O_PATH)
        try:
            return os.fstat(fd)
        finally:
            os.close(fd)

    def read_bytes(self, path: str, limit: int = MAX_FILE_BYTES) -> bytes:
        """The one way anything is read from a node: inside the root, at most ``limit`` bytes.

        Raises FileNotFoundError / OSError like open() does, FileTooLarge past the limit,
        NotAFile for a FIFO, socket or device in a file's place.
        """
        # O_NONBLOCK: opening a FIFO for reading waits for a writer, and reading it waits
        # for data; a recording (or a planted FIFO) must not hang a one-shot command.
        # Only regular files are read (sysfs and procfs attributes are), checked on the
        # open descriptor so the check and the read see the same file.
        flags = os.O_RDONLY | os.O_NONBLOCK
        fd = os.open(path, flags | os.O_CLOEXEC) if self.live else self._open(path, flags)
        # In pieces: procfs and sysfs size a read's buffer by what is asked for, and a sysctl
        # file refuses a read of 4 MiB or more outright (ENOMEM), so one read of the whole
        # limit would lose /proc/sys/kernel/hostname on a live node.
        chunks: list[bytes] = []
        size = 0
        try:
            status = os.fstat(fd)
            mode = status.st_mode
            if stat.S_ISDIR(mode):
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), path)
            if not stat.S_ISREG(mode):
                raise NotAFile(f"{path}: not a regular file ({file_kind(mode)}); not read")
            # A recording's file, on an ordinary file system, is read once as many bytes as
            # fstat gave as its size are in: no read(2) more to meet the end (a thousand per
            # replay).  A live file is read to its end: sysfs says 4,096 and procfs 0 (so a
            # size of 0 is read to the end on a recording too: it may be a mounted procfs).
            whole = -1
            if self.live:
                # A regular file reads as before; O_NONBLOCK was for the open.  (A recording's
                # files lie on an ordinary file system, where it changes no regular file's read.)
                os.set_blocking(fd, True)
            else:
                whole = status.st_size or -1
            while size <= limit and size != whole:
                chunk = os.read(fd, min(READ_CHUNK_BYTES, limit + 1 - size))
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
        finally:
            os.close(fd)
        if size > limit:
            raise FileTooLarge(f"{path}: larger than {limit:,} bytes; not read")
        return b"".join(chunks)

    def hostname(self) -> str | None:
        """The node's name: the kernel's (/proc/sys/kernel/hostname, which `topoagent
        snapshot` now records too); on a recording without that file, the name its
        snapshot.json keeps.  None when there is none, or none that is a name (blank, over
        253 characters, or holding spaces, control characters or what was one)."""
        name = self.read_optional("/proc/sys/kernel/hostname")
        if name is None and not self.live:
            try:
                meta = json.loads(self.read_bytes("/snapshot.json", 1 << 16))
            except (OSError, HostError, ValueError, RecursionError):
                meta = None
            recorded = meta.get("hostname") if isinstance(meta, dict) else None
            name = recorded if isinstance(recorded, str) else None
        name = name.strip() if name else ""
        safe = name.isprintable() and REPLACEMENT not in name and not any(c.isspace() for c in name)
        return name if name and len(name) <= 253 and safe else None

    def _record_links(self, path: str) -> None:
        """Note every symlink met on the way to ``path`` (paths as the node sees them)."""
        assert self.recording is not None
        current = Path("/")
        parts = list(PurePosixPath(path).parts[1:])
        hops = 0
        while parts and hops < _MAX_SYMLINK_HOPS:
            part = parts.pop(0)
            if part == "..":
                current = current.parent
                continue
            candidate = current / part
            if self._on_disk(candidate).is_symlink():
                hops += 1
                target = os.readlink(self._on_disk(candidate))
                self.recording.symlinks[str(candidate)] = target
                base = Path("/") if target.startswith("/") else current
                current = Path(os.path.normpath(base / target))
                # Resolve the target's own links on the next rounds.
                rest = parts
                parts = list(current.parts[1:]) + rest
                current = Path("/")
            else:
                current = candidate

    # --- reading ----------------------------------------------------------------------

    def read_text(self, path: str) -> str:
        """The file's text; raises FileNotFoundError / OSError like open() does."""
        data = self.read_bytes(path)
        if self.recording is not None:
            self._record_links(path)
            self.recording.files[self._real(path)] = data
        return machine_text(data.decode("utf-8", errors="replace"))

    def read_optional(self, path: str) -> str | None:
        """The file's stripped text, or None when it does not exist or cannot be read."""
        try:
            return self.read_text(path).strip()
        except (OSError, HostError):
            return None

    def exists(self, path: str) -> bool:
        try:
            self._stat(path)
        except (OSError, HostError):
            return False
        if self.recording is not None:
            self._record_links(path)
        return True

    def is_dir(self, path: str) -> bool:
        try:
            return stat.S_ISDIR(self._stat(path).st_mode)
        except (OSError, HostError):
            return False

    def islink(self, path: str) -> bool:
        """Whether ``path`` itself is a symlink (its parents are resolved first)."""
        if self.live:
            return os.path.islink(path)

        def action(dir_fd: int, name: str) -> bool:
            try:
                return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            except OSError:
                return False

        try:
            return self._inside(path, action, follow_last=False)
        except (OSError, HostError):
            return False

    def readlink(self, path: str) -> str:
        if self.live:
            target = os.readlink(path)
        else:
            target = self._inside(path, lambda dir_fd, name: os.readlink(name, dir_fd=dir_fd), follow_last=False)
        if self.recording is not None:
            parent, name = os.path.split(path.rstrip("/"))
            self._record_links(parent)
            self.recording.symlinks[os.path.join(self._real(parent), name)] = target
        return machine_text(target)  # a driver's or a device's name is read from its link

    def listdir(self, path: str) -> list[str]:
        """Sorted entry names; an empty list when the directory does not exist."""
        try:
            if self.live:
                found = _scan(path)
            else:
                fd = self._open(path, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    found = _scan(fd)
                finally:
                    os.close(fd)
        except (FileNotFoundError, NotADirectoryError):
            return []
        if self.recording is not None:
            self._record_links(path)
            self.recording.dirs[self._real(path)] = found
        # A name that is not safe text (bytes that are not UTF-8, a control character) is no
        # name the kernel gives a device: left out, not carried into every label it would name.
        return sorted(name for name in found if is_safe(name))

    # --- commands and NVML ------------------------------------------------------------

    async def run(self, argv: list[str], timeout: float = 10.0) -> CommandResult:
        """Run a command (never through a shell); replayed nodes answer from commands/."""
        if not argv:
            raise HostError("empty command")
        if not self.live:
            try:
                replayed = self._replay_command(argv)
            except CommandNotFound as exc:
                if exc.on_node and self.recording is not None:
                    self.recording.missing_commands.add(command_file_stem(argv))
                raise
            if self.recording is not None:
                self.recording.commands[command_file_stem(argv)] = replayed
            return replayed
        try:
            return await self._run_live(argv, timeout)
        except CommandNotFound:
            # Recorded too, so a replay says what the node said: not installed there.
            if self.recording is not None:
                self.recording.missing_commands.add(command_file_stem(argv))
            raise

    async def _run_live(self, argv: list[str], timeout: float) -> CommandResult:
        asyncio = sys.modules.get("asyncio")
        if asyncio is None or asyncio._get_running_loop() is None:
            # A one-shot command drives collectors without an event loop (see off_loop).
            return self._run_blocking(argv, timeout)
        try:
            process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError:
            raise CommandNotFound(f"{argv[0]}: command not found") from None
        except PermissionError:
            raise HostError(f"{argv[0]}: permission denied") from None
        try:
            out, err = await asyncio.wait_for(process.communicate(), timeout)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise CommandTimeout(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
        result = CommandResult(
            tuple(argv),
            machine_text(out.decode("utf-8", errors="replace")),
            machine_text(err.decode("utf-8", errors="replace")),
            process.returncode if process.returncode is not None else -1,
        )
        if self.recording is not None:
            self.recording.commands[command_file_stem(argv)] = result
        return result

    def _run_blocking(self, argv: list[str], timeout: float) -> CommandResult:
        # A tool that is not installed (lldpctl often, nvidia-smi without a driver) is told
        # by a PATH look-up: no fork, and no import of subprocess (3 ms of start-up).  shutil
        # too is imported here: it brings bz2, lzma and zlib, which a replay never needs.
        import shutil

        if shutil.which(argv[0]) is None:
            raise CommandNotFound(f"{argv[0]}: command not found")
        import subprocess

        try:
            done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=timeout, check=False)
        except FileNotFoundError:
            raise CommandNotFound(f"{argv[0]}: command not found") from None
        except PermissionError:
            raise HostError(f"{argv[0]}: permission denied") from None
        except subprocess.TimeoutExpired:
            raise CommandTimeout(f"{' '.join(argv)}: no answer within {timeout:g} s") from None
        result = CommandResult(
            tuple(argv),
            machine_text(done.stdout.decode("utf-8", errors="replace")),
            machine_text(done.stderr.decode("utf-8", errors="replace")),
            done.returncode,
        )
        if self.recording is not None:
            self.recording.commands[command_file_stem(argv)] = result
        return result

    def _replay_command(self, argv: list[str]) -> CommandResult:
        stem = f"/commands/{command_file_stem(argv)}"
        try:
            stdout = self.read_bytes(f"{stem}.out", MAX_COMMAND_BYTES)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            if self._optional_present(f"{stem}.missing"):
                raise CommandNotFound(f"{argv[0]}: command not found on the recorded node") from None
            raise CommandNotFound(f"{argv[0]}: not recorded on this node", on_node=False) from None
        except OSError as exc:
            raise HostError(f"{stem}.out: {exc.strerror or exc}") from None
        stderr = self._optional_recorded(f"{stem}.err", MAX_COMMAND_BYTES)
        rc = 0
        rc_text = self._optional_recorded(f"{stem}.rc", 64).strip()
        if rc_text:
            try:
                rc = int(rc_text)
            except ValueError:
                raise HostError(f"{stem}.rc: exit code {rc_text[:20]!r} is not a number") from None
        return CommandResult(tuple(argv), machine_text(stdout.decode("utf-8", errors="replace")), stderr, rc)

    def _optional_present(self, path: str) -> bool:
        try:
            self.read_bytes(path, 64)
        except (OSError, HostError):
            return False
        return True

    def _optional_recorded(self, path: str, limit: int) -> str:
        """A recorded side file (.err, .rc): empty when absent; errors name the file."""
        try:
            return machine_text(self.read_bytes(path, limit).decode("utf-8", errors="replace"))
        except FileNotFoundError:
            return ""
        except OSError as exc:
            raise HostError(f"{path}: {exc.strerror or exc}") from None

    def nvml(self) -> dict | None:
        """Recorded NVML answers (replay only); None when the node had no NVML."""
        if self.live:
            return None
        try:
            text = self.read_bytes("/nvml.json", MAX_NVML_BYTES)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise HostError(f"nvml.json: unreadable NVML recording: {exc.strerror or exc}") from None
        try:
            data = machine_json(text)  # JSON's escapes can carry any code point, NUL and lone surrogates too
        except (ValueError, RecursionError) as exc:
            raise HostError(f"nvml.json: unreadable NVML recording: {exc}") from None
        if not isinstance(data, dict):
            raise HostError("nvml.json: NVML recording must be a JSON object")
        self.note_nvml(data)
        return data

    def note_nvml(self, data: dict) -> None:
        """The live NVML reader hands its answers here so a snapshot can keep them."""
        if self.recording is not None:
            self.recording.nvml = data


def _scan(directory: str | int) -> dict[str, str]:
    with os.scandir(directory) as entries:
        return {e.name: _kind(e) for e in entries}


def _check_tarball_size(tarball: Path, archive: BoundedTarFile) -> None:
    """Refuse an archive that would unpack into more than a recorded node ever holds.

    Members are read one header at a time, so a million-member archive is refused after
    MAX_TARBALL_MEMBERS of them, and sizes are summed from the headers before any byte
    is written: the members' data and their extended headers (PAX records, GNU long
    names), which tarfile keeps in memory.
    """
    data = 0
    for count, member in enumerate(archive, start=1):
        data += member.size
        if count > MAX_TARBALL_MEMBERS:
            raise HostError(f"{tarball}: more than {MAX_TARBALL_MEMBERS:,} members; not a recorded node")
        if data + archive.extended_header_bytes > MAX_TARBALL_BYTES:
            raise HostError(f"{tarball}: unpacks to more than {MAX_TARBALL_BYTES >> 20} MiB; not a recorded node")


def _kind(entry: os.DirEntry) -> str:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    return "file"


def _is_tarball(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar"))
