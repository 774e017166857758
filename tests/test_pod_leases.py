"""A pod's lease ends with the pod: the real extender child binds through the loopback API
server (tests/fake_apiserver.py) the way a real kube-scheduler drove it (the recorded
bodies in ../shared/kube-scheduler-wire/, copied to tests/data/kube-scheduler-wire/), then
watches the pod; deleting it, or its end, gives the GPUs back on the real agents within
seconds."""

from __future__ import annotations

import copy
import json
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from service_helpers import wait_for

from bench.cluster import Cluster, cluster
from topoagent.cluster.deviceplugin.pods import ANNOTATION
from topoagent.cluster.extender.wire import LEASE_ANNOTATION

WIRE = Path(__file__).parent / "data" / "kube-scheduler-wire"
RELEASED_WITHIN_S = 5.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    # Two of the recording's machines; the watch lists again every 2 s so the sweep is seen soon.
    with cluster(["hgx-h100", "dgx-a100"], extender_args=["--pod-resync", "2"], work=tmp_path_factory.mktemp("cluster")) as running:
        yield running


def recorded(name: str) -> Any:
    return json.loads((WIRE / name).read_text())


def recorded_pod(c: Cluster, name: str) -> dict:
    """The pod kube-scheduler sent (gpu/w4: 4 GPUs, allreduce), under a new name and UID."""
    pod = copy.deepcopy(recorded("001-filter-req.json")["Pod"])
    pod["metadata"].update(name=name, uid=str(uuid.uuid4()))
    for key in ("resourceVersion", "creationTimestamp"):
        pod["metadata"].pop(key, None)
    c.api.add_pod(pod)
    return pod


def schedule(c: Cluster, pod: dict) -> tuple[str, dict]:
    """filter, prioritize and bind as the recording shows them, with this cluster's Node
    objects; (the node bound to, the bind's answer)."""
    args = recorded("001-filter-req.json")
    assert args["NodeNames"] is None and set(args) == {"Pod", "Nodes", "NodeNames"}
    args["Pod"], args["Nodes"]["items"] = pod, c.node_objects()
    filtered = c.extender.call("filter", args)
    assert set(filtered) == set(recorded("001-filter-resp.json"))
    args["Nodes"]["items"] = filtered["Nodes"]["items"]
    priorities = c.extender.call("prioritize", args)
    assert all(set(p) == {"Host", "Score"} for p in priorities)
    best = max(priorities, key=lambda p: p["Score"])["Host"]
    binding = recorded("003-bind-req.json")
    binding.update(PodName=pod["metadata"]["name"], PodNamespace=pod["metadata"]["namespace"], PodUID=pod["metadata"]["uid"], Node=best)
    answer = c.extender.call("bind", binding)
    assert set(answer) == set(recorded("003-bind-resp.json"))
    return best, answer


def leases_of(c: Cluster, uid: str) -> list[tuple[str, dict]]:
    return [(n.name, x) for n in c.nodes for x in n.request("GET", "/leases")[1]["leases"] if x["owner"].endswith("/" + uid)]


def free(c: Cluster, node: str) -> int:
    return c.node(node).request("GET", "/capacity")[1]["free_gpus"]


def gone_within(c: Cluster, what: str, check) -> float:
    """Seconds until ``check()`` is true, polled; fails past RELEASED_WITHIN_S."""
    t0 = time.monotonic()
    wait_for(what, check, timeout=RELEASED_WITHIN_S, log=lambda: (c.work / "extender.log").read_text())
    return time.monotonic() - t0


def bound(c: Cluster, name: str) -> tuple[str, dict]:
    pod = c.api.pod(name, "gpu")
    return pod["spec"]["nodeName"], pod["metadata"]["annotations"]


def test_a_deleted_pods_lease_is_released_within_seconds(c: Cluster) -> None:
    pod = recorded_pod(c, "w4-deleted")
    uid = pod["metadata"]["uid"]
    node, answer = schedule(c, pod)
    assert answer == {"Error": ""}
    held = leases_of(c, uid)
    assert [n for n, _ in held] == [node] and held[0][1]["owner"] == f"gpu/w4-deleted/{uid}"
    on_node, annotations = bound(c, "w4-deleted")
    assert on_node == node and annotations[LEASE_ANNOTATION] == held[0][1]["id"]
    assert annotations[ANNOTATION].split(",") == held[0][1]["gpu_uuids"]
    before = free(c, node)
    c.api.delete_pod("w4-deleted", "gpu")
    took = gone_within(c, "the deleted pod's lease released", lambda: not leases_of(c, uid))
    assert free(c, node) == before + 4
    assert "event=lease_released" in (c.work / "extender.log").read_text()
    print(f"deleted pod -> lease released in {took:.2f} s")


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_a_pod_that_ended_gives_its_gpus_back(c: Cluster, phase: str) -> None:
    name = f"w4-{phase.lower()}"
    pod = recorded_pod(c, name)
    schedule(c, pod)
    assert leases_of(c, pod["metadata"]["uid"])
    c.api.set_phase(name, "Running", "gpu")
    c.api.set_phase(name, phase, "gpu")
    gone_within(c, f"the {phase} pod's lease released", lambda: not leases_of(c, pod["metadata"]["uid"]))
    c.api.delete_pod(name, "gpu")


def test_the_watch_outlives_the_api_server_closing_it(c: Cluster) -> None:
    pod = recorded_pod(c, "w4-reconnect")
    schedule(c, pod)
    watches = c.api.watches
    c.api.close_watches()  # as an API server does at its timeout, or a restart
    wait_for("a new watch", lambda: c.api.watches > watches, timeout=10)
    c.api.delete_pod("w4-reconnect", "gpu")
    gone_within(c, "the lease released through the new watch", lambda: not leases_of(c, pod["metadata"]["uid"]))


def test_a_pod_deleted_while_the_api_server_was_away_is_found_at_the_next_list(c: Cluster) -> None:
    pod = recorded_pod(c, "w4-outage")
    schedule(c, pod)
    log = c.work / "extender.log"
    c.api.pods_unavailable = True
    try:
        c.api.close_watches()
        wait_for("the watch to notice", lambda: "event=pod_watch_failed" in log.read_text(), timeout=10, log=log.read_text)
        c.api.delete_pod("w4-outage", "gpu")  # no watch open: this event is never delivered
        assert leases_of(c, pod["metadata"]["uid"])
    finally:
        c.api.pods_unavailable = False
    # The list after the outage (the retry pause doubles from 1 s) no longer has the pod.
    wait_for("the lease released after the outage", lambda: not leases_of(c, pod["metadata"]["uid"]), timeout=15, log=log.read_text)
    assert "event=pod_watch_recovered" in log.read_text()


def test_one_watch_event_is_read_within_a_bound() -> None:
    """An event larger than the bound ends the watch with KubeError (the caller lists
    again) instead of growing a buffer without end."""
    from topoagent.cluster.extender.kube import Kube, KubeError, WatchCall

    class Stream(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            small = json.dumps({"type": "ADDED", "object": {"metadata": {"uid": "a"}}}).encode() + b"\n"
            self.wfile.write(small)
            self.wfile.write(b'{"type": "ADDED", "object": {"metadata": {"name": "' + b"x" * 300_000)  # no end of line
            self.wfile.flush()

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Stream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        events = Kube(f"http://127.0.0.1:{server.server_address[1]}").watch_pods("1", 5, 64 * 1024, WatchCall())
        assert next(iter(events))["object"]["metadata"]["uid"] == "a"
        with pytest.raises(KubeError, match="larger than 65536 bytes"):
            next(iter(events))
    finally:
        server.shutdown()
        server.server_close()


def test_a_lease_whose_pod_is_gone_is_swept_and_others_are_kept(c: Cluster) -> None:
    pod = recorded_pod(c, "w4-neighbour")
    node, _ = schedule(c, pod)  # the extender now sweeps this node's agent
    agent = c.node(node)
    ghost = f"gpu/ghost/{uuid.uuid4()}"  # a pod that no longer exists: e.g. deleted while the extender was down
    status, granted = agent.request("POST", "/place", {"gpus": 1, "reserve": {"owner": ghost, "ttl_s": 3600}}, token=c.token)
    assert status == 200, granted
    status, kept = agent.request("POST", "/place", {"gpus": 1, "reserve": {"owner": "someone-by-hand", "ttl_s": 3600}}, token=c.token)
    assert status == 200, kept
    # No pod has an empty name: this owner is someone's by hand too (the device plugin and /metrics say so alike).
    status, nameless = agent.request("POST", "/place", {"gpus": 1, "reserve": {"owner": f"gpu//{uuid.uuid4()}", "ttl_s": 3600}}, token=c.token)
    assert status == 200, nameless
    ids = lambda: {x["id"] for x in agent.request("GET", "/leases")[1]["leases"]}  # noqa: E731
    # Within two resyncs (2 s each) and the sweep's own time.
    wait_for("the ghost's lease swept", lambda: granted["lease"]["id"] not in ids(), timeout=10,
             log=lambda: (c.work / "extender.log").read_text())
    # A sweep after the ghost's: the nameless lease was swept by then too if the watch took it for a pod's.
    status, ghost = agent.request("POST", "/place", {"gpus": 1, "reserve": {"owner": f"gpu/ghost/{uuid.uuid4()}", "ttl_s": 3600}}, token=c.token)
    assert status == 200, ghost
    wait_for("the second ghost's lease swept", lambda: ghost["lease"]["id"] not in ids(), timeout=10,
             log=lambda: (c.work / "extender.log").read_text())
    assert {kept["lease"]["id"], nameless["lease"]["id"]} <= ids()
    assert [x["owner"] for _, x in leases_of(c, pod["metadata"]["uid"])] == [f"gpu/w4-neighbour/{pod['metadata']['uid']}"]
    for lease in (kept, nameless):
        agent.request("DELETE", f"/leases/{lease['lease']['id']}", token=c.token)
    c.api.delete_pod("w4-neighbour", "gpu")
    gone_within(c, "the neighbour's lease released", lambda: not leases_of(c, pod["metadata"]["uid"]))


def test_two_binds_of_one_pod_at_once_leave_it_with_the_lease_that_holds(c: Cluster) -> None:
    for attempt in range(3):  # each run races afresh; every interleaving must end the same way
        name = f"w4-race-{attempt}"
        pod = recorded_pod(c, name)
        meta = pod["metadata"]
        args = recorded("001-filter-req.json")
        args["Pod"], args["Nodes"]["items"] = pod, c.node_objects()
        assert len(c.extender.call("filter", args)["Nodes"]["items"]) == 2  # both nodes fit: either bind could win
        answers: list[dict] = []
        start = threading.Barrier(2)

        def bind(node: str) -> None:
            extender = type(c.extender)(c.extender.proc, c.extender.address, c.extender.port)  # a connection of its own
            start.wait()
            answers.append(extender.call("bind", {"PodName": name, "PodNamespace": "gpu", "PodUID": meta["uid"], "Node": node}))

        threads = [threading.Thread(target=bind, args=(n.name,)) for n in c.nodes]
        c.api.binding_delay_s = 0.3  # both binds reach the API server before either binding lands
        try:
            for t in threads:
                t.start()
            for t in threads:
                t.join(30)
        finally:
            c.api.binding_delay_s = 0.0
        errors = sorted(a["Error"] for a in answers)
        assert len(errors) == 2 and errors[0] == "" and errors[1], errors
        on_node, annotations = bound(c, name)
        held = leases_of(c, meta["uid"])
        # Exactly one lease, on the node the pod is bound to, and it is the one on the pod.
        assert [(n, x["id"]) for n, x in held] == [(on_node, annotations[LEASE_ANNOTATION])], (errors, held, annotations)
        assert annotations[ANNOTATION].split(",") == held[0][1]["gpu_uuids"]
        c.api.delete_pod(name, "gpu")
        gone_within(c, "the race winner's lease released", lambda: not leases_of(c, meta["uid"]))


def test_a_pod_deleted_while_the_extender_was_stopped_is_released_by_the_next_one(tmp_path: Path) -> None:
    """The new extender has bound nothing and the node carries no other leased pod: only
    asking every Node's agent for its leases finds this one (issue #37, item 9)."""
    with cluster(["hgx-h100"], extender_args=["--pod-resync", "2"], work=tmp_path) as c:
        pod = recorded_pod(c, "w4-orphan")
        uid = pod["metadata"]["uid"]
        node, answer = schedule(c, pod)
        assert answer == {"Error": ""} and leases_of(c, uid)
        before = free(c, node)
        c.stop_extender()
        c.api.delete_pod("w4-orphan", "gpu")  # no extender is watching: nobody hears of it
        assert leases_of(c, uid)
        c.start_extender()
        # Released within one resync after the start (2 s), the sweep's own time, the start-up.
        wait_for("the orphaned lease released by the new extender", lambda: not leases_of(c, uid), timeout=15,
                 log=lambda: (c.work / "extender.log").read_text())
        assert free(c, node) == before + 4
