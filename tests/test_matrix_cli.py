"""`topoagent matrix` as a user runs it: a real process, real files, real exit codes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import CORPUS, FIXTURES

from topoagent.collectors.nvidia_smi import TopoParseError, parse_topo_matrix

TOPO = CORPUS / "nvidia-smi-topo"


def topoagent(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        # -P: the repo root (the cwd) must not shadow the installed package.
        [sys.executable, "-P", "-m", "topoagent", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_json_lists_devices_and_every_pair_once():
    result = topoagent("matrix", "--from-nvidia-smi", str(FIXTURES / "nvidia-smi/hgx-h20-8gpu-8nic.txt"), "--json")
    assert result.returncode == 0, result.stderr
    doc = json.loads(result.stdout)
    names = [d["name"] for d in doc["devices"]]
    assert names == [f"GPU{i}" for i in range(8)] + [f"NIC{i}" for i in range(8)]
    assert doc["devices"][0] == {
        "name": "GPU0", "kind": "gpu", "device": None,
        "cpu_affinity": "0-47,96-143", "numa_affinity": "0", "gpu_numa_id": None,
    }
    assert doc["devices"][8]["device"] == "mlx5_1"
    pairs = {(p["a"], p["b"]) for p in doc["pairs"]}
    assert len(pairs) == len(doc["pairs"]) == 16 * 15 // 2
    gpu01 = next(p for p in doc["pairs"] if (p["a"], p["b"]) == ("GPU0", "GPU1"))
    assert gpu01 == {"a": "GPU0", "b": "GPU1", "level": "NV18", "nvlinks": 18, "expected_gbps": 450.0}


def test_text_mode_reprints_a_matrix_that_parses_back_equal():
    source = (TOPO / "dlperf-hugectr-8xV100-SXM2-2nic-drv470-handedited-tabs.txt").read_text()
    result = topoagent("matrix", "--from-nvidia-smi", "-", stdin=source)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["GPU0", "GPU1", "GPU2"]
    # aligned: every cell of a column starts at the same offset
    assert len({line.index("mlx5_0") if line.startswith("mlx5_0") else line.find("GPU7") for line in lines[:1]}) == 1
    assert parse_topo_matrix(result.stdout) == parse_topo_matrix(source)


def test_parse_error_exits_2_with_one_line_naming_the_line(tmp_path):
    bad = (TOPO / "delos-4gpu-NV2-NV1-2socket-xeon.txt").read_text().replace("GPU1\tNV2\t X \tSYS\tNV1", "GPU1\tNV2\t X \tSYS\tNV2")
    path = tmp_path / "bad.txt"
    path.write_text(bad)
    result = topoagent("matrix", "--from-nvidia-smi", str(path))
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "not symmetric" in result.stderr and "line" in result.stderr


def test_missing_file_exits_2_cleanly(tmp_path):
    result = topoagent("matrix", "--from-nvidia-smi", str(tmp_path / "nope.txt"))
    assert result.returncode == 2
    assert "cannot read" in result.stderr and "Traceback" not in result.stderr


def test_help_explains_the_command():
    result = topoagent("matrix", "--help")
    assert result.returncode == 0
    assert "nvidia-smi topo -m" in result.stdout and "--json" in result.stdout


HEADER_GLUED = (
    "        GPU0GPU1GPU2mlx5_0CPU AffinityNUMA Affinity\n"
    "GPU0     X      NV2     SYS     PIX     0-11    0\n"
    "GPU1    NV2      X      SYS     PIX     0-11    0\n"
    "GPU2    SYS     SYS      X      SYS     12-23   1\n"
    "mlx5_0  PIX     PIX     SYS      X\n"
)


def test_header_with_lost_separators():
    topo = parse_topo_matrix(HEADER_GLUED)
    assert [d.name for d in topo.devices] == ["GPU0", "GPU1", "GPU2", "mlx5_0"]
    assert topo.devices[2].numa_affinity == "1"
    assert topo.notes == ()


def test_header_that_disagrees_with_rows_is_not_trusted():
    text = HEADER_GLUED.replace("GPU0GPU1GPU2mlx5_0", "GPU0 GPU1 mlx5_0")
    topo = parse_topo_matrix(text)
    assert [d.name for d in topo.devices] == ["GPU0", "GPU1", "GPU2", "mlx5_0"]
    assert any("header does not match" in n for n in topo.notes)


def test_hash_prefixed_and_crlf_lines():
    text = "".join("#" + line + "\r\n" for line in HEADER_GLUED.replace("GPU0GPU1GPU2mlx5_0", "GPU0 GPU1 GPU2 mlx5_0").splitlines())
    assert parse_topo_matrix(text).level("GPU0", "mlx5_0") is not None


@pytest.mark.parametrize(
    "text,needle",
    [
        ("", "no matrix rows"),
        ("hello\nworld\n", "no matrix rows"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU1\tNV2\tNV2\n", "exactly one 'X'"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nGPU0\tNV2\t X \n", "second row"),
        ("\tGPU0\tmlx5_0\nGPU0\t X \tNV2\nmlx5_0\tNV2\t X \n", "NVLink"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-3\nGPU1\tNV2\t X \tzero\n", "CPU Affinity of GPU1"),
        ("\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV2\t0-3\t7\t9\nGPU1\tNV2\t X \t0-3\n", "values after the links"),
        ("\tGPU0\tGPU1\nGPU0\t X \tNV2\nsome text\nGPU1\tNV2\t X \n", "after non-matrix text"),
    ],
)
def test_malformed_input_raises_the_typed_error(text, needle):
    with pytest.raises(TopoParseError) as info:
        parse_topo_matrix(text)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "row_with_bad_level, text",
    [
        # The bad word right after 'X': the links stop early; it is not an affinity value.
        (2, "\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNVXX\t0-7\t0\nGPU1\tNVXX\t X \t0-7\t0\n"),
        # The bad word first on its row: the line would otherwise end the matrix body.
        (3, "\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV8\tNV8\nGPU1\tNVXX\t X \tNV8\nGPU2\tNV8\tNV8\t X \n"),
        # In the middle of an 8-GPU row: once reported as '18 values after the links'.
        (2, (TOPO / "nccl-933-8gpu-NV8-9nic-TRUNCATED-7rows.txt").read_text().replace("NV8 ", "NVXX", 1)),
    ],
)
def test_an_unknown_level_word_is_named_with_its_line(row_with_bad_level, text):
    with pytest.raises(TopoParseError) as info:
        parse_topo_matrix(text)
    assert info.value.line_no == row_with_bad_level
    assert str(info.value).startswith(f"line {row_with_bad_level}: unknown link level 'NVXX'")


def test_unknown_level_on_the_command_line(tmp_path):
    path = tmp_path / "topo.txt"
    path.write_text("\tGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\nGPU0\t X \tNVXX\t0-7\t0\nGPU1\tNVXX\t X \t0-7\t0\n")
    result = topoagent("matrix", "--from-nvidia-smi", str(path))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert f"{path}: line 2: unknown link level 'NVXX'" in result.stderr


def test_rdma_devices_named_directly_in_any_kernel_style():
    """Old drivers name NICs by RDMA device: bonds and predictable RoCE names too."""
    text = (
        "\tGPU0\tGPU1\tmlx5_bond_0\trocep65s0f0\tCPU Affinity\n"
        "GPU0\t X \tNV4\tPIX\tSYS\t0-7\n"
        "GPU1\tNV4\t X \tPIX\tSYS\t0-7\n"
        "mlx5_bond_0\tPIX\tPIX\t X \tSYS\n"
        "rocep65s0f0\tSYS\tSYS\tSYS\t X \n"
    )
    topo = parse_topo_matrix(text)
    assert [(d.name, d.kind, d.device) for d in topo.nics] == [
        ("mlx5_bond_0", "nic", "mlx5_bond_0"), ("rocep65s0f0", "nic", "rocep65s0f0")]
    assert str(topo.level("GPU1", "mlx5_bond_0")) == "PIX" and topo.notes == ()
