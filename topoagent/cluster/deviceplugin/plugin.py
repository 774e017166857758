"""A kubelet device plugin (API v1beta1) whose answers come from the local agent.

kubelet's side of the protocol (kubernetes/pkg/kubelet/cm/devicemanager): the plugin
serves the ``DevicePlugin`` service on a unix socket in kubelet's device-plugins
directory, then calls ``Registration.Register`` on ``kubelet.sock`` there naming that
socket; kubelet dials back, opens ``ListAndWatch`` and keeps it open.  When kubelet
restarts it wipes the directory's sockets and recreates its own, and every plugin must
serve and register again.

Devices are GPUs by UUID (what the NVIDIA container toolkit reads in
``NVIDIA_VISIBLE_DEVICES``).  Health is the agent's findings, polled with ETag; a GPU
the agent stops seeing stays listed as Unhealthy, so kubelet stops offering it instead of
forgetting it (it was allocated to pods that may still run).  An answer the poller cannot
use (not JSON, not a topology) is logged and the last list stands; polling goes on.

Inputs are checked before anything reaches kubelet: a request with a device twice (or one
device for two containers), or a size outside 1..offered, is refused (INVALID_ARGUMENT);
the agent's placement is used only when it names distinct offered devices, the must-haves
among them, as many as asked (else the index-order fallback); the extender's annotation
only when the agent's lease backs it (``pods``).

With leasing (a token and an API server), every allocation is leased to the pod kubelet is
admitting before Allocate answers: ``admission`` tells the pod by the GPUs its lease holds;
Allocate confirms that lease or reserves, and refuses what it cannot tell, what the agent
will not lease (409) and what it cannot read within ``ANSWER_BUDGET_S``, giving back what it
took.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import grpc
import grpc.aio

from topoagent.cluster.deviceplugin import api_pb2, api_pb2_grpc
from topoagent.cluster.deviceplugin.admission import Facts, attribute, facts, leases_of, prefer
from topoagent.cluster.deviceplugin.agent_client import (
    HEALTHY,
    UNHEALTHY,
    AgentAnswerError,
    AgentClient,
    AgentError,
    Gpu,
    gpus_of,
    placed_uuids,
)
from topoagent.cluster.deviceplugin.node import UNREACHABLE, NodeReporter, node_health
from topoagent.cluster.deviceplugin.pods import PodSource, PodsUnreadable
from topoagent.cluster.extender.wire import pod_ref
from topoagent.cluster.podwatch import Held, PodApi, PodWatch, owner_pod_uid
from topoagent.documents.lease import OWNER_MAX_LEN
from topoagent.log import log_event
from topoagent.vocabulary import GPU_RESOURCE, Detail

_T = TypeVar("_T")

API_VERSION = "v1beta1"  # constants.go: Version
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_RESOURCE = GPU_RESOURCE
DEFAULT_AGENT_URL = "http://127.0.0.1:9477"
# How long Allocate and GetPreferredAllocation wait for the agent and the API server before
# they refuse (or, for a preference, fall back): kubelet admits a node's pods one at a time
# and waits on these calls, so a hung agent must not hold every admission behind it; its own
# deadline for a plugin call is 30 s (PreStartContainer's), and a healthy answer takes
# milliseconds.  The pods read gives up sooner (PodSource: 3 s), to be named as the cause.
ANSWER_BUDGET_S = 5.0


@dataclass(frozen=True)
class Settings:
    plugin_dir: Path = Path(DEFAULT_PLUGIN_DIR)
    resource_name: str = DEFAULT_RESOURCE
    socket_name: str = "topoagent.sock"
    agent_url: str = DEFAULT_AGENT_URL
    agent_token: str | None = None
    poll_interval_s: float = 5.0  # a finding reaches kubelet after health_polls of these; one cheap 304 each
    watch_interval_s: float = 1.0  # how soon a kubelet restart is noticed
    # A GPU's health and the node's condition change once the new one holds this many polls
    # in a row: a finding flapping every poll moves neither kubelet nor the Node object.
    health_polls: int = 3
    lease_ttl_s: float = 86400.0  # a lease taken at Allocate; the pod watch ends it with the pod

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.socket_name


class Damper:
    """Each key's value as said: a new one once it has been seen ``polls`` times in a row
    (the first value of a key at once)."""

    def __init__(self, polls: int) -> None:
        self.polls = polls
        self.said: dict[str, Any] = {}
        self.coming: dict[str, tuple[Any, int]] = {}  # key -> (a new value, polls seen in a row)

    def settle(self, key: str, value: Any) -> Any:
        if key not in self.said or value == self.said[key]:
            self.said.setdefault(key, value)
            self.coming.pop(key, None)
            return value
        before, seen = self.coming.get(key, (None, 0))
        seen = seen + 1 if before == value else 1
        if seen >= self.polls:
            self.said[key] = value
            self.coming.pop(key, None)
        else:
            self.coming[key] = (value, seen)
        return self.said[key]


class Devices:
    """The devices kubelet is told about, and a way to wait until they change."""

    def __init__(self) -> None:
        self.by_uuid: dict[str, Gpu] = {}
        self.version = 0
        self.changed = asyncio.Condition()

    async def update(self, seen: dict[str, Gpu]) -> bool:
        merged = dict(seen)
        for uuid, gpu in self.by_uuid.items():
            if uuid not in merged:
                merged[uuid] = replace(gpu, health=UNHEALTHY)  # gone from the node: see the module docstring
        if merged == self.by_uuid:
            return False
        for uuid, gpu in merged.items():
            before = self.by_uuid.get(uuid)
            if before is None or before.health != gpu.health:
                log_event("device_health", uuid=uuid, gpu=gpu.name, health=gpu.health)
        async with self.changed:
            self.by_uuid = merged
            self.version += 1
            self.changed.notify_all()
        return True

    def listing(self) -> api_pb2.ListAndWatchResponse:
        devices = []
        for gpu in sorted(self.by_uuid.values(), key=lambda g: g.index):
            topology = None
            if gpu.numa_node is not None and gpu.numa_node >= 0:
                # kubelet's Topology Manager aligns GPUs with CPUs by these NUMA nodes.
                topology = api_pb2.TopologyInfo(nodes=[api_pb2.NUMANode(ID=gpu.numa_node)])
            devices.append(api_pb2.Device(ID=gpu.uuid, health=gpu.health, topology=topology))
        return api_pb2.ListAndWatchResponse(devices=devices)


class RequestRefused(ValueError):
    """kubelet's request cannot be answered as asked: INVALID_ARGUMENT with this message."""


def check_preferred(available: Sequence[str], must: Sequence[str], size: int) -> None:
    """RequestRefused naming what is wrong with a preferred-allocation request."""
    for name, ids in (("available_deviceIDs", available), ("must_include_deviceIDs", must)):
        twice = _repeated(ids)
        if twice is not None:
            raise RequestRefused(f"{name}: device {twice[:80]} twice")
    if not 1 <= size <= len(available):
        raise RequestRefused(f"allocation_size {size}: expected 1 to {len(available)} (the devices offered)")
    offered = set(available)
    missing = [d for d in must if d not in offered]
    if missing:
        raise RequestRefused(f"must_include_deviceIDs: {missing[0][:80]} is not among the devices offered")
    if len(must) > size:
        raise RequestRefused(f"must_include_deviceIDs: {len(must)} devices, more than allocation_size {size}")


def fits(chosen: Sequence[str], available: Sequence[str], must: Sequence[str], size: int) -> bool:
    """Whether ``chosen`` answers the request: ``size`` distinct offered devices, the must-haves among them."""
    picked = set(chosen)
    return len(chosen) == size == len(picked) and picked <= set(available) and set(must) <= picked


def _repeated(ids: Sequence[str]) -> str | None:
    seen: set[str] = set()
    for d in ids:
        if d in seen:
            return d
        seen.add(d)
    return None


def fallback_choice(available: Sequence[str], must: Sequence[str], size: int, devices: dict[str, Gpu],
                    covered: Collection[str] = ()) -> list[str]:
    """When the agent cannot answer: what kubelet must have, then GPUs no lease covers, then
    the rest, each in index order."""
    needed = set(must)
    rest = sorted((d for d in available if d not in needed),
                  key=lambda d: (d in covered, devices[d].index if d in devices else 1 << 30))
    return [*must, *rest][:size]


@dataclass(frozen=True)
class Leasing:
    """Leases taken at Allocate, for the pod being allocated, ended by the pod watch."""

    watch: PodWatch
    node: str
    ttl_s: float


class LocalAgent:
    """The pod watch's view of this node's agent (the watch's ``Keeper``)."""

    def __init__(self, agent: AgentClient) -> None:
        self.agent = agent

    async def release(self, node: str, lease_id: str) -> bool:
        return await self.agent.release(lease_id)

    async def leases(self, node: str) -> list[dict[str, Any]] | None:
        try:
            return await self.agent.leases()
        except AgentError:
            return None

    async def each(self, nodes: Iterable[str], ask: Callable[[str], Awaitable[_T]]) -> list[_T]:
        """One node's agent (this one): asked in turn."""
        return [await ask(node) for node in nodes]


class Refused(Exception):
    """Allocate cannot be answered: kubelet gets ``code`` and this message (the pod does not start)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Done:
    """What one Allocate has done so far, undone when it is refused."""

    taken: list[str] = field(default_factory=list)  # leases it took
    noted: dict[str, frozenset[str] | None] = field(default_factory=dict)  # pod UID -> its allocated GPUs before
    held: list[Held] = field(default_factory=list)  # the pods' leases, for the pod watch once it answers


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, devices: Devices, agent: AgentClient, pods: PodSource | None, leasing: Leasing | None = None,
                 resource: str = DEFAULT_RESOURCE, budget_s: float = ANSWER_BUDGET_S):
        self.devices = devices
        self.resource = resource
        self.agent = agent
        self.pods = pods
        self.leasing = leasing
        self.budget_s = budget_s
        self.allocated: dict[str, frozenset[str]] = {}  # pod UID -> the GPUs allocated to it, while it is Pending

    async def GetDevicePluginOptions(self, request: api_pb2.Empty, context: Any) -> api_pb2.DevicePluginOptions:
        return api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True)

    async def ListAndWatch(self, request: api_pb2.Empty, context: Any) -> AsyncIterator[api_pb2.ListAndWatchResponse]:
        version = -1
        while True:
            async with self.devices.changed:
                await self.devices.changed.wait_for(lambda: self.devices.version != version)
                version = self.devices.version
                listing = self.devices.listing()
            yield listing

    async def GetPreferredAllocation(self, request: api_pb2.PreferredAllocationRequest, context: Any) -> api_pb2.PreferredAllocationResponse:
        answers = []
        for want in request.container_requests:
            available, must, size = list(want.available_deviceIDs), list(want.must_include_deviceIDs), want.allocation_size
            try:
                check_preferred(available, must, size)
            except RequestRefused as exc:
                log_event("preferred_allocation_refused", logging.WARNING, error=str(exc))
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            try:
                async with asyncio.timeout(self.budget_s):
                    chosen = await self.preferred(available, must, size)
            except TimeoutError:
                log_event("preferred_allocation_failed", logging.WARNING, error=f"no answer within {self.budget_s:g} s")
                chosen = fallback_choice(available, must, size, self.devices.by_uuid)
            answers.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=chosen))
        return api_pb2.PreferredAllocationResponse(container_responses=answers)

    async def read_facts(self) -> Facts:
        """The agent's leases and this node's Pending pods (none without an API server);
        Refused (UNAVAILABLE, kubelet may try again) naming what could not be read."""
        try:
            leases = leases_of(await self.agent.leases())
        except AgentError as exc:
            raise Refused(grpc.StatusCode.UNAVAILABLE, f"cannot read who holds the GPUs: {exc}") from exc
        pods: list[dict[str, Any]] = []
        if self.pods is not None:
            try:
                pods = await self.pods.pending()
            except PodsUnreadable as exc:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"cannot read this node's pods: {exc}") from exc
            pending = {pod_ref(p).uid for p in pods}
            for uid in [u for u in self.allocated if u not in pending]:  # started or gone: kubelet admits it no more
                del self.allocated[uid]
        return facts(pods, leases, self.resource, self.allocated)

    async def preferred(self, available: list[str], must: list[str], size: int) -> list[str]:
        devices = self.devices.by_uuid
        covered: set[str] = set()
        if self.pods is not None:
            try:
                known = await self.read_facts()
            except Refused as exc:
                log_event("preferred_allocation_unattributed", logging.WARNING, reason=exc.message, preferring="GPUs no lease covers")
            else:
                covered = set(known.holder)
                choice = prefer(known, available, must, size)
                if choice.gpus is not None and choice.pod is not None:
                    log_event("preferred_allocation", source="lease", pod=str(choice.pod), devices=",".join(choice.gpus))
                    return choice.gpus
                if choice.unattributed:
                    log_event("preferred_allocation_unattributed", logging.WARNING, reason=choice.unattributed, preferring="GPUs no lease covers")
        if any(d not in devices for d in available):
            return fallback_choice(available, must, size, devices, covered)
        offered = set(available)
        body = {
            "gpus": size,
            "include": sorted(devices[d].index for d in must),
            # "only these": every GPU of the node kubelet did not offer is excluded; the agent
            # keeps off leased GPUs itself.
            "exclude": sorted(g.index for u, g in devices.items() if u not in offered),
        }
        try:
            answer = await self.agent.place(body)
        except AgentError as exc:
            log_event("preferred_allocation_failed", logging.WARNING, error=str(exc))
            answer = None
        if answer is None:
            return fallback_choice(available, must, size, devices, covered)
        placed = placed_uuids(answer)
        if placed is None or not fits(placed, available, must, size):
            # Not what was asked (a device twice, one not offered, another count): never to kubelet.
            log_event("agent_answer_refused", logging.WARNING, devices=",".join(placed or [])[:400], size=size)
            return fallback_choice(available, must, size, devices, covered)
        log_event("preferred_allocation", source="agent", devices=",".join(placed))
        return placed

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        wants = [list(want.devices_ids) for want in request.container_requests]
        message = self.malformed(wants)
        if message:
            # kubelet fails the pod's start with this message; nothing is half-allocated.
            log_event("allocate_refused", logging.WARNING, error=message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
        done = Done()
        try:
            async with asyncio.timeout(self.budget_s):
                answers = [await self.allocate(ids, done) for ids in wants]
        except TimeoutError:
            refused = Refused(grpc.StatusCode.UNAVAILABLE, f"the agent or the API server did not answer within {self.budget_s:g} s")
        except Refused as exc:
            refused = exc
        else:
            if self.leasing is not None:
                for held in done.held:  # released with its pod, by the pod watch
                    self.leasing.watch.track(held)
            return api_pb2.AllocateResponse(container_responses=answers)
        for uid, before in done.noted.items():
            if before is None:
                self.allocated.pop(uid, None)
            else:
                self.allocated[uid] = before
        for lease_id in done.taken:
            released = False
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.budget_s):
                    released = await self.agent.release(lease_id)
            if not released:  # its pod fails admission: the watch's sweep ends the lease with it
                log_event("lease_release_failed", logging.WARNING, lease=lease_id, reason="its Allocate was refused",
                          retry="the pod watch's sweep ends it with the pod")
        # Two jobs on one GPU, or a GPU nobody holds, is worse than a pod that fails to start.
        log_event("allocate_refused", logging.WARNING, error=refused.message, released=",".join(done.taken))
        await context.abort(refused.code, refused.message)
        raise AssertionError("abort returned")  # pragma: no cover - abort raises

    def malformed(self, wants: list[list[str]]) -> str:
        """Why kubelet's request cannot be what it means, or ""."""
        seen: set[str] = set()
        for ids in wants:
            twice = _repeated(ids)
            unknown = next((d for d in ids if d not in self.devices.by_uuid), None)
            again = next((d for d in ids if d in seen), None)
            message = ("no devices asked" if not ids else f"device {twice[:80]} asked twice" if twice is not None
                       else f"unknown device {unknown[:80]}: not one of this node's GPUs" if unknown is not None
                       else f"device {again[:80]} asked for two containers" if again is not None else "")
            if message:
                return message
            seen.update(ids)
        return ""

    async def allocate(self, ids: list[str], done: Done) -> api_pb2.ContainerAllocateResponse:
        """One container's answer, its GPUs leased to its pod first (Refused when they cannot be)."""
        known = await self.read_facts()
        if self.leasing is None:
            return await self.allocate_unleased(ids, known)
        who = attribute(known, ids)
        if who.refused or who.pod is None:
            raise Refused(grpc.StatusCode.FAILED_PRECONDITION, who.refused)
        pod, devices = who.pod, ",".join(ids)
        if who.lease is not None:  # its own lease holds them: nothing to take, its bindings to ask
            lease_id = who.lease.id
            answer = await self.bindings(ids, lease_id)
            by = "extender" if lease_id == pod.annotated else "device-plugin"
            order = [g for g in pod.own if g in set(ids)] if by == "extender" else None
        else:
            indices = sorted(self.devices.by_uuid[d].index for d in ids)
            try:
                answer, why = await self.agent.reserve(indices, pod.ref.owner(OWNER_MAX_LEN), self.leasing.ttl_s, [Detail.BINDINGS])
            except AgentError as exc:
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"cannot lease {devices[:400]} for {pod}: {exc}") from exc
            if answer is None:
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION, f"the agent would not lease these GPUs to {pod}: {why}")
            lease_id, by, order = answer["lease"]["id"], "device-plugin", None
            done.taken.append(lease_id)
            covers = answer["lease"].get("gpu_uuids")
            if not isinstance(covers, list) or sorted(map(str, covers)) != sorted(ids):
                raise Refused(grpc.StatusCode.UNAVAILABLE, f"the agent's lease {lease_id} holds {covers!r:.200}, not the GPUs kubelet allocated")
        done.noted.setdefault(pod.ref.uid, self.allocated.get(pod.ref.uid))
        self.allocated[pod.ref.uid] = self.allocated.get(pod.ref.uid, frozenset()) | set(ids)
        done.held.append(Held(pod.ref.namespace, pod.ref.name, pod.ref.uid, self.leasing.node, lease_id))
        log_event("allocation_leased", pod=str(pod), lease=lease_id, by=by, devices=devices)
        return api_pb2.ContainerAllocateResponse(envs=self.container_env(ids, answer, order))

    async def allocate_unleased(self, ids: list[str], known: Facts) -> api_pb2.ContainerAllocateResponse:
        """Without leasing (no token or no API server): refuse GPUs another owner holds; a
        lease of a pod Pending here may be this pod's (its bindings are asked as its holder)."""
        pending = {c.ref.uid: c for c in known.pods}
        lease_ids = set()
        for d in ids:
            lease = known.holder.get(d)
            if lease is None:
                continue
            uid = owner_pod_uid(lease.owner)
            if uid is None or (self.pods is not None and uid not in pending):
                raise Refused(grpc.StatusCode.FAILED_PRECONDITION,
                              f"device {d[:80]} is held by the agent's lease {lease.id[:64]} for {lease.owner[:120]}, "
                              "not for a pod starting on this node")
            lease_ids.add(lease.id)
        lease_id = next(iter(lease_ids)) if len(lease_ids) == 1 else None
        answer = await self.bindings(ids, lease_id)
        pod = next((c for c in pending.values() if c.annotated and c.annotated == lease_id), None)
        order = [g for g in pod.own if g in set(ids)] if pod is not None and set(ids) <= set(pod.own) else None
        return api_pb2.ContainerAllocateResponse(envs=self.container_env(ids, answer, order))

    async def bindings(self, ids: list[str], lease_id: str | None) -> dict[str, Any] | None:
        """The agent's rank order and nearest NICs for exactly these GPUs, asked as the holder of
        ``lease_id`` (its GPUs are no conflict to it); None when it cannot say."""
        body: dict[str, Any] = {"gpus": len(ids), "include": sorted(self.devices.by_uuid[d].index for d in ids),
                                "detail": [Detail.BINDINGS]}
        if lease_id is not None:
            body["lease"] = lease_id
        try:
            return await self.agent.place(body)
        except AgentError as exc:
            log_event("allocate_order_failed", logging.WARNING, error=str(exc))
            return None

    def container_env(self, ids: list[str], answer: dict[str, Any] | None, order: list[str] | None) -> dict[str, str]:
        """The container's environment, GPUs in rank order (``order``, else the agent's).

        ``CUDA_VISIBLE_DEVICES`` by UUID too: the runtime renumbers the container's GPUs by
        PCI bus order, so only UUIDs keep CUDA device 0 the rank-0 GPU."""
        env: dict[str, str] = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        placed = placed_uuids(answer) if answer is not None else None
        if placed is not None and sorted(placed) != sorted(ids):
            log_event("agent_answer_refused", logging.WARNING, devices=",".join(placed)[:400], asked=",".join(ids))
            placed = None  # another set than kubelet allocated: neither its order nor its NICs
        if answer is None or placed is None:
            log_event("allocate_order_unknown", logging.WARNING, devices=",".join(ids))
        rank = order or placed or ids
        if answer is not None and placed is not None:
            by_uuid = {g["uuid"]: g for g in answer["gpus"]}
            # One NIC per rank, the nearest to that rank's GPU, in rank order.
            nics = _unique(n for n in (_nearest_nic(by_uuid[u]) for u in rank) if n is not None)
            if nics:
                env["NCCL_IB_HCA"] = "=" + ",".join(nics)
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(rank)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(rank)
        log_event("allocate", devices=",".join(rank), nccl_ib_hca=env.get("NCCL_IB_HCA", ""))
        return env

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest, context: Any) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


NIC_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def _nearest_nic(gpu: dict[str, Any]) -> str | None:
    """The GPU's nearest NIC as the agent names it, when it names one as an interface can be named."""
    nics = gpu.get("nearest_nics")
    first = nics[0] if isinstance(nics, list) and nics else None
    return first if isinstance(first, str) and NIC_NAME.fullmatch(first) else None


class DevicePlugin:
    """Serve, register, keep the device list current, and start over when kubelet does."""

    def __init__(self, settings: Settings, pods: PodSource | None = None, kube: PodApi | None = None, node: str | None = None,
                 pod_resync_s: float = 60.0, reporter: NodeReporter | None = None):
        """With ``kube`` (and the agent's token): lease what kubelet allocates, and watch this
        ``node``'s pods to release the leases when they end.  With ``reporter``: the node's
        health from the same polls goes onto its Node object (``node``)."""
        self.settings = settings
        self.reporter = reporter
        self.agent = AgentClient(settings.agent_url, settings.agent_token)
        self.devices = Devices()
        self.watch: PodWatch | None = None
        leasing = None
        if kube is not None and node and pods is not None:
            self.watch = PodWatch(kube, LocalAgent(self.agent), resync_s=pod_resync_s, field_selector=f"spec.nodeName={node}",
                                  who="device-plugin")
            self.watch.note_node(node)  # its agent is swept from the first resync
            leasing = Leasing(self.watch, node, settings.lease_ttl_s)
        self.service = DevicePluginService(self.devices, self.agent, pods, leasing, settings.resource_name)
        self.server: grpc.aio.Server | None = None
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        poller = asyncio.create_task(self.poll_agent())
        watcher = asyncio.create_task(self.watch.run()) if self.watch is not None else None
        reporting = asyncio.create_task(self.reporter.run()) if self.reporter is not None else None
        try:
            await self.wait_for_devices()
            await self.serve_and_register_forever()
        finally:
            poller.cancel()
            if reporting is not None:
                reporting.cancel()
            if watcher is not None:
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher
            await self.stop_server()
            await self.agent.close()

    async def wait_for_devices(self) -> None:
        """kubelet is told about the plugin only once there is something to list."""
        while self.devices.version == 0 and not self.stopping.is_set():
            await self._sleep(0.2)

    async def poll_agent(self) -> None:
        """Forever: nothing the agent answers ends it (a GPU that turns critical later must
        still reach kubelet).  Each new problem is logged once; the last list stands."""
        etag: str | None = None
        problem: tuple[str, str] | None = None
        damper = Damper(self.settings.health_polls)
        gpus: dict[str, Gpu] = {}
        health = None
        while True:
            now: tuple[str, str] | None = None
            try:
                seen, doc = await self.agent.topology(etag)
                if doc is not None:  # else unchanged (304): the same answer counts again
                    gpus, health = gpus_of(doc), node_health(doc)
                etag = seen
                await self.devices.update({u: replace(g, health=damper.settle(u, g.health)) for u, g in gpus.items()})
                if self.reporter is not None and health is not None:
                    self.reporter.set(damper.settle("node", health))
            except AgentAnswerError as exc:
                now = ("agent_answer_refused", str(exc))
            except AgentError as exc:
                # The last list stands: a restarting agent must not make kubelet evict pods.
                now = ("agent_unreachable", str(exc))
            except Exception as exc:  # a document no check foresaw: say so, keep polling
                now = ("agent_answer_refused", f"{type(exc).__name__}: {exc}"[:300])
            if now is not None:
                etag = None  # ask for the whole document again next time
                if self.reporter is not None:
                    self.reporter.set(damper.settle("node", UNREACHABLE))
                if now != problem:
                    log_event(now[0], logging.WARNING, url=self.settings.agent_url, error=now[1], kept="the last device list")
            elif problem is not None:
                log_event("agent_reachable", url=self.settings.agent_url)
            problem = now
            await asyncio.sleep(self.settings.poll_interval_s)

    async def serve_and_register_forever(self) -> None:
        waiting = False
        while not self.stopping.is_set():
            kubelet = _identity(self.settings.kubelet_socket)
            if kubelet is None:
                if not waiting:  # once per absence: a wrong --plugin-dir is seen at once
                    log_event("waiting_for_kubelet", socket=str(self.settings.kubelet_socket))
                waiting = True
                await self._sleep(self.settings.watch_interval_s)
                continue
            waiting = False
            await self.start_server()
            if not await self.register():
                await self.stop_server()
                await self._sleep(self.settings.watch_interval_s)
                continue
            # Registered: watch until kubelet's socket is replaced (a kubelet restart) or ours is wiped.
            while not self.stopping.is_set():
                await self._sleep(self.settings.watch_interval_s)
                if _identity(self.settings.kubelet_socket) != kubelet or not self.settings.socket.exists():
                    log_event("kubelet_restarted", socket=str(self.settings.kubelet_socket))
                    break
            await self.stop_server()

    async def _sleep(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):  # woken early only to stop
            await asyncio.wait_for(self.stopping.wait(), seconds)

    async def start_server(self) -> None:
        path = self.settings.socket
        path.unlink(missing_ok=True)  # a socket left by an earlier run
        server = grpc.aio.server()
        api_pb2_grpc.add_DevicePluginServicer_to_server(self.service, server)
        server.add_insecure_port(f"unix://{path}")
        await server.start()
        self.server = server
        log_event("serving", socket=str(path))

    async def stop_server(self) -> None:
        if self.server is not None:
            await self.server.stop(grace=1.0)
            self.server = None
        # Our socket, unless kubelet already wiped it (or another run replaced it: same path).
        self.settings.socket.unlink(missing_ok=True)

    async def register(self) -> bool:
        request = api_pb2.RegisterRequest(
            version=API_VERSION,
            endpoint=self.settings.socket_name,  # kubelet joins it to its own directory
            resource_name=self.settings.resource_name,
            options=api_pb2.DevicePluginOptions(pre_start_required=False, get_preferred_allocation_available=True),
        )
        try:
            async with grpc.aio.insecure_channel(f"unix://{self.settings.kubelet_socket}") as channel:
                await api_pb2_grpc.RegistrationStub(channel).Register(request, timeout=10)
        except grpc.aio.AioRpcError as exc:
            log_event("register_failed", logging.WARNING, code=exc.code().name, detail=exc.details() or "")
            return False
        log_event("registered", resource=self.settings.resource_name, endpoint=self.settings.socket_name, devices=len(self.devices.by_uuid), healthy=sum(g.health == HEALTHY for g in self.devices.by_uuid.values()))
        return True


def _identity(path: Path) -> tuple[int, int, int] | None:
    """What tells one kubelet socket from the next one at the same path."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return (st.st_dev, st.st_ino, st.st_ctime_ns)
