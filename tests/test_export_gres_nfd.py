"""gres.conf read back against the topology; NFD labels against Kubernetes' label syntax;
the CPU core map against lstopo's Core L# on real hwloc recordings."""

from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from dataclasses import replace

import pytest
from conftest import FIXTURES, SHARED, WITHOUT_GPU_STACK
from hwloc_oracle import parse_hwloc_cpuset, run_lstopo

from topoagent.collectors.cpu import SYSFS, assume_core_map, read_core_map
from topoagent.commands.discover import discover_root
from topoagent.exporters.gres import bus_order, render_gres
from topoagent.exporters.nfd import LABEL_NAME, LABEL_PREFIX, LABEL_VALUE, gpu_product, nfd_features, render_nfd
from topoagent.node.cpulist import format_cpulist, parse_cpulist
from topoagent.node.host import Host

SNAPSHOTS = FIXTURES / "snapshots"
ALL = sorted(p.name for p in SNAPSHOTS.iterdir())


def read_gres(text: str) -> list[dict[str, str]]:
    lines = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            lines.append(dict(field.split("=", 1) for field in line.split()))
    return lines


def expand(ranges: str) -> set[int]:
    return set(parse_cpulist(ranges))


@pytest.mark.parametrize("name", [n for n in ALL if n not in WITHOUT_GPU_STACK])  # no gres.conf there
def test_gres_lines_read_back_to_the_topology(name):
    topology = discover_root(str(SNAPSHOTS / name))
    with Host(str(SNAPSHOTS / name)) as host:
        cores = read_core_map(host, topology.numa)
    assert topology.cpu is not None and topology.cpu.core_map == cores  # discovery's cpu collector
    lines = read_gres(render_gres(topology))
    ordered = bus_order(topology.gpus)
    assert len(lines) == len(ordered)
    for k, (line, gpu) in enumerate(zip(lines, ordered)):
        assert line["Name"] == "gpu" and line["File"] == f"/dev/nvidia{gpu.index}"
        assert " " not in line["Type"] and line["Type"] == line["Type"].lower()
        if len(ordered) > 1:
            links = [int(v) for v in line["Links"].split(",")]
            assert links[k] == -1 and len(links) == len(ordered)
            for j, peer in enumerate(ordered):
                if j != k:
                    level = topology.level(gpu.name, peer.name)
                    assert links[j] == (level.nvlinks if level.is_nvlink else 0)
        if "Cores" in line:
            threads = {c for c, core in cores.core_of.items() if core in expand(line["Cores"])}
            assert threads == set(parse_cpulist(gpu.cpus))  # cores cover exactly the GPU's CPUs


def test_dgx_a100_gres_binds_each_gpu_pair_to_its_numa_nodes_cores():
    topology = discover_root(str(SNAPSHOTS / "dgx-a100"))
    assert topology.cpu is not None and topology.cpu.core_map == assume_core_map(topology.numa)
    text = render_gres(topology)
    lines = read_gres(text)
    # GPU0/1 sit on NUMA 3 (CPUs 48-63,176-191 = cores 48-63 with SMT-2 on 128 cores)
    assert lines[0]["Cores"] == "48-63" and lines[1]["Cores"] == "48-63"
    assert lines[0]["Links"] == "-1,12,12,12,12,12,12,12"
    assert "assume SMT-2" in text  # the assumption is said, not hidden


def gpu_close_to_every_core(name: str, index: int):
    """A recorded node whose GPU ``index`` is local to all CPUs (as with NUMA node -1)."""
    topology = discover_root(str(SNAPSHOTS / name))
    gpus = list(topology.gpus)
    gpus[index] = replace(gpus[index], cpus=format_cpulist(topology.numa.all_cpus), numa_node=None)
    return replace(topology, gpus=tuple(gpus))


def test_a_gpu_close_to_every_core_names_them_all_when_its_peers_name_theirs():
    """Slurm wants Cores= on all of a node's GPUs or none (tests/test_slurm.py asks slurmctld)."""
    lines = read_gres(render_gres(gpu_close_to_every_core("pcie-2socket", 7)))
    assert [l["Cores"] for l in lines] == ["0-7"] * 4 + ["8-15"] * 3 + ["0-15"]
    # one NUMA node: every GPU is close to every core, and none names them
    lines = read_gres(render_gres(gpu_close_to_every_core("workstation-2gpu", 1)))
    assert all("Cores" not in l for l in lines)


def test_dgx1_hybrid_cube_mesh_links_are_asymmetric_and_symmetric_across_the_diagonal():
    lines = read_gres(render_gres(replace(discover_root(str(SNAPSHOTS / "dgx1-v100")), cpu=None)))
    matrix = [[int(v) for v in l["Links"].split(",")] for l in lines]
    assert all(matrix[i][j] == matrix[j][i] for i in range(8) for j in range(8))
    assert {v for row in matrix for v in row} == {-1, 0, 1, 2}
    assert all("Cores" not in l for l in lines)  # no CPU facts passed: no Cores= guessed


@pytest.mark.parametrize("recording", ["32intel64-2p8co2t+8ve", "16amd64-8n2c"])
def test_core_map_numbers_cores_as_lstopo_does(recording):
    """Slurm's Cores= are lstopo's logical core indices; check ours against lstopo itself."""
    with Host(str(SHARED / "hwloc" / "linux" / f"{recording}.tar.bz2")) as host:
        cores = read_core_map(host, None)
        xml = run_lstopo(str(host.root))
    assert cores is not None and cores.source == SYSFS
    lstopo = {}
    for index, core in enumerate(o for o in ET.fromstring(xml).iter("object") if o.get("type") == "Core"):
        for cpu in parse_hwloc_cpuset(core.get("cpuset")):
            lstopo[cpu] = index
    assert cores.core_of == lstopo
    if recording.startswith("32intel64"):  # 2 threads per core: 32 CPUs, 16 cores
        assert len(set(cores.core_of.values())) == 16


@pytest.mark.parametrize("name", ALL)
def test_nfd_features_are_valid_kubernetes_labels(name):
    text = render_nfd(discover_root(str(SNAPSHOTS / name)))
    pairs = [line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")]
    assert pairs
    for key, value in pairs:
        prefix, _, label = key.partition("/")
        assert prefix == "topoagent.io" and LABEL_PREFIX.match(prefix)
        assert len(label) <= 63 and LABEL_NAME.match(label), key
        assert len(value) <= 63 and LABEL_VALUE.match(value), (key, value)


def features(name: str) -> dict[str, str]:
    text = render_nfd(discover_root(str(SNAPSHOTS / name)))
    return dict(line.removeprefix("topoagent.io/").split("=", 1)
                for line in text.splitlines() if line and not line.startswith("#"))


def test_nfd_values_say_what_each_machine_is():
    dgx2, a100, ws, bad = features("dgx2"), features("dgx-a100"), features("workstation-2gpu"), features("degraded")
    assert dgx2["gpu.count"] == "16" and dgx2["nvswitch"] == "true" and dgx2["nvlink.zone-size"] == "16"
    assert dgx2["gpu.model"].startswith("Tesla-V100")
    assert a100["gpu.per-numa-node"] == "2" and a100["ib.rate-gbps"] == "200" and a100["nic.per-gpu-permille"] == "1000"
    # gpu-feature-discovery's nvidia.com/gpu.product value for the same GPU: one nodeSelector fits both.
    assert a100["gpu.model"] == "NVIDIA-A100-SXM4-40GB"
    assert ws["nvswitch"] == "false" and ws["nvlink.zone-size"] == "0"
    assert bad["findings"] == "3" and bad["findings.warnings"] == "3"  # x8 link, NVLink down, IB port down
    assert bad["ib.active-ports"] == "7"


# The labels a nodeAffinity Gt/Lt may compare: Kubernetes parses both sides as integers.
NOT_NUMBERS = {"gpu.model", "nvswitch", "health"}  # health: the kind of the finding that blocks placement


@pytest.mark.parametrize("name", ALL)
def test_every_nfd_label_but_the_model_and_a_flag_is_an_integer_gt_and_lt_can_compare(name):
    for key, value in features(name).items():
        if key not in NOT_NUMBERS:
            assert re.fullmatch(r"0|[1-9][0-9]*", value), (key, value)


def test_uneven_gpus_per_numa_node_give_the_fewest_and_the_most():
    node = discover_root(str(SNAPSHOTS / "pcie-2socket"))  # 4 + 4 GPUs; move one across
    moved = (replace(node.gpus[0], numa_node=1), *node.gpus[1:])
    labels = nfd_features(replace(node, gpus=moved), "t.io")
    assert (labels["t.io/gpu.per-numa-node"], labels["t.io/gpu.per-numa-node.max"]) == ("3", "5")


def test_gpu_product_spells_a_model_as_gpu_feature_discovery_does():
    assert gpu_product("NVIDIA H100 80GB HBM3") == "NVIDIA-H100-80GB-HBM3"
    assert gpu_product("Tesla V100-SXM2-32GB") == "Tesla-V100-SXM2-32GB"
    assert gpu_product("NVIDIA RTX A6000 (rev 2)") == "NVIDIA-RTX-A6000-rev-2"  # not a label value as GFD has it


def test_cli_exports_to_a_file_and_refuses_bad_input(tmp_path):
    out = tmp_path / "gres.conf"
    run = [sys.executable, "-P", "-m", "topoagent"]
    done = subprocess.run([*run, "export", "gres", "--root", str(SNAPSHOTS / "dgx2"), "-o", str(out)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert len(read_gres(out.read_text())) == 16
    bad = subprocess.run([*run, "export", "nfd", "--root", str(SNAPSHOTS / "dgx2"), "--prefix", "Bad_Prefix!"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "prefix" in bad.stderr
    missing = subprocess.run([*run, "export", "nccl-xml", "--root", str(tmp_path / "nope")],
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
