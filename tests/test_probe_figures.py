"""The worker's lines as typed values: written by the worker, read back once by the runner.

A line that does not have its type's shape ends the round as a crash naming what was
wrong, instead of a KeyError somewhere downstream.
"""

import asyncio
import json
import sys
import textwrap

import pytest

from topoagent.documents.agent import PROBE_FIGURE
from topoagent.probes.figures import (
    FailureKind,
    MalformedRecord,
    ProbeFigure,
    ProbeKind,
    ProbeSkip,
    Unit,
    parse_failure,
    parse_figure,
    parse_skip,
)
from topoagent.probes.plan import build_round_plan
from topoagent.probes.runner import run_probe_round

# A line exactly as the worker writes a one-direction P2P figure.
P2P_LINE = {
    "type": "result", "id": 2, "kind": "p2p", "src": 0, "dst": 1, "direction": "0->1",
    "size_bytes": 4194304, "repetitions": 7, "warmup": 1, "loop": 2, "unit": "GB/s",
    "median": 11.5, "p10": 10.9, "p90": 12.0, "min": 10.1, "max": 12.2,
    "duration_s": 0.01, "backend": "cpu",
}


def test_a_worker_line_reads_back_as_the_figure_it_was_written_from():
    figure = parse_figure(P2P_LINE)
    assert figure.kind is ProbeKind.P2P and figure.unit is Unit.GBPS
    assert (figure.measurement_id, figure.src, figure.dst, figure.minimum, figure.maximum) == (2, 0, 1, 10.1, 12.2)
    assert figure.median_gbps == 11.5 and figure.median_latency_s is None
    assert figure.to_record() == P2P_LINE
    assert list(figure.to_record()) == list(P2P_LINE)  # same keys, same order: the wire is unchanged


def test_latency_is_microseconds_on_the_wire_and_seconds_in_the_type():
    line = P2P_LINE | {"kind": "latency", "unit": "us", "median": 12.0}
    figure = parse_figure(line)
    assert figure.median_latency_s == pytest.approx(12e-6)
    assert figure.median_gbps is None


def test_topology_shows_a_figure_without_the_workers_bookkeeping():
    figure = parse_figure(P2P_LINE | {"received_at": 1700000000.0})
    shown = PROBE_FIGURE.dump(figure)
    assert list(shown) == [
        "kind", "direction", "src", "dst", "device", "numa_node", "size_bytes", "unit", "median", "p10", "p90",
        "repetitions", "available", "received_at", "taken_under_load",
    ]
    assert (shown["kind"], shown["src"], shown["median"], shown["device"]) == ("p2p", 0, 11.5, None)
    peer = parse_figure({"type": "result", "id": 0, "kind": "peer_access", "src": 1, "dst": 0, "available": False,
                         "backend": "cpu", "received_at": 5.0})
    assert {k: v for k, v in PROBE_FIGURE.dump(peer).items() if v is not None} == {
        "kind": "peer_access", "src": 1, "dst": 0, "available": False, "received_at": 5.0, "taken_under_load": False}


@pytest.mark.parametrize(
    "line, complaint",
    [
        ({k: v for k, v in P2P_LINE.items() if k != "id"}, "id must be an integer"),
        (P2P_LINE | {"kind": "teleport"}, "kind must be one of"),
        ({k: v for k, v in P2P_LINE.items() if k != "src"}, "a p2p result needs src"),
        ({k: v for k, v in P2P_LINE.items() if k != "median"}, "a p2p result needs median"),
        (P2P_LINE | {"median": "fast"}, "median must be a number"),
        (P2P_LINE | {"size_bytes": 4.5}, "size_bytes must be an integer"),
        (P2P_LINE | {"unit": "MB/s"}, "unit must be one of"),
        ({"type": "result", "id": 0, "kind": "peer_access", "src": 0, "dst": 1}, "needs available"),
        ({"type": "result", "id": 0, "kind": "h2d", "device": 0, "median": 1.0}, "needs numa_node"),
    ],
)
def test_a_malformed_result_line_names_what_is_wrong(line, complaint):
    with pytest.raises(MalformedRecord, match=complaint):
        parse_figure(line)


def test_skip_and_failure_lines():
    skip = ProbeSkip(measurement_id=4, kind=ProbeKind.H2D, reason="NUMA node 7 does not exist")
    assert skip.to_record() == {"type": "skipped", "id": 4, "kind": "h2d", "reason": "NUMA node 7 does not exist"}
    assert parse_skip(skip.to_record()) == skip
    with pytest.raises(MalformedRecord, match="needs a reason"):
        parse_skip({"type": "skipped", "id": 4, "kind": "h2d"})
    assert parse_failure({"type": "failure", "failure": "oom", "message": "x"}).failure is FailureKind.OOM
    assert parse_failure({"type": "failure", "failure": "gremlins", "message": "x"}).failure is FailureKind.CRASH


def stand_in(body: str) -> list[str]:
    return [sys.executable, "-c", "import json, sys\nsys.stdin.read()\n" + textwrap.dedent(body)]


def test_a_malformed_line_from_the_worker_ends_the_round_as_a_crash_keeping_the_good_ones():
    good = json.dumps(P2P_LINE)
    bad = json.dumps(P2P_LINE | {"id": 3, "src": 1, "dst": 0, "median": None})
    worker = stand_in(f"""
        print({good!r})
        print({bad!r})
        print(json.dumps({{"type": "done", "results": 2}}))
    """)
    probe_round = asyncio.run(run_probe_round(build_round_plan("cpu", [0, 1], []), timeout_s=30, command=worker))
    assert probe_round.failure is not None
    assert probe_round.failure.kind is FailureKind.CRASH
    assert probe_round.failure.message == "the worker sent a malformed result line: a p2p result needs median"
    assert [f.measurement_id for f in probe_round.results] == [2]
    assert isinstance(probe_round.results[0], ProbeFigure) and probe_round.results[0].received_at is not None
