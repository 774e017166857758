"""`topoagent matrix`: read an `nvidia-smi topo -m` output and print it aligned or as JSON."""

from __future__ import annotations

import argparse
import sys

from topoagent.collectors.nvidia_smi import render_topo_matrix
from topoagent.commands.sources import read_topo_matrix
from topoagent.documents import print_document


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "matrix",
        help="parse `nvidia-smi topo -m` output and print it aligned or as JSON",
        description=(
            "Read the output of `nvidia-smi topo -m` (any driver's format; tab- or "
            "space-separated, '#'-prefixed, truncated pastes) and print it re-aligned, "
            "or as JSON with every device and every unordered device pair."
        ),
    )
    parser.add_argument(
        "--from-nvidia-smi",
        metavar="FILE",
        required=True,
        help="file holding the output, or - for standard input",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of the matrix")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    topo = read_topo_matrix(args.from_nvidia_smi)
    if args.json:
        from topoagent.documents.schema import topo_matrix_document

        print_document(topo_matrix_document(topo))
    else:
        sys.stdout.write(render_topo_matrix(topo))
        for note in topo.notes:
            print(f"note: {note}", file=sys.stderr)
    return 0
