"""Issue 11 items 2, 3, 8 as a user checks them on recorded nodes: one binding per rank
(CPUs, memory node, NIC) and its launcher forms, healthy NICs, affinity tiers,
topology satisfaction and the all-reduce estimate."""

from __future__ import annotations

import itertools
import json
import os
import re
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from topoagent.commands.discover import discover_root
from topoagent.node.cpulist import parse_cpulist
from topoagent.node.levels import LevelKind
from topoagent.node.matrix import SAME_SOCKET_DISTANCE
from topoagent.node.model import NodeTopology
from topoagent.placement import NoFit, Placement, Request, place
from topoagent.vocabulary import Affinity

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "fixtures" / "snapshots"
FIXTURES = sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir())


@cache
def node(name: str) -> NodeTopology:
    return discover_root(str(SNAPSHOTS / name))


def placed(name: str, **request) -> Placement:
    busy = request.pop("busy", ())
    answer = place(node(name).distance_matrix(), Request(**request), busy)
    assert isinstance(answer, Placement), answer
    return answer


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "place", *args], input=stdin,
                          capture_output=True, text=True, timeout=60, cwd=REPO)


# --- NICs -----------------------------------------------------------------------------------


def test_eight_gpus_on_a_dgx_a100_get_all_eight_compute_hcas():
    out = cli("--gpus", "8", "--root", str(SNAPSHOTS / "dgx-a100"), "--json", "--detail", "bindings")
    answer = json.loads(out.stdout)
    compute = [f"mlx5_{i}" for i in range(8)]  # mlx5_8/9 are the storage ports, on no GPU's switch
    assert sorted(answer["env"]["NCCL_IB_HCA"].removeprefix("=").split(",")) == compute
    rank_nics = [g["nic"] for g in answer["gpus"]]
    assert sorted(rank_nics) == compute  # one HCA per rank, none shared
    for g in answer["gpus"]:
        assert g["nic"] in g["nearest_nics"] and g["nic_level"] == "PXB"


@pytest.mark.parametrize("name", FIXTURES)
def test_the_hca_list_names_exactly_the_nics_the_ranks_use(name):
    matrix = node(name).distance_matrix()
    for k in sorted({1, 2, matrix.size // 2, matrix.size} & set(range(1, matrix.size + 1))):
        answer = placed(name, gpus=k)
        used = {g.nic for g in answer.gpus if g.nic}
        hcas = answer.env.get("NCCL_IB_HCA", "=").removeprefix("=")
        assert set(filter(None, hcas.split(","))) == used
        assert set(answer.nics) == used


def test_a_nic_whose_port_is_down_is_never_chosen_nor_listed():
    topo = node("degraded")
    down = [n.device for n in topo.nics if n.active is False]
    assert down == ["mlx5_6"]  # the fixture's premise
    answer = placed("degraded", gpus=1, nics=1, include=[6])
    assert answer.nics != ("mlx5_6",) and answer.gpus[0].nic != "mlx5_6"
    assert answer.gpus[0].nic in {"mlx5_4", "mlx5_5", "mlx5_7"}  # the active ones as close (NODE)
    for k in range(1, 9):
        for pattern in ("allreduce", "independent"):
            answer = placed("degraded", gpus=k, pattern=pattern, nics=min(k, 7))
            listed = {*answer.nics, *answer.env.get("NCCL_IB_HCA", "").split(","),
                      *(n for g in answer.gpus for n in (g.nic, *g.nearest_nics))}
            assert "mlx5_6" not in listed and "=mlx5_6" not in listed
    refused = place(topo.distance_matrix(), Request(gpus=1, nics=8))
    assert isinstance(refused, NoFit) and refused.constraint == "nics"  # 7 NICs have a port up


def test_equally_close_nics_go_to_the_faster_one():
    from dataclasses import replace

    matrix = node("workstation-2gpu").distance_matrix()  # two NICs, both NODE to both GPUs
    slower = replace(matrix, nics=(replace(matrix.nics[0], rate_gbps=100.0), matrix.nics[1]))
    answer = place(slower, Request(gpus=1))
    assert isinstance(answer, Placement)
    assert answer.gpus[0].nic == matrix.nics[1].device  # 200 Gb/s beats 100 at the same distance


# --- CPUs and memory --------------------------------------------------------------------------


@pytest.mark.parametrize("name", FIXTURES)
def test_rank_cpu_lists_never_overlap_and_keep_siblings_together(name):
    topo = node(name)
    assert topo.cpu is not None and topo.cpu.core_map is not None
    core_of = topo.cpu.core_map.core_of
    numa_cpus = {n.id: n.cpus for n in topo.numa.nodes}
    size = len(topo.gpus)
    for k in sorted({1, 2, 3, size // 2, size - 1, size} & set(range(1, size + 1))):
        answer = placed(name, gpus=k)
        seen: set[int] = set()
        for g in answer.gpus:
            cpus = parse_cpulist(g.cpus)
            assert cpus and not cpus & seen, (k, g)
            seen |= cpus
            assert cpus <= numa_cpus[g.numa_node] and g.memory_node == g.numa_node
            siblings = {c for c in numa_cpus[g.numa_node] if core_of[c] in {core_of[x] for x in cpus}}
            assert siblings == cpus  # a core's threads are all in this rank's list
            assert g.numactl == ("numactl", f"--physcpubind={g.cpus}", f"--membind={g.numa_node}")
        # Together the ranks of a NUMA node use all of its CPUs.
        for numa in {g.numa_node for g in answer.gpus}:
            assert numa_cpus[numa] <= seen


def test_ranks_on_one_numa_node_split_its_cores_evenly():
    answer = placed("pcie-2socket", gpus=4, busy=[4, 5, 6, 7])
    assert [g.cpus for g in answer.gpus] == ["0-1,16-17", "2-3,18-19", "4-5,20-21", "6-7,22-23"]


# --- launcher forms ---------------------------------------------------------------------------


def test_slurm_forms_parse_as_srun_reads_them():
    answer = placed("dgx-a100", gpus=4, busy=[2, 3])
    assert answer.launch is not None
    options = dict(opt.split("=", 1) for opt in answer.launch.srun)
    assert options["--ntasks-per-node"] == "4"
    kind, _, masks = options["--cpu-bind"].partition(":")
    assert kind == "mask_cpu"
    for g, mask in zip(answer.gpus, masks.split(",")):
        value = int(mask, 16)  # srun(1): hexadecimal, 0x allowed
        assert {c for c in range(value.bit_length()) if value >> c & 1} == parse_cpulist(g.cpus)
    kind, _, gpus = options["--gpu-bind"].partition(":")
    assert kind == "map_gpu" and [int(i) for i in gpus.split(",")] == list(answer.indices)
    kind, _, cpus = answer.launch.srun_map_cpu.removeprefix("--cpu-bind=").partition(":")
    assert kind == "map_cpu"
    assert all(int(c) in parse_cpulist(g.cpus) for g, c in zip(answer.gpus, cpus.split(",")))


def test_open_mpi_rankfile_names_each_ranks_logical_cores():
    topo = node("dgx-a100")
    core_of = topo.cpu.core_map.core_of
    answer = placed("dgx-a100", gpus=8)
    lines = answer.launch.rankfile.splitlines()
    assert len(lines) == 8
    for line, g in zip(lines, answer.gpus):
        match = re.fullmatch(r"rank (\d+)=(\S+) slot=([0-9,-]+)", line)
        assert match and int(match[1]) == g.rank
        assert parse_cpulist(match[3]) == {core_of[c] for c in parse_cpulist(g.cpus)}


def test_torchrun_wrapper_runs_each_local_rank_under_its_own_numactl(tmp_path):
    answer = placed("dgx-a100", gpus=4, busy=[2, 3])
    wrapper = tmp_path / "bind.sh"
    wrapper.write_text(answer.launch.torchrun_wrapper)
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "numactl").write_text('#!/bin/sh\necho "$@"\n')
    (fake / "numactl").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}"}
    for g in answer.gpus:
        out = subprocess.run(["sh", str(wrapper), "python", "train.py"], env={**env, "LOCAL_RANK": str(g.rank)},
                             capture_output=True, text=True, timeout=10)
        assert out.returncode == 0
        assert out.stdout.split() == [*g.numactl[1:], "python", "train.py"]
    out = subprocess.run(["sh", str(wrapper), "true"], env={**env, "LOCAL_RANK": "4"}, capture_output=True, text=True, timeout=10)
    assert out.returncode == 1 and "LOCAL_RANK=4" in out.stderr


def test_nvidia_smi_text_alone_gives_no_rankfile_and_never_splits_a_gpus_cpus():
    corpus = REPO.parent / "shared" / "corpus" / "nvidia-smi-topo"
    path = next(corpus.glob("sglang-24966-8xH20*"))
    out = cli("--gpus", "4", "--from-nvidia-smi", str(path), "--json", "--detail", "bindings,launch")
    answer = json.loads(out.stdout)
    assert answer["launch"]["rankfile"] is None  # slots are core indices: no core map, no rankfile
    assert {g["cpus"] for g in answer["gpus"]} == {"0-47,96-143"}


H20_TEXT = REPO / "fixtures" / "nvidia-smi" / "hgx-h20-8gpu-8nic.txt"


@pytest.mark.parametrize("k", [2, 4, 8])
def test_nvidia_smi_text_gives_each_rank_its_gpus_whole_cpu_list(k):
    """Which CPUs are one core's hyperthreads is unknown from nvidia-smi text: splitting
    0-47,96-143 into 0-47 and 96-143 put two ranks on the two threads of every core."""
    from topoagent.commands.sources import matrix_and_left_out
    from topoagent.placement import Door

    matrix, _ = matrix_and_left_out(str(H20_TEXT))
    answer = place(matrix, Request(gpus=k))
    assert isinstance(answer, Placement)
    for g in answer.gpus:
        assert g.cpus == matrix.gpus[g.index].cpus  # the GPU's own list, whole
    assert answer.launch.srun_map_cpu is None  # one CPU per task would be the same CPU for all
    said = [line for line in answer.explain if "whole CPU list" in line]
    assert said and "core map" in said[0] and "a discovered node" in said[0]
    cli_words = [r.render(Door.CLI) for r in answer.reasons if "whole CPU list" in r.render(Door.CLI)]
    assert "--root" in cli_words[0]


def test_recorded_node_still_splits_by_cores_with_siblings_together():
    answer = placed("degraded", gpus=4)
    assert [g.cpus for g in answer.gpus] == ["0-11,96-107", "12-23,108-119", "24-35,120-131", "36-47,132-143"]
    assert not any("whole CPU list" in line for line in answer.explain)
    assert answer.launch.srun_map_cpu == "--cpu-bind=map_cpu:0,12,24,36"


# --- tiers ----------------------------------------------------------------------------------


def sockets(topo: NodeTopology) -> dict[int, frozenset[int]]:
    """NUMA node -> the NUMA nodes of its socket, by the SLIT table (closer than 20)."""
    nodes = {n.id: n for n in topo.numa.nodes}
    ids = sorted(nodes)
    return {a: frozenset(b for b, d in zip(ids, nodes[a].distances) if d < SAME_SOCKET_DISTANCE) for a in ids}


def oracle_tier(topo: NodeTopology, gpus: tuple[int, ...], ring: list[tuple[int, int]]) -> Affinity:
    """The seed's tiers, from the definitions, for these GPUs joined by ``ring``."""
    level = {(a.index, b.index): topo.level(a.name, b.name) for a in topo.gpus for b in topo.gpus}
    numa = {g.index: g.numa_node for g in topo.gpus}
    best = min(level[a, b] for a, b in level if a != b)
    socket_of = sockets(topo)
    links = [level[a, b] for a, b in ring]
    if len({socket_of[numa[g]] for g in gpus}) > 1 or any(lv.kind >= LevelKind.SYS for lv in links):
        return Affinity.ANY
    if len({numa[g] for g in gpus}) == 1 and all(lv == best for lv in links):
        return Affinity.BEST
    return Affinity.BETTER


def best_tier_any_ring(topo: NodeTopology, gpus: tuple[int, ...]) -> Affinity:
    order = list(Affinity)
    first, rest = gpus[0], gpus[1:]
    tiers = []
    for perm in itertools.permutations(rest):
        cycle = (first, *perm)
        ring = list(itertools.pairwise(cycle)) + ([(cycle[-1], first)] if len(cycle) >= 3 else [])
        tiers.append(oracle_tier(topo, gpus, ring))
    return min(tiers, key=order.index)


@pytest.mark.parametrize("name", ["dgx-a100", "pcie-2socket", "hgx-h100", "dgx1-v100", "degraded"])
def test_a_tier_fits_exactly_when_some_free_set_meets_it(name):
    topo = node(name)
    matrix = topo.distance_matrix()
    indices = [g.index for g in topo.gpus]
    order = list(Affinity)
    for busy in ((), (0,), (2, 3)):
        free = [i for i in indices if i not in busy]
        for k in (2, 3, 4):
            reachable = min((best_tier_any_ring(topo, s) for s in itertools.combinations(free, k)), key=order.index)
            for tier in (Affinity.BEST, Affinity.BETTER):
                answer = place(matrix, Request(gpus=k, affinity=tier), busy)
                meets = order.index(reachable) <= order.index(tier)
                assert answer.fit == meets, (name, busy, k, tier, reachable)
                if answer.fit:
                    ring = [(link.a_index, link.b_index) for link in answer.links]
                    assert order.index(oracle_tier(topo, answer.indices, ring)) <= order.index(tier)
                    assert order.index(answer.affinity) <= order.index(tier)
                else:
                    assert answer.constraint == "affinity" and answer.best_available is not None


def test_better_keeps_four_gpus_on_one_socket_of_a_dgx_a100():
    answer = placed("dgx-a100", gpus=4, busy=[2, 3], affinity="better")
    assert answer.indices == (4, 5, 6, 7) and answer.affinity is Affinity.BETTER
    assert set(answer.numa_nodes) == {5, 7}  # SLIT distance 12: one socket


def test_fallback_answers_the_best_lower_tier_and_says_so():
    # No NUMA node of a DGX A100 holds 4 GPUs: best cannot hold, better can.
    refused = place(node("dgx-a100").distance_matrix(), Request(gpus=4, affinity="best"))
    assert isinstance(refused, NoFit) and refused.constraint == "affinity"
    assert "affinity best" in refused.reason and refused.best_available is not None
    answer = placed("dgx-a100", gpus=4, affinity="best", fallback=True)
    assert answer.affinity is Affinity.BETTER
    assert any("answered at tier better" in line for line in answer.explain)
    text = cli("--gpus", "4", "--root", str(SNAPSHOTS / "dgx-a100"), "--affinity", "best", "--fallback").stdout
    assert "affinity: better" in text and "--affinity best" in text


# --- satisfaction and estimate ----------------------------------------------------------------


def test_satisfaction_counts_nvlink_and_one_switch_links_as_local():
    assert placed("dgx-a100", gpus=8).satisfaction == 1.0  # NV12 everywhere
    across = placed("pcie-2socket", gpus=8)
    levels = sorted(str(link.level) for link in across.links)
    assert levels == ["PIX"] * 6 + ["SYS"] * 2  # two switches of four, one per socket
    assert across.satisfaction == 0.75
    assert placed("pcie-2socket", gpus=1).satisfaction == 1.0  # no links: nothing is far


def test_estimate_follows_nccls_ring_model():
    answer = placed("dgx-a100", gpus=8, message_bytes=1 << 30)
    e = answer.estimate
    # 8.4 us base + 14 steps x 3.4 us (NVLink) + 1 GiB at 300 GB/s x 8/14 algorithm bandwidth
    expected = 8.4 + 14 * 3.4 + (1 << 30) / (1000 * 300 * 8 / 14)
    assert e.model == "ring_allreduce" and e.message_bytes == 1 << 30 and e.hop_latency_us == e.latency_us == 3.4
    assert e.time_us == pytest.approx(expected, abs=0.01)
    assert e.bus_bandwidth_gbps == pytest.approx((1 << 30) * 14 / 8 / (1000 * expected), abs=0.01)
    assert placed("dgx-a100", gpus=1).estimate is None


def test_alltoall_estimate_times_each_ranks_sends_to_every_peer():
    """Issue 27 item 5: alltoall printed the ring all-reduce's figures."""
    matrix = node("pcie-2socket").distance_matrix()
    answer = placed("pcie-2socket", gpus=8, pattern="alltoall", message_bytes=1 << 22)
    e = answer.estimate
    assert e.model == "alltoall" and e.message_bytes == 1 << 22 and e.ring_gbps is None
    pos = {g.index: p for p, g in enumerate(matrix.gpus)}
    gbps = {frozenset((ln.a_index, ln.b_index)): ln.gbps for ln in answer.links}  # every pair, as the answer rates it

    def send_us(a: int, b: int) -> float:
        return matrix.latency_us(pos[a], pos[b]) + (1 << 22) / (1000 * gbps[frozenset((a, b))])

    expected = max(sum(send_us(a, b) for b in answer.indices if b != a) for a in answer.indices)
    assert e.time_us == pytest.approx(expected, rel=1e-3)
    assert e.link_gbps == min(gbps.values())
    assert e.bus_bandwidth_gbps == pytest.approx(7 * (1 << 22) / (1000 * expected), rel=1e-3)


def test_pipeline_estimate_is_the_slowest_stage_and_independent_has_none():
    matrix = node("pcie-2socket").distance_matrix()
    answer = placed("pcie-2socket", gpus=8, pattern="pipeline")
    e = answer.estimate
    pos = {g.index: p for p, g in enumerate(matrix.gpus)}
    stage_us = [matrix.latency_us(pos[ln.a_index], pos[ln.b_index]) + (1 << 20) / (1000 * ln.gbps) for ln in answer.links]
    assert e.model == "pipeline_p2p" and e.message_bytes == 1 << 20  # one message, the latency-bound default
    assert e.time_us == pytest.approx(max(stage_us), rel=1e-3)
    assert e.bus_bandwidth_gbps == pytest.approx((1 << 20) / (1000 * max(stage_us)), rel=1e-3)
    assert placed("pcie-2socket", gpus=8, pattern="independent").estimate is None


def test_each_pattern_prints_its_own_model_and_follows_the_message_size():
    said = {}
    for pattern in ("allreduce", "alltoall", "pipeline", "independent"):
        out = cli("--gpus", "4", "--pattern", pattern, "--root", str(SNAPSHOTS / "hgx-h100"))
        assert out.returncode == 0, out.stderr
        said[pattern] = [line for line in out.stdout.splitlines() if line.startswith("estimate: ")]
    assert said["allreduce"][0].startswith("estimate: ring all-reduce of 268435456 bytes: ")
    assert said["alltoall"][0].startswith("estimate: all-to-all, one message of 1048576 bytes to each peer: ")
    assert said["pipeline"][0].startswith("estimate: pipeline point-to-point, one message of 1048576 bytes per stage: ")
    assert said["independent"] == []
    small, large = (placed("hgx-h100", gpus=4, pattern="alltoall", message_bytes=size).estimate for size in (1 << 16, 1 << 24))
    assert small.message_bytes == 1 << 16 and large.message_bytes == 1 << 24 and large.time_us > small.time_us


def test_batch_compares_four_local_gpus_with_eight_across_sockets():
    lines = "\n".join(json.dumps(r) for r in (
        {"gpus": 4, "affinity": "best", "message_bytes": 1 << 26, "detail": ["explain"]},
        {"gpus": 8, "message_bytes": 1 << 26, "detail": ["explain"]},
    )) + "\n"
    out = cli("--batch", "--root", str(SNAPSHOTS / "pcie-2socket"), stdin=lines)
    local, across = (json.loads(line) for line in out.stdout.splitlines())
    assert local["affinity"] == "best" and local["satisfaction"] == 1.0
    assert across["affinity"] == "any" and across["satisfaction"] < 1.0
    assert local["estimate"]["message_bytes"] == across["estimate"]["message_bytes"] == 1 << 26
    assert local["estimate"]["bus_bandwidth_gbps"] > across["estimate"]["bus_bandwidth_gbps"]
