"""Holds and guards (issue #39): the real extender child, real agents on dgx-a100 (NVSwitch, 8
GPUs) and pcie-2socket (8 GPUs), the loopback API server (tests/fake_apiserver.py) under the
real kubernetes client.  A pod of 8 GPUs that fits no node for --hold-after holds the node with
the most GPUs free; a smaller pod is filtered off that node (the reason names the large pod) and
only that node; the hold ends when the pod binds, is deleted, or at --hold-for.  From the moment
a node can fit the waiting pod, a guard keeps pods that waited less off it (a smaller one, a
large one that came later) until the pod binds, is deleted, or --hold-guard passes."""

from __future__ import annotations

import http.client
import re
import statistics
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from service_helpers import promtool_complaints, wait_for

from bench.cluster import RESOURCE, Cluster, ExtenderQueue, _request, cluster
from bench.cluster_replay import STARVE_FIXTURES, HoldSetting, ReplayQueue, local_cluster, starve_run, starve_stream, starve_waits
from topoagent.cluster.extender.holds import Holds, NodeLoad
from topoagent.cluster.extender.wire import PodRef

HOLD_AFTER = "0.3"
WITHIN_S = 10.0


@pytest.fixture(scope="module")
def c(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    args = ["--pod-resync", "2", "--hold-after", HOLD_AFTER, "--hold-for", "600"]
    with cluster(["dgx-a100", "pcie-2socket"], extender_args=args, work=tmp_path_factory.mktemp("holds")) as running:
        yield running


@pytest.fixture(autouse=True)
def clean(c: Cluster) -> Iterator[None]:
    yield
    tidy(c)


def tidy(c: Cluster) -> None:
    for node in c.nodes:  # the fillers' leases; the pods' go with their pods
        for lease in node.request("GET", "/leases")[1]["leases"]:
            if lease["owner"].startswith("filler"):
                node.request("DELETE", f"/leases/{lease['id']}", token=c.token)
    for (namespace, name) in list(c.api.pods):
        c.api.delete_pod(name, namespace)
    wait_for("every pod's lease released", lambda: all(not n.request("GET", "/leases")[1]["leases"] for n in c.nodes),
             timeout=WITHIN_S, log=lambda: log(c))
    wait_for("every hold, guard and waiting pod gone", lambda: holds(c) == ([], []) and guards(c) == [], timeout=WITHIN_S,
             log=lambda: log(c))


def log(c: Cluster) -> str:
    return (c.work / "extender.log").read_text()


def new_pod(c: Cluster, name: str, gpus: int) -> dict[str, Any]:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "namespace": "jobs", "uid": str(uuid.uuid4())},
           "spec": {"containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": {RESOURCE: str(gpus)}}}]},
           "status": {"phase": "Pending"}}
    c.api.add_pod(pod)
    return pod


def fill(c: Cluster, node: str, gpus: int) -> str:
    """Lease ``gpus`` GPUs of the node's agent for no pod (a job the cluster runs): the lease id."""
    status, doc = c.node(node).request("POST", "/place", {"gpus": gpus, "reserve": {"owner": "filler", "ttl_s": 600}}, token=c.token)
    assert status == 200, doc
    return doc["lease"]["id"]


def empty(c: Cluster, node: str, lease: str) -> None:
    assert c.node(node).request("DELETE", f"/leases/{lease}", token=c.token)[0] == 200


def filtered(c: Cluster, pod: dict, names: list[str]) -> tuple[list[str], dict[str, str]]:
    """(the nodes passed, every failed node's reason) of the extender's filter."""
    doc = c.extender.call("filter", {"Pod": pod, "Nodes": {"items": c.node_objects(names)}, "NodeNames": None})
    passed = [n["metadata"]["name"] for n in (doc["Nodes"] or {}).get("items") or []]
    return passed, {**doc["FailedNodes"], **doc["FailedAndUnresolvableNodes"]}


def unresolvable(c: Cluster, pod: dict, names: list[str]) -> dict[str, str]:
    return c.extender.call("filter", {"Pod": pod, "Nodes": {"items": c.node_objects(names)}, "NodeNames": None})["FailedAndUnresolvableNodes"]


def listing(c: Cluster) -> dict[str, Any]:
    status, doc = _request(c.extender, "GET", "/holds")
    assert status == 200, doc
    return doc


def holds(c: Cluster) -> tuple[list[tuple[str, str]], list[str]]:
    """((pod, node) of each hold, the pods waiting without one)."""
    doc = listing(c)
    return [(h["pod"], h["node"]) for h in doc["holds"]], [w["pod"] for w in doc["waiting"]]


def guards(c: Cluster) -> list[tuple[str, str]]:
    """(pod, node) of each guard in force."""
    return [(g["pod"], g["node"]) for g in listing(c)["guards"]]


def page(c: Cluster) -> bytes:
    conn = http.client.HTTPConnection(c.extender.address, c.extender.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read()
    finally:
        conn.close()


def metric(c: Cluster, name: str, labels: str = "") -> float:
    text = page(c).decode()
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not on /metrics:\n{text}"
    return float(m.group(1))


def bind(c: Cluster, pod: dict, node: str) -> dict:
    meta = pod["metadata"]
    return c.extender.call("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": node})


def waiting_big_pod(c: Cluster, name: str) -> tuple[dict, str, str]:
    """An 8-GPU pod that fits no node (dgx-a100 has 5 free, pcie-2socket 2) and has held a node
    since; (the pod, the node held, the dgx filler's lease)."""
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    lease = fill(c, dgx, 3)
    fill(c, pcie, 6)
    big = new_pod(c, name, 8)
    passed, failed = filtered(c, big, [dgx, pcie])
    assert passed == [] and set(failed) == {dgx, pcie}
    held = wait_for("a hold for the waiting pod", lambda: holds(c)[0], timeout=WITHIN_S, log=lambda: log(c))
    assert held == [(f"jobs/{name}", dgx)]  # the node with the most free GPUs
    return big, dgx, lease


def test_a_waiting_large_pod_holds_the_node_with_most_free_and_smaller_pods_keep_off_it_only(c: Cluster) -> None:
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    taken = metric(c, "topoagent_extender_holds_taken_total")
    big, _, lease = waiting_big_pod(c, "big-bound")
    doc = listing(c)["holds"][0]
    assert doc["uid"] == big["metadata"]["uid"] and doc["gpus"] == 8 and doc["since"] and doc["expires"]
    assert "fit no node" in doc["why"] and "5 of 8" in doc["why"]
    assert metric(c, "topoagent_extender_holds") == 1 and metric(c, "topoagent_extender_holds_taken_total") == taken + 1

    small = new_pod(c, "small", 1)
    passed, failed = filtered(c, small, [dgx, pcie])
    assert passed == [pcie]  # it fits elsewhere: not blocked
    assert "jobs/big-bound" in unresolvable(c, small, [dgx, pcie])[dgx]
    passed, failed = filtered(c, small, [dgx])
    assert passed == [] and "held for pod jobs/big-bound" in failed[dgx]

    empty(c, dgx, lease)  # the node drained: the large pod fits it, binds, and the hold ends at once
    passed, _ = filtered(c, big, [dgx, pcie])
    assert passed == [dgx]
    assert bind(c, big, dgx) == {"Error": ""}
    assert holds(c) == ([], [])
    assert metric(c, "topoagent_extender_holds") == 0
    assert metric(c, "topoagent_extender_holds_released_total", '{reason="bound"}') >= 1
    assert "event=hold_released" in log(c)


def test_a_deleted_pods_hold_ends(c: Cluster) -> None:
    dgx = c.nodes[0].name
    waiting_big_pod(c, "big-deleted")
    small = new_pod(c, "small-after", 1)
    assert dgx in unresolvable(c, small, [dgx])
    c.api.delete_pod("big-deleted", "jobs")
    wait_for("the deleted pod's hold gone", lambda: holds(c) == ([], []), timeout=WITHIN_S, log=lambda: log(c))
    assert metric(c, "topoagent_extender_holds_released_total", '{reason="deleted"}') >= 1
    assert unresolvable(c, small, [dgx]) == {}  # 5 free: it fits again


def test_a_pod_bound_by_kube_scheduler_itself_ends_its_hold(c: Cluster) -> None:
    """Without the extender's bind verb (kube-scheduler binding), the pod watch sees the bind."""
    waiting_big_pod(c, "big-bound-elsewhere")
    released = metric(c, "topoagent_extender_holds_released_total", '{reason="bound"}')
    c.api.set_node_name("big-bound-elsewhere", c.nodes[0].name, "jobs")
    wait_for("the bound pod's hold gone", lambda: holds(c) == ([], []), timeout=WITHIN_S, log=lambda: log(c))
    assert metric(c, "topoagent_extender_holds_released_total", '{reason="bound"}') == released + 1


def test_kube_schedulers_unschedulable_mark_counts_as_waiting(c: Cluster) -> None:
    """kube-scheduler calls no extender when its own count leaves no node: the pod watch's
    PodScheduled=False, Unschedulable is then what says the pod waits."""
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    fill(c, dgx, 2)
    fill(c, pcie, 7)
    new_pod(c, "big-marked", 8)
    c.api.set_pod_condition("big-marked", {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                                           "message": "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."}, "jobs")
    held = wait_for("a hold for the unschedulable pod", lambda: holds(c)[0], timeout=WITHIN_S, log=lambda: log(c))
    assert held == [("jobs/big-marked", dgx)]
    c.api.set_phase("big-marked", "Failed", "jobs")  # its end ends the hold
    wait_for("the ended pod's hold gone", lambda: holds(c) == ([], []), timeout=WITHIN_S, log=lambda: log(c))
    assert metric(c, "topoagent_extender_holds_released_total", '{reason="ended"}') >= 1


def test_no_hold_when_no_large_pod_waits(c: Cluster) -> None:
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    fill(c, dgx, 8)
    fill(c, pcie, 8)
    small = new_pod(c, "small-unplaced", 4)  # fits nowhere, but asks for fewer than --hold-min-gpus
    passed, _ = filtered(c, small, [dgx, pcie])
    assert passed == []
    assert holds(c) == ([], [])  # waiting is noted within the filter call: nothing noted, nothing can be held
    assert metric(c, "topoagent_extender_pods_waiting") == 0


def test_a_node_that_can_never_fit_the_pod_is_never_held(c: Cluster) -> None:
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    huge = new_pod(c, "huge", 16)  # no node has 16 GPUs
    passed, failed = filtered(c, huge, [dgx, pcie])
    assert passed == [] and "the node has 8 GPUs" in failed[dgx]
    wait_for("the impossible pod dropped", lambda: "event=hold_impossible" in log(c), timeout=WITHIN_S, log=lambda: log(c))
    assert holds(c) == ([], [])


def test_metrics_page_with_holds_is_valid_exposition(c: Cluster) -> None:
    waiting_big_pod(c, "big-metrics")
    assert promtool_complaints(page(c)) == []


def test_a_hold_expires_and_that_pod_holds_no_node_again(tmp_path_factory: pytest.TempPathFactory) -> None:
    args = ["--pod-resync", "2", "--hold-after", HOLD_AFTER, "--hold-for", "1"]
    with cluster(["dgx-a100", "pcie-2socket"], extender_args=args, work=tmp_path_factory.mktemp("expiry")) as c:
        dgx, pcie = c.nodes[0].name, c.nodes[1].name
        fill(c, dgx, 3)
        fill(c, pcie, 6)
        first = new_pod(c, "first", 8)
        filtered(c, first, [dgx, pcie])
        wait_for("the first pod's hold", lambda: holds(c)[0] == [("jobs/first", dgx)], timeout=WITHIN_S, log=lambda: log(c))
        wait_for("the hold expired", lambda: holds(c) == ([], []), timeout=WITHIN_S, log=lambda: log(c))
        assert metric(c, "topoagent_extender_hold_expired_total") == 1
        filtered(c, first, [dgx, pcie])  # it still fits nowhere, and holds nothing again
        assert holds(c) == ([], [])
        second = new_pod(c, "second", 8)  # the next large pod may hold
        filtered(c, second, [dgx, pcie])
        wait_for("the next pod's hold", lambda: holds(c)[0] == [("jobs/second", dgx)], timeout=WITHIN_S, log=lambda: log(c))


def test_the_node_that_frees_soonest_is_held() -> None:
    """Its leases ending oldest first, the node whose last lease to end was granted earliest."""
    older = NodeLoad(8, 2, ((10.0, 3), (11.0, 3)))  # 6 must end: the last of them granted at 11
    newer = NodeLoad(8, 5, ((12.0, 3),))  # 3 must end: granted at 12
    assert older.frees_at(8) == 11.0 and newer.frees_at(8) == 12.0
    assert NodeLoad(8, 8).frees_at(8) == float("-inf") and NodeLoad(8, 0, ((1.0, 4),)).frees_at(8) == float("inf")
    now = [100.0]
    holds = Holds(min_gpus=8, after_s=30, ttl_s=300, clock=lambda: now[0])
    holds.unplaced(PodRef("jobs", "big", "uid-big"), 8)
    holds.unplaced(PodRef("jobs", "small", "uid-small"), 4)  # below min_gpus: not waiting
    assert list(holds.waiting) == ["uid-big"] and holds.take({"a": older, "b": newer}) == []  # not yet due
    now[0] += 30
    assert [(h.pod.name, h.node) for h in holds.take({"a": newer, "b": older, "c": NodeLoad(4, 4)})] == [("big", "b")]


def test_in_the_replay_holds_bound_a_sustained_streams_large_pods_wait() -> None:
    """bench.cluster_replay --starve --rounds 30 --seeds 0-8, normal load (docs/benchmarks.md):
    kube-scheduler's backoff lets the 1-GPU pods created later take each GPU freed; a hold after
    30 s cuts the 8-GPU pods' longest wait by half or more (median over the seeds), the 1-GPU
    pods' median wait within 10 % (median over the seeds: one seed's grows, see the docs)."""
    c = local_cluster(list(STARVE_FIXTURES))
    settings = (HoldSetting(0, 0), HoldSetting(30, 0))
    runs = [[starve_run(c, jobs, s) for s in settings] for jobs in (starve_stream("normal", s, rounds=30) for s in range(9))]
    without_max, held_max = (statistics.median(r[n].big_max_s for r in runs) for n in (0, 1))
    without_small, held_small = (statistics.median(r[n].small_median_s for r in runs) for n in (0, 1))
    assert held_max * 2 <= without_max
    assert held_small <= without_small * 1.1


def test_in_the_replay_the_guard_halves_the_large_pods_longest_wait_at_overload() -> None:
    """bench.cluster_replay --starve --seeds 0-8, overload (docs/benchmarks.md): the guard alone
    (no hold) cuts the 8-GPU pods' longest wait by half or more, median over the seeds; the
    1-GPU pods wait longer for it (the docs say how much)."""
    c = local_cluster(list(STARVE_FIXTURES))
    settings = (HoldSetting.parse("off"), HoldSetting.parse("guard"))  # the bench's columns: guard at the default
    runs = [[starve_run(c, jobs, s) for s in settings] for jobs in (starve_stream("overload", s) for s in range(9))]
    without_max, guarded_max = (statistics.median(r[n].big_max_s for r in runs) for n in (0, 1))
    assert guarded_max * 2 <= without_max
    assert statistics.median(r[1].small_median_s for r in runs) > statistics.median(r[0].small_median_s for r in runs)


def test_a_guard_keeps_a_node_that_fits_the_waiting_pod_from_pods_that_would_break_that_fit() -> None:
    now = [100.0]
    holds = Holds(min_gpus=8, after_s=0, ttl_s=300, guard_s=20, clock=lambda: now[0])
    small, later = PodRef("jobs", "small", "uid-small"), PodRef("jobs", "later", "uid-later")
    passed: list[str] = ["a", "b"]
    holds.honour(small, 1, passed, {}, {"a": 8, "b": 8})
    assert passed == ["a", "b"] and holds.guards == {} and holds.waiting == {}  # no pod waits: nothing kept, nothing noted
    big = PodRef("jobs", "big", "uid-big")
    holds.honour(big, 8, [], {}, {})
    assert list(holds.waiting) == ["uid-big"] and not holds.busy()  # no holds (after_s 0): nothing for the keeper
    now[0] += 1
    passed, why = ["a", "b", "c", "d"], {}
    holds.honour(small, 1, passed, why, {"a": 8, "b": 5, "c": 9, "d": 16})
    # a fits the big pod only while nothing else lands there; b cannot fit it anyway; c and d keep room for it after.
    assert passed == ["b", "c", "d"] and "kept for pod jobs/big" in why["a"]
    passed, why = ["c"], {}
    holds.honour(small, 2, passed, why, {"c": 9})  # 2 of 9 would leave 7
    assert passed == [] and "kept for pod jobs/big" in why["c"]
    passed = ["a"]
    holds.honour(later, 8, passed, {}, {"a": 8})  # a large pod that waited less
    assert passed == [] and list(holds.waiting) == ["uid-big", "uid-later"]
    passed = ["a"]
    holds.honour(big, 8, passed, {}, {"a": 8})  # the waiting pod itself
    assert passed == ["a"]
    passed = ["e"]
    holds.honour(small, 1, passed, {}, {})  # e's free GPUs unknown: not guarded
    assert passed == ["e"]
    now[0] += 19
    assert [(pod.name, node) for pod, node, _ in holds.guards_now()] == [("big", "a"), ("big", "c")]
    now[0] += 1  # big's guards began 20 s ago: they end, and big keeps these nodes no more; the next in line does
    passed, why = ["a", "c"], {}
    holds.honour(small, 2, passed, why, {"a": 8, "c": 9})
    assert passed == [] and "kept for pod jobs/later" in why["a"] and "kept for pod jobs/later" in why["c"]
    holds.forget("uid-later", "deleted")
    passed = ["a", "c"]
    holds.honour(small, 2, passed, {}, {"a": 8, "c": 9})
    assert passed == ["a", "c"]
    holds.forget("uid-big", "bound")
    assert holds.guards == {} and holds.guards_now() == []


@pytest.fixture(scope="module")
def guards_alone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """Guards alone (--hold-after 0): no hold is ever taken."""
    args = ["--pod-resync", "2", "--hold-after", "0", "--hold-guard", "600"]
    with cluster(["dgx-a100", "pcie-2socket"], extender_args=args, work=tmp_path_factory.mktemp("guards")) as running:
        yield running


@pytest.fixture
def guarded(guards_alone: Cluster) -> Iterator[Cluster]:
    yield guards_alone
    tidy(guards_alone)


def freed_for_a_waiting_pod(c: Cluster, name: str) -> tuple[dict, str, str]:
    """An 8-GPU pod that fit no node (dgx-a100 5 free, pcie-2socket 2), then dgx-a100 emptied:
    (the pod, dgx-a100, pcie-2socket)."""
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    lease = fill(c, dgx, 3)
    fill(c, pcie, 6)
    big = new_pod(c, name, 8)
    assert filtered(c, big, [dgx, pcie])[0] == []
    assert holds(c) == ([], [f"jobs/{name}"]) and guards(c) == []  # no node fits it yet: nothing guarded
    empty(c, dgx, lease)
    return big, dgx, pcie


def test_a_guard_keeps_a_freed_node_for_the_waiting_pod_until_it_binds(guarded: Cluster) -> None:
    c = guarded
    before = metric(c, "topoagent_extender_guarded_total")
    big, dgx, pcie = freed_for_a_waiting_pod(c, "big-guarded")
    small = new_pod(c, "small-guarded", 1)
    passed, failed = filtered(c, small, [dgx, pcie])
    assert passed == [pcie]  # it fits elsewhere without taking the waiting pod's room: not blocked
    assert "kept for pod jobs/big-guarded" in unresolvable(c, small, [dgx, pcie])[dgx]
    assert guards(c) == [("jobs/big-guarded", dgx)] and holds(c) == ([], ["jobs/big-guarded"])
    assert metric(c, "topoagent_extender_guards") == 1 and metric(c, "topoagent_extender_guarded_total") >= before + 2
    later = new_pod(c, "big-later", 8)  # a large pod that came later waits its turn too
    passed, failed = filtered(c, later, [dgx, pcie])
    assert passed == [] and "kept for pod jobs/big-guarded" in failed[dgx]
    assert filtered(c, big, [dgx, pcie])[0] == [dgx]
    assert bind(c, big, dgx) == {"Error": ""}
    assert guards(c) == [] and holds(c) == ([], ["jobs/big-later"])
    assert metric(c, "topoagent_extender_guards") == 0
    assert "event=guard_taken" in log(c)


def test_a_deleted_pods_guard_ends(guarded: Cluster) -> None:
    c = guarded
    _, dgx, pcie = freed_for_a_waiting_pod(c, "big-gone")
    small = new_pod(c, "small-kept", 1)
    assert dgx in unresolvable(c, small, [dgx, pcie])
    c.api.delete_pod("big-gone", "jobs")
    wait_for("the deleted pod's guard gone", lambda: guards(c) == [] and holds(c) == ([], []), timeout=WITHIN_S, log=lambda: log(c))
    assert filtered(c, small, [dgx, pcie])[0] == [dgx, pcie]


def test_no_guard_when_no_large_pod_waits(guarded: Cluster) -> None:
    c = guarded
    dgx, pcie = c.nodes[0].name, c.nodes[1].name
    before = metric(c, "topoagent_extender_guarded_total")
    small = new_pod(c, "small-alone", 1)
    assert filtered(c, small, [dgx, pcie])[0] == [dgx, pcie]
    assert listing(c)["guards"] == [] and holds(c) == ([], [])
    assert metric(c, "topoagent_extender_guarded_total") == before


def test_a_guard_ends_after_hold_guard_and_the_node_is_not_kept_again(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The waiting pod did not take the node in --hold-guard (it may not fit there for a reason the
    extender cannot see): the others may take it."""
    args = ["--pod-resync", "2", "--hold-after", "0", "--hold-guard", "1"]
    with cluster(["dgx-a100", "pcie-2socket"], extender_args=args, work=tmp_path_factory.mktemp("guard-expiry")) as c:
        _, dgx, pcie = freed_for_a_waiting_pod(c, "big-slow")
        small = new_pod(c, "small-patient", 1)
        passed, failed = filtered(c, small, [dgx, pcie])  # the guard begins at this call, for 1 s
        assert passed == [pcie] and "kept for pod jobs/big-slow" in failed[dgx]
        assert "event=guard_taken" in log(c)  # not GET /holds: its listing may have ended by then on a loaded machine
        wait_for("the guard ended", lambda: filtered(c, small, [dgx, pcie])[0] == [dgx, pcie], timeout=WITHIN_S, log=lambda: log(c))
        assert guards(c) == [] and holds(c) == ([], ["jobs/big-slow"])  # it still waits, and keeps the node no more


def test_the_replay_waits_as_the_real_extender_with_guards_does(guarded: Cluster) -> None:
    """bench.cluster --starve (real agents, the real extender, guards alone) and the replay give
    every pod of the issue's overload stream the same wait, through the same queue model."""
    jobs = starve_stream("overload", 3)
    real = ExtenderQueue(guarded, guards=True).run(jobs)
    replayed = ReplayQueue(local_cluster(list(STARVE_FIXTURES)), HoldSetting(0, 600)).run(jobs)
    assert real == replayed
    assert max(real[j.id] for j in jobs if j.gpus == 8) < max(ReplayQueue(local_cluster(list(STARVE_FIXTURES)), HoldSetting(0, 0)).run(jobs)[j.id]
                                                             for j in jobs if j.gpus == 8)


def test_the_replays_per_pod_waits_are_what_its_figures_are_made_of() -> None:
    """bench.cluster_replay --starve --waits prints each pod's wait and node (the docs' argument
    reads seed 0 from it): its waits give the same figures as the table's run, and each pod sits on
    a node of the stream's."""
    c = local_cluster(list(STARVE_FIXTURES))
    settings = [HoldSetting(0, 0), HoldSetting(0, 20)]
    rows = [line.strip("|").split("|") for line in starve_waits(c, "overload", 0, 6, settings, True, "ages").splitlines()[2:]]
    jobs = starve_stream("overload", 0)
    assert [int(r[0]) for r in rows] == sorted(j.id for j in jobs)
    for n, setting in enumerate(settings):
        waits = {int(r[0]): float(r[3 + n].split()[0]) for r in rows}
        assert {r[3 + n].split()[1] for r in rows} <= set(STARVE_FIXTURES)
        figures = starve_run(c, jobs, setting)
        gpus = {j.id: j.gpus for j in jobs}
        assert statistics.median(w for j, w in waits.items() if gpus[j] == 1) == pytest.approx(figures.small_median_s, abs=0.05)
        assert max(w for j, w in waits.items() if gpus[j] == 8) == pytest.approx(figures.big_max_s, abs=0.05)
