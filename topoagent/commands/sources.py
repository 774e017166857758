"""Where one-shot commands get a node from: a live or recorded root, or nvidia-smi text."""

from __future__ import annotations

import sys

from topoagent.collectors.nvidia_smi import (
    MAX_TOPO_TEXT_CHARS,
    TopoMatrix,
    TopoParseError,
    parse_topo_matrix,
)
from topoagent.errors import UsageError
from topoagent.node.matrix import DistanceMatrix, gpus_with_unknown_pairs


def read_topo_matrix(path: str) -> TopoMatrix:
    """Parse `nvidia-smi topo -m` output from a file or stdin (``-``); errors are one line."""
    source = "stdin" if path == "-" else path
    # Bytes, not text: stdin under a UTF-8 locale decodes strictly and would raise on a
    # stray byte.  Read one byte past the bound to tell a too-long input without holding it.
    try:
        if path == "-":
            data = sys.stdin.buffer.read(MAX_TOPO_TEXT_CHARS + 1)
        else:
            with open(path, "rb") as handle:
                data = handle.read(MAX_TOPO_TEXT_CHARS + 1)
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {exc.strerror}") from None
    if len(data) > MAX_TOPO_TEXT_CHARS:
        raise UsageError(f"{source}: more than {MAX_TOPO_TEXT_CHARS} bytes; nvidia-smi topo -m prints a few KB")
    # nvidia-smi prints ASCII; a byte that is not UTF-8 reads as U+FFFD and the parser
    # names the value it spoils.
    text = data.decode("utf-8", errors="replace")
    try:
        return parse_topo_matrix(text)
    except TopoParseError as exc:
        raise UsageError(f"{source}: {exc}") from None


def matrix_from_nvidia_smi(path: str) -> DistanceMatrix:
    """The matrix over the GPUs whose levels are all known; a note on stderr names the rest.

    A pasted output cut off before some rows leaves those GPUs' levels to each other
    unknown; they are left out (no guessing) and the others stay usable.
    """
    return matrix_and_left_out(path)[0]


def matrix_and_left_out(path: str) -> tuple[DistanceMatrix, tuple[int, ...]]:
    """``matrix_from_nvidia_smi`` and the indices of the GPUs it left out."""
    source = "stdin" if path == "-" else path
    topo = read_topo_matrix(path)
    left_out = gpus_with_unknown_pairs(topo)
    try:
        matrix = DistanceMatrix.from_topo_matrix(topo, leave_out=left_out)
    except ValueError as exc:  # still unknown somewhere: no guessing
        raise UsageError(f"{source}: {exc}") from None
    if left_out:
        print(
            f"note: {source}: left out {', '.join(left_out)}: their levels to each other are "
            "unknown (rows missing from the nvidia-smi output); using the other GPUs",
            file=sys.stderr,
        )
    return matrix, tuple(int(name[3:]) for name in left_out)


def matrix_from_root(root: str) -> DistanceMatrix:
    """Discover the node under ``root`` (live or recorded) and return its distance matrix."""
    from topoagent.commands.discover import discover_root

    return discover_root(root).distance_matrix()
