"""A deadline on every search: where the exact search cannot finish in time the answer
still comes, valid and marked not proven; where it finishes, nothing changes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from topoagent.agent_schema import answer_document
from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.matrix import DistanceMatrix
from topoagent.placement import NoFit, Placement, Request, place
from topoagent.placement.search import prepare, warm
from topoagent.placement.synthetic import irregular_mesh, nvswitch_16
from topoagent.vocabulary import Pattern

HERE = Path(__file__).resolve().parent
CORPUS = HERE.parents[0].parent / "shared" / "corpus" / "nvidia-smi-topo"
# Answers of place() before deadlines existed, one row per (busy, pattern, k) and corpus file.
BEFORE = json.loads((HERE / "data" / "placement_answers_before_deadlines.json").read_text())

MESH = irregular_mesh(128)  # no symmetry to exploit: the exact search takes far longer than 1 ms


def assert_valid(matrix: DistanceMatrix, request: Request, busy: list[int], answer: Placement) -> None:
    """Every GPU free, k distinct ones, include and exclude met."""
    assert len(set(answer.indices)) == request.gpus
    assert set(answer.indices) <= {g.index for g in matrix.gpus}
    assert not set(answer.indices) & set(busy)
    assert set(request.include) <= set(answer.indices)
    assert not set(request.exclude) & set(answer.indices)


@pytest.mark.parametrize("pattern", [Pattern.ALLREDUCE, Pattern.PIPELINE, Pattern.ALLTOALL])
def test_adversarial_mesh_answers_by_the_deadline_with_a_valid_set_marked_not_proven(pattern):
    busy = list(range(0, 128, 5))
    request = Request(gpus=32, pattern=pattern, include=(1, 2), exclude=(3, 4), deadline_ms=1)
    answer = place(MESH, request, busy)
    assert isinstance(answer, Placement)
    assert_valid(MESH, request, busy, answer)
    assert answer.proven_optimal is False
    # The bound holds the answer's own bandwidth: no set beats it, this one included.
    assert answer.bandwidth_bound_gbps is not None
    assert answer.bandwidth_gbps is not None and answer.bandwidth_gbps <= answer.bandwidth_bound_gbps
    assert answer.explain[0].startswith("not proven optimal: the search stopped at the 1 ms deadline_ms")
    assert f"bandwidth <= {answer.bandwidth_bound_gbps:g} GB/s" in answer.explain[0]
    assert not any("does better" in line for line in answer.explain)  # no claim of the best
    doc = answer_document(answer)
    assert doc["proven_optimal"] is False and doc["bandwidth_bound_gbps"] == answer.bandwidth_bound_gbps
    assert doc["request"]["deadline_ms"] == 1


def test_a_deadline_answer_is_as_good_as_the_first_best_fit_set_at_least():
    """Not proven is not arbitrary: the set spans as few sockets as a best-fit set."""
    answer = place(MESH, Request(gpus=8, deadline_ms=1))
    assert isinstance(answer, Placement)
    assert len(answer.numa_nodes) == 1  # a socket of the mesh holds 8 GPUs


def test_the_same_request_with_time_to_finish_is_proven():
    node = nvswitch_16()
    answer = place(node, Request(gpus=6, deadline_ms=60_000), busy=[0, 9])
    assert isinstance(answer, Placement)
    assert answer.proven_optimal is True and answer.bandwidth_bound_gbps is None
    assert not answer.explain[0].startswith("not proven")
    assert answer.indices == place(node, Request(gpus=6), busy=[0, 9]).indices


def corpus(name: str) -> DistanceMatrix:
    return DistanceMatrix.from_topo_matrix(parse_topo_matrix((CORPUS / name).read_text()))


@pytest.mark.parametrize("name", sorted(BEFORE))
def test_every_recorded_answer_is_proven_and_the_same_as_before(name):
    matrix = corpus(name)
    for busy, pattern, k, before in BEFORE[name]:
        answer = place(matrix, Request(gpus=k, pattern=pattern, deadline_ms=60_000), busy)
        got = list(answer.indices) if isinstance(answer, Placement) else None
        assert got == before, (busy, pattern, k)
        if isinstance(answer, Placement):
            assert answer.proven_optimal, (busy, pattern, k)
        else:
            assert isinstance(answer, NoFit) and answer.constraint != "deadline_ms"


def test_warm_builds_the_tables_requests_read():
    """After warm(), a request reads the matrix's tables instead of building them."""
    node = nvswitch_16()
    prep = warm(node)
    assert prepare(node, None) is prep
    for pattern in Pattern:
        assert prep.small_table_if_built(pattern, 1) is not None
        assert prep.small_table_if_built(pattern, 15) is not None
