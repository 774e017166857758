"""The node's health on its Node object: a ``TopoagentHealthy`` condition and, if asked, a taint.

Opt-in (``device-plugin --node-condition``, ``--taint-on-critical``).  The plugin already polls
the agent's /topology for the GPUs' health; the same document decides the node's:

- a critical finding stands: ``TopoagentHealthy=False``, reason the first finding's kind in
  Kubernetes' CamelCase (``gpu-stack-missing`` -> ``GpuStackMissing``), message
  ``<kind>: <message>`` (``(+N more)`` when there are others); the taint is added;
- none: ``True``, reason ``NoCriticalFinding``; the taint (ours: same key and effect) is removed;
- the agent cannot be reached or answers no topology: ``Unknown``, reason ``AgentUnreachable``;
  the taint stays as it was (a restarting agent must not let pods onto a sick node, nor evict
  them from a well one).

This is node-problem-detector's form: a condition of its own type, patched on
``nodes/{name}/status`` with a strategic merge patch (conditions merge by ``type``), whose
``lastTransitionTime`` changes only when the status does, and ``lastHeartbeatTime`` at each write.
A write happens when what is said changes, again every ``heartbeat_s`` (repairing an edit by
hand), and ``retry_s`` after a failed one.  A taint is ``spec.taints`` on the Node, which a patch
replaces whole: the list is read (from the status patch's answer), ours put in or taken out, and
written back under that ``resourceVersion`` (a 409 is tried again), so nobody else's is lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from topoagent.log import log_event
from topoagent.text import printable_line
from topoagent.vocabulary import Severity

CONDITION = "TopoagentHealthy"
MAX_MESSAGE = 1024  # a condition message is for `kubectl describe node`, not the whole finding list
EFFECTS = ("NoSchedule", "PreferNoSchedule", "NoExecute")
# Kubernetes' label key and value grammar, which taints share.
_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


@dataclass(frozen=True, slots=True)
class Health:
    status: str  # "True", "False", "Unknown"
    reason: str
    message: str


@dataclass(frozen=True, slots=True)
class Taint:
    key: str
    value: str
    effect: str

    def document(self) -> dict[str, str]:
        return {"key": self.key, "value": self.value, "effect": self.effect} if self.value else {"key": self.key, "effect": self.effect}


def parse_taint(text: str) -> Taint:
    """``KEY=VALUE:EFFECT`` or ``KEY:EFFECT`` (kubectl taint's form); ValueError saying what is wrong."""
    spec, sep, effect = text.rpartition(":")
    if not sep or effect not in EFFECTS:
        raise ValueError(f"{text[:80]!r}: expected KEY=VALUE:EFFECT with EFFECT one of {', '.join(EFFECTS)}")
    key, _, value = spec.partition("=")
    if not _KEY.match(key) or len(key) > 316:
        raise ValueError(f"{text[:80]!r}: {key[:80]!r} is not a Kubernetes label key")
    if not _VALUE.match(value):
        raise ValueError(f"{text[:80]!r}: {value[:80]!r} is not a Kubernetes label value")
    return Taint(key, value, effect)


def camel(kind: str) -> str:
    """A finding kind as a condition reason: Kubernetes' CamelCase (``gpu-stack-missing`` -> ``GpuStackMissing``)."""
    return "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", kind) if part) or "CriticalFinding"


UNREACHABLE = Health("Unknown", "AgentUnreachable", "the local topoagent cannot be reached or answered no topology")


def node_health(topology: dict[str, Any]) -> Health:
    """The node's health from a /topology document whose shape ``gpus_of`` has checked."""
    findings = topology.get("findings")
    critical = [f for f in findings or [] if isinstance(f, dict) and f.get("severity") == Severity.CRITICAL]
    if not critical:
        return Health("True", "NoCriticalFinding", "topoagent reports no critical finding")
    kind, message = str(critical[0].get("kind") or "critical"), str(critical[0].get("message") or "")
    more = f" (+{len(critical) - 1} more)" if len(critical) > 1 else ""
    # A finding's text is the node's, not ours: controls (an escape, a NUL) never reach the Node.
    text = printable_line(f"{kind}{more}: {message}")
    return Health("False", camel(kind), text if len(text) <= MAX_MESSAGE else text[: MAX_MESSAGE - 3] + "...")


class NodeApiError(Exception):
    """The API server could not be asked, or said no."""


class NodeApi:
    """The API server calls for one Node: read it, patch its status, patch its taints."""

    def __init__(self, api_url: str, node: str, token_file: Path | None = None, ca_file: Path | None = None, timeout_s: float = 5.0):
        self.api_url = api_url.rstrip("/")
        self.node = node
        self.token_file = token_file
        self.ssl: ssl.SSLContext | bool = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def _call(self, method: str, path: str, body: Any = None, content_type: str | None = None) -> dict[str, Any]:
        headers = {"Accept": "application/json"}
        if self.token_file is not None:
            # Read each time: projected service account tokens are rotated on disk.
            headers["Authorization"] = f"Bearer {self.token_file.read_text().strip()}"
        if content_type is not None:
            headers["Content-Type"] = content_type
        url = f"{self.api_url}/api/v1/nodes/{self.node}{path}"
        try:
            async with (
                aiohttp.ClientSession(timeout=self.timeout) as http,
                http.request(method, url, json=body, headers=headers, ssl=self.ssl) as resp,
            ):
                text = await resp.text()
                if resp.status != 200:
                    raise NodeApiError(f"{method} nodes/{self.node}{path}: HTTP {resp.status}: {' '.join(text.split())[:200]}")
                doc = json.loads(text)
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError, RecursionError) as exc:
            raise NodeApiError(f"{method} nodes/{self.node}{path}: {str(exc) or type(exc).__name__}") from exc
        if not isinstance(doc, dict):
            raise NodeApiError(f"{method} nodes/{self.node}{path}: not a Node")
        return doc

    async def get(self) -> dict[str, Any]:
        return await self._call("GET", "")

    async def patch_condition(self, condition: dict[str, Any]) -> dict[str, Any]:
        """The Node as the patch left it (its new resourceVersion is the one a taint patch must name)."""
        return await self._call("PATCH", "/status", {"status": {"conditions": [condition]}}, "application/strategic-merge-patch+json")

    async def patch_taints(self, taints: list[Any], resource_version: str) -> None:
        body = {"metadata": {"resourceVersion": resource_version}, "spec": {"taints": taints}}
        await self._call("PATCH", "", body, "application/merge-patch+json")


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _condition_status(node: dict[str, Any]) -> str | None:
    status = node.get("status")
    conditions = status.get("conditions") if isinstance(status, dict) else None
    for c in conditions if isinstance(conditions, list) else []:
        if isinstance(c, dict) and c.get("type") == CONDITION:
            return str(c.get("status"))
    return None


def retainted(taints: Any, ours: Taint, present: bool) -> list[Any] | None:
    """The node's taint list with ours put in (``present``) or taken out; None when it is already so."""
    listed = [t for t in taints if isinstance(t, dict)] if isinstance(taints, list) else []
    mine = [t for t in listed if t.get("key") == ours.key and t.get("effect") == ours.effect]
    others = [t for t in listed if not (t.get("key") == ours.key and t.get("effect") == ours.effect)]
    if present:
        if len(mine) == 1 and mine[0].get("value", "") == ours.value:
            return None
        return [*others, ours.document()]
    return None if not mine else others


class NodeReporter:
    """Says the latest health on the Node: on each change, every ``heartbeat_s``, after a failure at once again."""

    def __init__(self, api: NodeApi, taint: Taint | None = None, heartbeat_s: float = 60.0, retry_s: float = 5.0):
        self.api = api
        self.taint = taint
        self.heartbeat_s = heartbeat_s
        self.retry_s = retry_s
        self.wanted: Health | None = None
        self.said: Health | None = None
        self.changed = asyncio.Event()
        self._failing = False

    def set(self, health: Health) -> None:
        if health != self.wanted:
            self.wanted = health
            self.changed.set()

    async def run(self) -> None:
        """Until cancelled; the API server's failures are logged once per outage and retried."""
        while True:
            wait = self.heartbeat_s
            health = self.wanted
            if health is not None:
                try:
                    await self.apply(health)
                    if self._failing:
                        log_event("node_condition_recovered", node=self.api.node)
                    self._failing = False
                except NodeApiError as exc:
                    if not self._failing:
                        log_event("node_condition_failed", logging.WARNING, node=self.api.node, error=str(exc)[:300],
                                  retry=f"every {self.retry_s:g} s")
                    self._failing, wait = True, self.retry_s
            self.changed.clear()
            if self.wanted != health:
                continue  # changed while we wrote: say the newer one now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), wait)

    async def apply(self, health: Health) -> None:
        node = await self.api.get()
        now = _now()
        condition = {"type": CONDITION, "status": health.status, "reason": health.reason, "message": health.message,
                     "lastHeartbeatTime": now}
        if _condition_status(node) != health.status:
            condition["lastTransitionTime"] = now
        node = await self.api.patch_condition(condition)
        if self.taint is not None and health.status in ("True", "False"):
            spec = node.get("spec")
            meta = node.get("metadata")
            new = retainted(spec.get("taints") if isinstance(spec, dict) else None, self.taint, health.status == "False")
            if new is not None:
                version = meta.get("resourceVersion") if isinstance(meta, dict) else None
                await self.api.patch_taints(new, str(version or ""))
                log_event("node_taint", node=self.api.node, taint=f"{self.taint.key}:{self.taint.effect}",
                          present=health.status == "False")
        if health != self.said:
            log_event("node_condition", node=self.api.node, condition=CONDITION, status=health.status, reason=health.reason)
        self.said = health
