"""The device plugin's view of the node: the local agent's /topology and /place over HTTP.

The plugin keeps no topology of its own: the agent discovers, keeps findings current and
places; the plugin only translates between kubelet's device IDs (GPU UUIDs) and the
agent's nvidia-smi indices.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from topoagent.vocabulary import Severity

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    index: int
    name: str  # "GPU3": what findings name as their subject
    numa_node: int | None
    health: str


def gpus_of(topology: Mapping[str, Any]) -> dict[str, Gpu]:
    """The node's GPUs by UUID, each Unhealthy when a critical finding names it.

    Only findings about the GPU itself count (subject ``GPU3`` or its UUID): a critical
    link finding (``GPU0-GPU1``) is a slow path the placement already avoids, not a reason
    to take both GPUs away from every pod."""
    critical = {f["subject"] for f in topology.get("findings", []) if f.get("severity") == Severity.CRITICAL}
    out = {}
    for g in topology.get("gpus", []):
        uuid = g.get("uuid")
        if not uuid:
            continue  # kubelet needs a stable ID; a GPU the agent cannot name is not offered
        sick = g["name"] in critical or uuid in critical
        out[uuid] = Gpu(uuid, g["index"], g["name"], g.get("numa_node"), UNHEALTHY if sick else HEALTHY)
    return out


class AgentError(Exception):
    """The agent could not be asked, or answered something other than a placement."""


class AgentClient:
    def __init__(self, url: str, token: str | None = None, timeout_s: float = 10.0):
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=self.timeout, headers=self.headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def topology(self, etag: str | None = None) -> tuple[str | None, dict[str, Any] | None]:
        """(ETag, document), or (etag, None) when it has not changed since ``etag``."""
        headers = {"If-None-Match": etag} if etag else {}
        try:
            async with self._http().get(f"{self.url}/topology", headers=headers) as resp:
                if resp.status == 304:
                    return etag, None
                if resp.status != 200:
                    raise AgentError(f"GET /topology: HTTP {resp.status}")
                return resp.headers.get("ETag"), await resp.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentError(f"GET /topology: {exc or type(exc).__name__}") from exc

    async def place(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """The agent's placement for a dry-run request, or None when nothing fits (409 now,
        422 ever)."""
        try:
            async with self._http().post(f"{self.url}/place", json=dict(request)) as resp:
                if resp.status in (409, 422):
                    return None
                if resp.status != 200:
                    raise AgentError(f"POST /place: HTTP {resp.status}: {(await resp.text())[:200]}")
                answer: dict[str, Any] = await resp.json()
                return answer
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise AgentError(f"POST /place: {exc or type(exc).__name__}") from exc
