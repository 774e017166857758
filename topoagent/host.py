"""Host: the only door to the machine — the live node, or a recorded one replayed.

``Host("/")`` reads the live ``/sys`` and ``/proc`` and runs real commands.
``Host(path)`` replays a recorded node (docs/snapshot-format.md): a directory, or a
``.tar.gz`` / ``.tar.bz2`` of one, holding ``sys/``, ``proc/``, ``commands/`` and
``nvml.json``.  A directory made by ``hwloc-gather-topology`` works too.

Paths are always given as the node sees them (``/sys/bus/pci/devices/...``).  On a
replayed node every symlink is resolved by hand *inside* the root: a sysfs link such as
``../../../devices/pci0000:00/...`` (or an absolute one) can never reach the files of the
machine doing the replay.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from topoagent.errors import TopoagentError

_MAX_SYMLINK_HOPS = 40
_COMMAND_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class HostError(TopoagentError):
    """The host (or its recording) cannot answer; the message says what and where."""


class CommandNotFound(HostError):
    """The command does not exist on this node (or was not recorded)."""


class CommandTimeout(HostError):
    """The command ran past its timeout and was killed."""


@dataclass(frozen=True, slots=True)
class CommandResult:
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
    nvml: dict | None = None


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

    # --- life cycle -------------------------------------------------------------------

    def close(self) -> None:
        if self._tempdir is not None:
            self._tempdir.cleanup()
            self._tempdir = None

    def __enter__(self) -> Host:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _extract(self, tarball: Path) -> Path:
        self._tempdir = tempfile.TemporaryDirectory(prefix="topoagent-root-")
        dest = Path(self._tempdir.name)
        try:
            with tarfile.open(tarball) as archive:
                # The 'data' filter keeps relative symlinks and refuses members (or link
                # targets) that would land outside dest, absolute paths and devices.
                archive.extractall(dest, filter="data")
        except tarfile.FilterError as exc:
            self.close()
            raise HostError(f"{tarball}: refusing unsafe member: {exc}") from None
        except (tarfile.TarError, OSError, EOFError) as exc:
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

    def _resolve(self, path: str, hops: int = 0) -> str:
        """Resolve inside the root: the parent first (cached), then the last component.

        Plain strings and a cache per directory: discovery resolves thousands of sysfs
        paths ten components deep, mostly in the same few hundred directories.
        """
        cached = self._resolved.get(path)
        if cached is not None:
            return cached
        if hops > _MAX_SYMLINK_HOPS:
            raise HostError(f"{path}: too many levels of symbolic links")
        parent, _, name = path.rstrip("/").rpartition("/")
        base = self._resolve(parent, hops) if parent else "/"
        prefix = "" if base == "/" else base
        if name in ("", "."):
            result = base
        elif name == "..":
            result = base.rsplit("/", 1)[0] or "/"
        else:
            target = self._link_target(f"{prefix}/{name}")
            if target is None:
                result = f"{prefix}/{name}"
            else:
                joined = target if target.startswith("/") else f"{prefix}/{target}"
                result = self._resolve(joined, hops + 1)
        self._resolved[path] = result
        return result

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

    def _local(self, path: str) -> Path:
        """Where the file lies on this machine, after resolving links inside the root."""
        if self.live:
            return Path(path)
        return self.root / self._resolve(path).lstrip("/")

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
        local = self._local(path)
        if self.recording is not None:
            self._record_links(path)
            data = local.read_bytes()
            self.recording.files[self._real(path)] = data
            return data.decode("utf-8", errors="replace")
        with open(local, encoding="utf-8", errors="replace") as handle:
            return handle.read()

    def read_optional(self, path: str) -> str | None:
        """The file's stripped text, or None when it does not exist or cannot be read."""
        try:
            return self.read_text(path).strip()
        except (OSError, HostError):
            return None

    def exists(self, path: str) -> bool:
        try:
            found = self._local(path).exists()
        except HostError:
            return False
        if self.recording is not None and found:
            self._record_links(path)
        return found

    def is_dir(self, path: str) -> bool:
        try:
            return self._local(path).is_dir()
        except HostError:
            return False

    def islink(self, path: str) -> bool:
        """Whether ``path`` itself is a symlink (its parents are resolved first)."""
        parent, name = os.path.split(path.rstrip("/"))
        local = self._local(parent) / name
        return local.is_symlink()

    def readlink(self, path: str) -> str:
        parent, name = os.path.split(path.rstrip("/"))
        target = os.readlink(self._local(parent) / name)
        if self.recording is not None:
            self._record_links(parent)
            self.recording.symlinks[os.path.join(self._real(parent), name)] = target
        return target

    def listdir(self, path: str) -> list[str]:
        """Sorted entry names; an empty list when the directory does not exist."""
        local = self._local(path)
        try:
            with os.scandir(local) as entries:
                found = {e.name: _kind(e) for e in entries}
        except (FileNotFoundError, NotADirectoryError):
            return []
        if self.recording is not None:
            self._record_links(path)
            self.recording.dirs[self._real(path)] = found
        return sorted(found)

    # --- commands and NVML ------------------------------------------------------------

    async def run(self, argv: list[str], timeout: float = 10.0) -> CommandResult:
        """Run a command (never through a shell); replayed nodes answer from commands/."""
        if not argv:
            raise HostError("empty command")
        if not self.live:
            replayed = self._replay_command(argv)
            if self.recording is not None:
                self.recording.commands[command_file_stem(argv)] = replayed
            return replayed
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
            out.decode("utf-8", errors="replace"),
            err.decode("utf-8", errors="replace"),
            process.returncode if process.returncode is not None else -1,
        )
        if self.recording is not None:
            self.recording.commands[command_file_stem(argv)] = result
        return result

    def _replay_command(self, argv: list[str]) -> CommandResult:
        stem = self.root / "commands" / command_file_stem(argv)
        out_file = stem.with_name(stem.name + ".out")
        if not out_file.is_file():
            raise CommandNotFound(f"{argv[0]}: not recorded on this node")
        err_file = stem.with_name(stem.name + ".err")
        rc_file = stem.with_name(stem.name + ".rc")
        stderr = err_file.read_text(errors="replace") if err_file.is_file() else ""
        rc = 0
        if rc_file.is_file():
            text = rc_file.read_text().strip()
            try:
                rc = int(text)
            except ValueError:
                raise HostError(f"{rc_file}: exit code {text!r} is not a number") from None
        return CommandResult(tuple(argv), out_file.read_text(errors="replace"), stderr, rc)

    def nvml(self) -> dict | None:
        """Recorded NVML answers (replay only); None when the node had no NVML."""
        if self.live:
            return None
        path = self.root / "nvml.json"
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise HostError(f"{path}: unreadable NVML recording: {exc}") from None
        if not isinstance(data, dict):
            raise HostError(f"{path}: NVML recording must be a JSON object")
        self.note_nvml(data)
        return data

    def note_nvml(self, data: dict) -> None:
        """The live NVML reader hands its answers here so a snapshot can keep them."""
        if self.recording is not None:
            self.recording.nvml = data


def _kind(entry: os.DirEntry[str]) -> str:
    if entry.is_symlink():
        return "link"
    if entry.is_dir(follow_symlinks=False):
        return "dir"
    return "file"


def _is_tarball(path: Path) -> bool:
    name = path.name.lower()
    return name.endswith((".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar"))
