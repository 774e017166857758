"""Where one-shot commands get a node from: a live or recorded root, or nvidia-smi text."""

from __future__ import annotations

import sys

from topoagent.cli import UsageError
from topoagent.collectors.nvidia_smi import TopoMatrix, TopoParseError, parse_topo_matrix
from topoagent.matrix import DistanceMatrix


def read_topo_matrix(path: str) -> TopoMatrix:
    """Parse `nvidia-smi topo -m` output from a file or stdin (``-``); errors are one line."""
    source = "stdin" if path == "-" else path
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            with open(path, encoding="utf-8", errors="replace") as handle:
                text = handle.read()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    try:
        return parse_topo_matrix(text)
    except TopoParseError as exc:
        raise UsageError(f"{source}: {exc}") from None


def matrix_from_nvidia_smi(path: str) -> DistanceMatrix:
    topo = read_topo_matrix(path)
    try:
        return DistanceMatrix.from_topo_matrix(topo)
    except ValueError as exc:  # GPU pairs cut off by truncation: no guessing
        raise UsageError(f"{'stdin' if path == '-' else path}: {exc}") from None


def matrix_from_root(root: str) -> DistanceMatrix:
    """Discover the node under ``root`` (live or recorded) and return its distance matrix."""
    from topoagent.commands.discover import discover_root

    return discover_root(root).distance_matrix()
