"""Placement on a live node (issue 11): NUMA distance, NIC health and rate, GPU health,
measured figures that cannot mislead, GPUs whose links are unknown."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from service_helpers import DGX_A100

from topoagent.cli import main
from topoagent.commands.discover import discover_root
from topoagent.config import Config
from topoagent.node.host import Host
from topoagent.node.levels import ACHIEVABLE_FRACTION
from topoagent.node.matrix import DistanceMatrix, Measurement
from topoagent.placement import Placement, Request, place
from topoagent.placement.synthetic import build
from topoagent.probes.figures import ProbeFigure, ProbeKind
from topoagent.probes.overlay import overlay
from topoagent.service.agent import Agent
from topoagent.vocabulary import Unit

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"


@pytest.fixture(scope="module")
def a100() -> DistanceMatrix:
    return discover_root(str(SNAPSHOTS / "dgx-a100")).distance_matrix()


@pytest.fixture(scope="module")
def h100() -> DistanceMatrix:
    return discover_root(str(SNAPSHOTS / "hgx-h100")).distance_matrix()


# --- 1. NUMA distance -------------------------------------------------------------------


def test_the_issues_dgx_a100_answer_stays_on_one_socket(capsys):
    """0,1,4,5 span NUMA 3 and 7 (SLIT 32, two sockets); 4,5,6,7 span 7 and 5 (12)."""
    argv = ["place", "--gpus", "4", "--busy", "2,3", "--root", str(SNAPSHOTS / "dgx-a100"), "--json"]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert sorted(g["index"] for g in doc["gpus"]) == [4, 5, 6, 7]
    assert doc["objective"]["numa_distance"] == 12
    assert doc["bandwidth_gbps"] == 300  # the same NV12 ring as before


def test_a_shorter_distance_beats_fewer_nodes():
    """Three NUMA nodes of one socket (distance 12) beat two nodes across sockets (32)."""
    numa = [0, 1, 2, 3, 3]
    m = build([["X" if i == j else "NODE" for j in range(5)] for i in range(5)], numa, ["0-7"] * 5, [])
    slit = {(a, b): 10 if a == b else (32 if 3 in (a, b) else 12) for a in range(4) for b in range(4)}
    m = replace(m, numa_distances=slit)
    answer = place(m, Request(gpus=3, pattern="independent"))
    assert isinstance(answer, Placement)
    assert sorted(answer.indices) == [0, 1, 2]
    assert (answer.objective.numa_distance, answer.objective.numa_nodes) == (12, 3)


def test_without_a_slit_table_nodes_are_counted():
    """An nvidia-smi matrix alone has no distances: the term is None, node counts decide."""
    m = build(
        [["X", "PIX", "SYS"], ["PIX", "X", "SYS"], ["SYS", "SYS", "X"]],
        [0, 0, 1],
        ["0-7", "0-7", "8-15"],
        [],
    )
    answer = place(m, Request(gpus=2))
    assert isinstance(answer, Placement)
    assert answer.objective.numa_distance is None and sorted(answer.indices) == [0, 1]


# --- 3. NICs: healthy and fast ------------------------------------------------------------


def test_a_nic_with_no_active_port_is_never_chosen_nor_listed(capsys):
    root = str(SNAPSHOTS / "degraded")
    assert main(["place", "--gpus", "1", "--nics", "1", "--include", "6", "--root", root, "--json", "--detail", "bindings"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["nics"] and "mlx5_6" not in doc["nics"]
    assert all("mlx5_6" not in g["nearest_nics"] for g in doc["gpus"])
    assert main(["place", "--gpus", "8", "--root", root, "--json", "--detail", "bindings"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all("mlx5_6" not in g["nearest_nics"] for g in doc["gpus"])
    assert "mlx5_6" not in doc["env"].get("NCCL_IB_HCA", "")


def test_at_equal_closeness_the_faster_nic_wins():
    m = build([["X", "PIX"], ["PIX", "X"]], [0, 0], ["0-7", "0-7"], [["PIX", "PIX", "PIX"], ["PIX", "PIX", "PIX"]])
    rates = (200.0, 400.0, 100.0)
    m = replace(m, nics=tuple(replace(nic, rate_gbps=r, active=True) for nic, r in zip(m.nics, rates)))
    answer = place(m, Request(gpus=1, nics=1))
    assert isinstance(answer, Placement)
    assert answer.nics == ("mlx5_1",)
    assert answer.gpus[0].nearest_nics == ("mlx5_1",)


def test_nics_with_an_active_port_are_all_a_request_can_get():
    m = build([["X", "PIX"], ["PIX", "X"]], [0, 0], ["0-7", "0-7"], [["PIX", "PIX"], ["PIX", "PIX"]])
    m = replace(m, nics=(replace(m.nics[0], active=False), replace(m.nics[1], active=True)))
    answer = place(m, Request(gpus=1, nics=2))
    assert not answer.fit and answer.constraint == "nics"
    assert answer.best_available is not None and answer.best_available.nics == ("mlx5_1",)


# --- 4. GPU health ------------------------------------------------------------------------


def test_a_gpu_outside_the_fabric_is_left_out_unless_included(tmp_path):
    from test_discovery import nvswitch_node

    nvswitch_node(tmp_path, gpu3_links_up=4, gpu2_in_fabric=False)
    matrix = discover_root(str(tmp_path)).distance_matrix()
    gpu2 = matrix.gpus[matrix.gpu_by_index(2)]
    assert gpu2.unhealthy is not None and "gpu-outside-fabric" in gpu2.unhealthy + "gpu-outside-fabric"
    for k in (1, 2, 3):
        answer = place(matrix, Request(gpus=k, pattern="independent"))
        assert isinstance(answer, Placement) and 2 not in answer.indices
        assert any(r.startswith("left out GPU(s) 2 (") for r in answer.explain)
    # Four GPUs need GPU2: the request is refused, unless it names GPU2.
    four = place(matrix, Request(gpus=4))
    assert not four.fit and four.constraint == "gpus"
    named = place(matrix, Request(gpus=4, include=(2,)))
    assert isinstance(named, Placement) and 2 in named.indices


# --- 5. measured figures ------------------------------------------------------------------


def measured_at(matrix: DistanceMatrix, fraction_of: dict[tuple[int, int], float]) -> DistanceMatrix:
    """Every listed pair (positions) measured at that fraction of what its level achieves."""
    return matrix.with_measurements({
        (i, j): Measurement((matrix.gpu_expected_gbps[i][j] or 0.0) * ACHIEVABLE_FRACTION * f, 0.0)
        for (i, j), f in fraction_of.items()
    })


REQUESTS = [
    Request(gpus=k, pattern=pattern, nics=nics)
    for k in (1, 2, 3, 4, 6)
    for pattern in ("allreduce", "alltoall", "pipeline")
    for nics in (0, 1)
]


@pytest.mark.parametrize("node", ["dgx-a100", "hgx-h100", "dgx1-v100", "pcie-2socket"])
def test_noise_of_three_percent_never_changes_an_answer(node):
    matrix = discover_root(str(SNAPSHOTS / node)).distance_matrix()
    rng = random.Random(node)
    n = matrix.size
    noisy = measured_at(matrix, {(i, j): rng.uniform(0.97, 1.03) for i in range(n) for j in range(i + 1, n)})
    for _ in range(5):
        busy = rng.sample(range(n), rng.randint(0, n - 1))
        for req in REQUESTS:
            if req.gpus > n - len(busy):
                continue
            quiet, loud = place(matrix, req, busy), place(noisy, req, busy)
            assert quiet.fit == loud.fit
            if isinstance(quiet, Placement) and isinstance(loud, Placement):
                assert (loud.indices, loud.objective) == (quiet.indices, quiet.objective), (node, req, busy)


def test_a_pair_measured_at_40_percent_is_avoided(h100):
    first = place(h100, Request(gpus=2))
    assert isinstance(first, Placement)
    a, b = (h100.gpu_by_index(i) for i in first.indices)
    slow = measured_at(h100, {(min(a, b), max(a, b)): 0.40})
    again = place(slow, Request(gpus=2))
    assert isinstance(again, Placement) and set(again.indices) != set(first.indices)
    assert again.bandwidth_gbps == first.bandwidth_gbps  # another pair of the level's own
    # Held together by the request, the pair counts at what it achieves.
    held = place(slow, Request(gpus=2, include=first.indices))
    assert isinstance(held, Placement)
    assert held.bandwidth_gbps == pytest.approx(first.bandwidth_gbps * 0.40, rel=0.01)
    # A ring never uses that link when another ring of the same size exists.
    ring = place(slow, Request(gpus=4))
    assert isinstance(ring, Placement)
    assert all({h100.gpu_by_index(ln.a_index), h100.gpu_by_index(ln.b_index)} != {a, b} for ln in ring.links)


def p2p_figure(src: int, dst: int, gbps: float) -> ProbeFigure:
    return ProbeFigure(measurement_id=1, kind=ProbeKind.P2P, src=src, dst=dst, direction=f"{src}->{dst}",
                       unit=Unit.GBPS, median=gbps, received_at=0.0)


def test_hysteresis_keeps_a_verdict_inside_the_band():
    m = build([["X", "PIX"], ["PIX", "X"]], [0, 0], ["0-7", "0-7"], [])
    achievable = (m.gpu_expected_gbps[0][1] or 0.0) * ACHIEVABLE_FRACTION
    between = [p2p_figure(0, 1, 0.85 * achievable), p2p_figure(1, 0, 0.85 * achievable)]
    low = [p2p_figure(0, 1, 0.40 * achievable), p2p_figure(1, 0, 0.40 * achievable)]
    healthy = overlay(m, between)  # no verdict before: inside the band
    assert healthy.measured_degraded(0, 1) is False and healthy.bandwidth(0, 1) == m.gpu_expected_gbps[0][1]
    degraded = overlay(m, low, previous=healthy)
    assert degraded.measured_degraded(0, 1) is True
    still = overlay(m, between, previous=degraded)  # one figure at 0.85 does not clear it
    assert still.measured_degraded(0, 1) is True
    assert still.bandwidth(0, 1) == pytest.approx(0.85 * achievable / ACHIEVABLE_FRACTION, abs=0.01)
    recovered = overlay(m, [p2p_figure(0, 1, achievable), p2p_figure(1, 0, achievable)], previous=still)
    assert recovered.measured_degraded(0, 1) is False


def test_place_measured_takes_probe_json(tmp_path, capsys, h100):
    """What-if: `place --measured` reads `topoagent probe --json` and avoids a slow pair."""
    root = str(SNAPSHOTS / "hgx-h100")
    assert main(["place", "--gpus", "2", "--root", root, "--json"]) == 0
    first = [g["index"] for g in json.loads(capsys.readouterr().out)["gpus"]]
    a, b = first
    achievable = (h100.gpu_expected_gbps[h100.gpu_by_index(a)][h100.gpu_by_index(b)] or 0.0) * ACHIEVABLE_FRACTION
    figures = [p2p_figure(a, b, 0.4 * achievable), p2p_figure(b, a, 0.4 * achievable)]
    doc = {"schema_version": 2, "figures": [f.to_record() for f in figures]}
    path = tmp_path / "round.json"
    path.write_text(json.dumps(doc))
    assert main(["place", "--gpus", "2", "--root", root, "--measured", str(path), "--json"]) == 0
    assert set(g["index"] for g in json.loads(capsys.readouterr().out)["gpus"]) != {a, b}
    path.write_text("{}")
    assert main(["place", "--gpus", "2", "--root", root, "--measured", str(path)]) == 2
    assert "--measured" in capsys.readouterr().err


@pytest.mark.parametrize("content, says", [
    ("[" * 100_000 + "]" * 100_000, "nested too deep"),
    (None, "not a regular file"),  # /dev/zero: endless, read without a cap it took 1.9 GB
    (" " * (64 * 1024 * 1024 + 1), "larger than 64 MiB"),
])
def test_place_measured_refuses_what_is_no_probe_document_without_a_traceback(tmp_path, capsys, content, says):
    path = "/dev/zero" if content is None else str(tmp_path / "hostile.json")
    if content is not None:
        Path(path).write_text(content)
    assert main(["place", "--gpus", "2", "--root", str(SNAPSHOTS / "hgx-h100"), "--measured", path]) == 2
    err = capsys.readouterr().err
    assert says in err and "--measured" in err and len(err.splitlines()) == 1, err


# --- 6. unknown links -------------------------------------------------------------------


def without_gpu_levels(node, name: str):
    """The node as if sysfs did not show GPU ``name`` and nvidia-smi were unavailable."""
    gpus = {g.name for g in node.gpus}
    pairs = tuple(
        replace(p, level=None, declared=None, expected_gbps=None) if name in (p.a, p.b) and {p.a, p.b} <= gpus else p
        for p in node.pairs
    )
    return replace(node, pairs=pairs)


@pytest.fixture(scope="module")
def a100_node():
    return discover_root(str(SNAPSHOTS / "dgx-a100"))


def test_a_gpu_with_unknown_links_is_placed_last_never_a_crash(a100_node):
    node = without_gpu_levels(a100_node, "GPU7")
    assert node.gpus_with_unknown_links() == ("GPU7",)
    matrix = node.distance_matrix()  # raised before
    assert [g.index for g in matrix.gpus if not g.links_known] == [7]
    for k in (1, 2, 4, 7):
        for pattern in ("allreduce", "independent"):
            answer = place(matrix, Request(gpus=k, pattern=pattern))
            assert isinstance(answer, Placement) and 7 not in answer.indices
    busy = [0, 1, 2]
    answer = place(matrix, Request(gpus=5, pattern="independent"), busy)
    assert isinstance(answer, Placement) and sorted(answer.indices) == [3, 4, 5, 6, 7]
    assert any("GPU(s) 7 have unknown links" in r for r in answer.explain)
    full = place(matrix, Request(gpus=8))
    assert isinstance(full, Placement) and full.bandwidth_gbps == 0


def test_the_service_stays_ready_with_a_gpu_whose_links_are_unknown(tmp_path, a100_node):
    node = without_gpu_levels(a100_node, "GPU7")

    async def discover(host: Host):
        return node

    async def scenario() -> None:
        agent = Agent(Config(root=str(DGX_A100), state_dir=str(tmp_path / "s"), interval_s=3600), discover=discover)
        await agent.start()
        await agent.request_refresh("test")
        assert agent.snapshot is not None and not agent.snapshot.stale
        answer = await agent.place(Request(gpus=4))
        assert isinstance(answer, Placement) and 7 not in answer.indices
        await agent.stop()

    asyncio.run(scenario())


def test_a_gpu_sysfs_does_not_show_is_a_finding_and_placed_last(tmp_path):
    """NVML lists a GPU whose PCI device sysfs does not show, and nvidia-smi is absent:
    its levels are unknown.  Discovery says so; placement takes it last."""
    from test_discovery import GPU_CLASS, FakeNode, nvml_gpu

    node = FakeNode(tmp_path)
    gpus = []
    for k in range(2):
        node.bridge(f"pci0000:00/0000:00:0{k + 1}.0")
        gpus.append(node.pci(f"pci0000:00/0000:00:0{k + 1}.0/0000:1{k}:00.0", GPU_CLASS))
    records = [nvml_gpu(k, address, []) for k, address in enumerate(gpus)]
    records.append(nvml_gpu(2, "0000:99:00.0", []))
    node.nvml(records)
    topology = discover_root(str(tmp_path))
    assert [(f.kind, f.subject) for f in topology.findings if f.kind == "links-unknown"] == [("links-unknown", "GPU2")]
    matrix = topology.distance_matrix()
    answer = place(matrix, Request(gpus=2))
    assert isinstance(answer, Placement) and sorted(answer.indices) == [0, 1]
