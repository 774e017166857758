"""Issue 27 item 4 (place): "busy now" and "never fits this node" are told apart at every
door -- POST /place 409 vs 422, `place` exit 1 vs 3, `never_fits` in each --batch line --
and the never-fits answer is the placement core's own search on the idle node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from service_helpers import DGX_A100, start_agent

from topoagent.commands.discover import discover_root
from topoagent.placement import NoFit, Placement, Request, place

# On the DGX A100 recording every NUMA node holds 2 GPUs; the node has 8.
NEVER = [
    ({"gpus": 9}, "gpus", "9 GPUs requested, 8 free of 8"),
    ({"gpus": 4, "single_numa": True}, "single_numa", "no NUMA node has 4 free GPUs (most: 2"),
]


def cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", "place", "--root", str(DGX_A100), *args],
                          input=stdin, capture_output=True, text=True, timeout=60)


def test_the_core_decides_never_fits_by_searching_the_idle_node():
    matrix = discover_root(str(DGX_A100)).distance_matrix()
    busy_now = place(matrix, Request(gpus=4), busy=[0, 1, 2, 3, 4])
    assert isinstance(busy_now, NoFit) and not busy_now.never_fits
    assert isinstance(place(matrix, Request(gpus=4)), Placement)  # the idle node: it fits
    for fields, constraint, reason in NEVER:
        for busy in ((), (0, 1, 2, 3, 4, 5)):
            answer = place(matrix, Request(**fields), busy)
            assert isinstance(answer, NoFit) and answer.never_fits, (fields, busy)
            # The reason is the idle node's, whatever is busy now; its count is what is free now.
            assert answer.constraint == constraint and answer.reason.startswith(reason.replace("8 free", f"{8 - len(busy)} free"))
            assert answer.free == tuple(i for i in range(8) if i not in busy)


def test_a_never_fits_answer_counts_the_gpus_free_now_beside_their_list():
    """Issue #36: with 4 of 8 leased it said "8 free of 8" beside "free": [4, 5, 6, 7]."""
    matrix = discover_root(str(DGX_A100)).distance_matrix()
    answer = place(matrix, Request(gpus=9), busy=[0, 1, 2, 3])
    assert isinstance(answer, NoFit) and answer.never_fits
    assert answer.free == (4, 5, 6, 7)
    assert answer.reason == "9 GPUs requested, 4 free of 8"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    agent = start_agent(tmp_path_factory.mktemp("never"), root=DGX_A100)
    yield agent
    agent.stop()


def test_http_422_for_never_fits_409_for_busy_now(served):
    for fields, constraint, reason in NEVER:
        reply = served.post("/place", fields)
        body = reply.json()
        assert reply.status == 422, (fields, reply.status, body)
        assert body["error"] == "never_fits" and body["detail"].startswith(f"never fits this node: {constraint}: {reason}")
        assert body["nofit"]["never_fits"] is True and body["nofit"]["constraint"] == constraint
    lease = served.post("/place", {"gpus": 6, "reserve": {"owner": "job-never", "ttl_s": 600}}, token=served.token)
    assert lease.status == 200, lease.body
    try:
        reply = served.post("/place", {"gpus": 4})
        body = reply.json()
        assert reply.status == 409 and body["error"] == "no_fit" and body["nofit"]["never_fits"] is False
        assert "leased" in body["detail"]
        # Busy or not, a request the idle node cannot take stays 422.
        assert served.post("/place", {"gpus": 9}).status == 422
    finally:
        gone = served.request("DELETE", f"/leases/{lease.json()['lease']['id']}", token=served.token)
        assert gone.status in (200, 204)


def test_cli_exits_3_for_never_fits_and_1_for_busy_now():
    never = cli("--gpus", "4", "--single-numa")
    assert never.returncode == 3, never.stderr
    assert never.stderr == "topoagent place: never fits this node: no NUMA node has 4 free GPUs (most: 2 on node 3)\n"
    assert never.stdout.startswith("never fits this node (--single-numa): ")
    busy = cli("--gpus", "4", "--busy", "0,1,2,3,4")
    assert busy.returncode == 1 and busy.stderr.startswith("topoagent place: no fit: ")
    assert json.loads(cli("--gpus", "9", "--json").stdout)["never_fits"] is True


@pytest.mark.parametrize("lines,status", [
    (['{"gpus": 2, "busy": [0, 1, 2, 3, 4, 5, 6]}', '{"gpus": 9}', '{"gpus": 2}'], 3),
    (['{"gpus": 2, "busy": [0, 1, 2, 3, 4, 5, 6]}', '{"gpus": 2}'], 1),
    (['{"gpus": 9}', '{"gpus": 0}'], 2),  # bad input is the worst
])
def test_batch_lines_say_never_fits_and_the_exit_is_the_worst_lines(lines, status):
    out = cli("--batch", stdin="\n".join(lines) + "\n")
    assert out.returncode == status, out.stderr
    answers = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(answers) == len(lines)
    for line, answer in zip(lines, answers):
        if "error" not in answer and not answer["fit"]:
            assert answer["never_fits"] is ('"gpus": 9' in line)
