"""Write what a recording Host was asked as a snapshot (docs/snapshot-format.md)."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from topoagent import __version__
from topoagent.node.host import Host, HostError
from topoagent.node.model import NodeTopology

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz")
# Archive names a user may reach for that we do not write: refused rather than
# recorded as a directory literally called "node.zip".
OTHER_ARCHIVE_SUFFIXES = (
    ".zip", ".tar", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst", ".gz", ".bz2", ".xz", ".zst", ".7z", ".rar",
)


def check_snapshot_target(out: str | os.PathLike[str], *, force: bool = False) -> None:
    """Refuse a target ``write_snapshot`` would not write (before any discovery runs).

    An existing archive or non-empty directory is refused unless ``force``; even then a
    directory is replaced only if it holds an earlier snapshot (its snapshot.json).
    """
    out_path = Path(out)
    name = out_path.name.lower()
    if name.endswith(ARCHIVE_SUFFIXES):
        if out_path.is_dir():
            raise HostError(f"{out}: is a directory; an archive target must be a file")
        if out_path.exists() and not force:
            raise HostError(f"{out}: exists; use --force to replace it")
        return
    if name.endswith(OTHER_ARCHIVE_SUFFIXES):
        raise HostError(
            f"{out}: unsupported archive type; write a directory (OUT) or a gzip tarball (OUT.tar.gz or OUT.tgz)"
        )
    if out_path.exists() and not out_path.is_dir():
        raise HostError(f"{out}: exists and is not a directory")
    if out_path.is_dir() and any(out_path.iterdir()):
        if not force:
            raise HostError(f"{out}: exists and is not empty; use --force to replace an earlier snapshot")
        if not (out_path / "snapshot.json").is_file():
            raise HostError(f"{out}: exists and holds no snapshot.json; --force replaces only an earlier snapshot")


def write_snapshot(host: Host, out: str | os.PathLike[str], *, force: bool = False) -> Path:
    """Write the recording of ``host`` to ``out`` (a new directory, or ``.tar.gz``/``.tgz``).

    See ``check_snapshot_target`` for what an existing ``out`` needs ``force`` for.
    """
    if host.recording is None:
        raise HostError("this host was not recording")
    check_snapshot_target(out, force=force)
    out_path = Path(out)
    if out_path.name.lower().endswith(ARCHIVE_SUFFIXES):
        with tempfile.TemporaryDirectory(prefix="topoagent-snap-") as tmp:
            stem = out_path.name.rsplit(".tar.gz", 1)[0].rsplit(".tgz", 1)[0] or "snapshot"
            root = Path(tmp) / stem
            _write_dir(host, root)
            # Beside the target, then renamed: a replaced archive is never half-written.
            partial = out_path.with_name(f".{out_path.name}.partial")
            try:
                import tarfile  # only a tarball needs it (a directory is the common case)

                with tarfile.open(partial, "w:gz") as archive:
                    archive.add(root, arcname=stem)
                os.replace(partial, out_path)
            finally:
                partial.unlink(missing_ok=True)
        return out_path
    if out_path.is_dir() and any(out_path.iterdir()):
        shutil.rmtree(out_path)  # force, and an earlier snapshot (checked above)
    _write_dir(host, out_path)
    return out_path


def record_counters(host: Host, node: NodeTopology, samples: int = 2, pause_s: float = 1.0) -> None:
    """Read every counter source ``samples`` times, ``pause_s`` apart, into the recording
    (telemetry.json), so a replay reproduces the rates; a recording keeps its own."""
    from topoagent.collectors.nvml import LiveCounterReader
    from topoagent.node.discovery import COUNTER_SOURCES
    from topoagent.service.telemetry import Context, read_live, recorded_samples, sample_document

    assert host.recording is not None
    if not host.live:
        recorded_samples(host)  # copies the recording's samples, if it has any
        return
    reader = LiveCounterReader()
    try:
        context = Context(host, node, reader)
        rounds = []
        for n in range(samples):
            if n:
                time.sleep(pause_s)
            rounds.append([read_live(source, context) for source in COUNTER_SOURCES])
    finally:
        reader.close()
    host.recording.telemetry = sample_document(rounds)


def _inside(root: Path, node_path: str) -> Path:
    return root / node_path.lstrip("/")


def _write_dir(host: Host, root: Path) -> None:
    rec = host.recording
    assert rec is not None
    root.mkdir(parents=True, exist_ok=True)
    for directory, entries in rec.dirs.items():
        base = _inside(root, directory)
        base.mkdir(parents=True, exist_ok=True)
        for name, kind in entries.items():
            # Entries listed but never read still exist on replay, so listings match.
            target = base / name
            if kind == "dir":
                target.mkdir(exist_ok=True)
    for link, link_target in sorted(rec.symlinks.items()):
        local = _inside(root, link)
        local.parent.mkdir(parents=True, exist_ok=True)
        if local.is_symlink() or local.exists():
            if local.is_dir() and not local.is_symlink():
                shutil.rmtree(local)
            else:
                local.unlink()
        os.symlink(link_target, local)
    for path, data in rec.files.items():
        local = _inside(root, path)
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(data)
    for directory, entries in rec.dirs.items():
        base = _inside(root, directory)
        for name, kind in entries.items():
            target = base / name
            if kind == "file" and not target.exists() and not target.is_symlink():
                target.touch()
    if rec.commands:
        commands = root / "commands"
        commands.mkdir(exist_ok=True)
        for stem, result in rec.commands.items():
            (commands / f"{stem}.out").write_text(result.stdout)
            if result.stderr:
                (commands / f"{stem}.err").write_text(result.stderr)
            if result.returncode:
                (commands / f"{stem}.rc").write_text(f"{result.returncode}\n")
    if rec.missing_commands:
        commands = root / "commands"
        commands.mkdir(exist_ok=True)
        for stem in sorted(rec.missing_commands):
            (commands / f"{stem}.missing").write_text("command not found\n")
    if rec.nvml is not None:
        (root / "nvml.json").write_text(json.dumps(rec.nvml, indent=1) + "\n")
    if rec.telemetry is not None:
        (root / "telemetry.json").write_text(json.dumps(rec.telemetry, indent=1) + "\n")
    recorded_by = f"topoagent snapshot {__version__}"
    hostname = host.hostname()  # re-recorded from a recording: that node's name
    if not host.live:
        recorded_by += f" --root {host.description.removeprefix('recording ')}"
    meta = {
        "schema": 1,
        "hostname": hostname,
        "recorded_at": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "recorded_by": recorded_by,
    }
    (root / "snapshot.json").write_text(json.dumps(meta, indent=1) + "\n")
