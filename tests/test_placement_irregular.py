"""Small irregular NVLink meshes, answered by the branch and bound: the same answers as the
search gave before its ring checks were made incremental (#38), and the optimum brute force
finds.  Each mesh is generated deterministically (placement.synthetic.irregular_mesh), each
request drawn from a seeded stream; tests/data/record_irregular_answers.py recorded the
answers at the commit named in the file."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from test_placement_exact import check_answer

import topoagent.placement.ksets as ksets
from topoagent.placement import Placement, Request, place
from topoagent.placement.synthetic import irregular_mesh
from topoagent.placement.tables import bits
from topoagent.vocabulary import Pattern

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


def test_spans_cut_and_skip_only_what_holds_no_set_as_good(branch_and_bound, monkeypatch):
    """The bound per set of NUMA nodes (Search._spans_left) against brute force: on small
    meshes of several NUMA nodes, with and without NUMA distances, every branch it cuts
    has no completion as good as the limit it was cut against (better, where it need not
    keep equals), and every candidate it leaves out of the sets it keeps, which the
    branch then takes in no child, is in no such completion.  And every answer is still
    the optimum of every term."""
    from itertools import combinations

    from topoagent.placement import search
    from topoagent.placement.tables import bits
    from topoagent.vocabulary import Pattern

    seen = {"cut": 0, "skipped": 0, "checked": 0}
    spans_left = search.Search._spans_left

    def checked(self, taken, cand, rem, dmg, limit, strict, spans):
        kept = spans_left(self, taken, cand, rem, dmg, limit, strict, spans)
        if kept is None:
            return kept
        within = 0
        for groups, reach in kept:
            within |= reach[0] if reach is not None else self._groups_mask(groups)
        cycle = self.req.pattern is Pattern.ALLREDUCE
        for extra in combinations(list(bits(cand)), rem):
            mask = taken | sum(1 << v for v in extra)
            if any(self.allowed[v] & mask | 1 << v != mask for v in bits(mask)):
                continue
            if self.rings.ham(mask, self.r, cycle) is None:
                continue
            key = self.found(mask, (), self.r).key
            if key < limit or (strict and key == limit):
                assert mask & ~taken & ~within == 0, (taken, cand, rem, limit, kept, mask)
        seen["checked"] += 1
        seen["cut"] += not kept
        seen["skipped"] += bool(cand & ~within) and bool(kept)
        return kept

    monkeypatch.setattr(search.Search, "_spans_left", checked)
    rng = random.Random(38)
    for _ in range(40):
        n = rng.randint(8, 10)
        matrix = irregular_mesh(n, seed=rng.randrange(10**6), p=rng.choice((0.3, 0.45, 0.6)), socket_size=rng.choice((2, 3, 4)))
        k = rng.randint(3, n - 1)
        busy = rng.sample(range(n), rng.randint(0, n - k))
        req = Request(gpus=k, pattern=rng.choice(("allreduce", "allreduce", "pipeline")))
        check_answer(matrix, req, busy, place(matrix, req, busy), {})
    assert seen["cut"] >= 10 and seen["skipped"] >= 10, seen  # the bound was at work


def test_a_branch_handed_its_parents_spans_gets_what_it_would_work_out(branch_and_bound, monkeypatch):
    """A child that only leaves out classes outside every set of NUMA nodes its parent
    kept (one, or the run of them that follows, at once) takes the parent's list instead
    of working it out again (Search._branch's spans_for): each such child, made to work it
    out after all, gets the very list it was handed; and the answers are the optimum of
    every term."""
    from topoagent.placement import search

    branch, spans_left = search.Search._branch, search.Search._spans_left
    handed: list = []
    seen = {"compared": 0, "runs": 0}
    parents: list[int] = []  # the class each branch on the path was handed

    def recomputing(self, ci, taken, rem, cand, dmg, was=None, spans=None, spans_for=search._STALE):
        if spans_for is search._STALE or spans_for is not self.best:
            parents.append(ci)
            try:
                return branch(self, ci, taken, rem, cand, dmg, was, spans, spans_for)
            finally:
                parents.pop()
        if parents and was is not None:
            # Past classes after the one the parent branched on that held its candidates: a run.
            had = [i for i in range(parents[-1], ci) if self.classes[i][0] & was[0] & ~was[2]]
            seen["runs"] += len(had) > 1
        handed.append(spans)
        try:
            return branch(self, ci, taken, rem, cand, dmg, was, spans, search._STALE)
        finally:
            if handed and handed[-1] is spans:
                handed.pop()  # cut before its spans were worked out

    def compared(self, *args):
        got = spans_left(self, *args)
        if handed:
            assert got == handed.pop()
            seen["compared"] += 1
        return got

    monkeypatch.setattr(search.Search, "_branch", recomputing)
    monkeypatch.setattr(search.Search, "_spans_left", compared)
    place_small_meshes_checked()
    assert seen["compared"] >= 10 and seen["runs"] >= 1, seen  # the lists were handed down, past runs of classes


def place_small_meshes_checked(checked: bool = True) -> list[tuple[int, ...] | None]:
    """Forty requests on small irregular meshes (seeded), each answer checked against brute
    force (unless not ``checked``); their GPUs in order (None: no placement)."""
    rng = random.Random(381)
    answers = []
    for _ in range(40):
        n = rng.randint(9, 12)
        matrix = irregular_mesh(n, seed=rng.randrange(10**6), p=rng.choice((0.3, 0.45, 0.6)), socket_size=rng.choice((2, 3)))
        k = rng.randint(3, n - 2)
        busy = rng.sample(range(n), rng.randint(0, n - k))
        req = Request(gpus=k, pattern=rng.choice(("allreduce", "allreduce", "pipeline")))
        answer = place(matrix, req, busy)
        if checked:
            check_answer(matrix, req, busy, answer, {})
        answers.append(answer.indices if isinstance(answer, Placement) else None)
    return answers


def test_first_sets_from_better_groups_of_numa_nodes_change_no_answer(branch_and_bound, monkeypatch):
    """On large meshes (BETTER_UNION_GPUS_MIN), once a group of NUMA nodes yields a cheap
    first set, the groups where a better one may lie are tried too (Anytime._better_union).
    What it keeps is a real set -- k free GPUs whose order carries the ring or path at the
    threshold, scored as the search scores them -- better than the first, and it only
    lowers the exact search's cutoff: every answer is the one found without it, and the
    optimum of every term.  Run on small meshes of several NUMA nodes (the size limit
    lowered), where it often finds a better set."""
    from topoagent.placement import anytime

    better_union = anytime.Anytime._better_union
    seen = {"tried": 0, "better": 0}

    def checked(self, r, found, unions):
        got = better_union(self, r, found, unions)
        seen["tried"] += 1
        if got is not found:
            seen["better"] += 1
            assert got.key < found.key
            assert got.mask.bit_count() == self.k and not got.mask & ~(self.candidates | self.include)
            assert sorted(got.order) == sorted(bits(got.mask))
            assert got.key == self.bb.found(got.mask, got.order, r).key
            links = list(zip(got.order, got.order[1:]))
            if self.req.pattern is Pattern.ALLREDUCE:
                links.append((got.order[-1], got.order[0]))
            assert all(self.prep.rank[a][b] >= r for a, b in links), (got.order, r)
        return got

    monkeypatch.setattr(anytime, "BETTER_UNION_GPUS_MIN", 0)
    monkeypatch.setattr(anytime.Anytime, "_better_union", checked)
    answers = place_small_meshes_checked()
    assert seen["tried"] >= 10 and seen["better"] >= 3, seen
    monkeypatch.setattr(anytime, "BETTER_UNION_GPUS_MIN", 10**9)
    assert place_small_meshes_checked(checked=False) == answers


def test_a_ring_check_from_its_parents_gets_what_it_would_work_out_from_nothing(branch_and_bound, monkeypatch):
    """The ring check (Search._ring_completable) starts from what an earlier check left --
    the peel, the members checked and their links, the component -- and a branch's check
    of its members among themselves is kept per members taken (Search._lacks): every check
    that starts from an earlier one, worked out again from nothing with nothing kept, says
    the same (whether the branch is cut, the candidates, the GPUs forced, what it leaves);
    and the answers are the optimum of every term."""
    from topoagent.placement import search

    completable = search.Search._ring_completable
    seen = {"compared": 0, "cut": 0}

    def compared(self, taken, cand, rem, was, forcing=False):
        got = completable(self, taken, cand, rem, was, forcing)
        if was is not None:
            kept, self.lacks_kept = self.lacks_kept, {}
            try:
                assert got == completable(self, taken, cand, rem, None, forcing), (taken, cand, rem, was)
            finally:
                self.lacks_kept = kept
            seen["compared"] += 1
            seen["cut"] += got is None
        return got

    monkeypatch.setattr(search.Search, "_ring_completable", compared)
    place_small_meshes_checked()  # the draws of the test above (brute force of some draws takes seconds)
    assert seen["compared"] >= 400 and seen["cut"] >= 40, seen  # checks started from earlier ones, and cut
