"""place(): the anchor counterexamples, constraints, NoFit reasons, and what a job launches with."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.documents.agent import answer_document
from topoagent.node.matrix import DistanceMatrix, GpuInfo
from topoagent.placement import NoFit, Placement, Request, RequestError, place
from topoagent.placement.synthetic import node_32, nvswitch_16, pcie_two_socket_8

REPO = Path(__file__).resolve().parents[1]

CORPUS = REPO.parent / "shared" / "corpus" / "nvidia-smi-topo"


def corpus(name: str) -> DistanceMatrix:
    path = next(CORPUS.glob(name + "*"))
    return DistanceMatrix.from_topo_matrix(parse_topo_matrix(path.read_text()))


DGX1 = corpus("dlperf-8xV100-SXM2-hybridcubemesh")
H20 = corpus("sglang-24966-8xH20")
ASUS = corpus("asus-esc8000a")


def test_dgx1_two_free_nvlinks_beat_one_where_pair_scoring_does_not():
    busy = [3, 4, 5, 7]  # free: 0, 1, 2, 6
    answer = place(DGX1, Request(gpus=2), busy)
    assert set(answer.indices) == {1, 2}
    assert str(answer.worst_level) == "NV2" and answer.bandwidth_gbps == 50.0


def test_pcie_two_socket_box_stays_on_one_socket_where_pair_scoring_crosses():
    box = pcie_two_socket_8()
    busy = [5, 6, 7]  # free: 0..4; socket 0 holds 0-3
    answer = place(box, Request(gpus=3), busy)
    assert set(answer.indices) <= {0, 1, 2, 3}
    assert answer.numa_nodes == (0,)


def test_ring_order_puts_neighbours_on_the_fastest_links():
    answer = place(DGX1, Request(gpus=8))
    # The DGX-1 hybrid cube mesh has an all-NV2 ring through all eight GPUs.
    assert answer.bandwidth_gbps == 50.0
    assert all(str(link.level) == "NV2" for link in answer.links)
    assert answer.env["CUDA_VISIBLE_DEVICES"] == ",".join(str(i) for i in answer.indices)


def test_single_gpu_comes_from_the_most_used_zone():
    answer = place(H20, Request(gpus=1), busy=[0, 1, 2])
    assert answer.indices == (3,)  # socket 0 has one GPU left; socket 1 stays whole
    assert answer.broken_zones == ()


def test_four_gpus_take_a_whole_socket_and_leave_the_other_whole():
    answer = place(H20, Request(gpus=4), busy=[1])
    assert set(answer.indices) == {4, 5, 6, 7}
    assert answer.numa_nodes == (1,)
    assert answer.cpus == "48-95,144-191"
    assert answer.numactl == ("numactl", "--cpunodebind=1", "--membind=1")


def test_nics_closest_to_the_gpus_go_into_nccl_ib_hca():
    answer = place(H20, Request(gpus=2, nics=2), busy=[0])
    assert isinstance(answer, Placement)
    by_gpu = {g.index: g.nearest_nics for g in answer.gpus}
    # NIC0..7 are mlx5_1..mlx5_8 in the legend; each GPU has one PIX NIC.
    assert all(len(nics) == 1 and nics[0].startswith("mlx5_") for nics in by_gpu.values())
    assert set(answer.nics) == {by_gpu[i][0] for i in answer.indices}
    assert answer.env["NCCL_IB_HCA"] == "=" + ",".join(answer.nics)


def test_alltoall_weakest_pair_and_pipeline_path():
    alltoall = place(DGX1, Request(gpus=4, pattern="alltoall"))
    assert set(alltoall.indices) in ({0, 1, 2, 3}, {4, 5, 6, 7})
    assert alltoall.bandwidth_gbps == 25.0 and len(alltoall.links) == 6
    pipeline = place(DGX1, Request(gpus=3, pattern="pipeline"))
    assert pipeline.bandwidth_gbps == 50.0  # a path 0-3-2 over NV2 exists
    assert len(pipeline.links) == 2


def test_independent_jobs_ignore_links_but_not_sockets():
    answer = place(ASUS, Request(gpus=2, pattern="independent"), busy=[0])
    assert set(answer.indices) == {2, 3}  # GPU 1 alone on socket 0 cannot pair on-socket
    assert answer.bandwidth_gbps is None and answer.links == ()
    assert answer.objective.numa_nodes == 1


def test_include_and_exclude():
    answer = place(DGX1, Request(gpus=2, include=(6,)))
    assert 6 in answer.indices and answer.bandwidth_gbps == 50.0
    answer = place(DGX1, Request(gpus=4, exclude=(0, 1, 2, 3)))
    assert set(answer.indices) == {4, 5, 6, 7}


def test_not_enough_free_gpus():
    answer = place(ASUS, Request(gpus=3), busy=[0, 1])
    assert isinstance(answer, NoFit)
    assert answer.constraint == "gpus"
    assert "3 GPUs requested, 2 free" in answer.reason
    assert answer.free == (2, 3)


def test_min_level_that_cannot_hold_names_the_best_available():
    answer = place(ASUS, Request(gpus=2, min_level="NV"))
    assert isinstance(answer, NoFit)
    assert answer.constraint == "min_level"
    assert "within NV1" in answer.reason and "NODE" in answer.reason
    assert answer.best_available is not None and answer.best_available.numa_nodes in ((0,), (1,))


def test_single_numa_that_cannot_hold():
    answer = place(ASUS, Request(gpus=3, single_numa=True))
    assert isinstance(answer, NoFit) and answer.constraint == "single_numa"
    assert "no NUMA node has 3 free GPUs (most: 2" in answer.reason
    assert len(answer.best_available.indices) == 3


def test_more_nics_than_the_node_has():
    answer = place(ASUS, Request(gpus=2, nics=9))
    assert isinstance(answer, NoFit) and answer.constraint == "nics"
    assert answer.reason == "9 NICs requested, the node has 4"
    assert len(answer.best_available.nics) == 4


def test_included_gpu_busy():
    answer = place(ASUS, Request(gpus=2, include=(1,)), busy=[1])
    assert isinstance(answer, NoFit) and answer.constraint == "include"
    assert "GPU 1 is busy" in answer.reason


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"gpus": 0}, "gpus"),
        ({"gpus": "2"}, "gpus"),
        ({"gpus": True}, "gpus"),
        ({"gpus": 2, "pattern": "ring"}, "pattern"),
        ({"gpus": 2, "min_level": "FAST"}, "min_level"),
        ({"gpus": 2, "min_level": "X"}, "min_level"),
        ({"gpus": 2, "single_numa": "yes"}, "single_numa"),
        ({"gpus": 2, "include": [1, 1]}, "include"),
        ({"gpus": 1, "include": [1, 2]}, "include"),
        ({"gpus": 2, "include": [1], "exclude": [1]}, "include"),
        ({"gpus": 2, "exclude": ["a"]}, "exclude"),
        ({"gpus": 2, "nics": -1}, "nics"),
    ],
)
def test_bad_request_fields_are_named(kwargs, field):
    with pytest.raises(RequestError) as err:
        Request.from_json(kwargs)
    assert err.value.field == field


def test_unknown_request_field_and_unknown_gpu():
    with pytest.raises(RequestError) as err:
        Request.from_json({"gpus": 2, "gpu_count": 3})
    assert err.value.field == "gpu_count"
    with pytest.raises(RequestError) as err:
        place(ASUS, Request(gpus=1), busy=[7])
    assert err.value.field == "busy" and "GPU 7 is not on this node" in str(err.value)


def test_json_is_plain_and_carries_identity_from_discovery():
    gpus = tuple(
        GpuInfo(index=g.index, name=g.name, uuid=f"GPU-{g.index:04d}", pci_address=f"0000:{g.index + 7:02x}:00.0",
                numa_node=g.numa_node, cpus=g.cpus)
        for g in ASUS.gpus
    )
    from dataclasses import replace

    rich = replace(ASUS, gpus=gpus)
    answer = place(rich, Request(gpus=2), busy=[0])
    data = json.loads(json.dumps(answer_document(answer)))
    assert data["fit"] is True
    assert [g["uuid"] for g in data["gpus"]] == [f"GPU-{i:04d}" for i in answer.indices]
    assert data["gpus"][0]["pci_address"].startswith("0000:")
    nofit = place(rich, Request(gpus=5))
    assert json.loads(json.dumps(answer_document(nofit)))["fit"] is False


def test_pure_same_answer_every_time():
    first = place(DGX1, Request(gpus=3), busy=[2])
    again = place(DGX1, Request(gpus=3), busy=[2])
    assert first.indices == again.indices and first.explain == again.explain


def test_scores_compare_nodes():
    nvlink = place(H20, Request(gpus=4))
    pcie = place(pcie_two_socket_8(), Request(gpus=4))
    assert nvlink.score > pcie.score


def test_large_synthetic_nodes():
    answer = place(nvswitch_16(), Request(gpus=8, nics=4), busy=[0, 1])
    assert answer.numa_nodes == (1,) and answer.bandwidth_gbps == 150.0
    big = place(node_32(), Request(gpus=12), busy=[0])
    # 12 GPUs cannot stay inside one NV18 zone of 8: the ring crosses sockets at SYS.
    assert big.objective.numa_nodes == 2
    zone = place(node_32(), Request(gpus=8), busy=[0])
    assert zone.bandwidth_gbps == 450.0 and min(zone.indices) >= 8


def test_after_warm_up_a_request_on_an_8_gpu_node_builds_no_answer():
    """The agent warms a new matrix: every set of the small tables has its answer pieces
    (bindings, NICs, launch forms) built, so a request only looks them up."""
    from topoagent.placement import warm
    from topoagent.placement.answer import built_answer_parts
    from topoagent.placement.tables import prepare

    matrix = pcie_two_socket_8()
    warm(matrix, budget_s=600)  # the budget is wall time: a loaded machine must not cut the warm-up short here
    built = built_answer_parts(prepare(matrix, None))
    assert built
    for k, busy, nics in ((2, [0], 0), (4, [1, 6], 1), (3, [], 2)):
        answer = place(matrix, Request(gpus=k, nics=nics), busy)
        assert isinstance(answer, Placement)
        assert built_answer_parts(prepare(matrix, None)) == built  # nothing new was built
