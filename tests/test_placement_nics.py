"""Issue 27 item 3: with ``nics`` asked, every rank gets a NIC that is right for *its* GPU,
and the answer prints that NIC's own level.

The oracle reads only the recorded node (levels, NUMA nodes, sockets, port states), never
the placement core's tables: on every recorded node, for every k and every N,

* no chosen NIC is strictly closer to a rank's GPU than the NIC the rank got;
* the level printed beside a rank's NIC is the matrix's level for (GPU, NIC);
* the chosen NICs put a NIC short of the socket link (below SYS) on as many of the ranks'
  sockets as N allows: min(N, the ranks' sockets that have such a NIC at all).
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

from topoagent.commands.discover import discover_root
from topoagent.documents.agent import answer_document
from topoagent.node.levels import LevelKind
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Placement, Request, place
from topoagent.vocabulary import Detail

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "fixtures" / "snapshots"
FIXTURES = sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir())


@cache
def matrix_of(name: str) -> DistanceMatrix:
    return discover_root(str(SNAPSHOTS / name)).distance_matrix()


def socket_of(matrix: DistanceMatrix, pos: int) -> tuple[str, int | None]:
    """A GPU's socket as the recorded node says it: the SLIT socket of its NUMA node, else the node."""
    numa = matrix.gpus[pos].numa_node
    host = matrix.host
    if host is not None and numa is not None and numa in host.socket_of:
        return ("socket", host.socket_of[numa])
    return ("numa", numa)


def cases() -> list[tuple[str, int, int]]:
    out = []
    for name in FIXTURES:
        matrix = matrix_of(name)
        usable = sum(1 for nic in matrix.nics if nic.active is not False) if matrix.gpu_nic_levels else 0
        out += [(name, k, n) for k in range(1, matrix.size + 1) for n in range(1, usable + 1)]
    return out


CASES = cases()


def test_the_oracle_covers_nodes_with_nics_on_both_sockets():
    # Without these the sweep below would check nothing that the issue found.
    assert {"dgx-a100", "hgx-h100"} <= {name for name, _, _ in CASES}


@pytest.mark.parametrize("name", sorted({name for name, _, _ in CASES}))
def test_every_rank_gets_a_nearest_chosen_nic_and_its_own_level(name):
    matrix = matrix_of(name)
    pos_of = {g.index: pos for pos, g in enumerate(matrix.gpus)}
    nic_pos = {(nic.device or nic.name): j for j, nic in enumerate(matrix.nics)}
    usable = [j for j, nic in enumerate(matrix.nics) if nic.active is not False]
    checked = 0
    for _, k, n in (c for c in CASES if c[0] == name):
        answer = place(matrix, Request(gpus=k, nics=n, detail=(Detail.BINDINGS,)))
        assert isinstance(answer, Placement), (k, n, answer)
        chosen = [nic_pos[x] for x in answer.nics]
        assert len(chosen) == n and len(set(chosen)) == n
        assert answer.env["NCCL_IB_HCA"] == "=" + ",".join(answer.nics)
        doc = answer_document(answer)
        for g, shown in zip(answer.gpus, doc["gpus"]):
            pos, got = pos_of[g.index], nic_pos[g.nic]
            levels = matrix.gpu_nic_levels[pos]
            assert got in chosen, (k, n, g)
            closer = [matrix.nics[j].device for j in chosen if levels[j].kind < levels[got].kind]
            assert not closer, f"{name} k={k} N={n}: rank {g.rank} (GPU{g.index}) got {g.nic} at {levels[got]}, {closer} closer"
            assert g.nic_level == levels[got] and shown["nic_level"] == str(levels[got])
            checked += 1
        ranks_sockets = {socket_of(matrix, pos_of[i]) for i in answer.indices}
        # A socket the ranks are on that some usable NIC serves short of SYS.
        coverable = {
            socket_of(matrix, pos_of[i]) for i in answer.indices
            if any(matrix.gpu_nic_levels[pos_of[i]][j].kind < LevelKind.SYS for j in usable)
        }
        covered = {
            socket_of(matrix, pos_of[i]) for i in answer.indices
            if any(matrix.gpu_nic_levels[pos_of[i]][j].kind < LevelKind.SYS for j in chosen)
        }
        assert covered <= ranks_sockets
        assert len(covered) == min(n, len(coverable)), f"{name} k={k} N={n}: {answer.nics} cover {covered} of {coverable}"
    assert checked


def test_dgx_a100_eight_gpus_four_nics_one_per_numa_pair_and_no_rank_across_sockets():
    """The issue's own case: ranks 4-7 were given mlx5_0..3 (SYS from them), printed PXB."""
    out = subprocess.run(
        [sys.executable, "-P", "-m", "topoagent", "place", "--gpus", "8", "--nics", "4", "--json", "--detail", "bindings",
         "--root", str(SNAPSHOTS / "dgx-a100")],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["env"]["NCCL_IB_HCA"] == "=mlx5_0,mlx5_2,mlx5_4,mlx5_6"
    assert {g["index"]: (g["nic"], g["nic_level"]) for g in answer["gpus"]} == {
        0: ("mlx5_0", "PXB"), 1: ("mlx5_0", "PXB"), 2: ("mlx5_2", "PXB"), 3: ("mlx5_2", "PXB"),
        4: ("mlx5_4", "PXB"), 5: ("mlx5_4", "PXB"), 6: ("mlx5_6", "PXB"), 7: ("mlx5_6", "PXB"),
    }
    assert all(g["nic"] in g["nearest_nics"] for g in answer["gpus"])


def test_one_nic_for_ranks_on_two_sockets_is_printed_at_its_real_distance():
    matrix = matrix_of("hgx-h100")
    answer = place(matrix, Request(gpus=8, nics=1))
    assert isinstance(answer, Placement)
    far = [g for g in answer.gpus if g.nic_level is not None and g.nic_level.kind is LevelKind.SYS]
    assert len(far) == 4  # one socket's ranks cross to the only NIC, and say so
