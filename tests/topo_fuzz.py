"""Hostile `nvidia-smi topo -m` inputs: the real corpus, mutated the ways issue #14 found.

A strategy, not a test: tests/test_parser_fuzz.py runs it through the parser in process and
through the real commands in bounded children.  Inputs are bytes, as stdin and files give
them.
"""

from __future__ import annotations

from collections.abc import Callable

from conftest import CORPUS
from hypothesis import strategies as st

SEEDS = tuple(path.read_bytes() for path in sorted((CORPUS / "nvidia-smi-topo").glob("*.txt")))

# Values that broke a command once, and their neighbours.
HOSTILE_TOKENS = (
    b"NV" + b"9" * 5000,  # int digit limit
    b"NV" + b"9" * 40,
    b"NV0",
    b"NV007",
    b"9" * 5000,
    b"GPU" + b"7" * 5000,
    b"0-4000000000",  # a cpulist that expands to billions
    b"156-20",  # a cut-off cpulist runs backwards
    b"0-3,",
    b"-1",
    b"N/A",
    b"X",
    b"NVXX",
    b"GPU\xd9\xa3",  # an Arabic-Indic digit: int() reads it
    b"NV\xd9\xa1\xd9\xa2",
    b"\xff\xfe",  # not UTF-8
    b"mlx5_0",
    b"#",
    b"NIC Legend:",
    b"Legend:",
    b"CPU Affinity",
)

Draw = Callable[..., object]


def _lines(data: bytes) -> list[bytes]:
    return data.splitlines(keepends=True) or [b""]


def truncate(draw: Draw, data: bytes) -> bytes:
    return data[: draw(st.integers(0, len(data)))]


def delete_line(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    del lines[draw(st.integers(0, len(lines) - 1))]
    return b"".join(lines)


def duplicate_line(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    at = draw(st.integers(0, len(lines) - 1))
    lines.insert(at, lines[at])
    return b"".join(lines)


def swap_lines(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    a, b = draw(st.integers(0, len(lines) - 1)), draw(st.integers(0, len(lines) - 1))
    lines[a], lines[b] = lines[b], lines[a]
    return b"".join(lines)


def swap_cells(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    at = draw(st.integers(0, len(lines) - 1))
    cells = lines[at].split()
    if len(cells) >= 2:
        a, b = draw(st.integers(0, len(cells) - 1)), draw(st.integers(0, len(cells) - 1))
        cells[a], cells[b] = cells[b], cells[a]
        lines[at] = b"\t".join(cells) + b"\n"
    return b"".join(lines)


def replace_cell(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    at = draw(st.integers(0, len(lines) - 1))
    cells = lines[at].split() or [b""]
    cells[draw(st.integers(0, len(cells) - 1))] = draw(st.sampled_from(HOSTILE_TOKENS))
    lines[at] = b"\t".join(cells) + b"\n"
    return b"".join(lines)


def random_bytes(draw: Draw, data: bytes) -> bytes:
    at = draw(st.integers(0, len(data)))
    return data[:at] + draw(st.binary(min_size=1, max_size=16)) + data[at:]


def long_line(draw: Draw, data: bytes) -> bytes:
    lines = _lines(data)
    at = draw(st.integers(0, len(lines) - 1))
    cell = draw(st.sampled_from([b" NV1", b" X", b" SYS", b" GPU1", b" 0-3"]))
    lines[at] = lines[at].rstrip(b"\n") + cell * draw(st.integers(1, 30_000)) + b"\n"
    return b"".join(lines)


def many_columns(draw: Draw, data: bytes) -> bytes:
    """A well-formed matrix of n GPUs: the 10k-column file took 2.3 GB."""
    n = draw(st.integers(2, 10_000))
    rows = draw(st.integers(1, 3))
    header = b"\t" + b"\t".join(b"GPU%d" % i for i in range(n)) + b"\n"
    body = b"".join(
        b"GPU%d\t" % r + b"\t".join(b"X" if c == r else b"SYS" for c in range(n)) + b"\n" for r in range(rows)
    )
    return header + body + data[draw(st.integers(0, len(data))):]


def glued_header(draw: Draw, data: bytes) -> bytes:
    """Separators lost from a header line: a 100 KB one froze `serve` for 30 s."""
    unit = draw(st.sampled_from([b"GPU0GPU1", b"a", b"ab", b"mlx5_", b"mlx5_0", b"x1_"]))
    glued = b"\t" + unit * draw(st.integers(1, 100_000 // len(unit))) + b"\n"
    lines = _lines(data)
    lines[0] = glued
    return b"".join(lines)


MUTATIONS = (
    truncate, delete_line, duplicate_line, swap_lines, swap_cells, replace_cell,
    random_bytes, long_line, many_columns, glued_header,
)


@st.composite
def hostile_topo(draw: Draw) -> bytes:
    """A real output with one to three mutations."""
    data: bytes = draw(st.sampled_from(SEEDS))
    for _ in range(draw(st.integers(1, 3))):
        mutation = draw(st.sampled_from(MUTATIONS))
        data = mutation(draw, data)
    return data
