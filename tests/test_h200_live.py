"""The real H200 served live: `topoagent serve --root /` runs as it ran on that node, in a mount
namespace of its own where /sys, /proc/driver and /proc/cpuinfo are the ones recorded there,
`nvidia-smi topo -m` prints what the real one printed, and NVML is the suite's C-ABI stand-in
(tests/nvml_stub) serving that GPU's answers under the real nvidia-ml-py.  Nothing of the agent
is replaced: it reads the live node its own way, discovery's child process included."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FIXTURES
from nvml_stub import StubNode
from service_helpers import Agent, metric_value, start_agent, wait_counters_read, wait_for
from test_real_h200 import assert_serves_the_recorded_counters

H200 = FIXTURES / "snapshots" / "h200-vm"

# As on the node: the recorded trees mounted where the kernel keeps them, then the agent.
IN_A_BOX = """set -e
mount --bind "$1/sys" /sys
mount --bind "$1/proc/driver" /proc/driver
mount --bind "$1/proc/cpuinfo" /proc/cpuinfo
shift
exec "$@"
"""


def fake_nvidia_smi(bindir: Path) -> None:
    """`nvidia-smi topo -m` printing what the real one printed on the node (escape codes kept)."""
    bindir.mkdir()
    script = bindir / "nvidia-smi"
    script.write_text(f'#!/bin/sh\n[ "$1 $2" = "topo -m" ] && exec cat {H200 / "commands" / "nvidia-smi_topo_-m.out"}\n'
                      'echo "nvidia-smi stand-in: only topo -m was recorded" >&2; exit 2\n')
    script.chmod(0o755)


def in_the_box(tmp: Path) -> tuple[list[str], dict[str, str]]:
    """The command that runs a command line on the H200 as recorded, and its environment."""
    unshare = shutil.which("unshare")
    assert unshare is not None, "util-linux's unshare is needed to mount the recorded /sys for this agent alone"
    assert os.geteuid() == 0, "mounting the recorded /sys in a namespace of its own needs root (CI runs as root)"
    node = StubNode(tmp / "nvml")
    node.serve_recording(H200, sample=-1)  # the sample the replay tests compare with (recorded_counters)
    fake_nvidia_smi(tmp / "bin")
    env = {**node.env(), "PATH": f"{tmp / 'bin'}:{os.environ['PATH']}"}
    return [unshare, "--mount", "--propagation", "private", "sh", "-c", IN_A_BOX, "sh", str(H200)], env


@pytest.fixture(scope="module")
def h200(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    tmp = tmp_path_factory.mktemp("h200")
    state = tmp / "state"
    state.mkdir(mode=0o700)
    wrapper, env = in_the_box(tmp)
    agent = start_agent(tmp, root=Path("/"), token=False, state_dir=state, env=env, wrapper=wrapper, ready_timeout=None)
    yield agent
    agent.stop()


def test_the_live_h200_is_ready_and_places_its_gpu(h200: Agent):
    wait_for("/readyz 200", lambda: h200.get("/readyz").status == 200, h200, timeout=60)
    topology = h200.get("/topology").json()
    assert [g["uuid"] for g in topology["gpus"]] == ["GPU-8aa1497e-909b-15e4-767c-dcfa583dff29"]
    assert [f for f in topology["findings"] if f["severity"] != "info"] == []
    assert topology["collectors"]["nvml"]["status"] == "ok" and topology["collectors"]["nvidia_smi"]["status"] == "ok"
    assert {name: c["warnings"] for name, c in topology["collectors"].items() if c["warnings"]} == {}  # the real topo output too
    placed = h200.post("/place", {"gpus": 1})
    assert placed.status == 200 and [g["index"] for g in placed.json()["gpus"]] == [0], placed.body
    assert h200.post("/place", {"gpus": 2}).status == 422


def test_every_gpu_family_the_h200_answered_is_on_metrics_with_its_value(h200: Agent):
    wait_for("/readyz 200", lambda: h200.get("/readyz").status == 200, h200, timeout=60)
    wait_counters_read(h200)
    page = h200.get("/metrics").body.decode()
    assert metric_value(page, "topoagent_collector_success", {"collector": "nvml_counters"}) == 1
    assert_serves_the_recorded_counters(page)


def test_a_snapshot_of_the_live_h200_records_what_nvml_answered_there(tmp_path: Path):
    """`topoagent snapshot` on the node: its nvml.json is the real one (what the recording holds),
    and its counter samples read with no error -- the landed code recorded a TypeError in both."""
    out = tmp_path / "again"
    wrapper, env = in_the_box(tmp_path)
    done = subprocess.run([*wrapper, sys.executable, "-P", "-m", "topoagent", "snapshot", "--counter-interval", "0", str(out)],
                          capture_output=True, text=True, env={**os.environ, **env}, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = json.loads((H200 / "nvml.json").read_text())
    again = json.loads((out / "nvml.json").read_text())
    health = ("health",)
    assert [{k: v for k, v in g.items() if k not in health} for g in again["gpus"]] == [
        {k: v for k, v in g.items() if k not in health} for g in recorded["gpus"]]
    samples = json.loads((out / "telemetry.json").read_text())["samples"]
    assert len(samples) == 2 and all("nvml_counters" in s["sources"] and "nvml_counters" not in s["errors"] for s in samples)
