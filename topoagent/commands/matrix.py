"""`topoagent matrix`: read an `nvidia-smi topo -m` output and print it aligned or as JSON."""

from __future__ import annotations

import argparse
import json
import sys

from topoagent.cli import UsageError
from topoagent.collectors.nvidia_smi import (
    TopoParseError,
    parse_topo_matrix,
    render_topo_matrix,
    topo_matrix_to_json,
)


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


def read_text(path: str) -> str:
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8", errors="replace") as handle:
            return handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None


def run(args: argparse.Namespace) -> int:
    text = read_text(args.from_nvidia_smi)
    try:
        topo = parse_topo_matrix(text)
    except TopoParseError as exc:
        source = "stdin" if args.from_nvidia_smi == "-" else args.from_nvidia_smi
        raise UsageError(f"{source}: {exc}") from None
    if args.json:
        json.dump(topo_matrix_to_json(topo), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render_topo_matrix(topo))
        for note in topo.notes:
            print(f"note: {note}", file=sys.stderr)
    return 0
