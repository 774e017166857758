"""Round trips of random matrices, and real outputs mangled every way a paste gets mangled."""

from __future__ import annotations

import os
import random

import pytest
from conftest import CORPUS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from topoagent.collectors.nvidia_smi import (
    TopoDevice,
    TopoMatrix,
    TopoParseError,
    parse_topo_matrix,
    render_topo_matrix,
)
from topoagent.node.levels import LevelKind, LinkLevel

PCIE_LEVELS = [LinkLevel(k) for k in (LevelKind.PIX, LevelKind.PXB, LevelKind.PHB, LevelKind.NODE, LevelKind.SYS)]
cpulists = st.one_of(
    st.none(),
    st.builds(lambda a, n: f"{a}-{a + n}", st.integers(0, 200), st.integers(1, 100)),
    st.builds(lambda a, b: f"{a}-{a + 3},{a + 10 + b}-{a + 20 + b}", st.integers(0, 100), st.integers(0, 50)),
    st.integers(0, 255).map(str),
)
numa_values = st.one_of(st.none(), st.integers(0, 16).map(str), st.just("0,2-17"), st.just("0-7"))


@st.composite
def matrices(draw) -> TopoMatrix:
    n_gpus = draw(st.integers(1, 10))
    n_nics = draw(st.integers(0, 6))
    nic_style = draw(st.sampled_from(["legend", "direct"]))
    with_gpu_numa = draw(st.booleans())
    devices = []
    for g in range(n_gpus):
        devices.append(
            TopoDevice(
                name=f"GPU{g}",
                kind="gpu",
                cpu_affinity=draw(cpulists),
                numa_affinity=draw(numa_values),
                gpu_numa_id=draw(st.integers(0, 40).map(str)) if with_gpu_numa else None,
            )
        )
    offset = draw(st.integers(0, 2))
    for k in range(n_nics):
        rdma = f"mlx5_{k + offset}"
        name = f"NIC{k}" if nic_style == "legend" else rdma
        devices.append(TopoDevice(name=name, kind="nic", device=rdma))
    n = len(devices)
    grid: list[list[LinkLevel]] = [[LinkLevel(LevelKind.SELF)] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1, n):
            choices = list(PCIE_LEVELS)
            if i < n_gpus and j < n_gpus:
                choices += [LinkLevel(LevelKind.NV, draw(st.integers(1, 24)))]
            level = draw(st.sampled_from(choices))
            grid[i][j] = grid[j][i] = level
    return TopoMatrix(devices=tuple(devices), levels=tuple(tuple(r) for r in grid))


@settings(max_examples=150, deadline=None)
@given(matrices(), st.sampled_from(["tabs", "spaces"]), st.booleans())
def test_render_then_parse_gives_the_same_matrix(matrix, style, legend):
    if not legend:
        # Without the NIC Legend, NICn columns cannot say which RDMA device they are.
        matrix = TopoMatrix(
            devices=tuple(
                d if not d.name.startswith("NIC") else TopoDevice(d.name, d.kind, None)
                for d in matrix.devices
            ),
            levels=matrix.levels,
        )
    text = render_topo_matrix(matrix, style=style, legend=legend)
    assert parse_topo_matrix(text) == matrix


# --- fuzzing real outputs -------------------------------------------------------------

COMPLETE = [
    "asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt",
    "dgxA100-8gpu-11nic-numa-range-0-7-commented.txt",
    "dlperf-hugectr-8xV100-SXM2-2nic-drv470-handedited-tabs.txt",
    "gb200-4gpu-grace-openshift-8nic-numa-multivalue-drv580.txt",
    "ibm-ac922-power9-4xV100-NV3-6nic.txt",
    "sglang-20855-8xH100-NV18-8nic-misaligned-columns.txt",
    "sglang-24966-8xH20-NV18-8nic-tabs-drv535.txt",
    "tensorflow-gdr-4gpu-mlx4-PHB-SOC-tabs.txt",
]
FUZZ_ROUNDS = int(os.environ.get("TOPOAGENT_FUZZ_ROUNDS", "300"))
LEVEL_WORDS = {"X", "PIX", "PXB", "PHB", "NODE", "SYS", "SOC"}
ALL = sorted(p.name for p in (CORPUS / "nvidia-smi-topo").glob("*.txt"))


def _mutate(text: str, rng: random.Random) -> tuple[str, str]:
    lines = text.split("\n")
    kind = rng.choice(["delete", "duplicate", "truncate", "swap", "bytes"])
    if kind == "delete":
        del lines[rng.randrange(len(lines))]
    elif kind == "duplicate":
        k = rng.randrange(len(lines))
        lines.insert(k, lines[k])
    elif kind == "truncate":
        cut = rng.randrange(len(text))
        return kind, text[:cut]
    elif kind == "swap":
        k = rng.randrange(len(lines))
        cells = lines[k].split("\t") if "\t" in lines[k] else lines[k].split()
        # Swap two link cells; swapped affinity values are indistinguishable from real ones.
        links = [i for i, c in enumerate(cells) if i and (c.strip() in LEVEL_WORDS or c.strip().startswith("NV"))]
        if len(links) > 2:
            a, b = rng.sample(links, 2)
            cells[a], cells[b] = cells[b], cells[a]
            lines[k] = ("\t" if "\t" in lines[k] else "    ").join(cells)
    else:
        raw = bytearray("\n".join(lines).encode())
        for _ in range(rng.randint(1, 8)):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        return kind, raw.decode("utf-8", errors="replace")
    return kind, "\n".join(lines)


def _consistent(original: TopoMatrix, got: TopoMatrix) -> None:
    """Whatever a mangled input still yields must agree with the original."""
    names = {d.name for d in original.devices}
    inferred = any("inferred" in note for note in got.notes)
    cut_row = next((n for n in got.notes if "no line end" in n), None)
    if not inferred:
        assert {d.name for d in got.devices} <= names
    for a, b, level in got.pairs():
        if level is None or a.name not in names or b.name not in names or inferred:
            continue
        if cut_row and (f"row {a.name} " in cut_row or f"row {b.name} " in cut_row):
            continue
        assert original.level(a.name, b.name) == level, (a.name, b.name)
    for device in got.devices:
        if device.name not in names or inferred or (cut_row and f"row {device.name} " in cut_row):
            continue
        before = original.devices[original.index(device.name)]
        for field in ("cpu_affinity", "numa_affinity", "gpu_numa_id", "device"):
            value = getattr(device, field)
            assert value is None or value == getattr(before, field), (device.name, field)


@pytest.mark.parametrize("name", COMPLETE)
def test_mangled_complete_outputs_give_typed_error_or_a_consistent_parse(corpus, name):
    text = (corpus / "nvidia-smi-topo" / name).read_text()
    original = parse_topo_matrix(text)
    rng = random.Random(name)
    for _ in range(FUZZ_ROUNDS):
        kind, mangled = _mutate(text, rng)
        try:
            got = parse_topo_matrix(mangled)
        except TopoParseError as exc:
            assert str(exc)  # says what is wrong
            continue
        if kind != "bytes":
            _consistent(original, got)


# Terminal escape sequences as terminals and nvidia-smi print them: SGR (the driver's own
# underline, colours), cursor and erase controls, window titles and hyperlinks (OSC, ended by
# BEL or ST), charset and keypad switches.
escape_sequences = st.one_of(
    st.sampled_from(["\x1b[4m", "\x1b[0m", "\x1b[m", "\x1b[1;31m", "\x1b[38;5;208m", "\x1b[K", "\x1b[2J",
                     "\x1b[?25l", "\x1b]0;gpu-node\x07", "\x1b]8;;https://example.com\x1b\\", "\x1b(B", "\x1b7",
                     "\x1b="]),
    st.builds(lambda params, final: f"\x1b[{params}{final}", st.from_regex(r"[0-9;?]{0,8}", fullmatch=True),
              st.characters(min_codepoint=0x40, max_codepoint=0x7E)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(COMPLETE), st.lists(st.tuples(st.integers(0, 100_000), escape_sequences), max_size=12))
def test_terminal_escape_codes_anywhere_change_nothing(name, inserts):
    """A capture with escape sequences put anywhere, even inside a value, parses as the
    plain capture does: the same devices, levels, columns and notes."""
    text = (CORPUS / "nvidia-smi-topo" / name).read_text()
    coloured = text
    # From the end backwards: each goes between characters of the capture, never inside another.
    for at, sequence in sorted(((where % (len(text) + 1), seq) for where, seq in inserts), reverse=True):
        coloured = coloured[:at] + sequence + coloured[at:]
    assert parse_topo_matrix(coloured) == parse_topo_matrix(text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ALL), st.binary(max_size=64), st.integers(0, 10_000))
def test_random_bytes_never_escape_as_anything_but_the_typed_error(name, junk, where):
    text = (CORPUS / "nvidia-smi-topo" / name).read_text()
    at = where % (len(text) + 1)
    mangled = text[:at] + junk.decode("latin-1") + text[at:]
    try:
        got = parse_topo_matrix(mangled)
    except TopoParseError:
        return
    assert got.devices and len(got.levels) == len(got.devices)
