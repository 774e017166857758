"""Leases hold GPUs by UUID: a re-numbering moves nothing, and a lease whose GPU left the
node holds no other GPU for it (it is listed as orphaned and keeps only the GPUs it still has)
instead of making every /place a 409."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from service_helpers import DGX_A100, metric_value

from topoagent.config import Config
from topoagent.exporters.prometheus import MetricsPage
from topoagent.node.discovery import discover
from topoagent.node.host import Host
from topoagent.node.model import NodeTopology
from topoagent.placement import NoFit, Request
from topoagent.service.agent import Agent
from topoagent.service.leases import LeaseConflict, LeaseError, LeaseStore


@pytest.fixture(scope="module")
def node() -> NodeTopology:
    with Host(str(DGX_A100)) as host:
        return asyncio.run(discover(host))


def without_gpu(node: NodeTopology, index: int) -> NodeTopology:
    """The node after a re-discovery lost GPU ``index`` (fell off the bus)."""
    name = f"GPU{index}"
    return replace(node, gpus=tuple(g for g in node.gpus if g.index != index),
                   pairs=tuple(p for p in node.pairs if name not in (p.a, p.b)))


def renumbered(node: NodeTopology, a: int, b: int) -> NodeTopology:
    """The same GPUs with the UUIDs of indices ``a`` and ``b`` swapped (a new enumeration order)."""
    uuid = {g.index: g.uuid for g in node.gpus}
    uuid[a], uuid[b] = uuid[b], uuid[a]
    return replace(node, gpus=tuple(replace(g, uuid=uuid[g.index]) for g in node.gpus))


def test_a_lease_names_its_gpus_by_uuid_and_follows_them_through_a_renumbering(tmp_path, node):
    store = LeaseStore(tmp_path)
    matrix = node.distance_matrix()
    answer = store.reserve_placement(matrix, Request(gpus=1, include=(7,)), "job", 600)
    assert not isinstance(answer, NoFit)
    lease, _ = answer
    assert lease.uuids == (node.gpus[7].uuid,)
    assert LeaseStore(tmp_path).leases()[0].uuids == lease.uuids  # persisted
    moved = renumbered(node, 0, 7).distance_matrix()  # the leased GPU is index 0 now
    again = store.reserve_placement(moved, Request(gpus=1, include=(0,)), "other", 600)
    assert isinstance(again, NoFit) and again.constraint == "include"  # still held
    free_seven = store.reserve_placement(moved, Request(gpus=1, include=(7,)), "other", 600)
    assert not isinstance(free_seven, NoFit)  # index 7 is another GPU now, and free


def test_a_lease_whose_gpu_left_the_node_blocks_nothing_and_is_listed_as_orphaned(tmp_path, node):
    lost = without_gpu(node, 7)
    answers = iter([node, lost])

    async def scripted(host: Host) -> NodeTopology:
        return next(answers)

    async def scenario() -> tuple[int, list[str], str, bool]:
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), interval_s=3600, udev=False), discover=scripted)
        await agent.start()
        try:
            async with asyncio.timeout(20):  # the first discovery, however long a loaded machine takes
                while agent.snapshot is None:
                    await asyncio.sleep(0.01)
            _, lease = await agent.reserve(Request(gpus=1, include=(7,)), "job-7", 600)
            assert lease is not None
            await agent.request_refresh("test")  # GPU 7 is gone
            dry = await agent.place(Request(gpus=7))
            _, reserved = await agent.reserve(Request(gpus=7), "job-all", 600)
            metrics = MetricsPage(agent).render().decode()
            return len(dry.indices), [l.id for l in agent.holding().orphaned], metrics, reserved is not None
        finally:
            await agent.stop()

    placed, orphaned, metrics, reserved = asyncio.run(scenario())
    assert placed == 7 and reserved  # every remaining GPU is free for dry runs and leases
    assert len(orphaned) == 1
    assert metric_value(metrics, "topoagent_leases_orphaned") == 1


@pytest.mark.parametrize("uuid", ["GPU-" + "a" * 200, "GPU-\x07bell", "GPU-a\u2028b"])
def test_a_gpu_whose_uuid_cannot_be_stored_is_never_leased_and_wipes_nothing(tmp_path, node, uuid):
    """Such a UUID used to be leased, then refused by the loader: the whole file was moved aside."""
    store = LeaseStore(tmp_path)
    victim = store.reserve_placement(node.distance_matrix(), Request(gpus=1, include=(0,)), "victim", 600)
    assert not isinstance(victim, NoFit)
    bad = replace(node, gpus=tuple(replace(g, uuid=uuid) if g.index == 3 else g for g in node.gpus))
    named = store.reserve_placement(bad.distance_matrix(), Request(gpus=1, include=(3,)), "job", 600)
    assert isinstance(named, NoFit)
    rest = store.reserve_placement(bad.distance_matrix(), Request(gpus=7), "job", 600)
    assert isinstance(rest, NoFit)  # 8 GPUs, one leased, one unleasable: 6 left
    six = store.reserve_placement(bad.distance_matrix(), Request(gpus=6), "job", 600)
    assert not isinstance(six, NoFit) and 3 not in six[0].gpus
    again = LeaseStore(tmp_path)
    assert again.recovered_from is None and again.quarantined == []
    assert {le.id for le in again.leases()} == {victim[0].id, six[0].id}


def test_a_reserve_naming_one_uuid_twice_is_refused_and_leaves_the_book_intact(tmp_path, node):
    """Two GPUs reporting one UUID: a lease of both named that UUID twice, was written, and
    the next read of the book quarantined it (the rule was the loader's alone)."""
    store = LeaseStore(tmp_path)
    victim = store.reserve_placement(node.distance_matrix(), Request(gpus=1, include=(4,)), "victim", 600)
    assert not isinstance(victim, NoFit)
    twin = replace(node, gpus=tuple(replace(g, uuid=node.gpus[0].uuid) if g.index == 1 else g for g in node.gpus))
    with pytest.raises(LeaseError, match="UUID is listed twice"):
        store.reserve_placement(twin.distance_matrix(), Request(gpus=2, include=(0, 1)), "job", 600)
    again = LeaseStore(tmp_path)
    assert again.recovered_from is None and again.quarantined == []
    assert [lease.id for lease in again.leases()] == [victim[0].id]


def test_a_reserve_by_index_of_a_gpu_leased_by_uuid_is_refused_where_that_gpu_sits_now(tmp_path, node):
    """One conflict check, by the rule leases hold GPUs by: the lease by UUID was granted at
    index 7; after a renumbering its GPU is index 0, which is refused, and 7 is free."""
    store = LeaseStore(tmp_path)
    held = store.reserve_placement(node.distance_matrix(), Request(gpus=1, include=(7,)), "job-a", 600)
    assert not isinstance(held, NoFit)
    store.gpus_now = {g.uuid: g.index for g in renumbered(node, 0, 7).gpus if g.uuid}
    with pytest.raises(LeaseConflict, match="GPU 0 is leased to job-a"):
        store.reserve("job-b", [0], 600)
    assert store.reserve("job-b", [7], 600).gpus == (7,)
    assert {lease.owner for lease in LeaseStore(tmp_path).leases()} == {"job-a", "job-b"}
