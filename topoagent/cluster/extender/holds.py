"""Holds and guards: nodes kept for a large pod that keeps failing, so small pods cannot starve it.

kube-scheduler retries a pod it could not place with a backoff (1 s, doubling to 10 s), while
pods created later go straight to its active queue.  Under steady small-pod pressure the GPUs
of a node free one at a time and the next small pod takes each, so a pod that needs the whole
node waits as long as the pressure lasts (issue #39).  No node choice fixes that order; the
extender can, because it sees every pod's placement:

* a pod that asks for at least ``min_gpus`` GPUs and fits no node *waits*: it failed the
  extender's filter on every candidate, or kube-scheduler marked it ``PodScheduled=False``,
  ``Unschedulable`` (the pod watch sees that; kube-scheduler calls no extender when its own
  count of the GPUs already leaves no node);
* once it has waited ``after_s``, it *holds* one node: among the nodes with at least as many
  GPUs in all as it asks for (a node that can never fit it is never held) and held by no other
  pod, the one that would free up soonest: its leases ending oldest first (pods of a stream
  live alike), the one whose last lease to end before the pod fits was granted earliest; then
  the most GPUs free, the fewest GPUs in all, the lowest name;
* while held, the node drains: every other pod asking for no more GPUs than the holder is
  filtered off it (``FailedAndUnresolvableNodes``: no preemption on the node can let it in),
  with a reason naming the holder; on every other node it passes as before;
* the hold ends when the holder binds, is deleted or ends (the bind verb, the pod watch), or
  after ``ttl_s``: it is then *expired*, and that pod holds no node again, so the next large
  pod may hold one;
* from the moment a node can fit a waiting (or holding) pod by its count of free GPUs, a *guard*
  keeps it, with no ``after_s`` to wait first: a pod that has waited less (any pod not waiting)
  and asks for no more GPUs, and would leave the node too few free for the waiting pod, is
  filtered off it (``FailedAndUnresolvableNodes``, the reason naming the waiting pod).  This is
  the race of issue #39: the node frees while the large pod sits out kube-scheduler's backoff,
  and a pod created later (a small one, or a large one retried sooner) takes it.  A guard costs
  the others only while a node already sits free for the large pod, and it makes no call of its
  own (the free counts are the filter's verdicts).  It ends when the pod binds, is deleted or
  ends, or ``guard_s`` after it first kept a pod off that node (the pod may not fit there for a
  reason the extender cannot see: a selector, a taint); that pod then guards that node no more.

One hold per waiting pod, one pod per held node; ``after_s`` 0: guards only, ``guard_s`` 0: holds
only.  With no large pod waiting there is no state and no work: the keeper loop sleeps on an
event, the filter reads two empty dicts.

Time is the caller's (``clock``): the replay (bench/cluster_replay.py) runs this very class in
simulated time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from topoagent.cluster.extender import HOLD_AFTER_S, HOLD_GUARD_S, HOLD_MIN_GPUS, HOLD_TTL_S
from topoagent.cluster.extender.wire import PodRef, WireError, gpus_wanted, pod_ref
from topoagent.cluster.podwatch import finished, object_field, text_field
from topoagent.log import log, log_event

MAX_WAITING = 10_000  # waiting large pods remembered; the oldest out past it
MAX_NEVER = 10_000  # pods that hold no node again, remembered; the oldest out past it
RELEASES = ("bound", "deleted", "ended")  # why a hold ended other than expiry, for /metrics


@dataclass(slots=True)
class Waiting:
    pod: PodRef
    gpus: int
    since: float  # the clock's time it was first seen fitting no node

@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What the holds read of a node: its agent's ``/capacity`` counts and ``/leases``."""

    gpus: int
    free: int
    leases: tuple[tuple[float, int], ...] = ()  # (created_at, GPUs) of each lease

    def frees_at(self, wanted: int) -> float:
        """When the lease granted last among those that must end for ``wanted`` GPUs to be free
        was granted, the leases ending oldest first (-inf: it fits now; inf: the leases alone
        cannot free enough, some GPUs are busy or unhealthy without one)."""
        needed = wanted - self.free
        if needed <= 0:
            return float("-inf")
        for created, gpus in sorted(self.leases):
            needed -= gpus
            if needed <= 0:
                return created
        return float("inf")


@dataclass(frozen=True, slots=True)
class Hold:
    pod: PodRef
    gpus: int
    node: str
    since: float  # the clock's time the hold was taken
    waited_since: float
    expires: float
    why: str


def unschedulable(pod: Mapping[str, Any]) -> bool:
    """kube-scheduler's verdict on the pod's last try: no node fit (``PodScheduled`` False, ``Unschedulable``)."""
    conditions = object_field(pod, "status").get("conditions")
    for condition in conditions if isinstance(conditions, list) else []:
        if isinstance(condition, dict) and condition.get("type") == "PodScheduled":
            return condition.get("status") == "False" and condition.get("reason") == "Unschedulable"
    return False


class Holds:
    def __init__(self, *, min_gpus: int = HOLD_MIN_GPUS, after_s: float = HOLD_AFTER_S, ttl_s: float = HOLD_TTL_S, guard_s: float = HOLD_GUARD_S,
                 resource: str = "nvidia.com/gpu", clock: Callable[[], float] = time.monotonic) -> None:
        """``after_s`` 0: no holds (guards only); ``guard_s`` 0: no guards (holds only)."""
        self.min_gpus, self.after_s, self.ttl_s, self.guard_s = min_gpus, after_s, ttl_s, guard_s
        self.resource, self.clock = resource, clock
        self.waiting: dict[str, Waiting] = {}  # pod UID -> since when it fits no node
        self.held: dict[str, Hold] = {}  # pod UID -> its hold
        self._by_node: dict[str, str] = {}  # node -> the UID of the pod holding it
        self._never: dict[str, None] = {}  # UIDs that hold no node again: their hold expired, or no node has their GPUs
        self.guards: dict[str, dict[str, float]] = {}  # pod UID -> node -> when its guard first kept a pod off it
        self.wake = asyncio.Event()  # set when a pod starts waiting: the keeper loop runs
        # For /metrics.
        self.taken = 0
        self.expired = 0
        self.released = dict.fromkeys(RELEASES, 0)
        self.guarded = 0  # pods kept off a node by a guard, one per node per filter call

    def busy(self) -> bool:
        """Work for the keeper: a hold to take or to end (a guard ends by itself, in the filter)."""
        return bool(self.held or (self.waiting and self.after_s > 0))

    # -- what the filter, the bind and the pod watch tell -----------------------------------

    def unplaced(self, pod: PodRef, gpus: int) -> None:
        """The pod fits no node now (each of its scheduling attempts that fails)."""
        if gpus < self.min_gpus or not pod.uid or pod.uid in self.held or pod.uid in self._never or pod.uid in self.waiting:
            return
        if len(self.waiting) >= MAX_WAITING:
            self.guards.pop(self.waiting.pop(next(iter(self.waiting))).pod.uid, None)
        self.waiting[pod.uid] = Waiting(pod, gpus, self.clock())
        log_event("pod_waiting", pod=str(pod), gpus=gpus, hold_after_s=self.after_s)
        if self.after_s > 0:  # a hold will be due: the keeper looks
            self.wake.set()

    def observe(self, kind: str, pod: Mapping[str, Any]) -> None:
        """A pod watch event: a bound, deleted or ended pod's hold ends; a large pod
        kube-scheduler marked unschedulable waits."""
        ref = pod_ref(pod)
        if not ref.uid:
            return
        if kind == "DELETED" or finished(pod):
            self.forget(ref.uid, "deleted" if kind == "DELETED" else "ended")
        elif text_field(object_field(pod, "spec"), "nodeName"):
            self.forget(ref.uid, "bound")
        elif unschedulable(pod):
            try:
                gpus = gpus_wanted(pod, self.resource)
            except (ValueError, WireError):  # PodError is a ValueError: a pod no node can take holds nothing
                return
            self.unplaced(ref, gpus)

    def forget(self, uid: str, reason: str) -> Hold | None:
        """The pod bound, was deleted or ended: its hold (returned) ends, it waits no more."""
        self.waiting.pop(uid, None)
        self._never.pop(uid, None)
        self.guards.pop(uid, None)
        hold = self.held.pop(uid, None)
        if hold is not None:
            self._by_node.pop(hold.node, None)
            self.released[reason] += 1
            log_event("hold_released", pod=str(hold.pod), node=hold.node, reason=reason, held_s=f"{self.clock() - hold.since:.1f}")
        return hold

    # -- the filter's question ---------------------------------------------------------------

    def blocking(self, node: str, uid: str, gpus: int) -> Hold | None:
        """The hold that keeps this pod (``uid``, asking for ``gpus``) off ``node``, if any."""
        holder = self._by_node.get(node)
        if holder is None or holder == uid:
            return None
        hold = self.held[holder]
        return hold if gpus <= hold.gpus else None

    def honour(self, pod: PodRef, gpus: int, passed: list[str], unresolvable: dict[str, str], free: Mapping[str, int]) -> None:
        """The filter's part: keep the pod off the nodes held for another and off those a guard
        keeps (``free``: each passed node's free GPUs, where its agent said), the reason in
        ``unresolvable`` (no preemption on the node lets it in); it still passes the others.
        Note a large pod that fits no node."""
        if self.held or self.waiting:
            ahead = self.ahead(pod.uid, gpus) if self.guard_s else {}
            for node in list(passed):
                hold = self.blocking(node, pod.uid, gpus)
                why = self.reason(hold) if hold is not None else self.guarding(node, free.get(node), gpus, ahead)
                if why is not None:
                    passed.remove(node)
                    unresolvable[node] = why
        if not passed:
            self.unplaced(pod, gpus)

    def ahead(self, uid: str, gpus: int) -> dict[int, list[tuple[float, PodRef]]]:
        """The pods whose guards may keep this one (``uid``, asking for ``gpus``) off a node: those
        that have waited longer (a pod not waiting has waited least) and ask for as many GPUs or
        more; by the GPUs they ask for, the longest waiting first."""
        own = self.held.get(uid) or self.waiting.get(uid)
        mine = (own.waited_since if isinstance(own, Hold) else own.since) if own is not None else float("inf")
        ahead: dict[int, list[tuple[float, PodRef]]] = {}
        large = [(h.pod, h.gpus, h.waited_since) for h in self.held.values()] + [(w.pod, w.gpus, w.since) for w in self.waiting.values()]
        for waiter, wants, since in large:
            if since < mine and wants >= gpus:
                ahead.setdefault(wants, []).append((since, waiter))
        for waiters in ahead.values():
            waiters.sort(key=lambda w: w[0])
        return ahead

    def guarding(self, node: str, free: int | None, gpus: int, ahead: Mapping[int, list[tuple[float, PodRef]]]) -> str | None:
        """Why a guard keeps a pod asking for ``gpus`` off ``node`` with ``free`` GPUs free (None:
        not known, nothing guarded), if one does: of the pods ``ahead``, the longest waiting that
        fits there now, would not after it, and has not kept that node for ``guard_s`` already."""
        if free is None:
            return None
        now = self.clock()
        keepers = []
        for wants in (w for w in ahead if free >= w > free - gpus):
            for since, waiter in ahead[wants]:
                began = self.guards.get(waiter.uid, {}).get(node, now)
                if now - began < self.guard_s:
                    keepers.append((since, waiter, wants))
                    break
        if not keepers:
            return None
        _, waiter, wants = min(keepers, key=lambda k: k[0])
        nodes = self.guards.setdefault(waiter.uid, {})
        if node not in nodes:
            nodes[node] = now
            log_event("guard_taken", pod=str(waiter), node=node, gpus=wants, free=free, guard_s=self.guard_s)
        self.guarded += 1
        return (f"kept for pod {waiter}, which asks for {wants} GPUs, has found no node for longer, and fits this "
                f"one now ({free} free): a pod asking for {gpus} would leave too few; such pods stay off this node "
                f"until it binds, is deleted, or {self.guard_s:g} s pass")

    def guards_now(self) -> list[tuple[PodRef, str, float]]:
        """(pod, node, since) of each guard still in force."""
        now = self.clock()
        pods = {h.pod.uid: h.pod for h in self.held.values()} | {w.pod.uid: w.pod for w in self.waiting.values()}
        return sorted(((pods[uid], node, since) for uid, nodes in self.guards.items() if uid in pods
                       for node, since in nodes.items() if now - since < self.guard_s), key=lambda g: g[2])

    @staticmethod
    def reason(hold: Hold) -> str:
        return (f"held for pod {hold.pod}, which asks for {hold.gpus} GPUs and found no node for longer than the others: "
                f"smaller pods stay off this node until it binds, is deleted or the hold ends")

    # -- the keeper's work: take holds that are due, end those expired ------------------------

    def due(self) -> list[Waiting]:
        """Waiting pods past ``after_s`` that hold nothing yet, the longest waiting first (none
        with ``after_s`` 0: no holds)."""
        if not self.after_s:
            return []
        now = self.clock()
        return sorted((w for w in self.waiting.values() if now - w.since >= self.after_s),
                      key=lambda w: w.since)

    def take(self, loads: Mapping[str, NodeLoad]) -> list[Hold]:
        """Holds for the due pods, from each node's load now; the holds taken."""
        taken = []
        for waiting in self.due():
            nodes = {node: load for node, load in loads.items() if load.gpus >= waiting.gpus and node not in self._by_node}
            if not nodes:
                if loads and not any(load.gpus >= waiting.gpus for load in loads.values()):
                    self.waiting.pop(waiting.pod.uid)  # no node has that many GPUs: no hold can help
                    self._hold_never(waiting.pod.uid)
                    log_event("hold_impossible", logging.WARNING, pod=str(waiting.pod), gpus=waiting.gpus,
                              largest=max(load.gpus for load in loads.values()))
                continue
            node = min(nodes, key=lambda n: self.rank(n, nodes[n], waiting.gpus))
            load, now = nodes[node], self.clock()
            why = (f"asks for {waiting.gpus} GPUs and fit no node for {now - waiting.since:.0f} s; of the nodes with "
                   f"{waiting.gpus} GPUs or more, {node} ({load.free} of {load.gpus} free) would free up soonest, its "
                   f"oldest leases ending first")
            hold = Hold(waiting.pod, waiting.gpus, node, now, waiting.since, now + self.ttl_s, why)
            self.held[waiting.pod.uid] = hold
            del self.waiting[waiting.pod.uid]  # it holds now (its hold keeps since when it waited)
            self._by_node[node] = waiting.pod.uid
            self.taken += 1
            taken.append(hold)
            log_event("hold_taken", pod=str(hold.pod), node=node, gpus=hold.gpus, why=why, ttl_s=self.ttl_s)
        return taken

    @staticmethod
    def rank(node: str, load: NodeLoad, gpus: int) -> tuple[float, int, int, str]:
        """A node's place in the choice of the node to hold for a pod of ``gpus`` (the smallest
        is held): the soonest to free up by its leases' ages, then the most GPUs free, the fewest
        GPUs in all, the lowest name."""
        return load.frees_at(gpus), -load.free, load.gpus, node

    def expire(self) -> list[Hold]:
        """End the holds past ``ttl_s``; those pods hold no node again (the next large pod may)."""
        now = self.clock()
        ended = [h for h in self.held.values() if now >= h.expires]
        for hold in ended:
            del self.held[hold.pod.uid]
            self._by_node.pop(hold.node, None)
            self._hold_never(hold.pod.uid)
            self.expired += 1
            log_event("hold_expired", logging.WARNING, pod=str(hold.pod), node=hold.node, held_s=f"{now - hold.since:.1f}")
        return ended

    def _hold_never(self, uid: str) -> None:
        self.guards.pop(uid, None)
        if len(self._never) >= MAX_NEVER:
            self._never.pop(next(iter(self._never)))
        self._never[uid] = None

    def interval_s(self) -> float:
        """How often the keeper looks while a pod waits: a fifth of ``after_s``, 50 ms to 1 s."""
        return max(0.05, min(1.0, self.after_s / 5))

    # -- what /holds shows ---------------------------------------------------------------------

    def document(self) -> dict[str, Any]:
        now, wall = self.clock(), time.time()

        def at(t: float) -> str:
            return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wall - (now - t)))

        return {
            "holds": [{"pod": str(h.pod), "uid": h.pod.uid, "gpus": h.gpus, "node": h.node, "since": at(h.since),
                       "waiting_since": at(h.waited_since), "expires": at(h.expires), "why": h.why}
                      for h in sorted(self.held.values(), key=lambda h: h.since)],
            "waiting": [{"pod": str(w.pod), "uid": w.pod.uid, "gpus": w.gpus, "since": at(w.since)}
                        for w in sorted(self.waiting.values(), key=lambda w: w.since)],
            "guards": [{"pod": str(pod), "uid": pod.uid, "node": node, "since": at(since), "until": at(since + self.guard_s)}
                       for pod, node, since in self.guards_now()],
            "settings": {"min_gpus": self.min_gpus, "after_s": self.after_s, "ttl_s": self.ttl_s, "guard_s": self.guard_s},
        }


Loads = Callable[[], Awaitable[dict[str, NodeLoad]]]


async def keep(holds: Holds, loads: Loads) -> None:
    """While a pod waits or holds: end the holds expired and take those due, every
    ``interval_s``; otherwise asleep on ``holds.wake``.  The ``loads`` (every agent's
    /capacity) are asked only for due pods; while those take no hold (each node that could
    take one held for another, or no agent answering), again only on a change -- a pod newly
    due, a hold ended -- or after a pause that doubles from ``interval_s`` up to ``after_s``."""
    while True:
        await holds.wake.wait()
        unserved: set[str] = set()  # the due pods the last ask found no hold for
        held = set(holds.held)
        pause, asked_at = holds.interval_s(), float("-inf")
        while holds.busy():
            try:
                holds.expire()
                due = {w.pod.uid for w in holds.due()}
                changed = bool(due - unserved) or not held <= set(holds.held)  # a pod newly due, a node unheld
                if due and (changed or holds.clock() - asked_at >= pause):
                    asked_at = holds.clock()
                    holds.take(await loads())
                    unserved = {w.pod.uid for w in holds.due()}
                    cap = max(holds.after_s, holds.interval_s())
                    pause = min(cap, holds.interval_s() if changed else 2 * pause) if unserved else holds.interval_s()
                held = set(holds.held)
            except Exception as exc:  # a bug of ours: said loudly, and the holds go on
                log.exception("holds_keeper_crashed error=%s", f"{type(exc).__name__}: {exc}"[:300])
            await asyncio.sleep(holds.interval_s())
        holds.wake.clear()
