"""A probe file names the node it was taken on, and `place --measured` refuses another
node's figures: a round from a workstation once moved a DGX's answer from GPUs 0 1 to 2 3."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
from schema_check import validate

from topoagent.cli import main

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "fixtures" / "snapshots"


@cache
def workstation_round() -> str:
    """`probe --json` of the recorded workstation, measured for real on the cpu backend."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "probe", "--root", str(SNAPSHOTS / "workstation-2gpu"),
         "--backend", "cpu", "--json", "--no-progress", "--timeout", "120"],
        capture_output=True, text=True, timeout=180, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture
def probe_file(tmp_path: Path) -> Path:
    path = tmp_path / "round.json"
    path.write_text(workstation_round())
    return path


def test_probe_json_names_the_node_and_its_gpus(probe_file):
    doc = json.loads(probe_file.read_text())
    validate(doc, "ProbeRound")
    assert doc["node"]["hostname"] == "wrx90-ws"
    assert [(g["index"], g["uuid"], g["pci_address"]) for g in doc["node"]["gpus"]] == [
        (0, "GPU-5afb7f3f-1f15-da95-b813-0a13f2fc6deb", "0000:c1:00.0"),
        (1, "GPU-6b3a13b0-ba12-32c3-502c-8f9d14cabf3e", "0000:c2:00.0"),
    ]


def test_place_refuses_a_probe_from_another_node(probe_file, capsys):
    assert main(["place", "--root", str(SNAPSHOTS / "dgx-a100"), "--gpus", "2", "--measured", str(probe_file)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert "wrx90-ws" in captured.err and "dgx-a100-01" in captured.err and "--measured" in captured.err


def test_place_takes_a_probe_from_this_node(probe_file, capsys):
    assert main(["place", "--root", str(SNAPSHOTS / "workstation-2gpu"), "--gpus", "2", "--measured", str(probe_file)]) == 0
    assert capsys.readouterr().err == ""


def test_batch_reads_the_same_file_the_same_way(probe_file, monkeypatch, capsys):
    import io

    monkeypatch.setattr("sys.stdin", io.StringIO('{"gpus": 2}\n'))
    assert main(["place", "--root", str(SNAPSHOTS / "dgx-a100"), "--batch", "--measured", str(probe_file)]) == 2
    assert "wrx90-ws" in capsys.readouterr().err


def test_an_old_probe_file_without_a_node_is_used_with_a_warning(probe_file, capsys):
    doc = json.loads(probe_file.read_text())
    del doc["node"]
    probe_file.write_text(json.dumps(doc))
    assert main(["place", "--root", str(SNAPSHOTS / "workstation-2gpu"), "--gpus", "2", "--measured", str(probe_file)]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("GPUs in rank order")
    assert captured.err.count("\n") == 1 and "warning" in captured.err and "which node" in captured.err


def test_twin_nodes_without_uuids_are_told_apart_by_hostname(probe_file, capsys):
    """Two nodes of one model share PCI addresses: without UUIDs, the names decide."""
    doc = json.loads(probe_file.read_text())
    doc["node"] = {"hostname": "wrx90-ws-twin", "gpus": [
        {"index": 0, "uuid": None, "pci_address": "0000:c1:00.0"},
        {"index": 1, "uuid": None, "pci_address": "0000:c2:00.0"},
    ]}
    probe_file.write_text(json.dumps(doc))
    assert main(["place", "--root", str(SNAPSHOTS / "workstation-2gpu"), "--gpus", "2", "--measured", str(probe_file)]) == 2
    err = capsys.readouterr().err
    assert "wrx90-ws-twin" in err and "not on this node wrx90-ws" in err
