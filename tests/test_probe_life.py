"""Probes that follow the node's life: jobs coming and going, slow decay, shared paths,
latency, and verdicts that change the matrix.  Fake clock; stand-in runners feed the
figures a marginal link would give, and one round runs the real CPU worker."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path

import pytest
from p2p_test_output import matrix_cells
from schema_check import validate

from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.documents.agent import topology_document
from topoagent.node.discovery import discover
from topoagent.node.host import Host
from topoagent.node.levels import PHB, PIX
from topoagent.node.matrix import DistanceMatrix
from topoagent.probes.figures import ProbeFigure, ProbeKind
from topoagent.probes.history import STATE_FILE, BaselineBook
from topoagent.probes.overlay import findings_for
from topoagent.probes.paths import probe_paths
from topoagent.probes.plan import PlanDefaults
from topoagent.probes.runner import ProbeRound, ProbeRunner
from topoagent.probes.schedule import GpuActivity, ProbeSchedule, ProbeTarget, ScheduleConfig
from topoagent.probes.service import ProbeService
from topoagent.service.served import Snapshot

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus"
CONFIG = ScheduleConfig(startup_delay_s=0, change_delay_s=5, min_interval_s=600, max_interval_s=4800, tolerance=0.1)
BUSY = GpuActivity(utilization_percent=95, other_processes=1)


class FakeClock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def drain(schedule: ProbeSchedule, clock: FakeClock, figure: float = 20.0, activity=None) -> list[ProbeTarget]:
    """Run every target that may run now, each for 1 s."""
    ran = []
    while (target := schedule.next_probe(activity or {})) is not None:
        clock.now += 1
        schedule.record(target, duration_s=1, figure=figure)
        ran.append(target)
    return ran


# --- jobs coming and going -----------------------------------------------------------------


def test_released_gpus_are_unverified_and_probed_first_until_checked():
    clock = FakeClock()
    schedule = ProbeSchedule(range(4), CONFIG, clock)
    drain(schedule, clock)
    assert schedule.next_probe({}) is None and schedule.unverified == frozenset()

    checks = schedule.on_gpus_released([1, 2])  # a two-GPU job ended
    assert {t.key for t in checks} == {"gpu:1", "gpu:2", "pair:1-2"}
    assert schedule.unverified == {1, 2}
    first = schedule.next_probe({})
    assert first in checks  # the checks go before the other re-armed pairs (0-1, 1-3, ...)
    clock.now += 1
    schedule.record(first, duration_s=1, figure=20.0)
    ran = [first, *drain(schedule, clock)]
    assert set(ran[:3]) == checks
    assert {t.key for t in ran[3:]} == {"pair:0-1", "pair:0-2", "pair:1-3", "pair:2-3"}
    assert schedule.unverified == frozenset()


def test_release_checks_stay_inside_the_duty_cycle():
    config = ScheduleConfig(startup_delay_s=0, duty_cycle=0.01, duty_window_s=3600, default_duration_s=10)
    clock = FakeClock()
    schedule = ProbeSchedule([0], config, clock)
    for _ in range(3):  # 30 of the 36 s an hour allows
        target = schedule.next_probe({})
        clock.now += 10
        schedule.record(target, duration_s=10, figure=20.0)
        schedule.request_round()
    schedule.on_gpus_released([0])
    assert schedule.next_probe({}) is None and schedule.unverified == {0}  # 10 s more would overrun
    clock.now += 3600
    assert schedule.next_probe({}) == ProbeTarget((0,))


def test_a_busy_gpu_stays_unverified_and_a_failed_check_does_not_verify():
    clock = FakeClock()
    schedule = ProbeSchedule([0, 1], CONFIG, clock)
    drain(schedule, clock)
    schedule.on_gpus_released([0])
    assert schedule.next_probe({0: BUSY}) is None  # a new job took it at once
    target = schedule.next_probe({})
    schedule.record(target, duration_s=1, figure=None, ok=False)
    assert schedule.unverified == {0}


def test_topology_change_rearms_only_the_links_that_changed():
    clock = FakeClock()
    schedule = ProbeSchedule([0, 1, 2], CONFIG, clock)
    drain(schedule, clock, figure=40.0)
    kept_due = schedule.states[ProbeTarget((0, 1))].due_at
    schedule.on_topology_change([0, 1, 2], changed=[ProbeTarget((1, 2))])  # one NVLink went down
    assert schedule.states[ProbeTarget((1, 2))].baseline is None
    assert schedule.states[ProbeTarget((0, 1))].baseline == 40.0
    assert schedule.states[ProbeTarget((0, 1))].due_at == kept_due
    clock.now += 5
    assert drain(schedule, clock) == [ProbeTarget((1, 2))]


def test_rearm_makes_one_link_due_soon_at_the_tightest_interval():
    clock = FakeClock()
    schedule = ProbeSchedule([0, 1, 2], CONFIG, clock)
    drain(schedule, clock)
    schedule.rearm([ProbeTarget((0, 2))])
    clock.now += 5
    assert drain(schedule, clock) == [ProbeTarget((0, 2))]


# --- a stand-in runner ------------------------------------------------------------------------


def pair_round(a: int, b: int, gbps: float, *, latency_us: float = 1.3) -> ProbeRound:
    results = (
        ProbeFigure(measurement_id=0, kind=ProbeKind.P2P, src=a, dst=b, direction=f"{a}->{b}", median=gbps, received_at=1.0),
        ProbeFigure(measurement_id=1, kind=ProbeKind.P2P, src=b, dst=a, direction=f"{b}->{a}", median=gbps, received_at=1.0),
        ProbeFigure(measurement_id=2, kind=ProbeKind.LATENCY, src=a, dst=b, direction=f"{a}->{b}", median=latency_us),
    )
    return ProbeRound(backend="cpu", started_at=1.0, duration_s=1.0, results=results)


def host_round(device: int, per_node: dict[int, float]) -> ProbeRound:
    results = tuple(
        ProbeFigure(measurement_id=n, kind=ProbeKind.H2D, device=device, numa_node=n, median=g, received_at=1.0)
        for n, g in per_node.items()
    )
    return ProbeRound(backend="cpu", started_at=1.0, duration_s=1.0, results=results)


class ScriptedRunner(ProbeRunner):
    """Answers each round with what ``answer(plan)`` says instead of running a worker."""

    def __init__(self, answer):
        super().__init__()
        self.answer = answer
        self.plans = []

    async def run(self, plan, *, force=False, on_record=None):
        self.plans.append(plan)
        probe_round = self.answer(plan)
        for figure in probe_round.figures():
            self._figures[figure.key] = figure
        self._latest = probe_round
        return probe_round


def service_for(gpus, answer, *, state_dir=None, matrix=None):
    clock = FakeClock()
    schedule = ProbeSchedule(gpus, CONFIG, clock)
    service = ProbeService(schedule, ScriptedRunner(answer), backend="cpu", numa_nodes=[0, 1],
                           book=BaselineBook(state_dir, clock=clock), matrix=matrix)
    return service, clock


def run_until_idle(service: ProbeService, clock: FakeClock, activity=None) -> list[ProbeRound]:
    rounds = []
    while (r := asyncio.run(service.step(activity))) is not None:
        clock.now += 1
        rounds.append(r)
    return rounds


def pair_gpus(plan) -> tuple[int, int]:
    m = next(m for m in plan["measurements"] if m["kind"] == "p2p")
    return m["src"], m["dst"]


@pytest.fixture(scope="module")
def two_socket():
    """The PCIe 2-socket recording: GPU0-3 under one switch on socket 0, GPU4-7 on socket 1."""
    return asyncio.run(discover(Host(str(ROOT / "fixtures/snapshots/pcie-2socket"))))


# --- slow decay, across a restart --------------------------------------------------------------


def test_slow_decay_raises_a_finding_no_single_step_did_and_survives_a_restart(tmp_path, two_socket):
    matrix = two_socket.distance_matrix()
    figure = {"now": 24.0}
    service, clock = service_for([0, 1], lambda plan: pair_round(0, 1, figure["now"]), state_dir=tmp_path, matrix=matrix)
    pair = ProbeTarget((0, 1))
    outcomes = []
    for _ in range(6):  # 3% less each round: 24.0 -> 20.6
        service.schedule.request_round()
        clock.now += 1
        asyncio.run(service.step())
        outcomes.append(service.last_verdict.outcome)
        figure["now"] *= 0.97
    assert "drift" not in outcomes and not service.decay_findings(matrix)

    # The agent restarts: the schedule starts afresh, the long baseline is read back.
    saved = json.loads((tmp_path / STATE_FILE).read_text())
    assert saved["links"][pair.key]["first"] == 24.0
    service, clock = service_for([0, 1], lambda plan: pair_round(0, 1, figure["now"]), state_dir=tmp_path, matrix=matrix)
    for _ in range(6):
        service.schedule.request_round()
        clock.now += 1
        asyncio.run(service.step())
        figure["now"] *= 0.97
    (decay,) = [f for f in service.findings(matrix) if f.kind == "link_decay"]
    assert decay.subject == "GPU0-GPU1" and decay.expected_gbps == 24.0
    assert decay.measured_gbps < 0.9 * 24.0
    assert "lost" in decay.message and "first healthy figure" in decay.message


def test_a_changed_link_forgets_its_long_baseline(tmp_path):
    service, clock = service_for([0, 1], lambda plan: pair_round(0, 1, 24.0), state_dir=tmp_path)
    service.schedule.request_round()
    run_until_idle(service, clock)
    assert "pair:0-1" in service.book.links
    service.on_topology_change([0, 1], changed=[ProbeTarget((0, 1))])
    assert "pair:0-1" not in BaselineBook(tmp_path).links


def test_an_unreadable_baseline_file_is_moved_aside_not_fatal(tmp_path):
    (tmp_path / STATE_FILE).write_text("{not json")
    book = BaselineBook(tmp_path)
    assert book.links == {} and "JSONDecodeError" in book.load_error
    assert (tmp_path / (STATE_FILE + ".corrupt")).exists()


# --- leases: a baseline with the lease, a check after it -------------------------------------


def test_a_lease_records_its_links_figures_and_its_release_rechecks_them(tmp_path, caplog):
    figure = {"now": 24.0}
    service, clock = service_for([0, 1, 2], lambda plan: pair_round(*pair_gpus(plan), figure["now"])
                                 if any(m["kind"] == "p2p" for m in plan["measurements"]) else host_round(0, {0: 10.0}),
                                 state_dir=tmp_path)
    run_until_idle(service, clock)
    recorded = service.on_lease_granted("lease-a", [0, 1])
    assert recorded == {"pair:0-1": 24.0, "gpu:0": 10.0, "gpu:1": 10.0}
    assert json.loads((tmp_path / STATE_FILE).read_text())["leases"]["lease-a"] == recorded

    figure["now"] = 12.0  # the job left the link at half speed
    service.on_lease_ended("lease-a", [0, 1])
    assert service.unverified == {0, 1}
    with caplog.at_level("INFO"):
        run_until_idle(service, clock)
    assert service.unverified == frozenset()
    line = next(r.getMessage() for r in caplog.records if "probe_after_release" in r.getMessage())
    assert "target=pair:0-1" in line and "before_gbps=24.00" in line and "after_gbps=12.00" in line
    assert "lease-a" not in json.loads((tmp_path / STATE_FILE).read_text())["leases"]


# --- contention --------------------------------------------------------------------------------


def test_paths_come_from_the_pcie_tree(two_socket):
    paths, footprints = probe_paths(two_socket)
    # GPU0 and GPU1 share a switch: their copies stay below it.
    assert not any(s.startswith(("host-bridge", "socket-link")) for s in paths[ProbeTarget((0, 1))])
    # GPU0 and GPU4 sit on different sockets: both host bridges and the socket link.
    crossing = paths[ProbeTarget((0, 4))]
    assert {"socket-link:0", "socket-link:1"} <= crossing
    assert sum(s.startswith("host-bridge:") for s in crossing) == 2
    assert "socket-link:0" in footprints[2] and any(s.startswith("host-bridge:") for s in footprints[2])


def test_a_probe_sharing_a_path_with_a_busy_gpu_waits_and_a_forced_one_is_marked_under_load(two_socket):
    paths, footprints = probe_paths(two_socket)
    matrix = two_socket.distance_matrix()
    service, clock = service_for(range(8), lambda plan: pair_round(*pair_gpus(plan), 2.0)
                                 if any(m["kind"] == "p2p" for m in plan["measurements"]) else host_round(0, {0: 1.0}),
                                 matrix=matrix)
    schedule = service.schedule
    schedule.paths, schedule.footprints = paths, footprints
    busy = {2: BUSY}  # a job on GPU2, under the same switch and host bridge as GPU0
    assert schedule.contended(ProbeTarget((0, 1)), busy) is False  # stays below the switch
    assert schedule.contended(ProbeTarget((0,)), busy) is True  # host link: same host bridge
    assert schedule.contended(ProbeTarget((0, 4)), busy) is True  # socket link
    assert schedule.contended(ProbeTarget((4, 5)), busy) is False  # the other socket's switch

    run_until_idle(service, clock, busy)
    postponed = {t for t, st in schedule.states.items() if st.baseline is None}
    assert ProbeTarget((0, 4)) in postponed and ProbeTarget((0,)) in postponed
    assert ProbeTarget((0, 1)) not in postponed

    schedule.request_round(force=True)
    run_until_idle(service, clock, busy)
    assert frozenset({0, 4}) in service.under_load
    assert schedule.states[ProbeTarget((0, 4))].baseline is None  # no baseline from a loaded figure
    found = service.findings(matrix)
    # 2 GB/s is far below a PIX or SYS pair: degraded -- but not where the copy shared a path.
    degraded = {f.subject for f in found if f.kind == "degraded_link"}
    assert "GPU0-GPU1" in degraded and "GPU0-GPU4" not in degraded
    assert (0, 4) not in {tuple(sorted((matrix.gpus[i].index, matrix.gpus[j].index))) for i, j in service.overlay(matrix).measured}
    assert "pair:0-4" not in service.book.links
    # Why no verdict: an info finding, and /topology marks the figures.
    loaded = [f for f in found if f.kind == "probed_under_load"]
    assert {f.subject for f in loaded} >= {"GPU0-GPU4"} and all(f.severity == "info" for f in loaded)
    assert "GPU0-GPU1" not in {f.subject for f in loaded}
    assert "not judged" in next(f.message for f in loaded if f.subject == "GPU0-GPU4")
    snapshot = Snapshot(1, two_socket, matrix, 0.0, (), {}).with_probes(
        2, service.overlay(matrix), tuple(service.figures()), tuple(found), frozenset(service.under_load),
    )
    doc = topology_document(snapshot)
    validate(doc, "Topology")
    marked = {(f["kind"], f["src"], f["dst"]): f["taken_under_load"] for f in doc["agent"]["probe_figures"] if f["src"] is not None}
    assert marked[("p2p", 0, 4)] is True and marked[("p2p", 0, 1)] is False


# --- latency -----------------------------------------------------------------------------------


def latency_figures(name: str, heading: str) -> list[ProbeFigure]:
    """The GPU rows of a p2pBandwidthLatencyTest latency matrix, as our latency figures."""
    cells = matrix_cells((CORPUS / "bandwidth" / name).read_text(), heading)
    return [ProbeFigure(measurement_id=0, kind=ProbeKind.LATENCY, src=src, dst=dst, median=us) for (src, dst), us in cells.items()]


def corpus_matrix(name: str) -> DistanceMatrix:
    return DistanceMatrix.from_topo_matrix(parse_topo_matrix((CORPUS / "nvidia-smi-topo" / name).read_text()))


@pytest.mark.parametrize(("topo", "test", "staged"), [
    ("asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt", "asus-esc8000a-e12-p2pBandwidthLatencyTest-4xRTX6000Ada-pcie-full.txt", False),
    ("puget-wrx90-2xRTX6000Ada-PHB-2nic.txt", "puget-wrx90-p2pBandwidthLatencyTest-2xRTX6000Ada-PHB-full.txt", False),
    ("asus-esc8000a-e12-4xRTX6000Ada-2xEPYC-NODE-4nic.txt", "asus-esc8000a-e12-p2pBandwidthLatencyTest-4xRTX6000Ada-pcie-full.txt", True),
    ("autodl-container-2xRTX2080Ti-PIX-numa1.txt", "autodl-container-p2pBandwidthLatencyTest-2xRTX2080Ti-noP2P.txt", True),
])
def test_small_copy_latency_far_above_the_level_is_a_finding(topo, test, staged):
    heading = "P2P=Disabled Latency Matrix (us)" if staged else "P2P=Enabled Latency (P2P Writes) Matrix (us)"
    if "noP2P" in test:  # that box has no P2P at all: both matrices are staged copies
        heading = "P2P=Enabled Latency (P2P Writes) Matrix (us)"
    matrix = corpus_matrix(topo)
    found = [f for f in findings_for(matrix, latency_figures(test, heading)) if f.kind == "high_latency"]
    n = len(matrix.gpus)
    assert len(found) == (n * (n - 1) // 2 if staged else 0)
    if staged:
        assert re.search(r"takes 1\d\.\d+ us per small copy", found[0].message)
        assert "alltoall and pipeline" in found[0].message


# --- verdicts that change the matrix -----------------------------------------------------------


def test_a_confirmed_numa_mismatch_moves_binding_and_keeps_the_claim(two_socket):
    matrix = two_socket.distance_matrix()
    pos = matrix.gpu_by_index(1)
    assert matrix.gpus[pos].numa_node == 0
    service, clock = service_for([1], lambda plan: host_round(1, {0: 9.0, 1: 20.0}), matrix=matrix)
    run_until_idle(service, clock)  # one round: a finding, not yet acted on; the link is re-armed
    assert any(f.kind == "numa_affinity_mismatch" for f in service.findings(matrix))
    assert service.overlay(matrix).gpus[pos].numa_node == 0
    clock.now += CONFIG.change_delay_s
    run_until_idle(service, clock)  # the re-armed round confirms it
    moved = service.overlay(matrix).gpus[pos]
    assert (moved.numa_node, moved.claimed_numa_node) == (1, 0)
    assert moved.cpus == matrix.gpus[matrix.gpu_by_index(4)].cpus  # node 1's CPUs, as GPU4 has


def test_a_confirmed_level_contradiction_demotes_the_pair():
    matrix = corpus_matrix("lmdeploy-4863-4xRTX2080Ti-PIX-tabs.txt")
    a, b = next((i, j) for i in range(matrix.size) for j in range(i + 1, matrix.size) if matrix.level(i, j) == PIX)
    ga, gb = matrix.gpus[a].index, matrix.gpus[b].index
    service, clock = service_for([ga, gb], lambda plan: pair_round(ga, gb, 8.0), matrix=matrix)
    run_until_idle(service, clock)
    assert service.overlay(matrix).level(a, b) == PIX  # one round is not enough
    clock.now += CONFIG.change_delay_s
    run_until_idle(service, clock)
    demoted = service.overlay(matrix)
    # Demoted to the level the finding names: what 8 GB/s delivers on this PCIe link.
    level = demoted.level(a, b)
    assert level == demoted.level(b, a) and level.sort_key() > PHB.sort_key()
    (finding,) = [f for f in service.findings(matrix) if f.kind == "level_contradiction"]
    assert f"what a {level} path delivers" in finding.message
    assert demoted.declared_levels[(min(a, b), max(a, b))] == PIX


# --- one round on the real CPU worker ----------------------------------------------------------


def test_released_gpus_are_verified_by_a_real_cpu_round():
    clock = FakeClock()
    schedule = ProbeSchedule([0, 1], CONFIG, clock)
    service = ProbeService(schedule, ProbeRunner(timeout_s=120), backend="cpu", numa_nodes=[0],
                           defaults=PlanDefaults(sizes_bytes=(65536,), repetitions=3, warmup=1, loop=2))
    for target in list(schedule.states):
        schedule.states[target].due_at = float("inf")  # nothing due but what the release makes due
    service.on_gpus_released([0, 1])
    rounds = run_until_idle(service, clock)
    assert len(rounds) == 3 and all(r.ok for r in rounds)
    assert service.unverified == frozenset()
    assert service.book.links["pair:0-1"].first > 0
