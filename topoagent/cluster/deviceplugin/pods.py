"""GPUs a scheduler extender already chose for a pod, read from the pod's annotation.

kubelet does not tell a device plugin which pod it allocates for, so the plugin looks at
the pods bound to this node that are still Pending and carry ``topoagent.io/gpus`` (GPU
UUIDs, comma-separated, in rank order).  A choice is used only when it is the one choice
that fits kubelet's request (same size, all offered, the must-haves in it): with two
pending pods whose choices both fit, the plugin cannot tell them apart and answers from
the agent instead, as it does when the API server cannot be reached.
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from pathlib import Path

import aiohttp

from topoagent.log import log_event

ANNOTATION = "topoagent.io/gpus"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def parse_choice(value: str) -> list[str]:
    return [part.strip() for part in value.split(",") if part.strip()]


class PodSource:
    def __init__(self, api_url: str, node_name: str, token_file: Path | None = None, ca_file: Path | None = None, timeout_s: float = 5.0):
        self.api_url = api_url.rstrip("/")
        self.node_name = node_name
        self.token_file = token_file
        self.ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def choices(self) -> list[list[str]]:
        """The annotated choices of this node's Pending pods; [] when they cannot be read."""
        headers = {}
        if self.token_file is not None:
            # Read each time: projected service account tokens are rotated on disk.
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        params = {"fieldSelector": f"spec.nodeName={self.node_name},status.phase=Pending"}
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as http,
                http.get(f"{self.api_url}/api/v1/pods", params=params, headers=headers, ssl=self.ssl) as resp,
            ):
                if resp.status != 200:
                    raise aiohttp.ClientError(f"HTTP {resp.status}")
                pods = (await resp.json()).get("items", [])
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
            log_event("pods_unreadable", logging.WARNING, api=self.api_url, error=str(exc) or type(exc).__name__)
            return []
        out = []
        for pod in pods:
            value = ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION)
            if value:
                out.append(parse_choice(value))
        return out

    async def chosen_fitting(self, available: Sequence[str], must: Sequence[str], size: int) -> list[str] | None:
        """The one extender choice that fits a preferred-allocation request, if exactly one does."""
        offered = set(available)
        fits = [c for c in await self.choices() if len(c) == size == len(set(c)) and set(c) <= offered and set(must) <= set(c)]
        return fits[0] if len({frozenset(c) for c in fits}) == 1 else None

    async def chosen_exactly(self, ids: Sequence[str]) -> list[str] | None:
        """The extender's rank order for exactly these GPUs, if a pending pod chose them."""
        for choice in await self.choices():
            if len(choice) == len(ids) and set(choice) == set(ids):
                return choice
        return None
