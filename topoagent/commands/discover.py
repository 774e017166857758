"""`topoagent discover`: find how this node (or a recorded one) is wired."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from topoagent.collectors.nvidia_smi import render_topo_matrix
from topoagent.documents import print_document
from topoagent.errors import UsageError
from topoagent.node.host import Host, HostError

if TYPE_CHECKING:
    from topoagent.node.model import NodeTopology


EPILOG = """\
examples:
  topoagent discover                     # this node, like nvidia-smi topo -m
  topoagent discover --json > node.json  # all of it, each fact with its source
  topoagent discover --root node.tar.gz  # a node recorded by topoagent snapshot
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "discover",
        help="discover GPUs, NICs, the PCIe tree and NUMA of this node (or a recording)",
        # Wrapped here: RawDescriptionHelpFormatter (for the examples) keeps lines as written.
        description=(
            "Read sysfs, NVML and `nvidia-smi topo -m`, derive every GPU/NIC pair's link\n"
            "level and report disagreements and degraded links as findings (on stderr)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--root", metavar="DIR|TARBALL", default="/",
                        help="a recorded node (snapshot directory or .tar.gz/.tar.bz2); default: this node")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the whole NodeTopology as JSON")
    out.add_argument("--matrix", action="store_true",
                     help="print the derived matrix in `nvidia-smi topo -m` form (the default)")
    parser.set_defaults(run=run)


def open_host(root: str) -> Host:
    try:
        host = Host(root)
    except HostError as exc:
        raise UsageError(str(exc)) from None
    if not host.live and not (host.root / "sys").is_dir():
        # Any directory would otherwise "discover" as a node with no GPUs.
        host.close()
        raise UsageError(f"not a recorded node: no sys/ under {root}")
    return host


def discover_root(root: str) -> NodeTopology:
    """Discover a live or recorded node for a one-shot command (discover, place, probe)."""
    from topoagent.node.discovery import discover_sync

    with open_host(root) as host:
        return discover_sync(host)


def run(args: argparse.Namespace) -> int:
    topology = discover_root(args.root)
    if args.json:
        from topoagent.documents.schema import node_document

        print_document(node_document(topology))
        return 0
    matrix = topology.topo_matrix()
    if matrix.devices:
        sys.stdout.write(render_topo_matrix(matrix))
    else:
        print("no GPUs or RDMA NICs found")
    for finding in topology.findings:
        print(f"{finding.severity}: {finding.subject}: {finding.message}", file=sys.stderr)
    for collector in topology.collectors:
        # Damaged single files did not stop the collector, but the user should know.
        for warning in collector.warnings:
            print(f"warning: {collector.name}: {warning}", file=sys.stderr)
    return 0
