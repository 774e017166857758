"""`topoagent slurm prolog|epilog|task-prolog`: a Slurm job's GPUs are leased from the agent
exactly while it runs, and each task is told its ranks' GPUs, CPUs and NICs.

The pure parts (Slurm's ids to the agent's, the task's share, the export lines) first; then
the verbs as slurmd runs them, against a real agent over loopback; then the whole path in
real slurmctld and slurmd (tests/slurm_cluster.py) with the recorded DGX A100 as the node."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, WITHOUT_GPU_STACK
from service_helpers import start_agent, wait_for, without_leases
from slurm_cluster import SlurmCluster, SlurmNode, gres_device_files
from test_slurm import DGX_A100_HARDWARE, DGX_A100_SOCKETS, synthetic_cpus

from topoagent.cluster.slurm import (
    RankBinding,
    SlurmJobError,
    agent_indices,
    cuda_numbering,
    export_lines,
    gres_order,
    nic_ports,
    parse_gpu_ids,
    ranks_from_document,
    ranks_of,
    split_ranks,
    task_exports,
    tasks_on_node,
)
from topoagent.commands.discover import discover_root
from topoagent.exporters.gres import gres_lines, render_gres

SNAPSHOTS = FIXTURES / "snapshots"


# -- Slurm's GPU ids and the agent's -------------------------------------------------------

def _topology(*gpus: tuple[int, str | None]) -> dict:
    return {"gpus": [{"index": i, "address": a} for i, a in gpus], "nics": []}


def test_slurms_gpu_i_is_the_agents_ith_gpu_in_bus_order():
    # nvidia-smi index 0 sits at the higher bus address: Slurm's 0 (first in gres.conf) is index 1
    topology = _topology((0, "0000:c1:00.0"), (1, "0000:07:00.0"), (2, None), (3, "0000:47:00.0"))
    order = gres_order(topology)
    assert order == [1, 3, 0, 2]
    assert agent_indices((0, 2), order) == {0: 1, 2: 0}
    with pytest.raises(SlurmJobError, match="Slurm's GPU 4 is not one of the agent's 4 GPUs"):
        agent_indices((4,), order)


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.iterdir() if p.name not in WITHOUT_GPU_STACK))
def test_the_mapping_follows_the_gres_conf_export_gres_writes(name):
    """gres.conf's line i (Slurm's GPU i) and gres_order's i-th GPU are the same GPU (a node
    without a working GPU stack has no gres.conf: export gres refuses it, tested there)."""
    topology = discover_root(str(SNAPSHOTS / name))
    doc = {"gpus": [{"index": g.index, "address": g.pci_address} for g in topology.gpus]}
    by_name = {g.name: g.index for g in topology.gpus}
    assert gres_order(doc) == [by_name[line.gpu] for line in gres_lines(topology)]


def test_slurm_gpu_lists_are_read_or_refused_in_one_line():
    assert parse_gpu_ids("SLURM_JOB_GPUS", "3,0,1") == (0, 1, 3)
    assert parse_gpu_ids("SLURM_JOB_GPUS", "0-2,5") == (0, 1, 2, 5)
    assert parse_gpu_ids("SLURM_JOB_GPUS", "") == ()
    for bad in ("GPU-6d1b2c3e", "0,1\nexport LD_PRELOAD=x", "MIG-1/2/3"):
        with pytest.raises(SlurmJobError, match=r"SLURM_JOB_GPUS=.*expected GPU indices"):
            parse_gpu_ids("SLURM_JOB_GPUS", bad)


# -- what a task is told ----------------------------------------------------------------

def _rank(rank, index, slurm_gpu, cpus, node, nic):
    return RankBinding(rank, index, slurm_gpu, frozenset(cpus), node, nic, 1 if nic else None)


RANKS = [_rank(0, 5, 5, range(8, 12), 1, "mlx5_2"), _rank(1, 4, 4, range(12, 16), 1, "mlx5_3"),
         _rank(2, 6, 6, range(0, 4), 0, "mlx5_0"), _rank(3, 7, 7, range(4, 8), 0, None)]


def test_each_of_four_tasks_gets_its_ranks_gpu_cpus_and_nic():
    cuda_of = cuda_numbering((4, 5, 6, 7), "4,5,6,7")
    mine, bound = split_ranks(RANKS, tasks_on_node("4", 0), 1)
    assert bound and mine == [RANKS[1]]
    assert dict(task_exports(mine, cuda_of, bound, "L1")) == {
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4", "TOPOAGENT_GPUS": "4", "TOPOAGENT_LEASE": "L1",
        "TOPOAGENT_CPUS": "12-15", "TOPOAGENT_CPU_BIND": "mask_cpu:0xf000", "TOPOAGENT_MEMORY_NODES": "1",
        "NCCL_IB_HCA": "=mlx5_3", "UCX_NET_DEVICES": "mlx5_3:1"}
    # rank 3 has no RDMA NIC: no NCCL_IB_HCA for it (NCCL then picks), not a guessed one
    last = dict(task_exports(split_ranks(RANKS, 4, 3)[0], cuda_of, True, None))
    assert "NCCL_IB_HCA" not in last and "UCX_NET_DEVICES" not in last and "TOPOAGENT_LEASE" not in last


def test_one_task_drives_all_ranks_in_rank_order_in_slurms_numbering():
    # cgroups renumber the step's GPUs 0..3: CUDA_VISIBLE_DEVICES keeps Slurm's numbering
    cuda_of = cuda_numbering((4, 5, 6, 7), "0,1,2,3")
    env = dict(task_exports(split_ranks(RANKS, 1, 0)[0], cuda_of, True, None))
    assert env["CUDA_VISIBLE_DEVICES"] == "1,0,2,3" and env["TOPOAGENT_GPUS"] == "5,4,6,7"
    assert env["TOPOAGENT_CPUS"] == "0-15" and env["TOPOAGENT_MEMORY_NODES"] == "1,0"
    assert env["TOPOAGENT_CPU_BIND"] == "mask_cpu:0xf00,0xf000,0xf,0xf0"
    assert env["NCCL_IB_HCA"] == "=mlx5_2,mlx5_3,mlx5_0"


def test_tasks_that_do_not_divide_the_gpus_share_them_unbound():
    mine, bound = split_ranks(RANKS, 3, 2)
    env = dict(task_exports(mine, cuda_numbering((4, 5, 6, 7), None), bound, None))
    assert not bound and env["CUDA_VISIBLE_DEVICES"] == "5,4,6,7"
    assert not {"TOPOAGENT_CPUS", "NCCL_IB_HCA"} & set(env)


def test_slurms_own_per_task_binding_is_left_alone():
    assert cuda_numbering((4, 5, 6, 7), "2") is None


def test_tasks_per_node_reads_slurms_compressed_lists():
    assert tasks_on_node("2(x3),1", 0) == 2 and tasks_on_node("2(x3),1", 2) == 2 and tasks_on_node("2(x3),1", 3) == 1
    with pytest.raises(SlurmJobError, match="names no node 4"):
        tasks_on_node("2(x3),1", 4)
    with pytest.raises(SlurmJobError, match="not Slurm's N or N"):
        tasks_on_node("two", 0)


def test_nothing_from_the_agent_can_add_a_line_to_the_task_prolog_output():
    answer = {"gpus": [{"index": 0, "cpus": "0-3\nexport LD_PRELOAD=/tmp/x.so", "nic": "mlx5_0\nexport A=b", "memory_node": 0}]}
    ports = nic_ports({"nics": [{"device": "mlx5_0\nexport A=b", "ports": [{"port": 1, "state": "ACTIVE"}]}]})
    assert ports == {}
    (rank,) = ranks_of(answer, {0: 0}, ports)
    assert rank.cpus is None and rank.nic is None
    text = export_lines(task_exports([rank], {0: "0"}, True, None))
    assert text.count("\n") == 4 and "LD_PRELOAD" not in text and "export A" not in text
    with pytest.raises(SlurmJobError, match="cannot be exported"):
        ranks_from_document([{"rank": 0, "index": 0, "slurm_gpu": 0, "nic": "a b", "nic_port": 1}])


def test_a_placement_of_other_gpus_than_the_jobs_is_refused():
    from topoagent.cluster.slurm import AgentRefused

    with pytest.raises(AgentRefused, match="not one of the job's GPUs"):
        ranks_of({"gpus": [{"index": 3}]}, {0: 0}, {})


# -- the verbs against a real agent ---------------------------------------------------------

def slurm_verb(verb: str, agent_url: str, tmp: Path, env: dict[str, str], *extra: str) -> subprocess.CompletedProcess[str]:
    """One verb as slurmd runs it: a bare environment of Slurm's variables."""
    child_env = {"PYTHONPATH": os.environ["PYTHONPATH"], **env}
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "slurm", verb, "--agent", agent_url,
                           "--token-file", str(tmp / "token"), "--state-dir", str(tmp / "jobs"), "--timeout", "5", *extra],
                          env=child_env, capture_output=True, text=True, timeout=60)


def leases_of(agent, owner: str) -> list[dict]:
    return [lease for lease in agent.get("/leases").json()["leases"] if lease["owner"] == owner]


@pytest.fixture(scope="module")
def shared_agent(tmp_path_factory):
    running = start_agent(tmp_path_factory.mktemp("agent"))
    yield running
    running.stop()


@pytest.fixture
def agent(shared_agent, tmp_path):
    """The module's agent holding no lease, as a fresh one starts (a start costs seconds),
    with its token where the verbs read it."""
    shutil.copy2(shared_agent.token_file, tmp_path / "token")  # its mode (0600) too
    return without_leases(shared_agent)


def test_prolog_leases_exactly_the_jobs_gpus_and_epilog_releases_them(agent, tmp_path):
    job = {"SLURM_JOB_ID": "41", "SLURM_JOB_GPUS": "2,3,6", "CUDA_VISIBLE_DEVICES": "2,3,6"}
    done = slurm_verb("prolog", agent.url, tmp_path, job)
    assert done.returncode == 0 and done.stderr == "", done.stderr
    (lease,) = leases_of(agent, "slurm-job-41")
    assert sorted(lease["gpus"]) == [2, 3, 6]  # the DGX A100's index order is its bus order
    record = json.loads((tmp_path / "jobs" / "job-41.json").read_text())
    assert record["lease"] == lease["id"] and [r["index"] for r in record["ranks"]] == lease["gpus"]
    # The prolog asked for the bindings (a lean answer has none): each rank's CPUs and memory node.
    assert all(r["cpus"] and r["memory_node"] is not None for r in record["ranks"]), record["ranks"]
    # the task prolog of a one-task step: every GPU in the lease's rank order
    step = {"SLURM_JOB_ID": "41", "SLURM_STEP_GPUS": "2,3,6", "CUDA_VISIBLE_DEVICES": "2,3,6", "SLURM_STEP_TASKS_PER_NODE": "1"}
    told = slurm_verb("task-prolog", agent.url, tmp_path, step)
    assert told.returncode == 0, told.stderr
    lines = told.stdout.splitlines()
    assert all(line.startswith("export ") for line in lines)
    env = dict(line[len("export "):].split("=", 1) for line in lines)
    assert env["TOPOAGENT_GPUS"] == ",".join(map(str, lease["gpus"])) == env["CUDA_VISIBLE_DEVICES"]
    assert env["TOPOAGENT_LEASE"] == lease["id"]

    for _ in range(2):  # the second finds nothing to release: still a success
        done = slurm_verb("epilog", agent.url, tmp_path, {"SLURM_JOB_ID": "41"})
        assert done.returncode == 0 and done.stderr == "", done.stderr
        assert leases_of(agent, "slurm-job-41") == [] and not (tmp_path / "jobs" / "job-41.json").exists()


def test_epilog_releases_every_lease_of_the_job_and_no_other(agent, tmp_path):
    """After a crash or reboot nothing but the agent remembers the job: the owner is enough."""
    for owner, gpus in (("slurm-job-7", [0]), ("slurm-job-7", [1]), ("slurm-job-70", [2])):
        reply = agent.post("/place", {"gpus": 1, "include": gpus, "reserve": {"owner": owner, "ttl_s": 600}}, token=agent.token)
        assert reply.status == 200, reply.body
    done = slurm_verb("epilog", agent.url, tmp_path, {"SLURM_JOB_ID": "7"})
    assert done.returncode == 0, done.stderr
    assert leases_of(agent, "slurm-job-7") == [] and len(leases_of(agent, "slurm-job-70")) == 1


def test_prolog_fails_in_one_line_when_a_gpu_is_leased_to_someone_else(agent, tmp_path):
    reply = agent.post("/place", {"gpus": 1, "include": [3], "reserve": {"owner": "inference-svc", "ttl_s": 600}}, token=agent.token)
    assert reply.status == 200
    done = slurm_verb("prolog", agent.url, tmp_path, {"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "2,3"})
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1 and "HTTP 409" in done.stderr and "inference-svc" in done.stderr, done.stderr
    assert leases_of(agent, "slurm-job-9") == [] and not (tmp_path / "jobs" / "job-9.json").exists()


def test_prolog_without_the_token_is_refused_by_the_agent(agent, tmp_path):
    (tmp_path / "token").write_text("not-the-token\n")
    done = slurm_verb("prolog", agent.url, tmp_path, {"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "0"})
    assert done.returncode == 1 and "HTTP 401" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def test_a_job_without_gpus_needs_no_agent(tmp_path):
    for verb in ("prolog", "task-prolog"):
        done = slurm_verb(verb, "http://127.0.0.1:9", tmp_path, {"SLURM_JOB_ID": "5"})
        assert (done.returncode, done.stdout, done.stderr) == (0, "", "")


def test_an_unreachable_agent_fails_the_prolog_unless_allowed(tmp_path):
    (tmp_path / "token").write_text("t\n")
    (tmp_path / "token").chmod(0o600)
    job = {"SLURM_JOB_ID": "5", "SLURM_JOB_GPUS": "0"}
    port = _closed_port()
    done = slurm_verb("prolog", f"http://127.0.0.1:{port}", tmp_path, job, "--timeout", "1")
    assert done.returncode == 1 and done.stderr.startswith("topoagent slurm prolog: agent unreachable:"), done.stderr
    assert len(done.stderr.splitlines()) == 1
    done = slurm_verb("prolog", f"http://127.0.0.1:{port}", tmp_path, job, "--timeout", "1", "--if-agent-down", "allow")
    assert done.returncode == 0 and "--if-agent-down allow" in done.stderr and len(done.stderr.splitlines()) == 1


@pytest.mark.parametrize("scheme", ["http", "https"])
@pytest.mark.parametrize("verb", ["prolog", "epilog"])
def test_a_wedged_agent_is_not_a_down_agent_and_fails_even_when_allowed(tmp_path, verb, scheme):
    """An agent that takes the connection and answers nothing (its store waiting on a FIFO,
    say) used to read as "down": --if-agent-down allow exited 0 and the job ran on GPUs a pod
    may hold.  A real listening socket on loopback that never answers stands for it; over
    TLS its silence comes in the handshake."""
    import socket

    (tmp_path / "token").write_text("t\n")
    (tmp_path / "token").chmod(0o600)
    with socket.socket() as wedged:
        wedged.bind(("127.0.0.1", 0))
        wedged.listen(16)  # the kernel completes each connection; nothing ever reads or answers
        url = f"{scheme}://127.0.0.1:{wedged.getsockname()[1]}"
        job = {"SLURM_JOB_ID": "5", "SLURM_JOB_GPUS": "0"}
        done = slurm_verb(verb, url, tmp_path, job, "--timeout", "1", "--if-agent-down", "allow")
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert done.stderr.startswith(f"topoagent slurm {verb}: agent wedged, not down (--if-agent-down allow does not cover it): "), done.stderr
    assert "answered nothing in time" in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
    assert not (tmp_path / "jobs" / "job-5.json").exists()


def test_a_records_directory_others_may_write_is_refused_before_any_lease(agent, tmp_path):
    """Whoever may write --state-dir may replace a job's record and bind its tasks elsewhere."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    jobs.chmod(0o777)
    done = slurm_verb("prolog", agent.url, tmp_path, {"SLURM_JOB_ID": "43", "SLURM_JOB_GPUS": "1"})
    assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "writable by anyone" in done.stderr and f"chmod 755 {jobs}" in done.stderr, done.stderr  # 755: the task prolog reads the records as the job's user
    assert leases_of(agent, "slurm-job-43") == []


def test_a_link_at_a_jobs_record_is_not_followed_by_the_task_prolog(agent, tmp_path):
    job = {"SLURM_JOB_ID": "44", "SLURM_JOB_GPUS": "2", "CUDA_VISIBLE_DEVICES": "2"}
    assert slurm_verb("prolog", agent.url, tmp_path, job).returncode == 0
    record = tmp_path / "jobs" / "job-44.json"
    elsewhere = tmp_path / "elsewhere.json"
    record.rename(elsewhere)
    record.symlink_to(elsewhere)
    step = {"SLURM_JOB_ID": "44", "SLURM_STEP_GPUS": "2", "CUDA_VISIBLE_DEVICES": "2", "SLURM_STEP_TASKS_PER_NODE": "1"}
    told = slurm_verb("task-prolog", agent.url, tmp_path, step)
    assert told.returncode == 2 and "symbolic link" in told.stderr, (told.returncode, told.stderr)
    assert slurm_verb("epilog", agent.url, tmp_path, {"SLURM_JOB_ID": "44"}).returncode == 0


def test_a_node_not_ready_for_placement_fails_the_prolog_at_once_even_when_allowed(tmp_path):
    """Its fabric down, the agent answers 503 not_ready_for_placement: a no, not an agent
    down to wait out or let pass, so the job never starts without a lease on a broken node
    (exit 1: slurmd drains the node)."""
    agent = start_agent(tmp_path, root=SNAPSHOTS / "no-fabric-manager")
    try:
        job = {"SLURM_JOB_ID": "12", "SLURM_JOB_GPUS": "0,1"}
        done = slurm_verb("prolog", agent.url, tmp_path, job, "--timeout", "40", "--if-agent-down", "allow")
        # Not retried until the 40 s deadline: that would end as an agent down, which
        # --if-agent-down allow lets pass (exit 0); the 503's own words and exit 1 say it was a no.
        assert done.returncode == 1 and done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith("topoagent slurm prolog: POST /place for GPUs 0,1 (Slurm's 0,1): HTTP 503: "
                                      "not ready for placement: nvswitch-no-nvlink (nvswitch): 6 NVSwitch(es)"), done.stderr
        assert leases_of(agent, "slurm-job-12") == [] and not (tmp_path / "jobs" / "job-12.json").exists()
    finally:
        agent.stop()


def test_bad_input_from_slurm_exits_2_in_one_line(tmp_path):
    for env, said in (({}, "SLURM_JOB_ID is not set"), ({"SLURM_JOB_ID": "1;rm"}, "not a Slurm job id"),
                      ({"SLURM_JOB_ID": "1", "SLURM_JOB_GPUS": "GPU-abc"}, "expected GPU indices")):
        done = slurm_verb("prolog", "http://127.0.0.1:9", tmp_path, env)
        assert done.returncode == 2 and said in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- in real slurmctld and slurmd --------------------------------------------------------------

def write_wrappers(directory: Path, agent_url: str, token: Path, state_dir: Path) -> list[str]:
    """docs/slurm.md's wrapper scripts, pointing at the test's agent; slurm.conf's lines."""
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    lines = []
    for verb, key in (("prolog", "Prolog"), ("epilog", "Epilog"), ("task-prolog", "TaskProlog")):
        script = directory / f"topoagent-{verb}.sh"
        # slurmd runs these without PATH or the test's environment
        script.write_text(f"#!/bin/sh\nPYTHONPATH={os.environ['PYTHONPATH']} exec {sys.executable} -P -m topoagent slurm {verb} "
                          f"--agent {agent_url} --token-file {token} --state-dir {state_dir} --timeout 15\n")
        script.chmod(0o755)
        lines.append(f"{key}={script}")
    return [*lines, "PrologFlags=Alloc"]


def read_env(path: Path) -> dict[str, str]:
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


def test_a_slurm_jobs_lease_exists_exactly_while_it_runs_and_each_task_gets_its_rank(tmp_path):
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    gres = render_gres(topology)
    agent_dir = tmp_path / "agent_files"
    agent_dir.mkdir()
    agent = start_agent(agent_dir)
    try:
        out = tmp_path / "out"
        out.mkdir(mode=0o777)
        conf = write_wrappers(tmp_path / "scripts", agent.url, agent_dir / "token", tmp_path / "jobs")
        node = SlurmNode("dgx-a100", hardware=DGX_A100_HARDWARE, hwloc_synthetic=synthetic_cpus(topology, DGX_A100_SOCKETS),
                         gres="gpu:nvidia_a100-sxm4-40gb:8", devices=gres_device_files(gres))
        with SlurmCluster(tmp_path / "slurm", [node], gres_conf=gres, extra_conf=conf) as cluster:
            diagnose = lambda: cluster.log("slurmd")[-3000:] + agent.log()[-2000:]  # noqa: E731
            # Four tasks, one per GPU; each writes its environment (whole: renamed into place, so the
            # poll never reads half of it), then waits for the test.
            task = (f'env > {out}/part.$SLURM_PROCID && mv {out}/part.$SLURM_PROCID {out}/task.$SLURM_PROCID.env; '
                    f'while [ ! -e {out}/go ]; do sleep 0.05; done')
            srun = subprocess.Popen(["srun", "--gres=gpu:4", "-n", "4", "sh", "-c", task], env=cluster.env, cwd=tmp_path,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                envs = wait_for("four tasks started", lambda: len(list(out.glob("task.*.env"))) == 4 and
                                [read_env(out / f"task.{i}.env") for i in range(4)], timeout=60, log=diagnose)
                job = envs[0]["SLURM_JOB_ID"]
                owner = f"slurm-job-{job}"
                (lease,) = leases_of(agent, owner)  # taken before the tasks started (PrologFlags=Alloc)
                slurm_gpus = [int(g) for g in envs[0]["SLURM_STEP_GPUS"].split(",")]
                assert sorted(lease["gpus"]) == slurm_gpus  # the DGX A100's bus order is its index order
            finally:
                (out / "go").touch()
                _, srun_err = srun.communicate(timeout=120)
            assert srun.returncode == 0, srun_err
            wait_for("the lease released after the job", lambda: leases_of(agent, owner) == [], timeout=60, log=diagnose)
            assert not (tmp_path / "jobs" / f"job-{job}.json").exists()

            # What each task should have been told: the agent's own placement of these GPUs.
            expected = agent.post("/place", {"gpus": 4, "include": lease["gpus"], "detail": ["bindings"]}).json()
            assert [g["index"] for g in expected["gpus"]] == lease["gpus"]
            ports = nic_ports(agent.get("/topology").json())
            for env in envs:
                rank = expected["gpus"][int(env["SLURM_LOCALID"])]
                assert env["CUDA_VISIBLE_DEVICES"] == str(rank["index"]) == env["TOPOAGENT_GPUS"], env
                assert env["TOPOAGENT_CPUS"] == rank["cpus"] and env["TOPOAGENT_MEMORY_NODES"] == str(rank["memory_node"])
                assert env["NCCL_IB_HCA"] == "=" + rank["nic"] and env["UCX_NET_DEVICES"] == f"{rank['nic']}:{ports[rank['nic']]}"
                assert env["TOPOAGENT_LEASE"] == lease["id"] and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"

            # A one-task job: its task gets both GPUs in rank order, and the masks for an inner srun.
            shown = cluster.run("srun", "--gres=gpu:2", "-n", "1", "sh", "-c", "env; curl -s " + agent.url + "/leases").stdout
            env = dict(line.split("=", 1) for line in shown.splitlines() if re.match(r"^[A-Z_]+=", line))
            held = json.loads(shown.splitlines()[-1])["leases"]
            (second,) = [lease for lease in held if lease["owner"] == f"slurm-job-{env['SLURM_JOB_ID']}"]
            assert env["TOPOAGENT_GPUS"] == ",".join(map(str, second["gpus"])) == env["CUDA_VISIBLE_DEVICES"]
            assert env["TOPOAGENT_CPU_BIND"].startswith("mask_cpu:") and env["TOPOAGENT_CPU_BIND"].count(",") == 1
            wait_for("the second lease released", lambda: leases_of(agent, second["owner"]) == [], timeout=60, log=diagnose)
    finally:
        agent.stop()


def test_a_job_whose_gpus_are_leased_to_someone_else_does_not_run(tmp_path):
    """The prolog's exit 1: slurmd drains the node and the job never starts its tasks."""
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    gres = render_gres(topology)
    agent_dir = tmp_path / "agent_files"
    agent_dir.mkdir()
    agent = start_agent(agent_dir)
    try:
        reply = agent.post("/place", {"gpus": 8, "reserve": {"owner": "inference-svc", "ttl_s": 600}}, token=agent.token)
        assert reply.status == 200
        conf = write_wrappers(tmp_path / "scripts", agent.url, agent_dir / "token", tmp_path / "jobs")
        node = SlurmNode("dgx-a100", hardware=DGX_A100_HARDWARE, hwloc_synthetic=synthetic_cpus(topology, DGX_A100_SOCKETS),
                         gres="gpu:nvidia_a100-sxm4-40gb:8", devices=gres_device_files(gres))
        with SlurmCluster(tmp_path / "slurm", [node], gres_conf=gres, extra_conf=conf) as cluster:
            ran = tmp_path / "ran"
            done = cluster.run("srun", "--gres=gpu:2", "touch", str(ran), check=False, timeout=120)
            assert done.returncode != 0 and "Prolog failure" in done.stderr and not ran.exists(), done.stderr
            # slurmd logs the prolog's one line and drains the node until an admin looks
            assert "leased to inference-svc" in cluster.log("slurmd")
            assert cluster.node_state("dgx-a100") in ("drained", "draining")
            assert [lease["owner"] for lease in agent.get("/leases").json()["leases"]] == ["inference-svc"]
    finally:
        agent.stop()


def test_a_task_prolog_that_cannot_place_says_why_in_the_tasks_output(tmp_path):
    """Slurm ends a task whose TaskProlog fails and drops the prolog's stderr: the reason goes
    to the task's output as a `print` line of the protocol."""
    step = {"SLURM_JOB_ID": "12", "SLURM_STEP_GPUS": "0", "CUDA_VISIBLE_DEVICES": "0"}
    done = slurm_verb("task-prolog", f"http://127.0.0.1:{_closed_port()}", tmp_path, step, "--timeout", "1")
    assert done.returncode == 1
    (line,) = done.stdout.splitlines()
    assert line.startswith("print topoagent slurm task-prolog: agent unreachable: ") and line[len("print "):] == done.stderr.strip()



def test_a_batch_jobs_script_is_bound_and_cancelling_it_releases_its_lease(tmp_path):
    """The batch script runs as the job's one task (the task prolog runs for it too); scancel
    ends it (no task of it exits on its own) and its epilog still releases the lease."""
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    gres = render_gres(topology)
    agent_dir = tmp_path / "agent_files"
    agent_dir.mkdir()
    agent = start_agent(agent_dir)
    try:
        conf = write_wrappers(tmp_path / "scripts", agent.url, agent_dir / "token", tmp_path / "jobs")
        node = SlurmNode("dgx-a100", hardware=DGX_A100_HARDWARE, hwloc_synthetic=synthetic_cpus(topology, DGX_A100_SOCKETS),
                         gres="gpu:nvidia_a100-sxm4-40gb:8", devices=gres_device_files(gres))
        with SlurmCluster(tmp_path / "slurm", [node], gres_conf=gres, extra_conf=conf) as cluster:
            diagnose = lambda: cluster.log("slurmctld")[-2000:] + cluster.log("slurmd")[-2000:]  # noqa: E731
            told = tmp_path / "batch.env"
            # exec: a child of the killed script would be orphaned to the harness's slurmd, PID 1 of its
            # namespace, which reaps no one; its zombie would keep the job COMPLETING and the epilog unrun.
            job = cluster.run("sbatch", "--parsable", "--gres=gpu:2", "--output=/dev/null", "--wrap", f"env > {told}.part; mv {told}.part {told}; exec sleep 600").stdout.strip()
            owner = f"slurm-job-{job}"
            (lease,) = wait_for(f"job {job}'s lease", lambda: leases_of(agent, owner), timeout=60, log=diagnose)
            # The batch script is the job's one task on the node: both GPUs in rank order, and a mask per rank for its srun.
            env = read_env(wait_for("the batch script's environment", told.exists, timeout=60, log=diagnose) and told)
            assert env["TOPOAGENT_GPUS"] == ",".join(map(str, lease["gpus"])) == env["CUDA_VISIBLE_DEVICES"], env
            assert re.fullmatch(r"mask_cpu:0x[0-9a-f]+,0x[0-9a-f]+", env["TOPOAGENT_CPU_BIND"]) and env["TOPOAGENT_LEASE"] == lease["id"]
            cluster.run("scancel", job)
            wait_for(f"job {job}'s lease released after scancel", lambda: leases_of(agent, owner) == [], timeout=60, log=diagnose)
            assert cluster.wait_job(job) == "CANCELLED"
    finally:
        agent.stop()


def test_a_requeued_job_holds_only_its_new_gpus_until_its_end(agent, tmp_path):
    """The same job id allocated again (requeue) after a prolog whose epilog never ran."""
    assert slurm_verb("prolog", agent.url, tmp_path, {"SLURM_JOB_ID": "30", "SLURM_JOB_GPUS": "0,1"}).returncode == 0
    end = int(time.time()) + 3600
    again = slurm_verb("prolog", agent.url, tmp_path, {"SLURM_JOB_ID": "30", "SLURM_JOB_GPUS": "1,2", "SLURM_JOB_END_TIME": str(end)})
    assert again.returncode == 0, again.stderr
    (lease,) = leases_of(agent, "slurm-job-30")
    assert sorted(lease["gpus"]) == [1, 2]
    assert end + 600 - 30 <= lease["expires_at"] <= end + 600 + 30  # the job's end and the grace, not --ttl's 7 days
