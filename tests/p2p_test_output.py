"""Reading the matrices of CUDA's p2pBandwidthLatencyTest outputs in the corpus."""

from __future__ import annotations


def matrix_cells(text: str, heading: str) -> dict[tuple[int, int], float]:
    """The off-diagonal cells of the matrix printed under ``heading``: (src, dst) -> value."""
    block = text.split(heading)[1]
    cells: dict[tuple[int, int], float] = {}
    for line in block.splitlines()[2:]:
        row = line.split()
        if not row or not row[0].isdigit():
            break
        src = int(row[0])
        for dst, value in enumerate(row[1:]):
            if dst != src:
                cells[src, dst] = float(value)
    return cells
