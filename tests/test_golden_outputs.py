"""Every recorded node still serves what its expected/ folder says users see from it:
GET /topology, GET /metrics and the answers to a fixed list of POST /place requests, from
a real `topoagent serve --root <node>` over loopback (see tests/golden_outputs.py, which
also says what is normalised and how to rewrite the files)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import golden_outputs
import pytest
from golden_outputs import FILES, NODES, SNAPSHOTS, UPDATE_COMMAND
from service_helpers import promtool_complaints

HERE = Path(__file__).resolve().parent
# place() on every recording, recorded before the anytime search (tests/data/record_snapshot_answers.py).
CORE_ANSWERS = json.loads((HERE / "data" / "placement_answers_snapshots.json").read_text())["answers"]
# Beside the served outputs: the text of the page at /, which tests/test_page_live.py reads in
# Chromium and rewrites with TOPOAGENT_WRITE_GOLDEN=1.
PAGE_TEXT = "page-text.json"


@pytest.fixture(scope="module")
def served() -> dict[str, dict[str, str]]:
    """Every node's outputs, once for the module (the eight agents run at once)."""
    return golden_outputs.all_outputs()


def test_every_recorded_node_has_golden_outputs():
    assert len(NODES) == 16  # tests/test_fixtures.py names them
    for node in NODES:
        held = sorted(p.name for p in (SNAPSHOTS / node / "expected").iterdir())
        assert held == sorted([*FILES, PAGE_TEXT]), f"{node}/expected holds {held}"


@pytest.mark.parametrize("node", NODES)
def test_the_node_serves_its_golden_outputs(served, node):
    diffs = golden_outputs.differences(node, served[node])
    assert not diffs, "\n".join(diffs) + f"\nThe served outputs changed. If that is meant, rewrite them with: {UPDATE_COMMAND}"
    if shutil.which("promtool"):  # scripts/test installs it
        metrics = (SNAPSHOTS / node / "expected" / "metrics.txt").read_bytes()
        assert promtool_complaints(metrics) == []


def test_nothing_of_the_machine_running_the_test_leaks_in(served):
    """The names are the recorded ones, and no path of this checkout (or a temporary
    directory of the run) is in any file."""
    for node, files in served.items():
        recorded = json.loads((SNAPSHOTS / node / "snapshot.json").read_text())["hostname"]
        topology = json.loads(files["topology.json"])
        assert topology["hostname"] == recorded
        # hostname labels gpu_info: a node without GPUs has none.
        assert set(re.findall(r'hostname="([^"]*)"', files["metrics.txt"])) == ({recorded} if topology["gpus"] else set())
        for name, text in files.items():
            assert str(golden_outputs.REPO) not in text and "golden-" not in text, f"{node}/{name} names a local path"


@pytest.mark.parametrize("node", ["dgx-a100", "degraded"])
def test_discover_json_prints_the_served_document_less_what_the_agent_adds(node):
    """What fixtures/README.md says of `topoagent discover --json`: the agent adds its own
    part, when each collector last succeeded, and the recorded counters' findings."""
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "discover", "--json", "--root", str(SNAPSHOTS / node)],
                          capture_output=True, text=True, timeout=120, env=os.environ)
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    served = json.loads((SNAPSHOTS / node / "expected" / "topology.json").read_text())
    assert served.pop("agent")["stale"] is False
    served["findings"] = [f for f in served["findings"] if f["source"] != "telemetry"]
    for doc in (printed, served):
        for collector in doc["collectors"].values():
            collector["seconds"] = collector["last_success_at"] = None
    assert printed == served


def test_served_answers_agree_with_the_placement_core_on_a_free_node():
    """The HTTP door gives the GPUs place() gave, in rank order, wherever the core's
    recorded answers (random busy sets) include the free node."""
    compared = 0
    for node in NODES:
        rows = json.loads((SNAPSHOTS / node / "expected" / "place.json").read_text())
        served = {}
        for row in rows:
            request = row["request"]
            if set(request) <= {"gpus", "pattern", "nics"}:
                key = (request.get("pattern", "allreduce"), request["gpus"], request.get("nics", 0))
                served[key] = [g["index"] for g in row["answer"]["gpus"]] if row["status"] == 200 else None
        # The nodes added with issue 27 have no recorded core answers (two of them answer none).
        for busy, pattern, k, nics, answer in CORE_ANSWERS.get(node, []):
            if not busy and (pattern, k, nics) in served:
                assert served[(pattern, k, nics)] == answer, f"{node}: {pattern} k={k} nics={nics}"
                compared += 1
    assert compared >= 100


def test_a_change_shows_as_a_diff_and_update_rewrites_it(served, monkeypatch, tmp_path, capsys):
    """What a reviewer sees: a unified diff naming the file, and the one command that
    rewrites every node's files (here pointed at a copy)."""
    copy = tmp_path / "fixtures" / "snapshots"
    shutil.copytree(SNAPSHOTS / "vm-1gpu" / "expected", copy / "vm-1gpu" / "expected")
    monkeypatch.setattr(golden_outputs, "REPO", tmp_path)
    monkeypatch.setattr(golden_outputs, "SNAPSHOTS", copy)
    monkeypatch.setattr(golden_outputs, "all_outputs", lambda nodes=None: {n: served[n] for n in nodes or ["vm-1gpu"]})
    metrics = copy / "vm-1gpu" / "expected" / "metrics.txt"
    metrics.write_text(metrics.read_text().replace("topoagent_gpus 1.0", "topoagent_gpus 2.0"))

    assert golden_outputs.main(["vm-1gpu"]) == 1
    out, err = capsys.readouterr()
    assert "--- fixtures/snapshots/vm-1gpu/expected/metrics.txt (committed)" in out
    assert "-topoagent_gpus 2.0\n+topoagent_gpus 1.0\n" in out
    assert UPDATE_COMMAND in err

    assert golden_outputs.main(["--update", "vm-1gpu"]) == 0
    assert "rewrote fixtures/snapshots/vm-1gpu/expected" in capsys.readouterr().out
    assert golden_outputs.differences("vm-1gpu", served["vm-1gpu"]) == []
    assert golden_outputs.main(["vm-1gpu"]) == 0
