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
forgetting it (it was allocated to pods that may still run).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from topoagent.cluster.deviceplugin import api_pb2, api_pb2_grpc
from topoagent.cluster.deviceplugin.agent_client import HEALTHY, UNHEALTHY, AgentClient, AgentError, Gpu, gpus_of
from topoagent.cluster.deviceplugin.pods import PodSource
from topoagent.log import log_event
from topoagent.vocabulary import GPU_RESOURCE

API_VERSION = "v1beta1"  # constants.go: Version
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
KUBELET_SOCKET = "kubelet.sock"
DEFAULT_RESOURCE = GPU_RESOURCE
DEFAULT_AGENT_URL = "http://127.0.0.1:9477"


@dataclass(frozen=True)
class Settings:
    plugin_dir: Path = Path(DEFAULT_PLUGIN_DIR)
    resource_name: str = DEFAULT_RESOURCE
    socket_name: str = "topoagent.sock"
    agent_url: str = DEFAULT_AGENT_URL
    agent_token: str | None = None
    poll_interval_s: float = 5.0  # how soon a finding reaches kubelet; one cheap 304 per poll
    watch_interval_s: float = 1.0  # how soon a kubelet restart is noticed

    @property
    def kubelet_socket(self) -> Path:
        return self.plugin_dir / KUBELET_SOCKET

    @property
    def socket(self) -> Path:
        return self.plugin_dir / self.socket_name


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


def fallback_choice(available: Sequence[str], must: Sequence[str], size: int, devices: dict[str, Gpu]) -> list[str]:
    """When the agent cannot answer: what kubelet must have, then the rest in index order."""
    rest = sorted((d for d in available if d not in must), key=lambda d: devices[d].index if d in devices else 1 << 30)
    return [*must, *rest][:size]


class DevicePluginService(api_pb2_grpc.DevicePluginServicer):
    def __init__(self, devices: Devices, agent: AgentClient, pods: PodSource | None):
        self.devices = devices
        self.agent = agent
        self.pods = pods

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
            ids = await self.preferred(list(want.available_deviceIDs), list(want.must_include_deviceIDs), want.allocation_size)
            answers.append(api_pb2.ContainerPreferredAllocationResponse(deviceIDs=ids))
        return api_pb2.PreferredAllocationResponse(container_responses=answers)

    async def preferred(self, available: list[str], must: list[str], size: int) -> list[str]:
        devices = self.devices.by_uuid
        if self.pods is not None:
            chosen = await self.pods.chosen_fitting(available, must, size)
            if chosen is not None:
                log_event("preferred_allocation", source="extender", devices=",".join(chosen))
                return chosen
        if any(d not in devices for d in available) or size <= 0:
            return fallback_choice(available, must, size, devices)
        offered = set(available)
        body = {
            "gpus": size,
            "include": sorted(devices[d].index for d in must),
            # "only these": every GPU of the node kubelet did not offer is excluded.
            "exclude": sorted(g.index for u, g in devices.items() if u not in offered),
        }
        try:
            answer = await self.agent.place(body)
        except AgentError as exc:
            log_event("preferred_allocation_failed", logging.WARNING, error=str(exc))
            answer = None
        if answer is None:
            return fallback_choice(available, must, size, devices)
        chosen = [g["uuid"] for g in answer["gpus"]]
        log_event("preferred_allocation", source="agent", devices=",".join(chosen))
        return chosen

    async def Allocate(self, request: api_pb2.AllocateRequest, context: Any) -> api_pb2.AllocateResponse:
        answers = []
        for want in request.container_requests:
            ids = list(want.devices_ids)
            unknown = [d for d in ids if d not in self.devices.by_uuid]
            if unknown:
                # kubelet fails the pod's start with this message; nothing is half-allocated.
                message = f"unknown device {unknown[0]}: not one of this node's GPUs"
                log_event("allocate_refused", logging.WARNING, error=message)
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, message)
            answers.append(api_pb2.ContainerAllocateResponse(envs=await self.container_env(ids)))
        return api_pb2.AllocateResponse(container_responses=answers)

    async def container_env(self, ids: list[str]) -> dict[str, str]:
        """The container's environment, GPUs in rank order.

        ``CUDA_VISIBLE_DEVICES`` by UUID too: the runtime renumbers the container's GPUs by
        PCI bus order, so only UUIDs keep CUDA device 0 the rank-0 GPU."""
        devices = self.devices.by_uuid
        order = ids
        env: dict[str, str] = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
        chosen = await self.pods.chosen_exactly(ids) if self.pods is not None else None
        if chosen is not None:
            order = chosen  # the extender's rank order
        body: dict[str, Any] = {"gpus": len(ids), "include": sorted(devices[d].index for d in ids)}
        try:
            answer = await self.agent.place(body)
        except AgentError as exc:
            log_event("allocate_order_failed", logging.WARNING, error=str(exc))
            answer = None
        if answer is not None:
            if chosen is None:
                order = [g["uuid"] for g in answer["gpus"]]
            by_uuid = {g["uuid"]: g for g in answer["gpus"]}
            # One NIC per rank, the nearest to that rank's GPU, in rank order.
            nics = _unique(by_uuid[u]["nearest_nics"][0] for u in order if by_uuid.get(u, {}).get("nearest_nics"))
            if nics:
                env["NCCL_IB_HCA"] = "=" + ",".join(nics)
        else:
            log_event("allocate_order_unknown", logging.WARNING, devices=",".join(ids))
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(order)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(order)
        log_event("allocate", devices=",".join(order), nccl_ib_hca=env.get("NCCL_IB_HCA", ""))
        return env

    async def PreStartContainer(self, request: api_pb2.PreStartContainerRequest, context: Any) -> api_pb2.PreStartContainerResponse:
        return api_pb2.PreStartContainerResponse()


def _unique(items: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(items))


class DevicePlugin:
    """Serve, register, keep the device list current, and start over when kubelet does."""

    def __init__(self, settings: Settings, pods: PodSource | None = None):
        self.settings = settings
        self.agent = AgentClient(settings.agent_url, settings.agent_token)
        self.devices = Devices()
        self.service = DevicePluginService(self.devices, self.agent, pods)
        self.server: grpc.aio.Server | None = None
        self.stopping = asyncio.Event()

    async def run(self) -> None:
        poller = asyncio.create_task(self.poll_agent())
        try:
            await self.wait_for_devices()
            await self.serve_and_register_forever()
        finally:
            poller.cancel()
            await self.stop_server()
            await self.agent.close()

    async def wait_for_devices(self) -> None:
        """kubelet is told about the plugin only once there is something to list."""
        while self.devices.version == 0 and not self.stopping.is_set():
            await self._sleep(0.2)

    async def poll_agent(self) -> None:
        etag: str | None = None
        failing = False
        while True:
            try:
                etag, doc = await self.agent.topology(etag)
                if failing:
                    log_event("agent_reachable", url=self.settings.agent_url)
                failing = False
                if doc is not None:
                    await self.devices.update(gpus_of(doc))
            except AgentError as exc:
                # The last list stands: a restarting agent must not make kubelet evict pods.
                if not failing:
                    log_event("agent_unreachable", logging.WARNING, url=self.settings.agent_url, error=str(exc))
                failing = True
            await asyncio.sleep(self.settings.poll_interval_s)

    async def serve_and_register_forever(self) -> None:
        while not self.stopping.is_set():
            kubelet = _identity(self.settings.kubelet_socket)
            if kubelet is None:
                await self._sleep(self.settings.watch_interval_s)
                continue
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
