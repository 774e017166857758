"""Latency in the objective of the latency-bound patterns (issue #19 with issue #9's
estimate): alltoall and pipeline rank links by one message's time, alpha (small-copy
latency: measured, else the level's calibrated figure) + size / bandwidth; allreduce stays
bandwidth-bound.  The brute-force oracle computes the same objective
(tests/placement_oracle.py; test_placement_exact.py runs it with measured latencies)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from placement_oracle import best_keys
from schema_check import validate
from test_placement_deadline import StepClock, frozen_clock, wall_clock_stands_still  # noqa: F401 (autouse)

import topoagent.placement.deadline as deadline_module
from topoagent.commands.discover import discover_root
from topoagent.documents.agent import answer_document
from topoagent.node.matrix import DistanceMatrix, LatencyMeasurement
from topoagent.placement import Placement, ReasonCode, Request, place, warm_answers
from topoagent.placement.answer import built_answer_parts
from topoagent.placement.ksets import small_table_if_built
from topoagent.placement.latency import LATENCY_BOUND_MESSAGE_BYTES
from topoagent.placement.search import warm
from topoagent.placement.synthetic import build, irregular_mesh, nvswitch_16
from topoagent.placement.tables import Prepared, prepare, timed, timed_tables_built
from topoagent.probes.figures import ProbeFigure, ProbeKind
from topoagent.probes.overlay import overlay
from topoagent.vocabulary import Pattern, Unit

SNAPSHOTS = Path(__file__).resolve().parents[1] / "fixtures" / "snapshots"
STAGED_US = 25.0  # a pair whose copies are staged through host memory (overlay.py's corpus: 10-15 us)


@pytest.fixture(scope="module")
def wide_but_slow() -> DistanceMatrix:
    """GPUs 0 and 1 on two NVLinks (NV2, ~50 GB/s) whose small copies measure 25 us;
    GPUs 2 and 3 under one PCIe switch (PIX, narrower) at the level's 1.5 us."""
    levels = [
        ["X", "NV2", "SYS", "SYS"],
        ["NV2", "X", "SYS", "SYS"],
        ["SYS", "SYS", "X", "PIX"],
        ["SYS", "SYS", "PIX", "X"],
    ]
    m = build(levels, [0, 0, 1, 1], ["0-7", "0-7", "8-15", "8-15"], [])
    return m.with_measurements({}, {(0, 1): LatencyMeasurement(STAGED_US, 0.0)})


def picked(matrix: DistanceMatrix, **request) -> Placement:
    answer = place(matrix, Request(**request))
    assert isinstance(answer, Placement)
    return answer


def test_small_alltoall_messages_take_the_quick_narrow_link_allreduce_the_wide_one(wide_but_slow):
    m = wide_but_slow
    assert m.bandwidth(0, 1) > m.bandwidth(2, 3)  # NV2 is the wider link
    assert set(picked(m, gpus=2).indices) == {0, 1}  # allreduce: bandwidth
    small = picked(m, gpus=2, pattern="alltoall", message_bytes=4096)
    assert set(small.indices) == {2, 3}
    expected_us = 1.5 + 4096 / (1000 * m.bandwidth(2, 3))
    assert small.objective.link_time_us == pytest.approx(expected_us, abs=1e-3)
    assert any("us per 4096-byte message over PIX (GPU2-GPU3): 1.5 us latency" in line for line in small.explain)
    validate(answer_document(small), "Placement")
    # Large messages: the transfer dwarfs 25 us, and the wide link wins again.
    assert set(picked(m, gpus=2, pattern="alltoall", message_bytes=256 << 20).indices) == {0, 1}
    # A pipeline's sends are timed the same way.
    assert set(picked(m, gpus=2, pattern="pipeline", message_bytes=4096).indices) == {2, 3}
    # allreduce is not latency-bound: its answer ignores the message size.
    assert set(picked(m, gpus=2, message_bytes=4096).indices) == {0, 1}


def test_the_default_message_size_is_documented_and_decides(wide_but_slow):
    """1 MiB: 25 us of latency is small beside NV2's transfer, so the wide link wins."""
    answer = picked(wide_but_slow, gpus=2, pattern="alltoall")
    assert set(answer.indices) == {0, 1}
    assert any("per 1048576-byte message" in line for line in answer.explain)
    assert answer.request.message_bytes is None


def test_the_oracle_agrees_on_every_size(wide_but_slow):
    for size in (64, 4096, 1 << 16, 1 << 20, 1 << 28):
        for pattern in ("alltoall", "pipeline"):
            for k in (2, 3):
                req = Request(gpus=k, pattern=pattern, message_bytes=size)
                answer = place(wide_but_slow, req)
                expected = best_keys(wide_but_slow, req, ())
                assert isinstance(answer, Placement) and expected is not None
                assert answer.objective.link_time_us == pytest.approx(-expected[0][0], abs=1e-3), (size, pattern, k)


def test_without_measured_latency_the_tables_are_the_bandwidth_ones():
    """Every level's alpha is the calibrated 1.5 us: one message's time orders links as
    bandwidth does, so the latency-bound patterns read the same (warm) tables and answers."""
    for path in sorted(SNAPSHOTS.iterdir()):
        matrix = discover_root(str(path)).distance_matrix()
        for size in (64, 1 << 20, 1 << 30):
            assert prepare(matrix, None, size) is prepare(matrix, None), path.name


def test_measured_latency_reaches_the_matrix_from_probe_figures_and_the_cli(tmp_path, wide_but_slow):
    """The probes' latency figures (the slower direction) become the pair's alpha; the
    CLI's --measured takes a `topoagent probe --json` document the same way."""
    plain = replace(wide_but_slow, measured_latency={})
    figures = [
        ProbeFigure(measurement_id=1, kind=ProbeKind.LATENCY, src=0, dst=1, unit=Unit.MICROSECONDS, median=STAGED_US, size_bytes=4, received_at=0.0),
        ProbeFigure(measurement_id=2, kind=ProbeKind.LATENCY, src=1, dst=0, unit=Unit.MICROSECONDS, median=2.0, size_bytes=4, received_at=0.0),
    ]
    measured = overlay(plain, figures)
    assert measured.latency_us(0, 1) == STAGED_US and plain.latency_us(0, 1) == 1.5
    assert set(picked(measured, gpus=2, pattern="alltoall", message_bytes=4096).indices) == {2, 3}

    a100 = SNAPSHOTS / "dgx-a100"
    doc = {"figures": [f.to_record() for f in (
        replace(figures[0], src=0, dst=1, received_at=None), replace(figures[1], src=1, dst=0, received_at=None),
    )]}
    probe_json = tmp_path / "probe.json"
    probe_json.write_text(json.dumps(doc))

    def cli(*extra: str) -> dict:
        run = subprocess.run(
            [sys.executable, "-m", "topoagent", "place", "--root", str(a100), "--gpus", "2", "--pattern", "alltoall",
             "--message-bytes", "4096", "--json", *extra],
            capture_output=True, text=True, timeout=120, check=True,
        )
        return json.loads(run.stdout)

    # On the DGX A100 every pair is NV12: GPU0-GPU1's staged copies put that pair last.
    assert sorted(g["index"] for g in cli()["gpus"]) == [0, 1]
    slow = cli("--measured", str(probe_json))
    assert sorted(g["index"] for g in slow["gpus"]) != [0, 1]
    assert slow["objective"]["link_time_us"] < STAGED_US


def measured_node(n: int) -> DistanceMatrix:
    """A fresh matrix (no tables yet) whose GPU0-GPU1 copies are staged: one message's time
    orders its links unlike bandwidth, so alltoall and pipeline read tables of their own."""
    node = nvswitch_16() if n == 16 else irregular_mesh(n)
    return node.with_measurements({}, {(0, 1): LatencyMeasurement(STAGED_US, 0.0)})


def test_warm_builds_the_timed_tables_so_the_first_request_builds_none(monkeypatch):
    node = measured_node(16)
    expected = {p: place(measured_node(16), Request(gpus=4, pattern=p)) for p in ("alltoall", "pipeline")}
    prep = warm(node)
    latency_ordered = timed(prep, LATENCY_BOUND_MESSAGE_BYTES)
    assert latency_ordered is not prep and prepare(node, None, LATENCY_BOUND_MESSAGE_BYTES) is latency_ordered  # kept
    for pattern in (Pattern.ALLTOALL, Pattern.PIPELINE):
        assert small_table_if_built(latency_ordered, pattern, 1) is not None
        assert small_table_if_built(latency_ordered, pattern, 15) is not None

    def no_build(*args, **kwargs):
        raise AssertionError("a request built tables warm() should have")

    monkeypatch.setattr(Prepared, "__init__", no_build)
    for pattern, before in expected.items():
        answer = place(node, Request(gpus=4, pattern=pattern))
        assert isinstance(answer, Placement) and isinstance(before, Placement)
        assert answer.indices == before.indices and answer.proven_optimal  # warming changes no answer
        assert place(node, Request(gpus=15, pattern=pattern)).proven_optimal


def test_warming_answers_ends_as_soon_as_the_agent_stops():
    """The agent warms answers in a thread it cannot cancel, and its exit waits for that
    thread: told to stop (SIGTERM), the warming builds nothing more."""
    node = irregular_mesh(8)
    prep = warm(node)
    warm_answers(node, stopped=lambda: True)
    assert built_answer_parts(prep) == {}
    warm_answers(node, stopped=lambda: False)
    assert len(built_answer_parts(prep)) > 8  # not stopped: every set's answer is built ahead


def test_answers_built_ahead_share_what_the_pattern_does_not_change():
    """The agent keeps every small set's answers for each pattern and NIC count: the ranks'
    NICs, CPUs, environment and launch lines are one copy per set, not one per pattern
    (four copies were most of an idle 8-GPU agent's answer memory)."""
    node = discover_root(str(SNAPSHOTS / "dgx-a100")).topo_matrix()
    matrix = DistanceMatrix.from_topo_matrix(node)
    prep = warm(matrix)
    warm_answers(matrix, budget_s=math.inf)  # every set's, however loaded the machine
    by_set: dict[tuple, list] = {}
    for (order, _pattern, nics, loads), parts in built_answer_parts(prep).items():
        by_set.setdefault((order, nics, loads), []).append(parts)
    assert by_set and all(len(group) == len(Pattern) for group in by_set.values())
    for group in by_set.values():
        first = group[0]
        for parts in group[1:]:
            assert parts.env is first.env and parts.launch is first.launch and parts.gpus is first.gpus
            assert parts.nic_reasons is first.nic_reasons and parts.numactl is first.numactl


def test_a_request_building_timed_tables_keeps_to_its_deadline(monkeypatch):
    """Unwarmed, 128 GPUs: the build (tens of ms) reads the clock row by row; when time
    runs out the bandwidth-ordered tables give a valid set at once, marked not proven,
    and nothing half-built is kept."""
    node = measured_node(128)
    monkeypatch.setattr(deadline_module, "clock", StepClock(1e-5))  # 1 ms: ~50 reads, fewer than 128 rows
    request = Request(gpus=8, pattern="alltoall", deadline_ms=1)
    answer = place(node, request)
    assert isinstance(answer, Placement) and not answer.proven_optimal
    assert len(set(answer.indices)) == 8 and answer.objective.link_time_us is not None
    assert answer.reasons[0].code is ReasonCode.NOT_PROVEN
    assert timed_tables_built(prepare(node, None)) == 0  # the stopped build left nothing
    # With time to spare the same request builds the tables and keeps them.
    monkeypatch.setattr(deadline_module, "clock", frozen_clock)
    assert place(node, Request(gpus=2, pattern="alltoall", deadline_ms=1)).proven_optimal
    assert timed_tables_built(prepare(node, None))
