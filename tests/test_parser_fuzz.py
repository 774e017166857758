"""Issue #14, class 3: hostile `nvidia-smi topo -m` input gives one line and exit 2.

Never a traceback, a MemoryError or a hang: the parser in process over many mutated real
outputs (only the typed error or a matrix), and the real commands in children held to a
memory limit and a timeout (exit 0, 1 or 2; with 2, exactly one line on stderr).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import CORPUS, FIXTURES
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from topo_fuzz import SEEDS, hostile_topo

from topoagent.cli import main
from topoagent.collectors import infiniband, pci
from topoagent.collectors.base import SourceError
from topoagent.collectors.nvidia_smi import MAX_TOPO_DEVICES, TopoParseError, parse_topo_matrix
from topoagent.collectors.nvml import parse_nvml
from topoagent.collectors.pci import PciParseError
from topoagent.node.cpulist import MAX_CPUS, CpuListError, parse_cpulist, parse_cpumask

# Each child may map this much: Python and topoagent need ~100 MB; the 10k-column file
# took 2.3 GB before the bounds.
CHILD_MEMORY_BYTES = 512 * 1024 * 1024
CHILD_TIMEOUT_S = 30
# In-process examples; raise it for a long run: TOPOAGENT_FUZZ_EXAMPLES=6000 pytest ...
IN_PROCESS_EXAMPLES = int(os.environ.get("TOPOAGENT_FUZZ_EXAMPLES", "150"))
TRUNCATED_H100 = CORPUS / "nvidia-smi-topo" / "stas00-8xH100-2socket-52c-ht.txt"


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_MEMORY_BYTES, CHILD_MEMORY_BYTES))


def topoagent(*args: str, stdin: bytes = b"", env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real command in a child held to CHILD_MEMORY_BYTES and CHILD_TIMEOUT_S."""
    result = subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", *args],
        input=stdin,
        capture_output=True,
        timeout=CHILD_TIMEOUT_S,
        preexec_fn=_limit_memory,
        env={**os.environ, **(env or {})},
    )
    return subprocess.CompletedProcess(
        result.args, result.returncode, result.stdout.decode(errors="replace"), result.stderr.decode(errors="replace")
    )


def assert_answered_or_refused(returncode: int, stderr: str, command: str) -> None:
    assert "Traceback" not in stderr and "MemoryError" not in stderr, stderr[-2000:]
    assert returncode in (0, 1, 2, 3), (returncode, stderr[-2000:])  # 3: place's "never fits this node"
    if returncode == 2:
        assert stderr.startswith(f"topoagent {command}: ") and stderr.count("\n") == 1, stderr[-2000:]


def run_in_process(argv: list[str]) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


@settings(max_examples=IN_PROCESS_EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_topo())
def test_matrix_and_place_answer_or_refuse_in_one_line(data: bytes) -> None:
    """The parser raises only its typed error, and both commands agree on every input."""
    try:
        parse_topo_matrix(data.decode("utf-8", errors="replace"))
    except TopoParseError as exc:
        assert "\n" not in str(exc)
    with tempfile.NamedTemporaryFile(suffix=".txt") as handle:
        handle.write(data)
        handle.flush()
        matrix_code, matrix_err = run_in_process(["matrix", "--from-nvidia-smi", handle.name])
        assert_answered_or_refused(matrix_code, matrix_err, "matrix")
        place_code, place_err = run_in_process(["place", "--from-nvidia-smi", handle.name, "--gpus", "2"])
        assert_answered_or_refused(place_code, place_err, "place")
    # One reading for both: a file `matrix` refuses, `place` refuses with the same words.
    if matrix_code == 2:
        assert place_code == 2 and place_err.split(": ", 1)[1] == matrix_err.split(": ", 1)[1]


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(hostile_topo())
@example(SEEDS[0] + b"\xff\xfe\n")
@example(b"\tGPU0\tGPU1\nGPU0\tX\tNV" + b"9" * 5000 + b"\nGPU1\tNV1\tX\n")
def test_the_real_commands_hold_under_a_memory_limit(data: bytes) -> None:
    """stdin as a UTF-8 locale decodes it (strict), in a child that may not grow or hang."""
    strict_utf8 = {"PYTHONIOENCODING": "utf-8:strict"}
    result = topoagent("matrix", "--from-nvidia-smi", "-", stdin=data, env=strict_utf8)
    assert_answered_or_refused(result.returncode, result.stderr, "matrix")
    with tempfile.NamedTemporaryFile(suffix=".txt") as handle:
        handle.write(data)
        handle.flush()
        result = topoagent("place", "--from-nvidia-smi", handle.name, "--gpus", "2", "--json")
    assert_answered_or_refused(result.returncode, result.stderr, "place")


def test_a_cut_off_real_file_gets_the_same_answer_from_matrix_and_place(tmp_path: Path) -> None:
    """Cut inside a CPU list ('52-103,156-20'): place traced back where matrix accepted."""
    text = TRUNCATED_H100.read_text()
    cut = tmp_path / "cut.txt"
    cut.write_text(text[: text.rindex("156-20") + len("156-20")])
    messages = set()
    for argv in (["matrix"], ["place", "--gpus", "2"]):
        code, err = run_in_process([*argv, "--from-nvidia-smi", str(cut)])
        assert code == 2 and err.count("\n") == 1, err
        messages.add(err.split(": ", 1)[1])
    (message,) = messages
    assert "GPU7" in message and "'156-20' runs backwards" in message and "cut off?" in message


def test_a_10k_column_file_is_refused_in_bounded_memory() -> None:
    n = 10_000
    names = [f"GPU{i}" for i in range(n)]
    rows = [f"GPU{r}\t" + "\t".join("X" if c == r else "SYS" for c in range(n)) for r in range(40)]
    result = topoagent("matrix", "--from-nvidia-smi", "-", stdin="\n".join(["\t" + "\t".join(names), *rows]).encode())
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr[-2000:]
    assert "more than 1048576 bytes" in result.stderr
    with pytest.raises(TopoParseError, match=f"at most {MAX_TOPO_DEVICES} devices"):
        parse_topo_matrix("\t" + "\t".join(names[:300]) + "\nGPU0\t" + "\t".join(["X"] + ["SYS"] * 299) + "\n")


def test_glued_headers_are_read_or_refused_in_a_bounded_child() -> None:
    """A 100 KB header with its separators lost froze `serve` for 30 s (each name was
    searched for at every position); now one value that long is refused, and a header of
    many short words that are no names is read as no header, in time linear in its length:
    a child that hangs fails on its timeout."""
    rows = "\nGPU0\tX\tNV1\nGPU1\tNV1\tX\n"
    for header in ("GPU0GPU1" * 12_500, "a" * 100_000, "ab" * 50_000 + "_"):
        result = topoagent("matrix", "--from-nvidia-smi", "-", stdin=("\t" + header + rows).encode())
        assert result.returncode == 2 and "longer than 4096 characters" in result.stderr, result.stderr
    for header in ("GPU0GPU1", "a " * 200_000, "mlx5_ " * 100_000):  # joined, then matched by name
        result = topoagent("matrix", "--from-nvidia-smi", "-", "--json", stdin=("\t" + header + rows).encode())
        assert result.returncode == 0, result.stderr
        assert [d["name"] for d in json.loads(result.stdout)["devices"]] == ["GPU0", "GPU1"]


@pytest.mark.parametrize(
    ("level", "message"),
    [("NV" + "9" * 40, "an NV link count is at most 999"), ("NV" + "9" * 5000, "longer than 4096 characters")],
)
def test_huge_nvlink_counts_are_one_typed_error(level: str, message: str) -> None:
    with pytest.raises(TopoParseError, match=message):
        parse_topo_matrix(f"\tGPU0\tGPU1\nGPU0\tX\t{level}\nGPU1\t{level}\tX\n")


def test_batch_answers_every_bad_line_and_goes_on(tmp_path: Path) -> None:
    bad_lines = [
        b'{"gpus": ' + b"9" * 5000 + b"}",  # past the int digit limit
        b"[" * 100_000 + b"]" * 100_000,  # nested past the recursion limit
        b'\xff\xfe{"gpus": 2}',  # not UTF-8 (stdin decodes strictly)
        b'{"gpus": 2, "pad": "' + b"x" * 100_000 + b'"}',  # longer than a request
        b'{"gpus": 2, "min_level": "NV' + b"9" * 5000 + b'"}',
    ]
    stdin = b"".join(line + b'\n{"gpus": 1}\n' for line in bad_lines)
    result = topoagent("place", "--batch", "--from-nvidia-smi", str(TRUNCATED_H100), stdin=stdin,
                       env={"PYTHONIOENCODING": "utf-8:strict"})
    # 2: the worst line's status (bad input); every line was still answered.
    assert result.returncode == 2 and result.stderr == "", result.stderr[-2000:]
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(answers) == 2 * len(bad_lines)
    for number, (bad, good) in enumerate(zip(answers[::2], answers[1::2])):
        assert bad["error"]["line"] == 2 * number + 1, bad
        assert good["fit"] is True, good


# --- the other parsers of recorded input: nvml.json, InfiniBand and PCI sysfs fields -------

NVML_SEED = json.loads((FIXTURES / "snapshots" / "hgx-h100" / "nvml.json").read_text())
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
    | st.sampled_from(["0-4000000000", "156-20", "0000:07:00.0", "9" * 5000, "²"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def hostile_nvml(draw: st.DrawFn) -> dict:
    """The recording with one field of the top level, a GPU or an NVLink replaced."""
    data = json.loads(json.dumps(NVML_SEED))
    gpu = draw(st.sampled_from(data["gpus"]))
    target = draw(st.sampled_from([data, gpu, draw(st.sampled_from(gpu["nvlinks"]))]))
    target[draw(st.sampled_from(sorted(target)))] = draw(json_values)
    return data


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(hostile_nvml())
def test_nvml_recordings_give_typed_fields_or_a_source_error(data: dict) -> None:
    try:
        info = parse_nvml(data)
    except SourceError as exc:
        assert "\n" not in str(exc)
        return
    for gpu in info.gpus:
        assert all(isinstance(v, (str, type(None))) for v in (gpu.uuid, gpu.name, gpu.pci_address, gpu.cpu_affinity))
        assert isinstance(gpu.memory_total_bytes, (int, type(None)))
        if gpu.cpu_affinity is not None:
            parse_cpulist(gpu.cpu_affinity)  # placement's reading: it must not raise later
        assert all(isinstance(link.version, (int, type(None))) for link in gpu.nvlinks)


@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(hostile_nvml())
def test_discover_holds_over_a_hostile_nvml_recording(tmp_path_factory: pytest.TempPathFactory, data: dict) -> None:
    """The whole discovery, not the parser alone: the bad field is a collector error."""
    root = tmp_path_factory.mktemp("node")
    shutil.copytree(FIXTURES / "snapshots" / "hgx-h100", root, symlinks=True, dirs_exist_ok=True)
    (root / "nvml.json").write_text(json.dumps(data))
    code, err = run_in_process(["discover", "--root", str(root), "--json"])
    assert_answered_or_refused(code, err, "discover")


sysfs_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(["9" * 5000, "0x" + "f" * 5000, "²", "٣", "-1", "200 Gb/sec (4X HDR)", "4: ACTIVE",
                     "16.0 GT/s PCIe", "fe80:0000:0000:0000:0015:5dff:fe00:0001", "4885:b893:3c4c:5d93"]),
)


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(sysfs_text)
def test_sysfs_field_parsers_read_a_value_or_nothing(text: str) -> None:
    """A recorded sysfs file may hold anything: each field reads as its value or None,
    and PCI hex fields and addresses raise only their typed error."""
    assert isinstance(infiniband.parse_rate(text)[0], (float, type(None)))
    assert isinstance(infiniband.parse_state(text), (str, type(None)))
    assert isinstance(infiniband.parse_lid(text), (int, type(None)))
    assert isinstance(infiniband.parse_subnet_prefix(text), (str, type(None)))
    assert isinstance(infiniband.parse_node_guid(text), (str, type(None)))
    assert isinstance(infiniband._natural(text), tuple) and infiniband._port_sort_key(text) >= 0
    assert isinstance(pci.parse_link_speed(text), (float, type(None)))
    assert isinstance(pci.parse_link_width(text), (int, type(None)))
    for parse in (pci.normalize_address, lambda t: pci.parse_hex(t, "vendor")):
        try:
            parse(text)
        except PciParseError as exc:
            assert "\n" not in str(exc)
    for parse_cpus in (parse_cpulist, parse_cpumask):
        try:
            assert len(parse_cpus(text)) <= MAX_CPUS
        except CpuListError as exc:
            assert "\n" not in str(exc)
