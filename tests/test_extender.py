"""`topoagent extender` as kube-scheduler meets it: 8 real agents on loopback (2 each of a
PCIe two-socket box, a DGX-1 hybrid cube mesh, a degraded HGX H100 and a DGX A100), the
real extender child binding through a loopback API server with the `kubernetes` client.
The calls are kube-scheduler's (k8s.io/kube-scheduler/extender/v1 documents, Go field
names), as bench/cluster.py replays them."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import ssl
import statistics
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import trustme  # requirements/test.txt: the mutual-TLS tests need it, never skip for want of it
from service_helpers import metric_value, promtool_complaints, wait_for

from bench.cluster import (
    RESOURCE,
    SNAPSHOTS,
    Cluster,
    CountOnly,
    Job,
    Node,
    Placed,
    ThroughExtender,
    ZoneFirst,
    _child_env,
    _free_port,
    _wait_line,
    cluster,
    fixtures_for,
    job_stream,
    replay,
    unanswering_node,
)
from bench.cluster_replay import LocalExtender, LocalZoneFirst, local_cluster
from topoagent.cluster.deviceplugin.pods import ANNOTATION
from topoagent.cluster.extender.nodetable import NodeTable
from topoagent.cluster.extender.wire import LEASE_ANNOTATION, PodError, PodRef, gpus_wanted, node_address, pod_ref, pod_request
from topoagent.placement import Placement, Request, place


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with cluster(fixtures_for(8), work=tmp_path_factory.mktemp("cluster")) as running:
        yield running


def new_pod(c: Cluster, gpus: int, annotations: dict[str, str] | None = None, name: str | None = None) -> dict:
    pod = {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name or f"pod-{uuid.uuid4().hex[:8]}", "namespace": "team-a", "uid": str(uuid.uuid4()),
                     "annotations": dict(annotations or {})},
        "spec": {"containers": [{"name": "main", "resources": {"limits": {RESOURCE: str(gpus)}}}]},
        "status": {"phase": "Pending"},
    }
    c.api.add_pod(pod)
    return pod


def args_for(c: Cluster, pod: dict, names: list[str] | None = None) -> dict:
    return {"Pod": pod, "Nodes": {"items": c.node_objects(names)}, "NodeNames": None}


def leases(c: Cluster) -> dict[str, list[dict]]:
    return {n.name: n.request("GET", "/leases")[1]["leases"] for n in c.nodes}


# First in the file: tests after it turn pods away, and the extender then polls those nodes
# (requeue), capacity requests this test would count as its own.

async def agents_served_by(app: Any, names: list[str], **options: Any) -> tuple[Any, Any]:
    """(runner, Agents): ``app`` served on a loopback port as the agent of every node in
    ``names`` (listed as if from the API server)."""
    from aiohttp import web

    from topoagent.cluster.extender import nodes

    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    table = NodeTable(None)
    table.replace(dict.fromkeys(names))
    return runner, nodes.Agents(f"http://127.0.0.1:{runner.addresses[0][1]}/{{node}}", table, **options)


def test_an_unchanged_node_is_answered_from_its_etag(c: Cluster) -> None:
    for node in c.nodes:  # each agent's first counter read swaps in its second snapshot: after it, nothing changes
        wait_for(f"{node.name}'s counters", lambda node=node: node.request("GET", "/topology")[1]["agent"]["snapshot_version"] >= 2,
                 timeout=120)
    def metrics() -> str:
        conn = socket.create_connection((c.extender.address, c.extender.port), timeout=10)
        conn.sendall(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        conn.close()
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.split(b"\r\n")[0].endswith(b" 200 OK") and promtool_complaints(body) == []
        return body.decode()

    pod = new_pod(c, 2, {"topoagent.io/pattern": "pipeline"})
    c.extender.call("filter", args_for(c, pod))
    before = metrics()
    c.extender.call("filter", args_for(c, pod))
    c.extender.call("prioritize", args_for(c, pod))
    after = metrics()

    def grew(name: str, labels: dict[str, str] | None = None) -> float:
        return (metric_value(after, name, labels) or 0) - (metric_value(before, name, labels) or 0)

    assert grew("topoagent_extender_capacity_requests_total", {"answer": "not_modified"}) == 2 * len(c.nodes)
    assert grew("topoagent_extender_capacity_requests_total", {"answer": "changed"}) == 0
    # Per node and call: the pod's request, from the cache, and on a whole node the ring through all its GPUs
    # (what a free pair is worth is asked for 1-GPU pods only).
    whole = [n for n in c.nodes if n.request("GET", "/capacity")[1]["free_gpus"] == n.matrix.size]
    assert grew("topoagent_extender_dry_runs_total", {"source": "cache"}) == 2 * (len(c.nodes) + len(whole))
    assert grew("topoagent_extender_dry_runs_total", {"source": "agent"}) == 0
    assert grew("topoagent_extender_requests_total", {"verb": "prioritize"}) == 1


def test_a_stream_of_pods_binds_disjoint_gpus_in_rank_order_and_beats_count_only(c: Cluster) -> None:
    jobs = job_stream(36, sum(n.gpus for n in c.nodes), load=0.9, seed=11)
    ours = ThroughExtender(c)
    checked = 0

    def check(c: Cluster, running: list[Placed]) -> None:
        nonlocal checked
        held: dict[str, set[int]] = {}
        for p in running:
            mine = set(p.gpus)
            assert not held.setdefault(p.node, set()) & mine, f"GPU handed out twice on {p.node}: {p.gpus}"
            held[p.node] |= mine
        newest = running[-1]
        pod = c.api.pod(f"job-{newest.job.id}", "bench")
        node = c.node(newest.node)
        chosen = pod["metadata"]["annotations"][ANNOTATION].split(",")
        assert len(chosen) == newest.job.gpus and set(chosen) <= set(node.uuid_index), "annotation names GPUs of another node"
        # Rank order: the agent's own lease, held by the pod, lists the same GPUs in the same order.
        lease = next(x for x in node.request("GET", "/leases")[1]["leases"] if x["id"] == pod["metadata"]["annotations"][LEASE_ANNOTATION])
        assert lease["gpu_uuids"] == chosen
        assert lease["owner"] == f"bench/job-{newest.job.id}/{pod['metadata']['uid']}"
        assert pod["spec"]["nodeName"] == newest.node
        checked += 1

    mine = replay(c, ours, jobs, check)
    assert checked == len(mine.placed) > 20
    assert set(ours.scores_seen) <= set(range(11)) and max(ours.scores_seen) == 10
    assert [b["node"] for b in c.api.bindings if b["namespace"] == "bench"] == [p.node for p in mine.placed]
    assert all(not held for held in leases(c).values()), "every finished job's lease was released"
    theirs = replay(c, CountOnly(c), jobs)
    assert len(mine.placed) == len(theirs.placed) == len(jobs)
    assert statistics.median(mine.ring_gbps) >= statistics.median(theirs.ring_gbps)
    assert statistics.mean(mine.ring_gbps) > statistics.mean(theirs.ring_gbps)
    assert all(not held for held in leases(c).values())


def whole_and_local(c: Cluster) -> set[str]:
    """The nodes with every GPU free and healthy whose GPUs all share local links: the
    agent's ring through all of them has satisfaction 1."""
    whole = set()
    for node in c.nodes:
        capacity = node.request("GET", "/capacity")[1]
        if capacity["free_gpus"] == capacity["gpus"]:
            status, answer = node.request("POST", "/place", {"gpus": capacity["gpus"]})
            if status == 200 and answer["satisfaction"] == 1:
                whole.add(node.name)
    return whole


def first_of(whole: set[str], a: str, b: str, better: bool) -> bool:
    """Whether node ``a`` must rank above ``b``: ``a`` is not whole and ``b`` is, or both are
    alike and ``a`` is ``better`` by the next term."""
    return (a not in whole and b in whole) or ((a in whole) == (b in whole) and better)


def test_scores_follow_the_agents_bandwidth_first_after_keeping_whole_nvlink_nodes(c: Cluster) -> None:
    """On the idle cluster the DGX-1s and DGX A100s are whole, every ring through all their
    GPUs on NVLink: a 2-GPU pod goes to any other node first (the degraded HGX, two GPUs
    unhealthy, is never whole; a PCIe node's ring crosses its sockets), best ring first."""
    whole = whole_and_local(c)
    assert {c.node(n).fixture for n in whole} == {"dgx1-v100", "dgx-a100"}, whole
    pod = new_pod(c, 2)
    priorities = c.extender.call("prioritize", args_for(c, pod))
    scores = {p["Host"]: p["Score"] for p in priorities}
    assert set(scores) == {n.name for n in c.nodes} and set(scores.values()) <= set(range(11))
    bandwidth = {}
    for node in c.nodes:
        status, answer = node.request("POST", "/place", {"gpus": 2})
        assert status == 200
        bandwidth[node.name] = answer["bandwidth_gbps"]
    for a in c.nodes:
        for b in c.nodes:
            if first_of(whole, a.name, b.name, bandwidth[a.name] > bandwidth[b.name]):
                assert scores[a.name] > scores[b.name], (a.fixture, b.fixture, scores)
    assert c.node(max(scores, key=lambda n: scores[n])).fixture == "degraded" and max(scores.values()) == 10


def test_a_one_gpu_pod_goes_where_it_breaks_the_least(c: Cluster) -> None:
    """A 1-GPU pod gets no ring, so its bandwidth ties everywhere: it leaves the whole NVLink
    nodes alone and, of the others, goes to the node whose best free pair is worth least to
    the next multi-GPU pod (PCIe); the 8-GPU pod that follows gets the best ring there is."""
    whole = whole_and_local(c)
    small = new_pod(c, 1)
    scores = {p["Host"]: p["Score"] for p in c.extender.call("prioritize", args_for(c, small))}
    best = max(scores, key=lambda n: scores[n])
    assert c.node(best).fixture == "pcie-2socket", {c.node(n).fixture: s for n, s in scores.items()}
    answers = {n.name: n.request("POST", "/place", {"gpus": 2}) for n in c.nodes}
    worth = {name: answer["bandwidth_gbps"] if status == 200 else 0 for name, (status, answer) in answers.items()}
    for a in c.nodes:
        for b in c.nodes:
            if first_of(whole, a.name, b.name, worth[a.name] < worth[b.name]):
                assert scores[a.name] > scores[b.name], (a.fixture, b.fixture, scores, answers[a.name], worth)
    big = {p["Host"]: p["Score"] for p in c.extender.call("prioritize", args_for(c, new_pod(c, 8)))}
    eight = {n.name: n.request("POST", "/place", {"gpus": 8}) for n in c.nodes}
    rings = {name: answer["bandwidth_gbps"] for name, (status, answer) in eight.items() if status == 200}
    assert rings[max(big, key=lambda n: big[n])] == max(rings.values())


def test_an_eight_gpu_pod_still_finds_an_nvswitch_node_whole_after_a_stream_of_small_pods(c: Cluster) -> None:
    """Small pods bound one after another through filter, prioritize and bind: each 2-GPU pod
    gets the best ring of the nodes it does not break whole (the degraded HGXs, then a PCIe
    node's socket), each 1-GPU pod a PCIe node; the DGX A100s and DGX-1s stay whole, and the
    8-GPU pod after them gets its full NVSwitch ring."""
    ours = ThroughExtender(c)
    a100s = [n.name for n in c.nodes if n.fixture == "dgx-a100"]
    placed: list[Placed] = []

    def bind(gpus: int) -> Placed:
        got = ours.place(Job(5000 + len(placed), 0.0, gpus, 1.0))
        assert got is not None, f"a {gpus}-GPU pod found no node after {[p.job.gpus for p in placed]}"
        placed.append(got)
        return got

    try:
        for n in range(10):  # 20 GPUs: the degraded nodes' 12 healthy ones, then 8 more
            bind(2)
            if n % 2:
                bind(1)
        fixture = {p.job.id: c.node(p.node).fixture for p in placed}
        assert {fixture[p.job.id] for p in placed if p.job.gpus == 1} == {"pcie-2socket"}
        assert [fixture[p.job.id] for p in placed if p.job.gpus == 2] == ["degraded"] * 6 + ["pcie-2socket"] * 4
        rings = [place(c.node(p.node).matrix, Request(gpus=2, include=tuple(sorted(p.gpus))), ()) for p in placed if p.job.gpus == 2]
        assert min(r.bandwidth_gbps or 0 for r in rings[:6] if isinstance(r, Placement)) >= 300.0, rings
        assert min(r.bandwidth_gbps or 0 for r in rings if isinstance(r, Placement)) >= 15.75, "no 2-GPU pod across sockets"
        assert all(ours.free_count[n.name] == 8 for n in c.nodes if n.fixture in ("dgx-a100", "dgx1-v100")), ours.free_count
        big = {p["Host"]: p["Score"] for p in c.extender.call("prioritize", args_for(c, new_pod(c, 8)))}
        winner = c.node(max(big, key=lambda n: (big[n], [-ord(ch) for ch in n])))
        assert winner.name in a100s and ours.free_count[winner.name] == 8
        assert winner.request("POST", "/place", {"gpus": 8})[1]["bandwidth_gbps"] == 300.0
    finally:
        for p in placed:
            ours.release(p)
    assert all(not held for held in leases(c).values())


@contextlib.contextmanager
def holding(c: Cluster, held: list[tuple[Node, int]]) -> Iterator[None]:
    """Another job leases that many GPUs of each node for the block; released after it."""
    leased = []
    try:
        for node, gpus in held:
            status, doc = node.request("POST", "/place", {"gpus": gpus, "reserve": {"owner": "someone-else", "ttl_s": 600}}, token=c.token)
            assert status == 200, doc
            leased.append((node, doc["lease"]["id"]))
        yield
    finally:
        for node, lease in leased:
            assert node.request("DELETE", f"/leases/{lease}", token=c.token)[0] == 200


def test_a_pod_that_fills_a_node_exactly_goes_there_first(c: Cluster) -> None:
    """At the same ring, a 2-GPU pod takes the DGX A100 with exactly 2 GPUs free (it breaks
    nothing there) over the one with 4 free."""
    a100s = [n for n in c.nodes if n.fixture == "dgx-a100"]
    with holding(c, [(n, n.gpus) for n in c.nodes if n.fixture == "degraded"] + [(a100s[0], 6), (a100s[1], 4)]):
        scores = {p["Host"]: p["Score"] for p in c.extender.call("prioritize", args_for(c, new_pod(c, 2)))}
        assert {n.request("POST", "/place", {"gpus": 2})[1]["bandwidth_gbps"] for n in a100s} == {300.0}
        assert scores[a100s[0].name] == 10 and scores[a100s[1].name] < 10, scores


def test_at_the_same_ring_a_pod_keeps_the_largest_block_a_node_can_give_then_fills_the_fullest(c: Cluster) -> None:
    """Two DGX A100s give a 2-GPU pod the same ring (the degraded HGXs, which give more, are
    full).  With 4 and 6 free it goes to the one with 6: 4 are left there, still a block of 4
    for a 4-GPU pod, where the other would keep only 2.  With 6 and 7 free both keep a block of
    4, and it goes to the one with 6: the fuller node, so the other's larger block stays."""
    a100s = [n for n in c.nodes if n.fixture == "dgx-a100"]
    full = [(n, n.gpus) for n in c.nodes if n.fixture == "degraded"]

    def winner(held: list[tuple[Node, int]]) -> tuple[str, dict[str, int]]:
        with holding(c, held):
            assert {n.request("POST", "/place", {"gpus": 2})[1]["bandwidth_gbps"] for n in a100s} == {300.0}
            scores = {p["Host"]: p["Score"] for p in c.extender.call("prioritize", args_for(c, new_pod(c, 2)))}
            return max(scores, key=lambda n: (scores[n], [-ord(ch) for ch in n])), scores

    # a100s[0] is the lower name: the one the scheduler would take at equal scores.
    best, scores = winner([*full, (a100s[0], 4), (a100s[1], 2)])
    assert best == a100s[1].name and scores[a100s[1].name] > scores[a100s[0].name], scores
    best, scores = winner([*full, (a100s[0], 1), (a100s[1], 2)])
    assert best == a100s[1].name and scores[a100s[1].name] > scores[a100s[0].name], scores


def test_the_in_process_replay_makes_the_real_extenders_choices(c: Cluster) -> None:
    """bench.cluster_replay judges scores over hundreds of streams: only worth it while it
    places each pod where the real extender, over loopback, binds it (and so does zone-first)."""
    jobs = job_stream(40, sum(n.gpus for n in c.nodes), load=0.9, seed=2)  # pods wait under both: retries replayed too
    local = local_cluster([n.fixture for n in c.nodes])
    assert [n.gpus for n in local.nodes] == [n.gpus for n in c.nodes]
    for real_policy, local_policy in ((ThroughExtender, LocalExtender), (ZoneFirst, LocalZoneFirst)):
        real = replay(c, real_policy(c), jobs)
        mine = replay(local, local_policy(local), jobs)  # type: ignore[arg-type]  (a LocalCluster)
        assert [(p.job.id, p.node, p.gpus) for p in mine.placed] == [(p.job.id, p.node, p.gpus) for p in real.placed]
        assert (mine.waited, mine.ring_gbps) == (real.waited, real.ring_gbps) and real.waited > 0
    assert all(not held for held in leases(c).values())


def test_a_full_node_and_a_too_small_node_say_why(c: Cluster) -> None:
    full = c.nodes[3]
    status, held = full.request("POST", "/place", {"gpus": full.gpus, "reserve": {"owner": "someone-else", "ttl_s": 600}}, token=c.token)
    assert status == 200
    try:
        result = c.extender.call("filter", args_for(c, new_pod(c, 2)))
        assert result["FailedNodes"] == {full.name: f"0 of {full.gpus} GPUs free; the pod needs 2"}
        assert full.name not in {n["metadata"]["name"] for n in result["Nodes"]["items"]}
        huge = c.extender.call("filter", args_for(c, new_pod(c, 16)))
        assert huge["Nodes"]["items"] == [] and huge["FailedNodes"] == {}
        assert huge["FailedAndUnresolvableNodes"] == {n.name: f"the node has {n.matrix.size} GPUs; the pod needs 16" for n in c.nodes}
    finally:
        assert full.request("DELETE", f"/leases/{held['lease']['id']}", token=c.token)[0] == 200


def test_a_pod_rejected_for_a_lease_is_requeued_within_seconds_of_the_release(c: Cluster) -> None:
    """The release changes nothing Kubernetes sees, so the extender writes the node's new
    capacity ETag on its Node: the update kube-scheduler retries rejected pods on."""
    full = c.nodes[2]
    free = full.request("GET", "/capacity")[1]["free_gpus"]
    status, held = full.request("POST", "/place", {"gpus": free, "reserve": {"owner": "someone-else", "ttl_s": 600}}, token=c.token)
    assert status == 200, held
    result = c.extender.call("filter", args_for(c, new_pod(c, 1)))
    assert full.name in result["FailedNodes"]
    patched_before = [x for x in c.api.node_patch_times if x[0] == full.name]
    before = c.api.nodes[full.name]["metadata"].get("annotations", {}).get("topoagent.io/capacity")
    assert full.request("DELETE", f"/leases/{held['lease']['id']}", token=c.token)[0] == 200
    released = time.monotonic()
    # Within seconds: the wait's bound, which fails the test.
    patch = wait_for("the Node's capacity annotation", lambda: next(
        (x for x in c.api.node_patch_times[len(patched_before):] if x[0] == full.name and x not in patched_before), None), timeout=5)
    after = c.api.nodes[full.name]["metadata"]["annotations"]["topoagent.io/capacity"]
    assert after not in (before, "unanswered")
    print(f"extender: lease released -> Node annotated in {patch[1] - released:.2f} s")
    # Retried now, the pod fits the node again.
    assert full.name in {n["metadata"]["name"] for n in c.extender.call("filter", args_for(c, new_pod(c, 1)))["Nodes"]["items"]}


def test_the_pods_wishes_are_the_agents_words(c: Cluster) -> None:
    """A node passes exactly when its own agent places the same request."""
    wishes = {"topoagent.io/min-level": "NV12", "topoagent.io/affinity": "better", "topoagent.io/single-numa": "false"}
    pod = new_pod(c, 4, wishes)
    result = c.extender.call("filter", args_for(c, pod))
    assert result["Error"] == "" and result["NodeNames"] is None
    passed = {n["metadata"]["name"] for n in result["Nodes"]["items"]}
    for node in c.nodes:
        status, answer = node.request("POST", "/place", {"gpus": 4, "min_level": "NV12", "affinity": "better", "single_numa": False})
        assert (node.name in passed) == (status == 200), (node.fixture, answer)
        if status != 200:
            # Nothing is busy: a node that refuses could not take it with every GPU free
            # (422), so preempting there would not help -- unresolvable (issue 27).
            assert status == 422, (node.fixture, answer)
            assert result["FailedAndUnresolvableNodes"][node.name] == answer["detail"]
    assert passed and len(passed) < len(c.nodes)


def test_a_bad_annotation_fails_every_node_with_the_parsers_message(c: Cluster) -> None:
    pod = new_pod(c, 2, {"topoagent.io/pattern": "ringg"})
    result = c.extender.call("filter", args_for(c, pod))
    said = c.nodes[0].request("POST", "/place", {"gpus": 2, "pattern": "ringg"})[1]["detail"]
    assert said.startswith("pattern: ")
    assert result["FailedAndUnresolvableNodes"] == {name: "topoagent.io/pattern: " + said.removeprefix("pattern: ") for name in result["FailedAndUnresolvableNodes"]}
    assert len(result["FailedAndUnresolvableNodes"]) == len(c.nodes) and result["Nodes"]["items"] == [] and result["Error"] == ""
    assert {p["Score"] for p in c.extender.call("prioritize", args_for(c, pod))} == {0}


def test_names_only_when_node_cache_capable(c: Cluster) -> None:
    pod = new_pod(c, 8)
    known = [n.name for n in c.nodes]  # their addresses come from the API server's Node objects
    result = c.extender.call("filter", {"Pod": pod, "NodeNames": [*known, "node-never-seen"]})
    assert result["Nodes"] is None and set(result["NodeNames"]) <= set(known) and result["NodeNames"]
    assert "not among the API server's Node objects" in result["FailedNodes"]["node-never-seen"]


class Garbled(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "7")
        self.end_headers()
        self.wfile.write(b'{"free_')

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def silent(c: Cluster) -> Iterator[list[tuple[str, str]]]:
    """Three nodes whose agents do not answer: one refuses connections, one accepts and
    says nothing, one answers what is not JSON."""
    port = c.nodes[0].port
    base = c.nodes[0].address.rsplit(".", 1)[0]
    hung = socket.socket()
    hung.bind((f"{base}.201", port))
    hung.listen(8)  # never accepted: the request is sent and nothing comes back
    garbled = ThreadingHTTPServer((f"{base}.202", port), Garbled)
    threading.Thread(target=garbled.serve_forever, daemon=True).start()
    c.unanswering = [("node-refuses", f"{base}.200"), ("node-hangs", f"{base}.201"), ("node-garbles", f"{base}.202")]
    for name, address in c.unanswering:
        c.api.add_node(unanswering_node(name, address))
    try:
        yield c.unanswering
    finally:
        for name, _ in c.unanswering:
            c.api.remove_node(name)
        c.unanswering = []
        hung.close()
        garbled.shutdown()
        garbled.server_close()


def test_an_agent_that_does_not_answer_is_filtered_out_with_the_reason(c: Cluster, silent: list) -> None:
    pod = new_pod(c, 1)
    result = c.extender.call("filter", args_for(c, pod))
    assert result["Error"] == ""
    assert "did not answer" in result["FailedNodes"]["node-refuses"]
    assert "did not answer within 2 s" in result["FailedNodes"]["node-hangs"]
    assert "the answer is not JSON" in result["FailedNodes"]["node-garbles"]
    assert {n["metadata"]["name"] for n in result["Nodes"]["items"]} == {n.name for n in c.nodes}
    # Not asked again at once: the next cycle says so instead of waiting out the timeout again.
    again = c.extender.call("filter", args_for(c, pod))["FailedNodes"]["node-hangs"]
    assert again.startswith("the node's agent did not answer within 2 s (") and "asked again after 10 s" in again


def test_with_unanswered_pass_it_stays_with_the_lowest_score(c: Cluster, silent: list, tmp_path: Path) -> None:
    port = c.nodes[0].port
    log = tmp_path / "extender.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-url", f"http://{{address}}:{port}",
                                 "--unanswered", "pass", "--agent-timeout", "0.5", "--kube-api", c.api.url], stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    try:
        line = _wait_line(proc, "extender", log)
        other = type(c.extender)(proc, "127.0.0.1", int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0]))
        pod = new_pod(c, 1)
        result = other.call("filter", args_for(c, pod))
        assert {n["metadata"]["name"] for n in result["Nodes"]["items"]} == {n.name for n in c.nodes} | {"node-refuses", "node-hangs", "node-garbles"}
        scores = {p["Host"]: p["Score"] for p in other.call("prioritize", args_for(c, pod))}
        assert scores["node-refuses"] == scores["node-hangs"] == scores["node-garbles"] == 0
        assert min(scores[n.name] for n in c.nodes) >= 1
        assert "event=agent_unanswered" in wait_for("the log line", lambda: log.read_text() if "treated_as=pass" in log.read_text() else "", log=log.read_text)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


@pytest.fixture
def fabric_down(c: Cluster, tmp_path: Path) -> Iterator[dict]:
    """A node whose agent answers, and says it is not ready for placement: the recorded DGX
    A100 whose fabric manager never started (fixtures/snapshots/no-fabric-manager)."""
    address = c.nodes[0].address.rsplit(".", 1)[0] + ".203"
    log = tmp_path / "agent-fabric-down.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(SNAPSHOTS / "no-fabric-manager"),
                                 "--listen", f"{address}:{c.nodes[0].port}", "--state-dir", str(tmp_path / "state")],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    try:
        _wait_line(proc, "agent on no-fabric-manager", log)
        node = unanswering_node("node-fabric-down", address)  # a Node object, as for the silent ones
        c.api.add_node(node)

        def blocked() -> bool:
            conn = http.client.HTTPConnection(address, c.nodes[0].port, timeout=5)
            try:
                conn.request("GET", "/readyz")
                return b"not_ready_for_placement" in conn.getresponse().read()
            finally:
                conn.close()
        wait_for("the agent's first snapshot", blocked, log=log.read_text)
        yield node
    finally:
        c.api.remove_node("node-fabric-down")
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def with_node(c: Cluster, pod: dict, node: dict) -> dict:
    return {"Pod": pod, "Nodes": {"items": [*c.node_objects(), node]}, "NodeNames": None}


def test_a_node_not_ready_for_placement_is_refused_with_the_agents_reason(c: Cluster, fabric_down: dict) -> None:
    pod, name = new_pod(c, 1), fabric_down["metadata"]["name"]
    for _ in range(2):  # an answer, not a silence: asked again every call, never quieted
        result = c.extender.call("filter", with_node(c, pod, fabric_down))
        assert name not in {n["metadata"]["name"] for n in result["Nodes"]["items"]}
        assert name not in result["FailedNodes"]  # no preemption mends a fabric
        reason = result["FailedAndUnresolvableNodes"][name]
        assert reason.startswith("not ready for placement: nvswitch-no-nvlink (nvswitch): 6 NVSwitch(es) on the PCI bus"), reason
    assert {n["metadata"]["name"] for n in result["Nodes"]["items"]} == {n.name for n in c.nodes}


def test_with_unanswered_pass_a_node_not_ready_for_placement_is_still_refused(c: Cluster, fabric_down: dict, tmp_path: Path) -> None:
    port = c.nodes[0].port
    log = tmp_path / "extender.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-url", f"http://{{address}}:{port}",
                                 "--unanswered", "pass", "--kube-api", c.api.url], stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    try:
        line = _wait_line(proc, "extender", log)
        other = type(c.extender)(proc, "127.0.0.1", int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0]))
        result = other.call("filter", with_node(c, new_pod(c, 1), fabric_down))
        assert {n["metadata"]["name"] for n in result["Nodes"]["items"]} == {n.name for n in c.nodes}
        assert result["FailedAndUnresolvableNodes"]["node-fabric-down"].startswith("not ready for placement: nvswitch-no-nvlink (nvswitch): ")
        assert "agent_unanswered" not in log.read_text()  # it answered: not logged as "did not answer"
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def test_a_failed_bind_releases_the_lease(c: Cluster) -> None:
    pod = new_pod(c, 2, name="doomed")
    c.api.fail_binding.add("doomed")
    try:
        best = max(c.extender.call("prioritize", args_for(c, pod)), key=lambda p: p["Score"])["Host"]
        meta = pod["metadata"]
        result = c.extender.call("bind", {"PodName": "doomed", "PodNamespace": "team-a", "PodUID": meta["uid"], "Node": best})
    finally:
        c.api.fail_binding.discard("doomed")
    assert "HTTP 500" in result["Error"] and "etcdserver" in result["Error"]
    assert all(not held for held in leases(c).values()), "the lease went with the failed bind"
    assert "nodeName" not in c.api.pod("doomed", "team-a")["spec"]
    # A pod that was replaced (another UID) is not bound either, and nothing is leased.
    stale = c.extender.call("bind", {"PodName": "doomed", "PodNamespace": "team-a", "PodUID": "not-the-uid", "Node": best})
    assert "it was replaced" in stale["Error"]
    assert all(not held for held in leases(c).values())


def test_a_retried_bind_leases_nothing_more(c: Cluster) -> None:
    pod = new_pod(c, 4, name="twice")
    meta = pod["metadata"]
    best = max(c.extender.call("prioritize", args_for(c, pod)), key=lambda p: p["Score"])["Host"]
    binding = {"PodName": "twice", "PodNamespace": "team-a", "PodUID": meta["uid"], "Node": best}
    assert c.extender.call("bind", binding) == {"Error": ""}
    held = [x for x in c.node(best).request("GET", "/leases")[1]["leases"] if x["owner"].startswith("team-a/twice/")]
    assert len(held) == 1 and held[0]["id"] == c.api.pod("twice", "team-a")["metadata"]["annotations"][LEASE_ANNOTATION]
    assert "already bound to node " + best in c.extender.call("bind", binding)["Error"]
    assert [x["id"] for x in c.node(best).request("GET", "/leases")[1]["leases"]] == [held[0]["id"]]
    assert c.node(best).request("DELETE", f"/leases/{held[0]['id']}", token=c.token)[0] == 200


def test_hostile_bodies_get_400_and_the_extender_keeps_serving(c: Cluster) -> None:
    for verb, body in (("filter", b"{not json"), ("filter", b"[]"), ("prioritize", b'{"Pod": 3, "NodeNames": []}'),
                       ("filter", b'{"Pod": {}, "Nodes": {"items": [{"metadata": {"name": 7}}]}}'), ("bind", b'{"PodName": ""}')):
        conn = socket.create_connection((c.extender.address, c.extender.port), timeout=10)
        conn.sendall(b"POST /scheduler/" + verb.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + b"Content-Length: " + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        reply = b""
        while chunk := conn.recv(65536):
            reply += chunk
        conn.close()
        head, _, payload = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 400"), (verb, body, reply)
        assert json.loads(payload)["error"] == "bad_request"
    assert c.extender.call("filter", args_for(c, new_pod(c, 0)))["Error"] == ""


def test_a_node_with_malformed_addresses_fails_alone_with_a_reason(c: Cluster) -> None:
    """A Node (in the API server) whose address entries are of the wrong JSON types has no
    usable address: it fails filtering with the reason, the other nodes are answered, never a 500."""
    good = c.nodes[0]
    malformed = [{"metadata": {"name": f"malformed-{k}"}, "status": {"addresses": addresses}} for k, addresses in enumerate([
        [{"type": ["InternalIP"], "address": "1.2.3.4"}],
        [{"type": {"x": 1}, "address": "1.2.3.4"}, {"type": "InternalIP", "address": ["1.2.3.4"]}, "InternalIP", 7],
        {"type": "InternalIP"},
    ])]
    for node in malformed:
        c.api.add_node(node)
    try:
        pod = new_pod(c, 1)
        body = {"Pod": pod, "Nodes": {"items": [*c.node_objects([good.name]), *malformed]}}
        result = c.extender.call("filter", body)
        assert [n["metadata"]["name"] for n in result["Nodes"]["items"]] == [good.name], result
        assert sorted(result["FailedNodes"]) == [m["metadata"]["name"] for m in malformed]
        assert all("has no usable address" in why for why in result["FailedNodes"].values()), result["FailedNodes"]
        scores = c.extender.call("prioritize", body)
        assert {s["Host"] for s in scores} == {good.name, *result["FailedNodes"]}
    finally:
        for node in malformed:
            c.api.remove_node(node["metadata"]["name"])


def test_a_nodes_address_is_its_first_usable_one_by_kind() -> None:
    assert node_address({"status": {"addresses": [
        {"type": ["InternalIP"], "address": "9.9.9.9"}, {"type": "Hostname", "address": "gpu1"},
        {"type": "InternalIP", "address": "not an address!"}, {"type": "InternalIP", "address": "10.0.0.1"},
        {"type": "InternalIP", "address": "10.0.0.2"}]}}) == "10.0.0.1"
    assert node_address({"status": {"addresses": [{"type": "Hostname", "address": "gpu1"}, None, []]}}) == "gpu1"
    assert node_address({"status": {"addresses": [{"type": {}, "address": {}}]}}) is None
    assert pod_ref({"metadata": {"namespace": ["x"], "name": {"a": 1}, "uid": 7}}) == PodRef("default", "", "")


def test_a_pods_gpu_count_and_wishes_read_like_the_agent_reads_them() -> None:
    def pod(containers: list, init: list | None = None, annotations: dict | None = None) -> dict:
        return {"metadata": {"annotations": annotations or {}}, "spec": {"containers": containers, "initContainers": init or []}}

    def gpus(n: object, kind: str = "limits") -> dict:
        return {"resources": {kind: {RESOURCE: n}}}

    assert gpus_wanted(pod([gpus("2"), gpus("1", "requests"), {}])) == 3
    assert gpus_wanted(pod([gpus("1")], init=[gpus("4")])) == 4  # init containers run alone, first
    assert pod_request(pod([{}])) is None
    assert pod_request(pod([gpus("2")], annotations={"topoagent.io/single-numa": "true", "topoagent.io/pattern": "pipeline"})) == {
        "gpus": 2, "single_numa": True, "pattern": "pipeline"}
    for wishes, said in (({"topoagent.io/single-numa": "yes"}, 'topoagent.io/single-numa: expected true or false, got "yes"'),
                              ({"topoagent.io/min-level": "NVX"}, "topoagent.io/min-level: expected a GPU-to-GPU link level")):
        with pytest.raises(PodError, match=said):
            pod_request(pod([gpus("2")], annotations=wishes))
    with pytest.raises(PodError, match=r"containers\[0\].resources.limits\[nvidia.com/gpu\]: expected a whole number"):
        gpus_wanted(pod([gpus("1.5")]))
    # Not a Pod kube-scheduler would send, but a body anyone reaching the service may: an
    # answer for the pod (every node fails with the reason), not a crash (HTTP 500).
    with pytest.raises(PodError, match=r"spec.containers: expected a list, got int"):
        gpus_wanted({"spec": {"containers": 5}})


def test_help_shows_the_scheduler_config_and_bad_flags_exit_2() -> None:
    shown = subprocess.run([sys.executable, "-P", "-m", "topoagent", "extender", "--help"], capture_output=True, text=True, timeout=60, env=_child_env())
    assert shown.returncode == 0
    assert max(map(len, shown.stdout.splitlines())) <= 100  # the raw formatter wraps nothing itself
    for words in ("filterVerb: filter", "bindVerb: bind", "managedResources", "topoagent.io/min-level", "topoagent.io/gpus", "--unanswered",
                  "enableHTTPS: true", "--tls-cert-file", "--client-ca-file", "--insecure-bind-without-client-auth"):
        assert words in shown.stdout
    for flags, said in ((["--agent-url", "http://agent:9477"], "--agent-url"), (["--bind"], "--agent-token-file"), (["--agent-timeout", "0"], "--agent-timeout")):
        bad = subprocess.run([sys.executable, "-P", "-m", "topoagent", "extender", *flags], capture_output=True, text=True, timeout=60, env=_child_env())
        assert bad.returncode == 2 and said in bad.stderr, (flags, bad.stderr)


def test_the_stream_is_the_same_for_every_policy() -> None:
    assert job_stream(50, 64, 0.9, 3) == job_stream(50, 64, 0.9, 3)
    assert {j.gpus for j in job_stream(200, 64, 0.9, 3)} == {1, 2, 4, 8}
    assert isinstance(job_stream(1, 8, 0.5, 1)[0], Job)


def test_an_agents_answer_is_read_whole_refused_past_the_bound_and_kept_small() -> None:
    """An answer that comes in many chunks is read to its end (one read() gives one chunk),
    and one past the limit is the agent's failure, not the extender's memory; of what is
    read, the cache keeps only the figures a verdict needs."""
    import asyncio

    from aiohttp import web

    from topoagent.cluster.extender import nodes

    async def main() -> None:
        sizes = {"big": 600_000, "huge": nodes.MAX_RESPONSE_BYTES}

        async def capacity(request: web.Request) -> web.StreamResponse:
            pad = "x" * sizes[request.match_info["node"]]
            body = json.dumps({"gpus": 8, "free_gpus": 8, "pad": pad}).encode()
            resp = web.StreamResponse(headers={"Content-Type": "application/json", "ETag": '"1"'})
            await resp.prepare(request)
            try:
                for at in range(0, len(body), 16384):
                    await resp.write(body[at:at + 16384])
                    await asyncio.sleep(0)
                await resp.write_eof()
            except ConnectionResetError:  # the extender stopped reading "huge"
                pass
            return resp

        async def place(request: web.Request) -> web.Response:
            return web.json_response({"gpus": [{"index": 0}, {"index": 1}], "bandwidth_gbps": 300.0, "pad": "x" * 100_000,
                                      "objective": {"numa_distance": 10, "damage": 2, "pad": "y" * 1000}})

        app = web.Application()
        app.router.add_get("/{node}/capacity", capacity)
        app.router.add_post("/{node}/place", place)
        runner, agents = await agents_served_by(app, ["big", "huge"])
        try:
            etag, doc = await agents.capacity("big")
            assert doc == {"gpus": 8, "free_gpus": 8} and etag == '"1"'  # all the verdict reads, all that is kept
            for _ in range(2):  # the agent's answer, then the cache's: the same few figures
                assert await agents.dry_run("big", etag, {"gpus": 2}) == {"bandwidth_gbps": 300.0, "objective": {"numa_distance": 10},
                                                                          "satisfaction": None}
            assert agents.asked["dry_run_agent"] == agents.asked["dry_run_cache"] == 1
            assert len(json.dumps([agents._capacity["big"][1], agents._answers["big"][1]])) < 300
            with pytest.raises(nodes.Unreachable, match="larger than"):
                await agents.capacity("huge")
        finally:
            await agents.close()
            await runner.cleanup()

    asyncio.run(main())


def test_the_sweeps_ask_at_most_concurrency_agents_at_once_and_never_hold_up_a_scheduling_call() -> None:
    """One bound for the background sweeps (the lease sweep asked fixed batches of 32, the
    requeue watch and the holds keeper 16 each, whatever --concurrency said): at most
    --concurrency agents at once, in turns of their own, so a scheduling call's verdict is
    answered while a sweep holds every turn."""
    import asyncio

    from aiohttp import web

    from topoagent.cluster.extender.wire import Candidate

    async def main() -> None:
        asking, peak, full, go = 0, 0, asyncio.Event(), asyncio.Event()

        async def leases(request: web.Request) -> web.Response:
            nonlocal asking, peak
            asking += 1
            peak = max(peak, asking)
            if asking == 2:
                full.set()
            await go.wait()  # held until the scheduling call has its answer
            asking -= 1
            return web.json_response({"leases": [{"id": request.match_info["node"], "owner": "x"}]})

        async def capacity(request: web.Request) -> web.Response:
            return web.json_response({"gpus": 8, "free_gpus": 0}, headers={"ETag": '"1"'})

        app = web.Application()
        app.router.add_get("/{node}/leases", leases)
        app.router.add_get("/{node}/capacity", capacity)
        names = [f"n{i}" for i in range(7)]
        runner, agents = await agents_served_by(app, [*names, "scheduled"], concurrency=2, timeout_s=60)
        try:
            sweep = asyncio.ensure_future(agents.each(names, agents.leases))
            async with asyncio.timeout(60):  # however slow a loaded machine is
                await full.wait()
                verdict = await agents.verdict(Candidate("scheduled", None, None), {"gpus": 1})
            assert verdict.answered and not verdict.fits and "0 of 8 GPUs free" in verdict.reason
            go.set()
            answers = await sweep
            assert [a[0]["id"] for a in answers if a] == names  # each node's answer, in the nodes' order
            assert peak == 2
        finally:
            await agents.close()
            await runner.cleanup()

    asyncio.run(main())


# --- mutual TLS: only kube-scheduler's client certificate is answered ------------------------
# Real handshakes over loopback: a throwaway CA signs the extender's certificate (127.0.0.1)
# and kube-scheduler's; another CA signs a certificate that must be refused.


@dataclass
class Certs:
    dir: Path
    ca: Any  # trustme.CA
    other_ca: Any

    def path(self, name: str) -> str:
        return str(self.dir / name)

    def client(self, cert: str | None = None, key: str | None = None) -> ssl.SSLContext:
        """A client trusting the extender's CA, presenting ``cert``/``key`` when given."""
        context = ssl.create_default_context(cafile=self.path("ca.crt"))
        if cert is not None:
            context.load_cert_chain(self.path(cert), self.path(key or ""))
        return context


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    where = tmp_path_factory.mktemp("certs")
    ca, other_ca = trustme.CA(), trustme.CA()
    ca.cert_pem.write_to_path(str(where / "ca.crt"))
    other_ca.cert_pem.write_to_path(str(where / "other-ca.crt"))
    for name, issuer, identities, common_name in (("server", ca, ("127.0.0.1", "localhost"), None),
                                                  ("scheduler", ca, ("kube-scheduler.example",), "kube-scheduler"),
                                                  ("stranger", other_ca, ("kube-scheduler.example",), "kube-scheduler")):
        issued = issuer.issue_cert(*identities, common_name=common_name)
        issued.cert_chain_pems[0].write_to_path(str(where / f"{name}.crt"))
        issued.private_key_pem.write_to_path(str(where / f"{name}.key"))
    return Certs(where, ca, other_ca)


@dataclass
class TLSExtender:
    port: int
    log: Path
    probe_port: int


def https_call(port: int, context: ssl.SSLContext | None, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    """One request on its own connection (plain HTTP when ``context`` is None)."""
    if context is None:
        conn: http.client.HTTPConnection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=context)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        return resp.status, json.loads(raw) if raw and resp.headers.get_content_type() == "application/json" else raw
    finally:
        conn.close()


@pytest.fixture(scope="module")
def tls(c: Cluster, certs: Certs) -> Iterator[TLSExtender]:
    """A second extender on the cluster's agents and API server, as extender.yaml runs it:
    --bind behind mutual TLS."""
    log = c.work / "extender-tls.log"
    probe_port = _free_port("127.0.0.1")
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-url", f"http://{{address}}:{c.nodes[0].port}",
             "--agent-token-file", str(c.work / "token"), "--bind", "--kube-api", c.api.url, "--probe-listen", f"127.0.0.1:{probe_port}",
             "--tls-cert-file", certs.path("server.crt"), "--tls-key-file", certs.path("server.key"), "--client-ca-file", certs.path("ca.crt")],
            stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    try:
        line = _wait_line(proc, "extender with TLS", log)
        assert f"callers need a certificate from {certs.path('ca.crt')}" in line
        yield TLSExtender(int(line.split("https://127.0.0.1:", 1)[1].split("/", 1)[0]), log, probe_port)
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()


def leases_of(c: Cluster, pod: dict) -> list[dict]:
    owner = f"{pod['metadata']['namespace']}/{pod['metadata']['name']}/"
    return [x for held in leases(c).values() for x in held if x["owner"].startswith(owner)]


def test_kube_schedulers_certificate_gets_filter_prioritize_and_bind(c: Cluster, certs: Certs, tls: TLSExtender) -> None:
    scheduler = certs.client("scheduler.crt", "scheduler.key")
    pod = new_pod(c, 2, name="over-tls")
    status, filtered = https_call(tls.port, scheduler, "POST", "/scheduler/filter", args_for(c, pod))
    assert status == 200 and filtered["Error"] == "" and filtered["Nodes"]["items"]
    status, priorities = https_call(tls.port, scheduler, "POST", "/scheduler/prioritize", args_for(c, pod))
    assert status == 200 and max(p["Score"] for p in priorities) == 10
    best = max(priorities, key=lambda p: p["Score"])["Host"]
    binding = {"PodName": "over-tls", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": best}
    status, bound = https_call(tls.port, scheduler, "POST", "/scheduler/bind", binding)
    (held,) = leases_of(c, pod)
    try:
        assert (status, bound) == (200, {"Error": ""})
        assert c.api.pod("over-tls", "team-a")["spec"]["nodeName"] == best
        assert c.api.bindings[-1] == {"namespace": "team-a", "name": "over-tls", "uid": pod["metadata"]["uid"], "node": best}
        # Who asked is in the log, from the verified certificate.
        said = wait_for("the bind's caller", lambda: [x for x in tls.log.read_text().splitlines() if "event=bind_asked" in x], log=tls.log.read_text)
        assert "pod=team-a/over-tls" in said[0] and ",CN=kube-scheduler\"" in said[0]
        # /metrics and the probes answer a client with a certificate on the main port too.
        assert https_call(tls.port, scheduler, "GET", "/metrics")[0] == 200
        assert https_call(tls.port, scheduler, "GET", "/healthz")[0] == 200
    finally:
        assert c.node(best).request("DELETE", f"/leases/{held['id']}", token=c.token)[0] == 200


def test_without_a_client_certificate_the_handshake_fails_and_the_probes_answer_apart(c: Cluster, certs: Certs, tls: TLSExtender) -> None:
    """A caller without a certificate does not complete the TLS handshake, on any path, so it
    cannot hold a request open either; kubelet's probes (no certificate) answer on
    --probe-listen, which serves nothing else; nothing is leased or bound."""
    bare = certs.client()
    pod = new_pod(c, 1, name="not-yours")
    bindings = len(c.api.bindings)
    binding = {"PodName": "not-yours", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": c.nodes[0].name}
    for method, path, body in (("GET", "/healthz", None), ("POST", "/scheduler/bind", binding), ("POST", "/healthz/../scheduler/bind", binding),
                               ("POST", "/scheduler/filter", args_for(c, pod)), ("GET", "/metrics", None)):
        with pytest.raises(OSError):  # an alert (SSLError) or a closed connection, as TLS 1.3 has it
            https_call(tls.port, bare, method, path, body)
    assert https_call(tls.probe_port, None, "GET", "/healthz") == (200, {"status": "alive"})
    assert https_call(tls.probe_port, None, "GET", "/readyz") == (200, {"status": "ready"})
    for method, path, body in (("POST", "/scheduler/bind", binding), ("GET", "/metrics", None), ("POST", "/scheduler/filter", args_for(c, pod))):
        assert https_call(tls.probe_port, None, method, path, body)[0] in (404, 405), path
    assert len(c.api.bindings) == bindings and "nodeName" not in c.api.pod("not-yours", "team-a")["spec"]
    assert leases_of(c, pod) == []
    assert "pod=team-a/not-yours" not in tls.log.read_text()  # refused before the handler: no bind was asked


def test_a_certificate_from_another_ca_or_plain_http_is_refused_at_the_handshake(c: Cluster, certs: Certs, tls: TLSExtender) -> None:
    pod = new_pod(c, 1, name="stranger")
    bindings = len(c.api.bindings)
    binding = {"PodName": "stranger", "PodNamespace": "team-a", "PodUID": pod["metadata"]["uid"], "Node": c.nodes[0].name}
    for context in (certs.client("stranger.crt", "stranger.key"), None):
        for path in ("/scheduler/bind", "/readyz"):
            # TLS 1.3: the client's side of the handshake may end before the server's verdict,
            # which then arrives as an alert (SSLError) or a closed connection.
            with pytest.raises(OSError):
                https_call(tls.port, context, "POST" if path != "/readyz" else "GET", path, binding if path != "/readyz" else None)
    assert len(c.api.bindings) == bindings and "nodeName" not in c.api.pod("stranger", "team-a")["spec"]
    assert leases_of(c, pod) == []


def test_bad_tls_start_ups_exit_2_with_one_line_naming_the_problem(certs: Certs, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("a-token\n")
    cert, key, ca = certs.path("server.crt"), certs.path("server.key"), certs.path("ca.crt")
    bind = ["--bind", "--agent-token-file", str(token), "--kube-api", "http://127.0.0.1:9"]
    cases = (
        (["--tls-cert-file", cert], "--tls-cert-file needs --tls-key-file too"),
        (["--tls-key-file", key], "--tls-key-file needs --tls-cert-file too"),
        (["--client-ca-file", ca], "--client-ca-file needs --tls-cert-file and --tls-key-file"),
        (["--tls-cert-file", str(tmp_path / "gone.crt"), "--tls-key-file", key], f"--tls-cert-file {tmp_path / 'gone.crt'}: No such file or directory"),
        (["--tls-cert-file", key, "--tls-key-file", key], f"--tls-cert-file {key}: no PEM certificate in it"),
        (["--tls-cert-file", cert, "--tls-key-file", certs.path("scheduler.key")],
         f"--tls-key-file {certs.path('scheduler.key')}: not the key of the certificate in --tls-cert-file {cert}"),
        (["--tls-cert-file", cert, "--tls-key-file", key, "--client-ca-file", key], f"--client-ca-file {key}: no PEM CA certificate in it"),
        (["--listen", "0.0.0.0:0", *bind], "--bind on 0.0.0.0:0 (not loopback) without --client-ca-file"),
        (["--listen", "[::]:0", "--tls-cert-file", cert, "--tls-key-file", key, *bind], "--bind on [::]:0 (not loopback) without --client-ca-file"),
    )
    procs = [subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "extender", *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=_child_env()) for flags, _ in cases]
    for proc, (flags, said) in zip(procs, cases, strict=True):
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and out == "", (flags, proc.returncode, err)
        assert err.count("\n") == 1 and err.startswith(f"topoagent extender: {said}"), (flags, err)


def test_https_without_client_certificates_and_the_loud_insecure_bind(certs: Certs, tmp_path: Path) -> None:
    """--insecure-bind-without-client-auth starts --bind on every address, and every start
    says so; HTTPS without --client-ca-file answers anyone who trusts its certificate."""
    token = tmp_path / "token"
    token.write_text("a-token\n")
    log = tmp_path / "extender.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "0.0.0.0:0", "--bind", "--agent-token-file", str(token),
                                 "--kube-api", "http://127.0.0.1:9", "--insecure-bind-without-client-auth",
                                 "--tls-cert-file", certs.path("server.crt"), "--tls-key-file", certs.path("server.key")],
                                stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    try:
        line = _wait_line(proc, "extender", log)
        port = int(line.split("https://0.0.0.0:", 1)[1].split("/", 1)[0])
        assert "event=unauthenticated_callers" in log.read_text() and "--insecure-bind-without-client-auth" in log.read_text()
        status, doc = https_call(port, certs.client(), "POST", "/scheduler/filter", {"Pod": {"spec": {"containers": []}}, "NodeNames": ["node-x"]})
        assert status == 200 and doc["NodeNames"] == ["node-x"]
    finally:
        proc.terminate()
        assert proc.wait(timeout=20) == 0
        proc.stdout.close()
