"""`topoagent export gres` read by real Slurm (Debian's 22.05): slurmd parses every recorded
node's gres.conf, and a slurmctld + slurmd pair on loopback gives jobs the recorded DGX
A100's GPUs.  The node's /dev/nvidia* are faked in slurmd's private /dev and its CPUs are the
recorded node's, through hwloc's synthetic topology (tests/slurm_cluster.py says how)."""

from __future__ import annotations

import os
import re
import subprocess
import xml.etree.ElementTree as ET
from collections import Counter

import pytest
from conftest import FIXTURES, WITHOUT_GPU_STACK
from hwloc_oracle import LSTOPO, parse_hwloc_cpuset
from slurm_cluster import SlurmCluster, SlurmNode, gres_device_files
from test_export_gres_nfd import gpu_close_to_every_core

from topoagent.commands.discover import discover_root
from topoagent.exporters.gres import render_gres
from topoagent.node.model import NodeTopology

SNAPSHOTS = FIXTURES / "snapshots"
ALL = sorted(p.name for p in SNAPSHOTS.iterdir())

# The DGX A100: two AMD EPYC 7742 sockets in NPS4 mode, four NUMA nodes (16 cores each) per
# socket; the recording's NUMA distances (12 within a socket, 32 across) say the same.
DGX_A100_SOCKETS = 2
DGX_A100_HARDWARE = "CPUs=256 Sockets=2 CoresPerSocket=64 ThreadsPerCore=2"


def synthetic_cpus(topology: NodeTopology, packages: int = 1) -> str:
    """hwloc's synthetic description of the recorded node's CPUs as the export reads them:
    each NUMA node a run of whole cores, two threads per core, thread c + N/2 the sibling
    of CPU c (Linux's x86 numbering).  Checked against the recording with lstopo below."""
    assert topology.cpu is not None and topology.cpu.core_map is not None
    nodes = len(topology.numa.nodes)
    cores = len(topology.cpu.core_map.all_cores)
    threads = len(topology.cpu.core_map.core_of) // cores
    assert nodes % packages == 0 and cores % nodes == 0
    # indexes=STRIDE*COUNT:...: PU P# go core by core first, then thread by thread
    return f"pack:{packages} numa:{nodes // packages} core:{cores // nodes} pu:{threads}(indexes={threads}*{cores}:1*{threads})"


def lstopo_cpus(synthetic: str) -> tuple[dict[int, frozenset[int]], dict[int, int]]:
    """NUMA node -> CPUs and CPU -> Core L#, as lstopo reads a synthetic description."""
    assert LSTOPO is not None, "lstopo-no-graphics not found: install Debian's hwloc-nox (scripts/test does)"
    done = subprocess.run([LSTOPO, "--of", "xml", "-"], env=dict(os.environ, HWLOC_SYNTHETIC=synthetic),
                          capture_output=True, text=True, timeout=60, check=True)
    objects = list(ET.fromstring(done.stdout).iter("object"))
    numa = {int(o.get("os_index", "-1")): parse_hwloc_cpuset(o.get("cpuset", "0x0")) for o in objects if o.get("type") == "NUMANode"}
    core_of = {}
    for index, core in enumerate(o for o in objects if o.get("type") == "Core"):
        for cpu in parse_hwloc_cpuset(core.get("cpuset", "0x0")):
            core_of[cpu] = index
    return numa, core_of


def gres_fields(text: str) -> list[dict[str, str]]:
    """gres.conf lines, or slurmd -G's "Gres ..." lines, as field -> value."""
    lines = []
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        if "Name=" in line:
            lines.append(dict(w.split("=", 1) for w in line[line.index("Name="):].split() if "=" in w))
    return lines


def slurm_gres(lines: list[dict[str, str]]) -> str:
    """slurm.conf's Gres= for these gres.conf lines: gpu:TYPE:COUNT per type."""
    return ",".join(f"gpu:{kind}:{n}" for kind, n in Counter(line["Type"] for line in lines).items())


@pytest.mark.parametrize("name", ALL)
def test_the_cpus_slurmd_is_shown_are_the_recorded_nodes(name):
    """The synthetic CPUs given to slurmd have the recording's NUMA nodes and the cores the
    export's Cores= count in, so slurmd judges the export against the recorded node."""
    topology = discover_root(str(SNAPSHOTS / name))
    numa, core_of = lstopo_cpus(synthetic_cpus(topology))
    assert numa == topology.numa.cpus_by_node()
    assert topology.cpu is not None and topology.cpu.core_map is not None
    assert core_of == topology.cpu.core_map.core_of


def test_the_dgx_a100s_numa_distances_say_two_sockets_of_four_nodes():
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    per_socket = len(topology.numa.nodes) // DGX_A100_SOCKETS
    for node in topology.numa.nodes:
        for other, distance in enumerate(node.distances):
            same_socket = node.id // per_socket == other // per_socket
            assert distance == (10 if other == node.id else 12 if same_socket else 32)


@pytest.mark.parametrize("name", [n for n in ALL if n not in WITHOUT_GPU_STACK])  # no gres.conf there
def test_slurmd_reads_every_line_of_each_recorded_nodes_gres_conf(tmp_path, name):
    topology = discover_root(str(SNAPSHOTS / name))
    text = render_gres(topology)
    wrote = gres_fields(text)
    node = SlurmNode(name, hwloc_synthetic=synthetic_cpus(topology), gres=slurm_gres(wrote), devices=gres_device_files(text))
    done = SlurmCluster(tmp_path, [node], gres_conf=text).slurmd_gres()
    said = done.stdout + done.stderr
    assert done.returncode == 0 and not re.search(r"error|fatal", said, re.I), said
    read = gres_fields(said)
    assert len(read) == len(topology.gpus), said
    for mine, theirs in zip(wrote, read):
        for field in ("Type", "File", "Cores", "Links"):
            assert theirs.get(field) == mine.get(field), (field, said)


def test_slurmd_takes_only_its_own_lines_from_a_gres_conf_shared_by_nodes(tmp_path):
    """`export gres --node-name` lines for many nodes in one file, as docs/slurm.md suggests."""
    dgx = discover_root(str(SNAPSHOTS / "dgx-a100"))
    text = render_gres(dgx, "dgx-a100") + render_gres(discover_root(str(SNAPSHOTS / "workstation-2gpu")), "ws01")
    node = SlurmNode("dgx-a100", hwloc_synthetic=synthetic_cpus(dgx, DGX_A100_SOCKETS),
                     gres="gpu:nvidia_a100-sxm4-40gb:8", devices=gres_device_files(text)[:8])
    done = SlurmCluster(tmp_path, [node], gres_conf=text).slurmd_gres()
    said = done.stdout + done.stderr
    assert done.returncode == 0 and "error" not in said, said
    assert [line["File"] for line in gres_fields(said)] == [f"/dev/nvidia{i}" for i in range(8)]


def test_slurmctld_takes_a_node_with_one_gpu_close_to_every_core_without_complaint(tmp_path):
    """A GPU local to all CPUs (NUMA node -1) beside GPUs that name their cores: slurmctld
    logs "has CPUs configured for only some of the records" unless all name cores."""
    topology = gpu_close_to_every_core("pcie-2socket", 7)
    text = render_gres(topology)
    node = SlurmNode("pcie", hwloc_synthetic=synthetic_cpus(topology, 2), gres=slurm_gres(gres_fields(text)),
                     devices=gres_device_files(text))
    with SlurmCluster(tmp_path, [node], gres_conf=text) as cluster:
        shown = cluster.run("srun", "--gres=gpu:1", "--gres-flags=enforce-binding", "sh", "-c", "scontrol show job -d $SLURM_JOB_ID").stdout
        log = cluster.log("slurmctld")
    assert re.search(r"GRES=gpu:tesla_v100-pcie-16gb:1\(IDX:\d\)", shown), shown
    # gres/gpu: the node's registration; (enforce-binding jobs get a "gres_min_cpus ... is
    # greater than avail_cpus" error from Slurm 22.05 whatever the gres.conf)
    assert not [line for line in log.splitlines() if "error" in line and "gres/gpu" in line], log


def dgx_a100_cluster(directory, gres_conf: str | None = None) -> tuple[SlurmCluster, list[dict[str, str]]]:
    """The recorded DGX A100 as a Slurm node; its gres.conf the export's unless given."""
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    text = render_gres(topology)
    node = SlurmNode("dgx-a100", hardware=DGX_A100_HARDWARE, hwloc_synthetic=synthetic_cpus(topology, DGX_A100_SOCKETS),
                     gres="gpu:nvidia_a100-sxm4-40gb:8", devices=gres_device_files(text))
    return SlurmCluster(directory, [node], gres_conf=gres_conf or text), gres_fields(text)


@pytest.fixture
def dgx_a100(tmp_path):
    cluster, conf = dgx_a100_cluster(tmp_path)
    with cluster:
        yield cluster, conf


def job_env(output: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def test_srun_gets_two_of_the_exported_gpus(dgx_a100):
    cluster, _ = dgx_a100
    node = cluster.run("scontrol", "show", "node", "dgx-a100").stdout
    assert "State=IDLE" in node and "Gres=gpu:nvidia_a100-sxm4-40gb:8" in node and "CPUTot=256" in node, node
    env = job_env(cluster.run("srun", "--gres=gpu:2", "env").stdout)
    gpus = env["CUDA_VISIBLE_DEVICES"].split(",")
    assert len(set(gpus)) == 2 and set(gpus) <= {str(i) for i in range(8)}, env
    assert env["SLURM_STEP_GPUS"] == env["CUDA_VISIBLE_DEVICES"] and env["SLURM_GPUS_ON_NODE"] == "2"


def test_a_batch_job_is_told_its_gpus_by_type(dgx_a100, tmp_path):
    cluster, _ = dgx_a100
    out = tmp_path / "job.env"
    job = cluster.run("sbatch", "--parsable", "--gres=gpu:nvidia_a100-sxm4-40gb:2", f"--output={out}", "--wrap", "env").stdout.strip()
    assert cluster.wait_job(job) == "COMPLETED"
    env = job_env(out.read_text())
    assert len(env["SLURM_JOB_GPUS"].split(",")) == 2 and env["CUDA_VISIBLE_DEVICES"] == env["SLURM_JOB_GPUS"], env


def bound_job_beside_socket0s_gpus(cluster: SlurmCluster, conf: list[dict[str, str]]) -> str:
    """With socket 0's four GPUs held, what a job binding to its 2 GPUs is given (empty
    when its GPUs and CPUs are of socket 1, else what it got)."""
    socket0 = [str(i) for i, line in enumerate(conf) if max(int(c) for c in re.split(r"[-,]", line["Cores"])) < 64]
    assert socket0 == ["0", "1", "2", "3"]
    held = cluster.run("salloc", "--no-shell", "--gres=gpu:4", "--gres-flags=enforce-binding")
    holder = re.search(r"Granted job allocation (\d+)", held.stderr)
    assert holder, held.stderr
    shown = cluster.run("srun", "--gres=gpu:2", "--gres-flags=enforce-binding", "-c", "2",
                        "sh", "-c", "echo GPUS=$SLURM_STEP_GPUS; scontrol show job -d $SLURM_JOB_ID; scontrol show job -d " + holder.group(1)).stdout
    cluster.run("scancel", holder.group(1))
    (our_cpus, our_gpus), (_, their_gpus) = re.findall(r"CPU_IDs=(\S+) .*IDX:([-\d,]+)\)", shown)
    assert their_gpus == "0-3" and set(job_env(shown)["GPUS"].split(",")).isdisjoint(socket0), shown
    # Slurm's CPU ids: 2 per core, socket 1 = cores 64-127
    on_socket1 = our_gpus in ("4-5", "6-7") and all(int(c) >= 128 for c in re.split(r"[-,]", our_cpus))
    return "" if on_socket1 else f"GPUs {our_gpus}, CPUs {our_cpus}"


def test_enforce_binding_puts_a_jobs_cpus_on_the_socket_of_its_gpus(dgx_a100):
    """Cores= at work: with socket 0's GPUs taken, a job binding to its GPUs gets GPUs and
    CPUs of socket 1."""
    assert bound_job_beside_socket0s_gpus(*dgx_a100) == ""


def test_a_new_gres_conf_binds_once_slurmd_then_slurmctld_restart(tmp_path):
    """docs/slurm.md's steps on a node whose gres.conf had no Cores=.  Slurm 22.05 takes new
    Cores= only when slurmctld restarts after slurmd has read them (the other order, or
    scontrol reconfigure alone, leaves jobs unbound: tried by hand)."""
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    unbound = re.sub(r" Cores=\S+", "", render_gres(topology))
    cluster, conf = dgx_a100_cluster(tmp_path, unbound)
    with cluster:
        (cluster.etc / "gres.conf").write_text(render_gres(topology))
        cluster.restart("slurmd")
        cluster.restart("slurmctld")
        assert bound_job_beside_socket0s_gpus(cluster, conf) == ""


def test_the_harness_hands_slurmctld_a_topology_conf(tmp_path):
    """The cluster writer (fabric work) checks its topology.conf with this harness."""
    topology = "SwitchName=leaf1 Nodes=gpu[01-02]\nSwitchName=leaf2 Nodes=gpu[03-04]\nSwitchName=spine Switches=leaf[1-2]\n"
    with SlurmCluster(tmp_path, [SlurmNode("gpu[01-04]", slurmd=False)], topology_conf=topology) as cluster:
        shown = cluster.run("scontrol", "show", "topology").stdout
    switches = {m["name"]: m for m in re.finditer(r"SwitchName=(?P<name>\S+) Level=(?P<level>\d) .*?(?:Switches=(?P<switches>\S+) )?Nodes=(?P<nodes>\S+)", shown)}
    assert {name: (m["level"], m["nodes"]) for name, m in switches.items()} == {
        "leaf1": ("0", "gpu[01-02]"), "leaf2": ("0", "gpu[03-04]"), "spine": ("1", "gpu[01-04]")}, shown
