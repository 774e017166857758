"""A pod's lease ends with the pod: a watch on the API server's pods that releases the
agent lease of a pod that ended (``Succeeded``, ``Failed``) or was deleted.

Whoever took a lease for a pod runs one: the extender for the leases of its binds (the
pod carries ``topoagent.io/lease`` and ``spec.nodeName``), the device plugin for its node's.  Releasing is
``DELETE /leases/{id}`` on the node's agent, through the ``Keeper`` given; a release
that fails (agent away) is retried at every resync until the agent says the lease is gone.

The loop: list the pods (paged: a consistent snapshot without holding the whole cluster
in one body), then watch from the list's resourceVersion for ``resync_s`` seconds, then
list again.  A stream the API server closes early, a 410 Gone or an unreadable event
start the next list at once (at most one a second): no event is lost for long, and the
list repairs anything missed.  Each list also sweeps the agents (every node of the
cluster when the caller knows them, as the extender does: after a restart it has bound
nothing yet, and a pod that ended while it was down is on no list of its own): a lease whose owner
names a pod (``namespace/name/uid``, the extender's owner form) and whose pod is not in
two lists in a row, or has finished, is released.  The agents' leases are read *before*
each list starts, so a lease seen at one resync was granted to a pod that existed before
the next list began: that list has the pod unless it is gone, even when the watch sees
one node's pods only (the device plugin's) and the pod was being bound there.

Whoever leases for a pod without writing it on the pod (the device plugin at Allocate)
calls ``track``: its lease is then released with the pod like an annotated one.

Memory: per pod with a lease, one small record (at most ``max_tracked``); per resync, the
owners of the leases read; per watch event, one pod object, at most ``max_event_bytes``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from topoagent.cluster.extender.kube import KubeError, WatchCall, WatchThread
from topoagent.cluster.extender.wire import LEASE_ANNOTATION
from topoagent.documents.lease import owner_pod
from topoagent.log import event_line, log, log_event

_T = TypeVar("_T")

FINISHED = frozenset({"Succeeded", "Failed"})
LIST_PAGE = 500
MAX_EVENT_BYTES = 4 * 1024 * 1024  # etcd keeps objects below 1.5 MiB; a Pod as JSON stays well below this
MAX_TRACKED = 200_000
MAX_PAUSE_S = 30.0


class PodApi(Protocol):
    """The API server calls the watch makes (``extender.kube.Kube``); blocking."""

    def list_pods_page(self, limit: int, token: str | None, field_selector: str | None = None) -> dict[str, Any]: ...

    def watch_pods(self, resource_version: str, timeout_s: int, max_event_bytes: int, call: WatchCall,
                   field_selector: str | None = None) -> Iterable[dict[str, Any]]: ...


class Keeper(Protocol):
    """The agents' leases."""

    async def release(self, node: str, lease_id: str) -> bool: ...

    async def leases(self, node: str) -> list[dict[str, Any]] | None: ...

    async def each(self, nodes: Iterable[str], ask: Callable[[str], Awaitable[_T]]) -> list[_T]:
        """``ask(node)`` for every node, as many at once as the keeper allows."""
        ...


@dataclass(frozen=True, slots=True)
class Held:
    """A pod's lease, as the pod's annotation and binding say."""

    namespace: str
    name: str
    uid: str
    node: str
    lease: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def text_field(doc: Mapping[str, Any], key: str) -> str:
    """``doc[key]`` where it is text, else "": an API object's field, never trusted to be there."""
    value = doc.get(key)
    return value if isinstance(value, str) else ""


def object_field(doc: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    """``doc[key]`` where it is an object, else {}."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def pod_uid(pod: Mapping[str, Any]) -> str:
    return text_field(object_field(pod, "metadata"), "uid")


def held_lease(pod: Mapping[str, Any]) -> Held | None:
    """The lease the pod holds by its annotation, on the node it is bound to; None without."""
    meta = object_field(pod, "metadata")
    lease, node = text_field(object_field(meta, "annotations"), LEASE_ANNOTATION), text_field(object_field(pod, "spec"), "nodeName")
    uid = text_field(meta, "uid")
    if not lease or not node or not uid:
        return None
    return Held(text_field(meta, "namespace") or "default", text_field(meta, "name"), uid, node, lease)


def finished(pod: Mapping[str, Any]) -> bool:
    return text_field(object_field(pod, "status"), "phase") in FINISHED


def owner_pod_uid(owner: Any) -> str | None:
    """The pod UID a lease owner names (``owner_pod``), or None for any other owner."""
    pod = owner_pod(owner)
    return pod[2] if pod else None


class PodWatch:
    def __init__(self, api: PodApi, keeper: Keeper, *, resync_s: float = 60.0, field_selector: str | None = None,
                 max_tracked: int = MAX_TRACKED, who: str = "extender", cluster_nodes: Callable[[], Iterable[str]] | None = None,
                 on_event: Callable[[str, Mapping[str, Any]], None] | None = None) -> None:
        self.api = api
        self.on_event = on_event  # told every pod event first (the extender's holds)
        self.keeper = keeper
        # Every node of the cluster (the extender's Node table): all swept at each resync, so a
        # lease whose pod ended while no watch ran is found whoever bound it, restart or not.
        self.cluster_nodes = cluster_nodes
        self.resync_s = resync_s
        self.field_selector = field_selector
        self.max_tracked = max_tracked
        self.who = who
        self.tracked: dict[str, Held] = {}  # pod UID -> its lease
        self.unreleased: dict[str, Held] = {}  # lease id -> lease whose release failed; retried each resync
        self.nodes: dict[str, None] = {}  # nodes whose agents are swept (insertion-ordered, bounded)
        self.suspects: dict[tuple[str, str], str] = {}  # (node, lease id) -> pod UID: not live at the last resync
        self.released = 0
        self.resyncs = 0

    def track(self, held: Held) -> None:
        """A lease taken for a pod that does not carry it (the device plugin's at Allocate):
        released when the pod ends, like an annotated one."""
        self.tracked[held.uid] = held
        self.note_node(held.node)

    def note_node(self, node: str) -> None:
        """A node that may hold pods' leases (the extender's bind calls it)."""
        self.nodes.pop(node, None)
        self.nodes[node] = None
        while len(self.nodes) > self.max_tracked:
            self.nodes.pop(next(iter(self.nodes)))

    async def run(self) -> None:
        """List, watch, again, until cancelled; never raises for the API server's sake."""
        failing = False
        pause = 1.0  # between lists: one a second, doubling to MAX_PAUSE_S while the API server fails
        while True:
            started = time.monotonic()
            try:
                version = await self.resync()
                if failing:
                    log_event("pod_watch_recovered", who=self.who)
                failing, pause = False, 1.0
                await self.watch(version)
            except KubeError as exc:  # the API server refused, or a stream broke: the watch goes on
                if not failing:  # once per outage, not once per retry
                    log_event("pod_watch_failed", logging.WARNING, who=self.who, error=str(exc)[:300], retry=f"within {MAX_PAUSE_S:g} s")
                failing, pause = True, min(MAX_PAUSE_S, pause * 2)
            except Exception as exc:  # a bug of ours: said with its traceback, and the watch goes on
                if not failing:
                    log.error(event_line("pod_watch_failed", who=self.who, error=f"{type(exc).__name__}: {exc}"[:300],
                                         retry=f"within {MAX_PAUSE_S:g} s"), exc_info=exc)
                failing, pause = True, min(MAX_PAUSE_S, pause * 2)
            await asyncio.sleep(max(0.0, pause - (time.monotonic() - started)))

    # -- one event --------------------------------------------------------------------------

    async def observe(self, kind: str, pod: Mapping[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(kind, pod)
        uid = pod_uid(pod)
        if not uid:
            return
        held = held_lease(pod)
        if kind == "DELETED" or finished(pod):
            held = held or self.tracked.get(uid)
            self.tracked.pop(uid, None)
            if held is not None:
                await self._release(held, "deleted" if kind == "DELETED" else text_field(object_field(pod, "status"), "phase"))
            return
        if held is not None:
            await self._follow(held)

    async def _release(self, held: Held, reason: str) -> None:
        if await self.keeper.release(held.node, held.lease):
            self.unreleased.pop(held.lease, None)
            self.released += 1
            log_event("lease_released", who=self.who, pod=str(held), uid=held.uid, node=held.node, lease=held.lease, reason=reason)
        elif held.lease not in self.unreleased and len(self.unreleased) < self.max_tracked:
            log_event("lease_release_failed", logging.WARNING, who=self.who, pod=str(held), node=held.node, lease=held.lease,
                      reason=reason, retry="at the next resync")
            self.unreleased[held.lease] = held  # past max_tracked: the sweep still finds it, its pod gone

    # -- list, sweep, watch -----------------------------------------------------------------

    async def resync(self) -> str:
        """Sweep the agents against a fresh list of the pods; the list's resourceVersion."""
        self.resyncs += 1
        for held in list(self.unreleased.values()):
            await self._release(held, "retry")
        # Leases first, then the list: see the module docstring.
        owned = await self._pod_owned_leases()
        interesting = {uid for _, _, uid in owned} | set(self.tracked)
        version, live, annotated, ended = await asyncio.to_thread(self._list_all, interesting)
        before, self.tracked = self.tracked, {}
        for held in ended:
            await self._release(held, "ended")
        for held in annotated.values():
            await self._follow(held)
        for uid, held in before.items():
            if uid in self.tracked or held.lease in {h.lease for h in ended}:
                continue
            if uid in live:  # still running; a lease not on its annotations (the device plugin's own)
                self.tracked[uid] = held
            else:
                await self._release(held, "pod gone")
        # A pod-owned lease whose pod is not live, twice in a row: the second list started
        # after the first read of the leases, so even a watch narrowed to one node's pods
        # (a pod being bound there now is not yet in it) cannot sweep a live pod's lease.
        handled = {h.lease for h in before.values()} | {h.lease for h in self.tracked.values()} | {h.lease for h in ended}
        suspects: dict[tuple[str, str], str] = {}
        for node, lease_id, uid in owned:
            if uid in live or lease_id in handled:
                continue
            if (node, lease_id) in self.suspects:
                await self._release(Held("", f"uid {uid}", uid, node, lease_id), "its pod no longer exists")
            elif len(suspects) < self.max_tracked:
                suspects[(node, lease_id)] = uid
        self.suspects = suspects
        return version

    async def _follow(self, held: Held) -> None:
        before = self.tracked.get(held.uid)
        if before is not None and before.lease != held.lease:
            await self._release(before, "replaced by lease " + held.lease)
        if before is None and len(self.tracked) >= self.max_tracked:
            log_event("pod_watch_full", logging.WARNING, who=self.who, tracked=len(self.tracked), pod=str(held))
            return  # the resync's sweep still ends its lease with the pod
        self.tracked[held.uid] = held
        self.note_node(held.node)

    async def _pod_owned_leases(self) -> list[tuple[str, str, str]]:
        """(node, lease id, pod UID) of every pod-owned lease on the nodes swept: those noted,
        and every node of the cluster when known; as many agents asked at once as the keeper allows."""
        nodes = dict.fromkeys(self.nodes)
        if self.cluster_nodes is not None:
            nodes.update(dict.fromkeys(self.cluster_nodes()))
        out: list[tuple[str, str, str]] = []
        for node, leases in zip(nodes, await self.keeper.each(nodes, self.keeper.leases), strict=True):
            for lease in leases or []:
                uid = owner_pod_uid(lease.get("owner"))
                lease_id = lease.get("id")
                if uid is not None and isinstance(lease_id, str):
                    out.append((node, lease_id, uid))
        return out

    def _list_all(self, interesting: set[str]) -> tuple[str, set[str], dict[str, Held], list[Held]]:
        """(resourceVersion, the UIDs of ``interesting`` whose pods exist and have not
        finished, the leases of live annotated pods, those of finished ones).  Nothing else
        of the list is kept: memory grows with the leases, not with the cluster's pods."""
        token: str | None = None
        live: set[str] = set()
        annotated: dict[str, Held] = {}
        ended: list[Held] = []
        while True:
            page = self.api.list_pods_page(LIST_PAGE, token, self.field_selector)
            for pod in page["items"]:
                if not isinstance(pod, dict):
                    continue
                uid, held, done = pod_uid(pod), held_lease(pod), finished(pod)
                if uid in interesting and not done:
                    live.add(uid)
                if held is not None and done:
                    ended.append(held)
                elif done and uid in self.tracked:
                    ended.append(self.tracked[uid])
                elif held is not None:
                    annotated[uid] = held
            meta = object_field(page, "metadata")
            token = text_field(meta, "continue") or None
            if token is None:
                return text_field(meta, "resourceVersion"), live, annotated, ended

    async def watch(self, version: str) -> None:
        """Events from ``version`` on, until the stream ends (resync_s at the latest).  However
        it ends (cancelled included), its thread has ended too."""
        def stream(call: WatchCall) -> Iterable[dict[str, Any]]:
            return self.api.watch_pods(version, max(1, int(self.resync_s)), MAX_EVENT_BYTES, call, self.field_selector)

        async with WatchThread(stream, "pod-watch") as events:
            async for event in events:
                kind, pod = event["type"], event["object"]
                if kind == "ERROR":  # 410 Gone (too old a resourceVersion) and the like: list again
                    raise KubeError(f"watch pods: {cut_status(pod)}")
                if kind in ("ADDED", "MODIFIED", "DELETED"):
                    await self.observe(kind, pod)


def cut_status(status: Mapping[str, Any]) -> str:
    return f"{text_field(status, 'reason') or 'error'} {status.get('code', '')}: {text_field(status, 'message')[:160]}"
