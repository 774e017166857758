"""bench.placement_versus judges each answer two revisions differ on: worse or better on
the objective's terms (1)-(6) -- one side was not optimal -- or a tie there that the
tie-break settled differently (placement.objective, term 7)."""

from __future__ import annotations

import argparse

import pytest

from bench.placement_versus import differing_class, mesh_asks, sizes_arg
from topoagent.placement import synthetic
from topoagent.placement.objective import evaluate_partner_loss


def pairs_node():
    """Six GPUs on one socket: NV2 pairs (0, 1) and (2, 3), an NV1 pair (4, 5), PIX between."""
    n = 6
    levels = [["X" if i == j else "PIX" for j in range(n)] for i in range(n)]
    for (a, b), level in {(0, 1): "NV2", (2, 3): "NV2", (4, 5): "NV1"}.items():
        levels[a][b] = levels[b][a] = level
    return synthetic.build(levels, [0] * n, ["0-15"] * n, [])


def test_partner_loss_counts_the_best_links_a_set_takes_from_the_gpus_left_free():
    node = pairs_node()
    assert evaluate_partner_loss(node, [], [0, 1]) == 0  # a whole pair leaves every other pair whole
    split_nv2 = evaluate_partner_loss(node, [], [0])  # GPU 1 falls from NV2 to PIX
    split_nv1 = evaluate_partner_loss(node, [], [4])  # GPU 5 falls from NV1 to PIX
    assert split_nv2 > split_nv1 > 0
    assert evaluate_partner_loss(node, [1], [0]) == 0  # GPU 1 is busy: nobody left free loses


def chain_node():
    """Four GPUs on one socket, NV2 links 0-1-2-3 and NV1 3-0: one zone at every level, so
    taking any one GPU damages alike; only GPU 0 loses its NV2 partner when GPU 1 goes."""
    levels = [["X" if i == j else "NODE" for j in range(4)] for i in range(4)]
    for (a, b), level in {(0, 1): "NV2", (1, 2): "NV2", (2, 3): "NV2", (3, 0): "NV1"}.items():
        levels[a][b] = levels[b][a] = level
    return synthetic.build(levels, [0] * 4, ["0-15"] * 4, [])


def test_a_set_equal_on_terms_1_to_6_is_a_tie_judged_by_partner_loss():
    node = chain_node()
    assert evaluate_partner_loss(node, [], [0]) == 0 < evaluate_partner_loss(node, [], [1])
    assert differing_class(node, 1, [], [1], [1]) == "tie, same partner loss"
    assert differing_class(node, 1, [], [1], [0]) == "tie, partner loss lower"
    assert differing_class(node, 1, [], [0], [1]) == "tie, partner loss higher"
    assert differing_class(node, 1, [], [0], [3]) == "tie, same partner loss"
    assert differing_class(pairs_node(), 2, [], [0, 1], [2, 3]) == "tie, same partner loss"


def test_a_set_worse_on_an_earlier_term_is_reported_as_such_whatever_its_partner_loss():
    node = pairs_node()
    assert differing_class(node, 2, [], [0, 1], [4, 5]) == "worse on (1)-(6)"  # NV1 below NV2
    assert differing_class(node, 2, [], [4, 5], [0, 1]) == "better on (1)-(6)"
    assert differing_class(node, 2, [], [0, 1], [0, 2]) == "worse on (1)-(6)"  # PIX


def test_damage_alone_separates_two_sets_of_one_bandwidth():
    # Two sockets of four: taking from the socket with one GPU busy damages less.
    n = 8
    levels = [["X" if i == j else ("NODE" if i // 4 == j // 4 else "SYS") for j in range(n)] for i in range(n)]
    node = synthetic.build(levels, [i // 4 for i in range(n)], ["0-7" if i < 4 else "8-15" for i in range(n)], [])
    assert differing_class(node, 1, [0], [1], [4]) == "worse on (1)-(6)"
    assert differing_class(node, 1, [0], [4], [1]) == "better on (1)-(6)"


def test_the_mesh_study_draws_the_same_requests_every_time():
    asks = mesh_asks(64, 100)
    assert asks == mesh_asks(64, 100)
    assert {k for k, _ in asks} == {1, 2, 4, 8, 16, 32}
    assert all(len(set(busy)) == len(busy) <= 64 - k for k, busy in asks)


def test_sizes_are_gpu_counts_separated_by_commas():
    assert sizes_arg("32,64,128") == (32, 64, 128)
    assert sizes_arg("8") == (8,)
    assert all(k <= 8 for k, _ in mesh_asks(8, 200))  # the least size: every request fits it
    for bad in ("", "32,,64", "sixty-four", "1", "4", "32,7"):  # below 8 the study's requests could not fit
        with pytest.raises(argparse.ArgumentTypeError):
            sizes_arg(bad)
