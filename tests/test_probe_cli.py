"""`topoagent probe` input errors: one line on stderr, exit 2, and no worker started."""

import pytest

from topoagent.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["probe", "--root", "/nonexistent-root", "--backend", "cpu"], "/nonexistent-root: no such file"),
        (["probe", "--backend", "cuda"], "say which GPUs to probe"),
        (["probe", "--gpus", "0", "--backend", "cpu"], "--gpus needs at least 1"),
        (["probe", "--from-nvidia-smi", "/nonexistent/topo.txt"], "cannot read /nonexistent/topo.txt"),
        (["probe", "--backend", "cpu", "--timeout", "0"], "--timeout must be positive"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("topoagent probe: ") and message in err
    assert err.count("\n") == 1


def test_unreadable_matrix_names_the_file_and_line(tmp_path, capsys):
    bad = tmp_path / "topo.txt"
    bad.write_text("\tGPU0\tGPU1\nGPU0\t X \tBOGUS\nGPU1\tPIX\t X\n")
    assert main(["probe", "--from-nvidia-smi", str(bad), "--backend", "cpu"]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "line" in err


def test_probe_a_recorded_node_on_the_cpu_backend(capsys):
    """--root discovers the recorded node, then measures every GPU pair for real (CPU)."""
    import json

    from conftest import FIXTURES

    root = FIXTURES / "snapshots" / "dgx-a100"
    assert main(["probe", "--root", str(root), "--backend", "cpu", "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["failure"] is None
    assert len(doc["pairs"]) == 8 * 7 // 2
    assert all(p["measured_gbps"] > 0 and p["level"] == "NV12" for p in doc["pairs"])
