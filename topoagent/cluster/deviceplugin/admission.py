"""Which pod kubelet is admitting, told by the GPUs its lease holds (pure: no I/O).

kubelet's GetPreferredAllocation and Allocate name devices and a count, never a pod.  The
pod is told only where the facts leave one answer, and preference and Allocate read it the
same way:

- the candidates for a request of ``size`` GPUs are this node's Pending pods with a
  container asking ``size`` (init containers too), less those kubelet has started
  (``status.startTime``) and those this plugin has allocated all their GPUs to; a pod allocated in part is the one kubelet is admitting (it allocates a
  pod's containers back to back), and the only candidate;
- a candidate's own GPUs are those its leases hold (owner ``namespace/name/uid`` with its
  UID), in the extender's rank order when its annotation names that lease's GPUs;
- preference: when every candidate holds a lease, the oldest whose lease fits the request
  (kubelet admits a batch oldest first) gets its own GPUs; a lone candidate without a lease
  gets GPUs no lease covers; with a candidate without a lease among several, the plugin
  cannot tell, prefers GPUs no lease covers and says so;
- Allocate: GPUs a candidate's lease holds are that candidate's (when every candidate holds
  a lease); GPUs no lease covers are the lone candidate's, for which a lease is taken before
  the answer; anything else is refused, with the reason.

What this cannot see: with several same-size pods all holding leases, kubelet may admit
another than the oldest; that pod then runs on the oldest one's GPUs under its lease, and
the other way round (every GPU stays leased to a pod of the pair; the leases end with
either pod).  kubelet's pod-resources API would tell, after the answer; it is not read.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from topoagent.cluster.deviceplugin.pods import container_counts, pod_choice
from topoagent.cluster.extender.wire import PodError, PodRef, gpus_wanted, pod_ref
from topoagent.cluster.podwatch import owner_pod_uid
from topoagent.log import log_event


@dataclass(frozen=True)
class Lease:
    id: str
    owner: str
    gpus: tuple[str, ...]  # by UUID, rank order


@dataclass(frozen=True)
class Candidate:
    """A Pending pod on this node that kubelet may be admitting."""

    ref: PodRef
    created: str  # metadata.creationTimestamp (RFC 3339 sorts as text)
    wanted: int
    sizes: tuple[int, ...]  # GPUs per container asking any
    own: tuple[str, ...]  # the GPUs its leases hold, rank order
    leases: tuple[Lease, ...]
    annotated: str  # the lease its topoagent.io annotations name and the agent backs, or ""
    allocated: frozenset[str] = frozenset()  # GPUs this plugin has allocated to it

    def __str__(self) -> str:
        return str(self.ref)

    def lease_of(self, ids: Iterable[str]) -> Lease | None:
        """Its one lease holding all of ``ids``."""
        wanted = set(ids)
        return next((x for x in self.leases if wanted <= set(x.gpus)), None)


@dataclass(frozen=True)
class Facts:
    """This node's Pending pods and the agent's leases, read once for one answer."""

    pods: tuple[Candidate, ...]
    holder: dict[str, Lease] = field(default_factory=dict)  # GPU UUID -> the lease holding it

    def candidates(self, size: int) -> list[Candidate]:
        out = [c for c in self.pods if size in c.sizes and len(c.allocated) < c.wanted]
        midway = [c for c in out if c.allocated]
        return midway[:1] if midway else out


def leases_of(documents: Iterable[Mapping[str, Any]]) -> list[Lease]:
    """The agent's ``GET /leases`` as leases, those naming their GPUs by UUID."""
    out = []
    for doc in documents:
        lease_id, lease_owner, uuids = doc.get("id"), doc.get("owner"), doc.get("gpu_uuids")
        if isinstance(lease_id, str) and isinstance(lease_owner, str) and isinstance(uuids, list) and all(isinstance(u, str) for u in uuids):
            out.append(Lease(lease_id, lease_owner, tuple(uuids)))
    return out


def facts(pods: Sequence[Mapping[str, Any]], leases: Sequence[Lease], resource: str, allocated: Mapping[str, frozenset[str]]) -> Facts:
    by_uid: dict[str, list[Lease]] = {}
    for lease in leases:
        uid = owner_pod_uid(lease.owner)
        if uid is not None:
            by_uid.setdefault(uid, []).append(lease)
    out = []
    for pod in pods:
        ref = pod_ref(pod)
        if not ref.uid or _phase(pod) != "Pending" or _started(pod):
            continue
        try:
            wanted = gpus_wanted(pod, resource)
        except PodError:
            continue
        sizes = tuple(container_counts(pod, resource))
        own_leases = by_uid.get(ref.uid, [])
        annotated, own = "", [g for x in own_leases for g in x.gpus]
        choice = pod_choice(pod)
        if choice is not None:
            named = next((x for x in own_leases if x.id == choice.lease and sorted(x.gpus) == sorted(choice.gpus)), None)
            if named is None:
                log_event("annotation_ignored", logging.WARNING, pod=str(ref), lease=choice.lease[:64],
                          reason="the agent holds no such lease for this pod on these GPUs")
            else:
                annotated = named.id
                own = [*choice.gpus, *(g for g in own if g not in set(choice.gpus))]
        meta = pod.get("metadata")
        created = meta.get("creationTimestamp") if isinstance(meta, dict) else None
        out.append(Candidate(ref, created if isinstance(created, str) else "", wanted, sizes, tuple(own), tuple(own_leases),
                             annotated, allocated.get(ref.uid, frozenset())))
    return Facts(tuple(out), {g: x for x in leases for g in x.gpus})


def _phase(pod: Mapping[str, Any]) -> str:
    status = pod.get("status")
    phase = status.get("phase") if isinstance(status, dict) else None
    return phase if isinstance(phase, str) else ""


def _started(pod: Mapping[str, Any]) -> bool:
    """kubelet has admitted it (it writes ``status.startTime`` once it has): no candidate."""
    status = pod.get("status")
    return isinstance(status, dict) and bool(status.get("startTime"))


def _names(pods: Sequence[Candidate]) -> str:
    shown = ", ".join(str(c) for c in pods[:4])
    return shown + (f" and {len(pods) - 4} more" if len(pods) > 4 else "")


@dataclass(frozen=True)
class Preference:
    pod: Candidate | None  # the pod told, or None
    gpus: list[str] | None  # its own GPUs to prefer; None: GPUs no lease covers
    unattributed: str = ""  # why no pod could be told, when it matters


def prefer(facts: Facts, available: Sequence[str], must: Sequence[str], size: int) -> Preference:
    pods = facts.candidates(size)
    if len(pods) == 1 and not pods[0].own:
        return Preference(pods[0], None)
    unleased = [c for c in pods if not c.own]
    if unleased:
        return Preference(None, None, f"cannot tell which of {_names(pods)} kubelet is admitting: {_names(unleased)} holds no lease")
    offered, needed = set(available), set(must)
    for pod in sorted(pods, key=lambda c: (c.created, str(c))):  # kubelet admits a batch oldest first
        mine = [g for g in pod.own if g in offered and g not in pod.allocated]
        if not needed <= set(mine):
            continue
        picked = set([*must, *(g for g in mine if g not in needed)][:size])
        chosen = [g for g in mine if g in picked]
        if len(chosen) == size:
            return Preference(pod, chosen)
    why = f"no lease of {_names(pods)} holds {size} of the GPUs offered" if pods else ""
    return Preference(None, None, why)


@dataclass(frozen=True)
class Attribution:
    """Whose allocation ``ids`` is: ``pod`` with ``lease`` (its own, holding them) or to lease
    for it (``lease`` None); else ``refused`` says why."""

    pod: Candidate | None = None
    lease: Lease | None = None
    refused: str = ""


def attribute(facts: Facts, ids: Sequence[str]) -> Attribution:
    pods = facts.candidates(len(ids))
    wanted = set(ids)
    unleased = [c for c in pods if not c.own]
    owners = [c for c in pods if c.lease_of(ids) is not None]
    if owners and (not unleased or len(pods) == 1):
        return Attribution(owners[0], owners[0].lease_of(ids))
    held = sorted(g for g in wanted if g in facts.holder)
    if held:
        lease = facts.holder[held[0]]
        pod = next((c for c in pods if lease in c.leases), None)
        if pod is not None and unleased:
            return Attribution(refused=f"device {held[0][:80]} is leased to {pod}, and {_names(unleased)} may be the pod being admitted: "
                                       "cannot tell which kubelet is admitting")
        if pod is not None:
            return Attribution(refused=f"device {held[0][:80]} is leased to {pod}, whose lease does not hold all of these GPUs")
        return Attribution(refused=f"device {held[0][:80]} is held by the agent's lease {lease.id[:64]} for {lease.owner[:120]}, "
                                   "not for the pod kubelet is admitting")
    if not pods:
        return Attribution(refused=f"no Pending pod on this node asks for {len(ids)} GPUs")
    if len(pods) > 1:
        return Attribution(refused=f"cannot tell which of {_names(pods)} kubelet is admitting (no lease holds these GPUs)")
    pod = pods[0]
    if pod.own and not pod.allocated:
        return Attribution(refused=f"{pod}'s lease holds GPUs {','.join(pod.own)[:200]}, not these")
    return Attribution(pod)
