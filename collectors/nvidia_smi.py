"""`nvidia-smi topo -m`: the declared witness of how GPUs and NICs are wired.

``parse_topo_matrix`` is pure: text in, ``TopoMatrix`` out, or one ``TopoParseError`` that
names the line and what is wrong.  It reads the output as tokens, not fixed columns,
because real pastes come tab-separated, tab-expanded, realigned by hand, misaligned,
prefixed with ``#``, truncated, or without their header; and the driver itself wraps the
header line in terminal escape codes (underline on, off), which are dropped first.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field

from topoagent.collectors.base import CollectorResult, NoData, SourceError, command_missing, run_collector
from topoagent.errors import TopoagentError
from topoagent.node.cpulist import CpuListError, parse_cpulist
from topoagent.node.host import CommandNotFound, Host
from topoagent.node.levels import LevelError, LevelKind, LinkLevel
from topoagent.text import without_terminal_escapes


class TopoParseError(TopoagentError, ValueError):  # ValueError: callers that parse corpora catch it
    """The text is not a readable `nvidia-smi topo -m` matrix."""

    def __init__(self, message: str, line_no: int | None = None, line: str | None = None):
        self.message = message
        self.line_no = line_no
        self.line = line
        where = f"line {line_no}: " if line_no is not None else ""
        shown = ""
        if line is not None:
            excerpt = line.strip()
            if len(excerpt) > 60:
                excerpt = excerpt[:57] + "..."
            shown = f" (line reads {excerpt!r})"
        super().__init__(f"{where}{message}{shown}")


@dataclass(frozen=True, slots=True)
class TopoDevice:
    """One row/column of the matrix, as nvidia-smi names it."""

    name: str  # GPU0, NIC3, mlx5_0 ...
    kind: str  # "gpu" or "nic"
    device: str | None = None  # NICs: the RDMA device (from the NIC Legend, or the name)
    cpu_affinity: str | None = None  # cpulist such as "0-47,96-143"; None for N/A
    numa_affinity: str | None = None  # "0", "0-7", "0,2-17"; None for N/A
    gpu_numa_id: str | None = None  # the GPU memory's own NUMA node; None for N/A


@dataclass(frozen=True, slots=True)
class TopoMatrix:
    """An `nvidia-smi topo -m` matrix, parsed: its devices and the level between each two."""

    devices: tuple[TopoDevice, ...]
    # levels[i][j]; None where neither device's row was in the text (truncated paste).
    levels: tuple[tuple[LinkLevel | None, ...], ...]
    missing_rows: tuple[str, ...] = ()  # devices whose row was absent
    notes: tuple[str, ...] = field(default=())  # what was inferred or cut off
    _by_name: dict[str, int] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Merging looks both names of every pair up: 65,280 times on a 128-GPU node, where a
        # scan of the devices each time took 40% of merging it.  The first of a name wins.
        for i, device in enumerate(self.devices):
            self._by_name.setdefault(device.name, i)

    def index(self, name: str) -> int:
        return self._by_name[name]  # KeyError(name) for a name it does not hold

    def level(self, a: str, b: str) -> LinkLevel | None:
        return self.levels[self.index(a)][self.index(b)]

    @property
    def gpus(self) -> tuple[TopoDevice, ...]:
        return tuple(d for d in self.devices if d.kind == "gpu")

    @property
    def nics(self) -> tuple[TopoDevice, ...]:
        return tuple(d for d in self.devices if d.kind == "nic")

    def pairs(self) -> Iterator[tuple[TopoDevice, TopoDevice, LinkLevel | None]]:
        """Every unordered pair of distinct devices once, in matrix order."""
        for i, a in enumerate(self.devices):
            for j in range(i + 1, len(self.devices)):
                yield a, self.devices[j], self.levels[i][j]


# --- bounds ---------------------------------------------------------------------------

# The largest real outputs hold 16 GPUs and ~20 NICs in under 20 KB.  Bounding the text,
# the devices and each value keeps hostile input (a 10k-column paste, a 100 KB header,
# thousands of digits) to one clear error in bounded time and memory: the level grid is
# devices squared.
MAX_TOPO_TEXT_CHARS = 1 << 20
MAX_TOPO_DEVICES = 256
MAX_TOPO_VALUE_CHARS = 4096  # a cpulist of every other CPU of 1024 fits


# --- tokens ---------------------------------------------------------------------------

# ASCII digits only: int() would also read '١٢', and nvidia-smi prints none.
_LEVEL_TOKEN = re.compile(r"X|NV[0-9]+|PIX|PXB|PHB|NODE|SYS|SOC")
# RDMA device names are lower case (mlx5_0, mlx4_0, bnxt_re0); upper case is GPUn/NICn only.
# e.g. mlx5_0, mlx4_0, bnxt_re0, mlx5_bond_0, rocep65s0f0, efa_0 ... : lower case, ending in a digit.
_DEVICE_NAME = re.compile(r"GPU[0-9]+|NIC[0-9]+|[a-z][a-z0-9_]*[0-9]")
_GLUED_NAME = re.compile(r"GPU[0-9]+|NIC[0-9]+|[a-z]+[0-9]*_[0-9]+|[a-z][a-z_]*[0-9]+")
_TRAILING_COLUMNS = ("CPU Affinity", "NUMA Affinity", "GPU NUMA ID")
_TRAILING_RE = re.compile("|".join(re.escape(c) for c in _TRAILING_COLUMNS))
_NUMA_ID = re.compile(r"-?[0-9]+")
_NIC_LEGEND_ENTRY = re.compile(r"(NIC[0-9]+)\s*:\s*(\S+)")
_NOT_AVAILABLE = {"N/A", "NA", ""}


def _is_level(token: str) -> bool:
    return _LEVEL_TOKEN.fullmatch(token) is not None


# An upper-case word where a level belongs ('NVXX', 'PCI'): no affinity value looks so.
_LEVEL_WORD = re.compile(r"[A-Z][A-Z0-9]+")


def _is_level_word(token: str) -> bool:
    return _LEVEL_WORD.fullmatch(token) is not None and token.upper() not in _NOT_AVAILABLE


def _unknown_level(line_no: int, raw: str, token: str) -> TopoParseError:
    known = "X, NV<n>, PIX, PXB, PHB, NODE, SYS, SOC"
    return TopoParseError(f"unknown link level {token!r} (known: {known})", line_no, raw)


def _clean(line: str) -> str:
    # Scripts paste the output as comments ('#GPU0 ...', '#        GPU0 ...').
    return line.lstrip().lstrip("#").rstrip("\r\n")


def _is_row(tokens: list[str]) -> bool:
    return (
        len(tokens) >= 2
        and not _is_level(tokens[0])
        and _DEVICE_NAME.fullmatch(tokens[0]) is not None
        and _is_level(tokens[1])
    )


@dataclass
class _Row:
    """One line of the matrix as the parser splits it, before cells become levels."""

    line_no: int
    text: str
    label: str
    cells: list[str]
    trailing: list[str]
    ends_input: bool = False  # the last line, with no line end: perhaps cut off


def _split_header(text: str) -> tuple[list[str], list[str]] | None:
    """Device names and trailing column titles of a header line, or None if it is not one."""
    trailing = [m.group(0) for m in _TRAILING_RE.finditer(text)]
    first = _TRAILING_RE.search(text)
    device_part = text[: first.start()] if first else text
    names = device_part.split()
    if not names:
        return ([], trailing) if trailing else None
    if not all(_DEVICE_NAME.fullmatch(n) for n in names):
        # Separators lost ('GPU0GPU1GPU2'): recover names by pattern.
        glued = _unglue("".join(names))
        if glued is None:
            return None
        names = glued
    if not any(n.startswith("GPU") for n in names):
        return None
    return names, trailing


def _unglue(text: str) -> list[str] | None:
    """'GPU0GPU1mlx5_0' -> names, or None if some part is no name.

    Each name must start where the last one ended, so a failed match ends the search:
    linear in the header's length (a scan that retried every position was quadratic,
    and froze `serve` for 30 s on a 100 KB header).
    """
    names: list[str] = []
    position = 0
    while position < len(text):
        match = _GLUED_NAME.match(text, position)
        if match is None:
            return None
        names.append(match.group(0))
        position = match.end()
    return names


def _device_kind(name: str) -> str:
    # `topo -m` lists GPUs and NICs only; whatever is not GPUn is a NIC (NICn, mlx5_0, ...).
    return "gpu" if re.fullmatch(r"GPU\d+", name) else "nic"


def _value(token: str | None) -> str | None:
    if token is None or token.upper() in _NOT_AVAILABLE:
        return None
    return token


def parse_topo_matrix(text: str) -> TopoMatrix:
    """Parse the output of `nvidia-smi topo -m`.

    Raises ``TopoParseError`` naming the line and the problem.  A truncated paste yields
    the whole rows it has; devices without a row are listed in ``missing_rows`` and their
    levels are taken from the other rows by symmetry where possible.
    """
    if len(text) > MAX_TOPO_TEXT_CHARS:
        raise TopoParseError(
            f"input is {len(text)} characters, more than {MAX_TOPO_TEXT_CHARS}; "
            "nvidia-smi topo -m prints a few KB"
        )
    if "\x00" in text:
        raise TopoParseError("input holds NUL bytes; this is not nvidia-smi text output")
    text = without_terminal_escapes(text)  # a paste; what the Host reads has none left
    lines = text.splitlines()

    rows: list[_Row] = []
    header: tuple[list[str], list[str]] | None = None
    header_line_no: int | None = None
    nic_legend: dict[str, str] = {}
    body_closed_at: int | None = None
    in_nic_legend = False
    last_text_before_rows: tuple[int, str] | None = None
    legend_notes: list[str] = []

    for line_no, raw in enumerate(lines, start=1):
        line = _clean(raw)
        stripped = line.strip()
        tokens = line.split()
        if any(len(token) > MAX_TOPO_VALUE_CHARS for token in tokens):
            raise TopoParseError(
                f"a value longer than {MAX_TOPO_VALUE_CHARS} characters; nvidia-smi prints none",
                line_no,
                raw,
            )
        if stripped.startswith("NIC Legend"):
            in_nic_legend = True
            body_closed_at = body_closed_at or line_no
            continue
        if in_nic_legend:
            entry = _NIC_LEGEND_ENTRY.fullmatch(stripped)
            if entry and line_no == len(lines) and not text.endswith("\n"):
                legend_notes.append(
                    f"line {line_no}: NIC Legend entry {entry.group(1)} ends with no line end "
                    "and may be cut off; ignored"
                )
            elif entry:
                nic_legend[entry.group(1)] = entry.group(2)
            continue
        if stripped.startswith("Legend"):
            body_closed_at = body_closed_at or line_no
            continue
        if (
            len(tokens) >= 3
            and body_closed_at is None
            and (rows or last_text_before_rows is not None)
            and _DEVICE_NAME.fullmatch(tokens[0])
            and _is_level_word(tokens[1])
            and not _is_level(tokens[1])
            and any(_is_level(t) for t in tokens[2:])
        ):
            # 'GPU1  NVXX  X  NV8 ...': a matrix row whose first cell is not a level.
            raise _unknown_level(line_no, raw, tokens[1])
        if _is_row(tokens):
            if body_closed_at is not None:
                if not rows:
                    raise TopoParseError("matrix row after the legend", line_no, raw)
                raise TopoParseError(
                    f"matrix row after non-matrix text on line {body_closed_at}", line_no, raw
                )
            if not rows and last_text_before_rows is not None:
                header_line_no, header_text = last_text_before_rows
                header = _split_header(header_text)
            links = 1
            while links < len(tokens) and _is_level(tokens[links]):
                links += 1
            cells, rest = tokens[1:links], tokens[links:]
            if len(cells) > MAX_TOPO_DEVICES:
                raise TopoParseError(
                    f"row {tokens[0]} has {len(cells)} link cells; at most {MAX_TOPO_DEVICES} devices are read",
                    line_no,
                    raw,
                )
            if rest and _is_level_word(rest[0]):
                # Links stop early at a word no affinity column holds: a bad level, not
                # the first trailing value ('GPU0  X  NVXX  NV8 ...').
                header_devices = len(header[0]) if header is not None else 0
                if len(cells) < header_devices or any(_is_level(t) for t in rest[1:]):
                    raise _unknown_level(line_no, raw, rest[0])
            rows.append(_Row(line_no, raw, tokens[0], cells, rest))
            continue
        if not stripped:
            continue
        if rows:
            # Trailing tool text, a legend without its title, a cut-off row: the body ends.
            if body_closed_at is None:
                body_closed_at = line_no
            continue
        last_text_before_rows = (line_no, line)

    if not rows:
        raise TopoParseError("no matrix rows found (expected lines like 'GPU0  X  NV12 ...')")

    notes: list[str] = list(legend_notes)
    if not text.endswith("\n") and rows[-1].line_no == len(lines):
        rows[-1].ends_input = True
        notes.append(
            f"line {rows[-1].line_no}: the output ends inside row {rows[-1].label} with no line end; "
            "if it was cut off, that row's last value may be incomplete"
        )
    width = max(len(r.cells) for r in rows)
    complete: list[_Row] = []
    for position, row in enumerate(rows):
        if len(row.cells) == width:
            complete.append(row)
        elif position == len(rows) - 1 and len(rows) > 1:
            notes.append(f"line {row.line_no}: row {row.label} is cut off and was ignored")
        else:
            raise TopoParseError(
                f"row {row.label} has {len(row.cells)} link cells, other rows have {width}",
                row.line_no,
                row.text,
            )
    rows = complete

    seen: dict[str, int] = {}
    diagonal: dict[str, int] = {}
    for row in rows:
        if row.label in seen:
            raise TopoParseError(
                f"device {row.label} has a second row (first on line {seen[row.label]})",
                row.line_no,
                row.text,
            )
        seen[row.label] = row.line_no
        selfs = [i for i, c in enumerate(row.cells) if c == "X"]
        if len(selfs) != 1:
            raise TopoParseError(
                f"row {row.label} must have exactly one 'X' (itself), found {len(selfs)}",
                row.line_no,
                row.text,
            )
        diagonal[row.label] = selfs[0]
    by_column: dict[int, str] = {}
    for label, column in diagonal.items():
        if column in by_column:
            raise TopoParseError(
                f"rows {by_column[column]} and {label} both put 'X' in column {column + 1}",
                seen[label],
            )
        by_column[column] = label

    names, trailing_titles = _resolve_names(header, header_line_no, rows, by_column, width, notes)

    levels = _assemble_levels(rows, names, width)
    devices = _build_devices(rows, names, trailing_titles, nic_legend, header is not None)
    missing = tuple(n for n in names if n not in seen)
    if missing:
        notes.append("no row for " + ", ".join(missing) + " (truncated output?)")
    return TopoMatrix(
        devices=devices,
        levels=levels,
        missing_rows=missing,
        notes=tuple(notes),
    )


def _resolve_names(
    header: tuple[list[str], list[str]] | None,
    header_line_no: int | None,
    rows: list[_Row],
    by_column: dict[int, str],
    width: int,
    notes: list[str],
) -> tuple[list[str], list[str]]:
    """Column names: the header's when it agrees with the rows, else derived from them."""
    if header is not None:
        names, trailing = header
        if len(names) == width and all(names[c] == label for c, label in by_column.items()):
            if len(set(names)) != len(names):
                raise TopoParseError("header names a device twice", header_line_no)
            return names, trailing
        notes.append(
            f"line {header_line_no}: header does not match the rows; "
            "device names taken from the row labels"
        )
    else:
        notes.append("no header line; device names taken from the row labels")
        trailing = list(_TRAILING_COLUMNS)

    resolved: list[str | None] = [by_column.get(c) for c in range(width)]
    if None in resolved:
        known = [n for n in resolved if n is not None]
        gpu_numbers = [int(n[3:]) for n in known if _device_kind(n) == "gpu"]
        nic_numbers = [int(n[3:]) for n in known if re.fullmatch(r"NIC\d+", n)]
        next_gpu = max(gpu_numbers, default=-1) + 1
        next_nic = max(nic_numbers, default=-1) + 1
        inferred: list[str] = []
        for c in range(width):
            if resolved[c] is not None:
                continue
            # NVLink joins GPUs only: a column with an NV cell is a GPU.
            if any(re.fullmatch(r"NV\d+", r.cells[c]) for r in rows):
                name = f"GPU{next_gpu}"
                next_gpu += 1
            else:
                name = f"NIC{next_nic}"
                next_nic += 1
            resolved[c] = name
            inferred.append(name)
        notes.append("column names inferred without a header: " + ", ".join(inferred))
    if len(set(resolved)) != len(resolved):
        raise TopoParseError("could not name the columns uniquely without a usable header")
    return [n for n in resolved if n is not None], trailing


def _assemble_levels(
    rows: list[_Row], names: list[str], width: int
) -> tuple[tuple[LinkLevel | None, ...], ...]:
    index = {n: i for i, n in enumerate(names)}
    grid: list[list[LinkLevel | None]] = [[None] * width for _ in range(width)]
    source: list[list[int | None]] = [[None] * width for _ in range(width)]
    parsed: dict[str, LinkLevel] = {}  # a matrix repeats a handful of distinct cells
    for row in rows:
        i = index[row.label]
        for j, cell in enumerate(row.cells):
            level = parsed.get(cell)
            if level is None:
                try:
                    level = parsed[cell] = LinkLevel.parse(cell)
                except LevelError as exc:
                    raise TopoParseError(str(exc), row.line_no, row.text) from None
            if (level.kind is LevelKind.SELF) != (i == j):
                raise TopoParseError(
                    f"{row.label}/{names[j]}: 'X' is only valid on the diagonal",
                    row.line_no,
                    row.text,
                )
            grid[i][j] = level
            source[i][j] = row.line_no
    for i in range(width):
        for j in range(i + 1, width):
            a, b = grid[i][j], grid[j][i]
            if a is not None and b is not None and a != b:
                raise TopoParseError(
                    f"matrix is not symmetric: {names[i]}->{names[j]} is {a} "
                    f"but line {source[j][i]} gives {names[j]}->{names[i]} as {b}",
                    source[i][j],
                )
            grid[i][j] = grid[j][i] = a if a is not None else b
        grid[i][i] = LinkLevel(LevelKind.SELF)
    kinds = [_device_kind(n) for n in names]
    for i, name in enumerate(names):
        if kinds[i] == "gpu":
            continue
        for j, level in enumerate(grid[i]):
            if level is not None and level.is_nvlink:
                raise TopoParseError(
                    f"{name}/{names[j]}: NVLink ({level}) joins GPUs only", source[i][j] or source[j][i]
                )
    return tuple(tuple(r) for r in grid)


def _build_devices(
    rows: list[_Row],
    names: list[str],
    trailing_titles: list[str],
    nic_legend: dict[str, str],
    had_header: bool,
) -> tuple[TopoDevice, ...]:
    by_label = {r.label: r for r in rows}
    devices = []
    for name in names:
        values: dict[str, str | None] = {}
        row = by_label.get(name)
        if row is not None and row.trailing:
            if len(row.trailing) > len(trailing_titles):
                raise TopoParseError(
                    f"row {name} has {len(row.trailing)} values after the links, "
                    f"but the header names {len(trailing_titles)} columns "
                    f"({', '.join(trailing_titles) or 'none'})",
                    row.line_no,
                    row.text,
                )
            for title, token in zip(trailing_titles, row.trailing):
                values[title] = _checked_value(title, token, row)
        kind = _device_kind(name)
        device = None
        if kind == "nic":
            device = nic_legend.get(name, None if re.fullmatch(r"NIC\d+", name) else name)
        devices.append(
            TopoDevice(
                name=name,
                kind=kind,
                device=device,
                cpu_affinity=values.get("CPU Affinity"),
                numa_affinity=values.get("NUMA Affinity"),
                gpu_numa_id=values.get("GPU NUMA ID"),
            )
        )
    return tuple(devices)


def _checked_value(title: str, token: str, row: _Row) -> str | None:
    value = _value(token)
    if value is None:
        return None
    # One reading of CPU and NUMA lists for every command (matrix, place, probe): the
    # parser refuses what placement could not read ('156-20' from a cut-off paste).
    problem = None
    if title == "GPU NUMA ID":
        if not _NUMA_ID.fullmatch(value) or len(value) > 6:
            problem = "not a valid value"
    else:
        try:
            parse_cpulist(value)
        except CpuListError as exc:
            problem = f"not a valid value: {exc}"
    if problem is None:
        return value
    if row.ends_input:
        problem += " (the output ends there with no line end: cut off?)"
    shown = token if len(token) <= 40 else token[:37] + "..."
    raise TopoParseError(f"{title} of {row.label} is {shown!r}, {problem}", row.line_no)


# --- rendering ------------------------------------------------------------------------

_LEGEND = """\
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks"""


def render_topo_matrix(matrix: TopoMatrix, *, style: str = "spaces", legend: bool = True) -> str:
    """Print the matrix the way `nvidia-smi topo -m` does.

    ``style="tabs"`` separates cells with tabs as nvidia-smi writes them; ``"spaces"``
    aligns them in columns for a terminal.  Unknown levels print as ``?``.
    """
    if style not in ("spaces", "tabs"):
        raise ValueError(f"unknown style {style!r}")
    titles = [t for t in _TRAILING_COLUMNS if _has_column(matrix, t)]
    header = [""] + [d.name for d in matrix.devices] + titles
    body: list[list[str]] = []
    for i, device in enumerate(matrix.devices):
        if device.name in matrix.missing_rows:
            continue
        cells = [device.name]
        for level in matrix.levels[i]:
            cells.append("?" if level is None else (" X " if level.kind is LevelKind.SELF else str(level)))
        if device.kind == "gpu":
            for title in titles:
                cells.append(_field(device, title) or "N/A")
        body.append(cells)

    if style == "tabs":
        lines = ["\t".join(header)] + ["\t".join(cells) for cells in body]
    else:
        ncols = len(header)
        widths = [0] * ncols
        for cells in [header] + body:
            for k, cell in enumerate(cells):
                widths[k] = max(widths[k], len(cell))
        widths = [max(8, w + 2) for w in widths]
        lines = []
        for cells in [header] + body:
            text = "".join(cell.ljust(widths[k]) for k, cell in enumerate(cells))
            lines.append(text.rstrip())
    out = "\n".join(lines) + "\n"
    if legend:
        out += "\n" + _LEGEND + "\n"
        legend_entries = [
            f"  {d.name}: {d.device}"
            for d in matrix.nics
            if d.device and re.fullmatch(r"NIC\d+", d.name)
        ]
        if legend_entries:
            out += "\nNIC Legend:\n\n" + "\n".join(legend_entries) + "\n"
    return out


def _field(device: TopoDevice, title: str) -> str | None:
    return {
        "CPU Affinity": device.cpu_affinity,
        "NUMA Affinity": device.numa_affinity,
        "GPU NUMA ID": device.gpu_numa_id,
    }[title]


def _has_column(matrix: TopoMatrix, title: str) -> bool:
    # Keep a column when any GPU has a value in it; CPU and NUMA affinity always print.
    if title in ("CPU Affinity", "NUMA Affinity"):
        return bool(matrix.gpus)
    return any(_field(d, title) is not None for d in matrix.gpus)


# --- collector ------------------------------------------------------------------------

TOPO_COMMAND = ["nvidia-smi", "topo", "-m"]


async def collect(host: Host, timeout: float = 20.0) -> CollectorResult[TopoMatrix]:
    """Run `nvidia-smi topo -m` on the host: the driver's declared matrix."""

    async def read() -> tuple[TopoMatrix, tuple[str, ...]]:
        try:
            result = await host.run(TOPO_COMMAND, timeout=timeout)
        except CommandNotFound as exc:
            raise command_missing(exc.on_node, "nvidia-smi") from None
        command = " ".join(TOPO_COMMAND)
        if result.returncode != 0:
            detail = (result.stderr.strip() or result.stdout.strip()).splitlines()
            reason = detail[0] if detail else "no output"
            if "couldn't communicate with the nvidia driver" in reason.lower():
                raise NoData(f"{command}: {reason}")
            raise SourceError(f"{command}: exit code {result.returncode}: {reason}")
        try:
            topo = parse_topo_matrix(result.stdout)
        except TopoParseError as exc:
            raise SourceError(f"{command}: {exc}") from None
        return topo, topo.notes

    return await run_collector("nvidia_smi", read)


def first_numa_node(numa_affinity: str | None) -> int | None:
    """The NUMA node of a GPU from nvidia-smi's 'NUMA Affinity' cell.

    A list such as '0,2-17' (Grace: the CPU node, then the GPU-memory nodes) starts with
    the node whose CPUs are close; a range such as '0-7' means the driver could not narrow
    it down, which we report as unknown.
    """
    if not numa_affinity:
        return None
    first = numa_affinity.split(",")[0]
    if re.fullmatch(r"\d+", first):
        return int(first)
    return None
