"""`topoagent slurm health`: slurmd's HealthCheckProgram drains the node while the agent reports
a critical finding, and resumes it when none is left, never a node someone else drained.

Agents on two recordings play the node's two moods: ``no-gpu-stack`` (8 GPUs on the bus, no
NVML nor nvidia-smi: critical ``gpu-stack-missing``) and ``dgx-a100`` (no critical finding).
The Slurm side is real slurmctld and slurmd (tests/slurm_cluster.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES
from service_helpers import start_agent, wait_for
from slurm_cluster import SlurmCluster, SlurmNode

from topoagent.cluster.slurm import AgentRefused, critical_reason, health_action

SNAPSHOTS = FIXTURES / "snapshots"
NODE = "gpu01"


def test_the_reason_names_the_first_critical_finding_in_one_line():
    doc = {"findings": [{"severity": "warning", "kind": "nvlink-down", "message": "x"},
                        {"severity": "critical", "kind": "gpu-stack-missing", "message": "8 GPUs\\non the bus"},
                        {"severity": "critical", "kind": "no-gpus", "message": "y"}]}
    assert critical_reason(doc) == "topoagent: gpu-stack-missing (+1 more): 8 GPUs\\non the bus"
    assert critical_reason({"findings": [{"severity": "critical", "kind": "k", "message": "a\nb " * 200}]}).count("\n") == 0
    assert len(critical_reason({"findings": [{"severity": "critical", "kind": "k", "message": "m" * 900}]})) <= 200
    assert critical_reason({"findings": [{"severity": "warning", "kind": "k", "message": "m"}]}) is None
    with pytest.raises(AgentRefused, match="no finding list"):
        critical_reason({"gpus": []})  # an answer that says nothing resumes nothing


def test_only_a_drain_of_ours_is_resumed_and_anothers_is_never_overwritten():
    ours = "topoagent: no-gpus: no GPU found"
    assert health_action(ours, "idle", "") == ("drain", ours)
    assert health_action(ours, "mixed", "") == ("drain", ours)  # running jobs finish: drain, not down
    assert health_action(ours, "drained", ours) is None  # nothing to do twice
    assert health_action(ours, "drained", "topoagent: old-kind: gone") == ("drain", ours)  # our reason kept current
    assert health_action(ours, "drained", "bad DIMM, ticket 4411") is None
    assert health_action(None, "draining", ours) == ("resume", "")
    assert health_action(None, "drained*", ours) == ("resume", "")
    assert health_action(None, "drained", "bad DIMM, ticket 4411") is None
    assert health_action(None, "idle", "") is None


def health(cluster: SlurmCluster, agent_url: str, *extra: str) -> subprocess.CompletedProcess[str]:
    """The verb as slurmd runs it: SLURMD_NODENAME set, the cluster's slurm.conf."""
    env = {"PYTHONPATH": os.environ["PYTHONPATH"], "PATH": os.environ["PATH"], "SLURM_CONF": cluster.env["SLURM_CONF"],
           "SLURMD_NODENAME": NODE}
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "slurm", "health", "--agent", agent_url,
                           "--token-file", "/nonexistent", "--timeout", "10", *extra],
                          env=env, capture_output=True, text=True, timeout=120)


def node_reason(cluster: SlurmCluster) -> tuple[str, str]:
    state, _, reason = cluster.run("sinfo", "-h", "-N", "-n", NODE, "-o", "%T %E").stdout.strip().partition(" ")
    return state, reason


@pytest.fixture(scope="module")
def agents(tmp_path_factory: pytest.TempPathFactory):
    """A blind node's agent and a well one's, read only: both tests ask them the same."""
    sick_dir, well_dir = tmp_path_factory.mktemp("sick"), tmp_path_factory.mktemp("well")
    sick = start_agent(sick_dir, root=SNAPSHOTS / "no-gpu-stack", token=False)
    try:
        well = start_agent(well_dir, token=False)
    except BaseException:
        sick.stop()
        raise
    yield sick, well
    sick.stop()
    well.stop()


def test_a_critical_finding_drains_the_node_and_its_end_resumes_it(tmp_path: Path, agents):
    sick, well = agents
    with SlurmCluster(tmp_path / "slurm", [SlurmNode(NODE)]) as cluster:
        done = health(cluster, well.url)
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "") and node_reason(cluster)[0] == "idle"

        done = health(cluster, sick.url)
        assert done.returncode == 0 and done.stderr.startswith(f"topoagent slurm health: drained {NODE}: topoagent: gpu-stack-missing"), done.stderr
        state, reason = node_reason(cluster)
        assert state in ("drained", "draining") and reason.startswith("topoagent: gpu-stack-missing: 8 NVIDIA GPU(s) on the PCI bus"), reason
        # A job is not started on it.
        assert cluster.run("srun", "--immediate=5", "true", check=False, timeout=60).returncode != 0
        again = health(cluster, sick.url)
        assert (again.returncode, again.stderr) == (0, "") and node_reason(cluster) == (state, reason)

        done = health(cluster, well.url)
        assert done.returncode == 0 and f"resumed {NODE}" in done.stderr
        # resumed: slurmctld pings the node again ("idle*" until it answers)
        wait_for("the node idle again", lambda: node_reason(cluster)[0] == "idle", timeout=60,
                 log=lambda: cluster.log("slurmctld")[-2000:])
        assert cluster.run("srun", "true", timeout=60).returncode == 0

        # An admin's drain is theirs: neither resumed nor given our reason.
        cluster.run("scontrol", "update", f"nodename={NODE}", "state=drain", "reason=bad DIMM, ticket 4411")
        for url in (well.url, sick.url):
            done = health(cluster, url)
            assert (done.returncode, done.stderr) == (0, "") and node_reason(cluster)[1] == "bad DIMM, ticket 4411"


def test_slurmd_runs_it_as_health_check_program(tmp_path: Path, agents):
    """docs/slurm.md's wrapper in slurm.conf: slurmd's own periodic run drains and resumes."""
    sick, well = agents
    url_file = tmp_path / "agent-url"
    url_file.write_text(well.url)
    script = tmp_path / "topoagent-health.sh"
    # slurmd runs it with SLURMD_NODENAME alone in its environment: the test's paths are spelt out
    script.write_text(f"#!/bin/sh\nexport PATH={os.environ['PATH']} SLURM_CONF={tmp_path / 'slurm' / 'etc' / 'slurm.conf'}\n"
                      f"PYTHONPATH={os.environ['PYTHONPATH']} exec {sys.executable} -P -m topoagent slurm health "
                      f"--agent $(cat {url_file}) --token-file /nonexistent --timeout 10\n")
    script.chmod(0o755)
    conf = [f"HealthCheckProgram={script}", "HealthCheckInterval=1", "HealthCheckNodeState=ANY"]
    with SlurmCluster(tmp_path / "slurm", [SlurmNode(NODE)], extra_conf=conf) as cluster:
        diagnose = lambda: cluster.log("slurmd")[-3000:]  # noqa: E731
        url_file.write_text(sick.url)
        wait_for("the node drained by the health check",
                 lambda: node_reason(cluster)[1].startswith("topoagent: gpu-stack-missing"), timeout=60, log=diagnose)
        url_file.write_text(well.url)
        wait_for("the node resumed by the health check", lambda: node_reason(cluster)[0] == "idle", timeout=60, log=diagnose)
