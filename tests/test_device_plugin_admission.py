"""The device plugin's one rule for which pod kubelet is admitting (``admission``), over
pods and leases as the API server and the agent write them: the same facts must give
preference and Allocate the same pod, and no answer where they cannot tell."""

from __future__ import annotations

import uuid

from topoagent.cluster.deviceplugin.admission import Lease, attribute, facts, prefer

G = [f"GPU-{i}" for i in range(8)]


def pod(name: str, gpus: int, created: str, phase: str = "Pending") -> dict:
    return {"metadata": {"name": name, "namespace": "ns", "uid": str(uuid.uuid4()), "creationTimestamp": created},
            "spec": {"containers": [{"name": "c", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": phase}}


def lease_of(p: dict, gpus: list[str], lease_id: str) -> Lease:
    m = p["metadata"]
    return Lease(lease_id, f"{m['namespace']}/{m['name']}/{m['uid']}", tuple(gpus))


def test_leased_pods_are_told_by_their_gpus_oldest_first_and_agree_with_allocate() -> None:
    old, young = pod("old", 1, "2026-01-01T00:00:00Z"), pod("young", 1, "2026-01-01T00:00:05Z")
    known = facts([young, old], [lease_of(old, [G[3]], "a"), lease_of(young, [G[1]], "b")], "nvidia.com/gpu", {})
    chosen = prefer(known, G, [], 1)
    assert chosen.gpus == [G[3]] and chosen.pod is not None and chosen.pod.ref.name == "old"
    who = attribute(known, chosen.gpus)
    assert who.pod == chosen.pod and who.lease is not None and who.lease.id == "a"
    assert attribute(known, [G[1]]).pod.ref.name == "young"  # kubelet's own pick: by the lease holding it
    assert "not for the pod kubelet is admitting" in attribute(known, [G[3], G[1]]).refused  # no 2-GPU pod pending
    a, b = pod("a", 2, "2026-01-01T00:00:00Z"), pod("b", 2, "2026-01-01T00:00:01Z")
    pair = facts([a, b], [lease_of(a, G[4:6], "a"), lease_of(b, G[6:8], "b")], "nvidia.com/gpu", {})
    split = attribute(pair, [G[4], G[6]])  # one GPU of each pod's lease: neither pod's
    assert split.pod is None and "whose lease does not hold all of these GPUs" in split.refused, split.refused


def test_a_pod_without_a_lease_among_others_cannot_be_told() -> None:
    x, y = pod("x", 2, "2026-01-01T00:00:00Z"), pod("y", 2, "2026-01-01T00:00:01Z")
    known = facts([x, y], [lease_of(x, [G[0], G[1]], "a"), Lease("s", "slurm/job-7", (G[2],))], "nvidia.com/gpu", {})
    chosen = prefer(known, G, [], 2)
    assert chosen.gpus is None and "cannot tell" in chosen.unattributed and "ns/y holds no lease" in chosen.unattributed
    for ids in ([G[0], G[1]], [G[4], G[5]]):
        assert "cannot tell" in attribute(known, ids).refused
    assert "slurm/job-7" in attribute(known, [G[2], G[3]]).refused
    # y alone (x started: kubelet wrote its startTime): y is told, and gets GPUs no lease covers.
    x["status"]["startTime"] = "2026-01-01T00:00:09Z"
    alone = facts([x, y], [lease_of(x, [G[0], G[1]], "a")], "nvidia.com/gpu", {})
    assert prefer(alone, G, [], 2).pod.ref.name == "y"
    who = attribute(alone, [G[4], G[5]])
    assert who.pod is not None and who.pod.ref.name == "y" and who.lease is None
    assert "ns/x" in attribute(alone, [G[0], G[1]]).refused


def test_a_pod_allocated_in_part_is_the_one_kubelet_is_admitting() -> None:
    two, other = pod("two", 1, "2026-01-01T00:00:00Z"), pod("other", 1, "2026-01-01T00:00:01Z")
    two["spec"]["containers"].append({"name": "d", "resources": {"limits": {"nvidia.com/gpu": "1"}}})
    leases = [lease_of(two, [G[6]], "t")]
    known = facts([two, other], leases, "nvidia.com/gpu", {two["metadata"]["uid"]: frozenset({G[6]})})
    who = attribute(known, [G[7]])
    assert who.pod is not None and who.pod.ref.name == "two"
    done = facts([two, other], leases + [lease_of(two, [G[7]], "u")], "nvidia.com/gpu", {two["metadata"]["uid"]: frozenset(G[6:8])})
    assert [c.ref.name for c in done.candidates(1)] == ["other"]  # all its GPUs allocated: no longer a candidate
