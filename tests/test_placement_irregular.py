"""Small irregular NVLink meshes, answered by the branch and bound: the same answers as the
search gave before its ring checks were made incremental (#38), and the optimum brute force
finds.  Each mesh is generated deterministically (placement.synthetic.irregular_mesh), each
request drawn from a seeded stream; tests/data/record_irregular_answers.py recorded the
answers at the commit named in the file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_placement_exact import check_answer

import topoagent.placement.ksets as ksets
from topoagent.placement import Placement, Request, place
from topoagent.placement.synthetic import irregular_mesh

RECORDED = json.loads((Path(__file__).resolve().parent / "data" / "placement_answers_irregular.json").read_text())
MESHES = RECORDED["meshes"]


@pytest.fixture
def branch_and_bound(monkeypatch):
    """No table of every k-set: these nodes are small enough for one, and the branch and
    bound is what is judged."""
    monkeypatch.setattr(ksets, "SMALL_TABLE_SETS", 0)


@pytest.mark.parametrize("mesh", MESHES, ids=[f"{m['gpus']}-gpus-seed-{m['seed']}-p-{m['p']}" for m in MESHES])
def test_irregular_meshes_answer_as_before_and_as_brute_force(branch_and_bound, mesh):
    matrix = irregular_mesh(mesh["gpus"], seed=mesh["seed"], p=mesh["p"], socket_size=mesh["socket_size"])
    cache: dict = {}
    for busy, pattern, k, before in mesh["answers"]:
        req = Request(gpus=k, pattern=pattern)
        answer = place(matrix, req, busy)
        got = list(answer.indices) if isinstance(answer, Placement) else None
        assert got == before, (pattern, k, busy)  # the same GPUs, in the same ring or path order
        check_answer(matrix, req, busy, answer, cache)  # and the optimum of every term


def test_the_recorded_requests_reach_the_ring_checks():
    """The file is no set of easy cases: most ask for rings or paths of 4 or more GPUs, and
    every one has an answer to compare."""
    rows = [row for mesh in MESHES for row in mesh["answers"]]
    assert len(rows) == 50
    assert all(before is not None for *_, before in rows)
    assert sum(k >= 4 for _, _, k, _ in rows) >= 30
