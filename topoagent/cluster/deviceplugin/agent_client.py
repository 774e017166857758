"""The device plugin's view of the node: the local agent's /topology and /place over HTTP.

The plugin keeps no topology of its own: the agent discovers, keeps findings current and
places; the plugin only translates between kubelet's device IDs (GPU UUIDs) and the
agent's nvidia-smi indices.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from topoagent.documents.lease import LEASE_ID
from topoagent.vocabulary import PLACEMENT_BLOCKERS, Severity

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"


@dataclass(frozen=True, slots=True)
class Gpu:
    uuid: str
    index: int
    name: str  # "GPU3": what findings name as their subject
    numa_node: int | None
    health: str


def gpus_of(topology: Any) -> dict[str, Gpu]:
    """The node's GPUs by UUID, each Unhealthy when a critical finding names it, and all of
    them while a critical finding of a kind that blocks placement stands.

    Only findings about the GPU itself count (subject ``GPU3`` or its UUID): a critical
    link finding (``GPU0-GPU1``) is a slow path the placement already avoids, not a reason
    to take both GPUs away from every pod.  A document that is not a topology (a field
    missing or of another type, one UUID twice) is AgentError naming what is wrong: the
    caller keeps the last good list rather than half of a bad one."""
    if not isinstance(topology, dict):
        raise AgentAnswerError(f"GET /topology: expected a JSON object, got {type(topology).__name__}")
    findings, gpus = topology.get("findings", []), topology.get("gpus")
    if not isinstance(findings, list) or not isinstance(gpus, list):
        raise AgentAnswerError("GET /topology: expected lists of gpus and findings")
    critical = {f.get("subject") for f in findings if isinstance(f, dict) and f.get("severity") == Severity.CRITICAL}
    # A finding that blocks placement (the NVLink fabric down, no GPU stack) names the node's
    # fabric, not a GPU, yet no GPU of it can be trusted to a pod: all Unhealthy while it stands.
    blocked = any(isinstance(f, dict) and f.get("severity") == Severity.CRITICAL and f.get("kind") in PLACEMENT_BLOCKERS
                  for f in findings)
    out = {}
    for n, g in enumerate(gpus):
        if not isinstance(g, dict):
            raise AgentAnswerError(f"GET /topology: gpus[{n}]: expected an object")
        uuid, name, numa = g.get("uuid"), g.get("name"), g.get("numa_node")
        index: Any = g.get("index")
        if uuid is None or uuid == "":
            continue  # kubelet needs a stable ID; a GPU the agent cannot name is not offered
        if not isinstance(uuid, str) or not _whole(index) or not isinstance(name, str) or not (numa is None or _whole(numa)):
            raise AgentAnswerError(f"GET /topology: gpus[{n}]: expected a string uuid and name, a whole index and numa_node")
        if uuid in out:
            raise AgentAnswerError(f"GET /topology: gpus[{n}]: UUID {uuid[:60]} twice")
        sick = blocked or name in critical or uuid in critical
        out[uuid] = Gpu(uuid, index, name, numa, UNHEALTHY if sick else HEALTHY)
    return out


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def placed_uuids(answer: Any) -> list[str] | None:
    """The GPUs of a /place answer by UUID, in rank order; None when it names them otherwise."""
    gpus = answer.get("gpus") if isinstance(answer, dict) else None
    if not isinstance(gpus, list) or not all(isinstance(g, dict) and isinstance(g.get("uuid"), str) for g in gpus):
        return None
    return [g["uuid"] for g in gpus]


class AgentError(Exception):
    """The agent could not be asked, or answered something other than a placement."""


class AgentAnswerError(AgentError):
    """The agent answered, with something that is not the document asked for."""


@contextlib.contextmanager
def _asking(what: str) -> Iterator[None]:
    """One exchange with the agent: a failure to ask is AgentError naming ``what``; an
    answer that is not JSON is AgentAnswerError (the poller tells a lying agent apart)."""
    try:
        yield
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise AgentError(f"{what}: {exc or type(exc).__name__}") from exc
    except (ValueError, RecursionError) as exc:
        raise AgentAnswerError(f"{what}: not JSON: {str(exc)[:120]}") from exc


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
        with _asking("GET /topology"):
            async with self._http().get(f"{self.url}/topology", headers=headers) as resp:
                if resp.status == 304:
                    return etag, None
                if resp.status != 200:
                    raise AgentError(f"GET /topology: HTTP {resp.status}")
                return resp.headers.get("ETag"), await resp.json()

    async def leases(self) -> list[dict[str, Any]]:
        """The leases the agent holds (``GET /leases``)."""
        with _asking("GET /leases"):
            async with self._http().get(f"{self.url}/leases") as resp:
                if resp.status != 200:
                    raise AgentError(f"GET /leases: HTTP {resp.status}")
                doc = await resp.json()
        held = doc.get("leases") if isinstance(doc, dict) else None
        if not isinstance(held, list):
            raise AgentAnswerError("GET /leases: not a list of leases")
        return [x for x in held if isinstance(x, dict)]

    async def reserve(self, indices: list[int], owner: str, ttl_s: float, detail: list[str] | None = None) -> tuple[dict[str, Any] | None, str]:
        """(the placement with its ``lease``, "") for a lease on exactly these GPUs, or (None,
        the agent's reason) when it holds some of them already (409) or never could (422)."""
        body: dict[str, Any] = {"gpus": len(indices), "include": indices, "reserve": {"owner": owner, "ttl_s": ttl_s}}
        if detail:
            body["detail"] = detail
        answer, why = await self._place(body)
        lease = answer.get("lease") if answer is not None else None
        if answer is not None and not (isinstance(lease, dict) and isinstance(lease.get("id"), str)):
            raise AgentAnswerError("POST /place: a reserve answered without its lease")
        return answer, why

    async def release(self, lease_id: str) -> bool:
        """Whether the lease is gone now (released, or already ended)."""
        if not LEASE_ID.fullmatch(lease_id):
            return False  # not an id the agent hands out: never put into a URL
        try:
            async with self._http().delete(f"{self.url}/leases/{lease_id}") as resp:
                return resp.status in (200, 404)
        except (aiohttp.ClientError, TimeoutError):
            return False

    async def place(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """The agent's placement for a dry-run request, or None when nothing fits (409 now,
        422 ever)."""
        return (await self._place(request))[0]

    async def _place(self, request: Mapping[str, Any]) -> tuple[dict[str, Any] | None, str]:
        """(placement, "") or, on 409 and 422, (None, the agent's reason)."""
        with _asking("POST /place"):
            async with self._http().post(f"{self.url}/place", json=dict(request)) as resp:
                if resp.status in (409, 422):
                    return None, _reason(await resp.text())
                if resp.status != 200:
                    raise AgentError(f"POST /place: HTTP {resp.status}: {(await resp.text())[:200]}")
                answer = await resp.json()
        if not isinstance(answer, dict):
            raise AgentAnswerError("POST /place: not a placement")
        return answer, ""


def _reason(text: str) -> str:
    """The ``detail`` of the agent's error body, printable and short; the body's start without one."""
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        doc = None
    detail = doc.get("detail") if isinstance(doc, dict) else None
    said = detail if isinstance(detail, str) else text
    return "".join(c if c.isprintable() else " " for c in said[:300])
