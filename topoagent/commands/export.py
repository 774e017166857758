"""`topoagent export FORMAT`: this node's topology in the formats other tools read."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from topoagent.errors import UsageError

if TYPE_CHECKING:
    from topoagent.node.model import NodeTopology

FORMATS = {
    "nccl-xml": "NCCL topology file for NCCL_TOPO_FILE",
    "gres": "Slurm gres.conf lines for the node's GPUs",
    "nfd": "Node Feature Discovery local feature file (features.d)",
    "svg": "a picture of the node (SVG)",
    "html": "the same picture in a standalone HTML page",
}


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "export",
        help="write the topology as an NCCL topology file, gres.conf, NFD features or a picture",
        description="Discover this node (or a recording) and write it in another tool's format.",
    )
    formats = parser.add_subparsers(dest="format", metavar="FORMAT", required=True)
    for name, text in FORMATS.items():
        fmt = formats.add_parser(name, help=text, description=text)
        fmt.add_argument("--root", metavar="DIR|TARBALL", default="/",
                         help="a recorded node (snapshot directory or tarball); default: this node")
        fmt.add_argument("-o", "--output", metavar="FILE",
                         help="write here (atomically) instead of standard output")
        if name == "gres":
            fmt.add_argument("--node-name", metavar="NAME",
                             help="start each line with NodeName=NAME, so one gres.conf serves many nodes")
        if name == "nfd":
            fmt.add_argument("--prefix", default="topoagent.io",
                             help="label namespace (default: topoagent.io)")
            fmt.add_argument("--topograph-labels", action="store_true",
                             help="also write NVIDIA topograph's network.topology.nvidia.com/leaf and /accelerator labels")
        fmt.set_defaults(run=run)


# One rule for every format: a node without GPUs has nothing to export, so each says the
# same line and exits 1 without writing (an existing -o file is left as it was); 2 is bad input.
NO_GPUS = "no GPUs found on this node; nothing written"
EXIT_NO_GPUS = 1


def run(args: argparse.Namespace) -> int:
    from topoagent.commands.discover import discover_root

    topology = discover_root(args.root)
    if not topology.gpus:
        print(f"topoagent export {args.format}: {NO_GPUS}", file=sys.stderr)
        return EXIT_NO_GPUS
    from topoagent.node.findings import held_back  # not service.exports: its config pulls in telemetry

    held = held_back(args.format, topology)
    if held:
        print(f"topoagent export {args.format}: {held}; nothing written", file=sys.stderr)
        return EXIT_NO_GPUS
    _write(_render(args, topology), args.output)
    return 0


def _render(args: argparse.Namespace, topology: NodeTopology) -> str:
    if args.format == "nccl-xml":
        from topoagent.exporters.nccl_xml import NcclXmlError, render_nccl_xml

        try:
            return render_nccl_xml(topology)
        except NcclXmlError as exc:
            raise UsageError(str(exc)) from None
    if args.format == "gres":
        from topoagent.exporters.gres import GresError, render_gres

        try:
            return render_gres(topology, args.node_name)
        except GresError as exc:
            raise UsageError(str(exc)) from None
    if args.format == "nfd":
        from topoagent.exporters.nfd import LabelError, check_label, render_nfd

        try:
            check_label(f"{args.prefix}/gpu.count", "0")
        except LabelError:
            raise UsageError(f"--prefix {args.prefix!r} is not a valid label namespace") from None
        return render_nfd(topology, args.prefix, args.topograph_labels)
    from topoagent.exporters.svg import render_page, render_svg

    return render_svg(topology) if args.format == "svg" else render_page(topology)


def _write(text: str, output: str | None) -> None:
    if output is None or output == "-":
        sys.stdout.write(text)
        return
    path = Path(output)
    if not path.parent.is_dir():
        raise UsageError(f"{path.parent}: no such directory")
    # Write beside the target and rename, so a reader (NCCL, slurmd, nfd-worker) never
    # sees half a file.
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except OSError as exc:
        Path(tmp).unlink(missing_ok=True)
        raise UsageError(f"{path}: {exc.strerror}") from None
