"""The files the running agent keeps current ([exports]): NFD's feature file, gres.conf
and NCCL's topology file.

Each is the text `topoagent export nfd|gres|nccl-xml` prints for the served node, with the
findings of the whole snapshot (discovery's, the probes', the counters'), so a label such
as ``findings.errors`` changes when a finding appears or clears.  A file is rewritten
(beside it, then renamed: a reader never sees half of one) only when its text differs
from what this agent last wrote there; the NFD file also when its expiry comes within
half its lifetime.  A file that cannot be written is tried again at the next check; the
others are written anyway.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

from topoagent.config import Config
from topoagent.log import log_event
from topoagent.node.findings import held_back
from topoagent.node.model import NodeTopology
from topoagent.service.served import Board

# How often the agent looks for a new snapshot to write the files from.
EXPORT_CHECK_S = 1.0


class ExportFailed(Exception):
    """One or more files could not be written; the message names each."""


@dataclass(frozen=True, slots=True)
class Written:
    text: str  # the export's text as last written (without the expiry line)
    refresh_at: float | None  # Unix time to rewrite it anyway (NFD's expiry); None: never


def expiry_line(expires_at: float) -> str:
    """NFD's directive: the features below it are dropped after this time (RFC 3339)."""
    stamp = datetime.fromtimestamp(expires_at, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return f"# +expiry-time={stamp}\n"


def rendered(config: Config, node: NodeTopology) -> dict[str, str]:
    """Configured path -> the export's text for ``node`` (empty when it has no GPUs,
    where `topoagent export` writes nothing too; no gres.conf or NCCL file while a finding
    leaves the GPUs' links unseen, see ``held_back``)."""
    if not node.gpus:
        return {}
    out = {}
    if config.export_nfd_path:
        from topoagent.exporters.nfd import render_nfd

        out[config.export_nfd_path] = render_nfd(node, config.export_nfd_prefix, config.export_nfd_topograph_labels)
    if config.export_gres_path and not held_back("gres", node):  # the last one written stays
        from topoagent.exporters.gres import render_gres

        out[config.export_gres_path] = render_gres(node, config.export_gres_node_name)
    if config.export_nccl_path and not held_back("nccl-xml", node):
        from topoagent.exporters.nccl_xml import render_nccl_xml

        out[config.export_nccl_path] = render_nccl_xml(node)
    return out


def write_atomically(path: Path, text: str) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # O_EXCL, a random name
    try:
        with os.fdopen(fd, "w") as handle:
            os.fchmod(handle.fileno(), 0o644)  # on the file made, never on what the name points at by now
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class Exports:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.written: dict[str, Written] = {}  # path -> what this agent last wrote there
        self.writes = 0  # files written since start

    def refresh_due(self) -> bool:
        now = self.clock()
        return any(w.refresh_at is not None and now >= w.refresh_at for w in self.written.values())

    def update(self, config: Config, node: NodeTopology) -> list[str]:
        """Write what changed; the paths written.  Raises ExportFailed naming the files
        that could not be written, after trying every one."""
        failed, done = [], []
        now = self.clock()
        for path, text in rendered(config, node).items():
            last = self.written.get(path)
            is_nfd = path == config.export_nfd_path
            if last is not None and last.text == text and (last.refresh_at is None or now < last.refresh_at):
                continue
            content, refresh_at = text, None
            if is_nfd:
                lifetime = config.export_nfd_expiry_s
                content, refresh_at = expiry_line(now + lifetime) + text, now + lifetime / 2
            try:
                write_atomically(Path(path), content)
            except OSError as exc:
                failed.append(f"{path}: {exc.strerror or exc}")
                continue
            self.written[path] = Written(text, refresh_at)
            self.writes += 1
            done.append(path)
        if failed:
            raise ExportFailed("cannot write " + "; ".join(failed))
        return done


def node_with_all_findings(node: NodeTopology, findings: tuple) -> NodeTopology:
    """The node as exports render it: with every finding the agent serves."""
    return node if findings == node.findings else replace(node, findings=findings)


class ExportsLoop:
    """Keeps the configured files up to the served snapshot."""

    def __init__(self, board: Board, config: Callable[[], Config]) -> None:
        self.board = board
        self.config = config
        self.exports = Exports()
        self._exported: tuple | None = None  # (snapshot version, config) the files were last brought up to

    async def update(self) -> None:
        """Bring the configured files up to the served snapshot: rendered again only when
        the snapshot or the config changed (or NFD's expiry nears), written only where the
        text changed.  A failure raises: the loop logs it and the next check retries."""
        snapshot, config = self.board.served.snapshot, self.config()
        if snapshot is None:
            return
        key = (snapshot.version, config)
        if key == self._exported and not self.exports.refresh_due():
            return
        node = node_with_all_findings(snapshot.node, snapshot.findings)
        written = await asyncio.to_thread(self.exports.update, config, node)
        self._exported = key
        for path in written:
            log_event("export_written", path=path, snapshot_version=snapshot.version)
