"""This node's Pending pods, read from the API server, and the extender's choice on them.

kubelet does not tell a device plugin which pod it allocates for, so the plugin reads the
pods bound to this node that are still Pending (``admission`` tells the pod from them and
the agent's leases).  The extender's bind leaves ``topoagent.io/gpus`` (GPU UUIDs,
comma-separated, in rank order) and ``topoagent.io/lease`` on a pod.  Anyone who can edit a
pod can write annotations, so a choice counts only when the node's agent holds that lease
for that pod (owner ``namespace/name/uid`` with the pod's UID) on exactly those GPUs: only
the extender, with the agents' token, makes such a lease.
"""

from __future__ import annotations

import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from topoagent.cluster.extender.wire import LEASE_ANNOTATION

ANNOTATION = "topoagent.io/gpus"
MAX_CHOICE_GPUS = 4096  # more than any node has: a longer annotation is no extender's
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_choice(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


@dataclass(frozen=True, slots=True)
class Choice:
    """The extender's choice for one pod, as its annotations say (not yet checked)."""

    namespace: str
    name: str
    uid: str
    lease: str
    gpus: tuple[str, ...]  # rank order


def pod_choice(pod: Any) -> Choice | None:
    """The pod's annotated choice, or None when it carries none (or one of another shape)."""
    meta = pod.get("metadata") if isinstance(pod, dict) else None
    if not isinstance(meta, dict):
        return None
    annotations = meta.get("annotations")
    if not isinstance(annotations, dict):
        return None
    value, lease, uid = annotations.get(ANNOTATION), annotations.get(LEASE_ANNOTATION), meta.get("uid")
    if not (isinstance(value, str) and isinstance(lease, str) and lease and isinstance(uid, str) and uid):
        return None
    gpus = parse_choice(value[: MAX_CHOICE_GPUS * 128])
    if not gpus or len(gpus) > MAX_CHOICE_GPUS or len(set(gpus)) != len(gpus):
        return None
    namespace, name = meta.get("namespace"), meta.get("name")
    return Choice(namespace if isinstance(namespace, str) else "default", name if isinstance(name, str) else "", uid, lease, tuple(gpus))


class PodsUnreadable(Exception):
    """This node's pods could not be read: no answer, another status, not a PodList."""


class PodSource:
    def __init__(self, api_url: str, node_name: str, token_file: Path | None = None, ca_file: Path | None = None, timeout_s: float = 3.0):
        """``timeout_s`` below the plugin's Allocate bound: a hung API server is named as such."""
        self.api_url = api_url.rstrip("/")
        self.node_name = node_name
        self.token_file = token_file
        self.ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def pending(self) -> list[dict[str, Any]]:
        """This node's Pending pods; PodsUnreadable saying why when they cannot be read."""
        headers = {}
        params = {"fieldSelector": f"spec.nodeName={self.node_name},status.phase=Pending"}
        try:
            if self.token_file is not None:
                # Read each time: projected service account tokens are rotated on disk.
                headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as http,
                http.get(f"{self.api_url}/api/v1/pods", params=params, headers=headers, ssl=self.ssl) as resp,
            ):
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                doc = await resp.json()
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError) as exc:
            raise PodsUnreadable(f"GET {self.api_url}/api/v1/pods: {str(exc) or type(exc).__name__}") from exc
        pods = doc.get("items") if isinstance(doc, dict) else None
        if not isinstance(pods, list):
            raise PodsUnreadable(f"GET {self.api_url}/api/v1/pods: not a PodList")
        return [pod for pod in pods if isinstance(pod, dict)]


def container_counts(pod: Mapping[str, Any], resource: str) -> list[int]:
    """How many of ``resource`` each container and init container asks for (limits, else
    requests), those that ask; what cannot be read counts as nothing."""
    spec = pod.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    out = []
    for key in ("initContainers", "containers"):
        containers = spec.get(key)
        for container in containers if isinstance(containers, list) else []:
            resources = container.get("resources") if isinstance(container, dict) else None
            for kind in ("limits", "requests"):
                table = resources.get(kind) if isinstance(resources, dict) else None
                if isinstance(table, dict) and resource in table:
                    value = table[resource]
                    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) < 6:
                        out.append(int(value))
                    elif isinstance(value, int) and not isinstance(value, bool):
                        out.append(value)
                    break
    return [n for n in out if n > 0]
