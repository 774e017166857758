"""A pod rejected for a reason that can go away is retried when it does.

kube-scheduler moves a pod it could not place back to its queue on a cluster event (a Node
changing, a pod ending), else only at its periodic flush (5 minutes).  A lease released or
an agent coming back changes nothing Kubernetes sees, so a pod the extender rejected for it
used to wait minutes.  So, as HAMi keeps its device annotations on the Node, the extender
writes each node's capacity ETag on its Node (``topoagent.io/capacity``) when it changes:
the Node update is the event that sends the rejected pods back to be scheduled.

Only nodes that rejected a pod in the last ``keep_s`` are watched (a rejection for a reason
no change can lift -- too few GPUs on the node -- is not noted): their agents are asked
``/capacity`` (with If-None-Match, mostly 304) every ``interval_s``, at most ``concurrency``
at once (``Agents.each``).  The ETag the rejection was decided under is the baseline; one
that differs from it (a silent agent answering again counts) is patched onto the Node, once
per change.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from topoagent.cluster.extender.kube import KubeError
from topoagent.cluster.extender.nodes import Agents, Unreachable
from topoagent.log import log_event

CAPACITY_ANNOTATION = "topoagent.io/capacity"
UNANSWERED = "unanswered"  # the annotation's value while a node's agent does not answer
MAX_WATCHED = 5000
RESULTS = ("patched", "failed", "skipped")  # of a capacity change to write on a Node


class NodePatcher(Protocol):
    async def annotate_node(self, name: str, annotations: dict[str, str]) -> None: ...


class Requeue:
    def __init__(self, agents: Agents, kube: NodePatcher, *, interval_s: float = 1.0, keep_s: float = 600.0) -> None:
        self.agents = agents
        self.kube = kube
        self.interval_s = interval_s
        self.keep_s = keep_s
        self._watched: dict[str, float] = {}  # node -> monotonic time of its last rejection
        self._seen: dict[str, str] = {}  # node -> the capacity ETag written (or first seen)
        # For /metrics, by result: patched; failed (the API server refused or was away: tried
        # again at the next sweep); skipped (the node has left the API server's table: it is
        # no longer watched, there is no Node to write on).
        self.patches = dict.fromkeys(RESULTS, 0)

    def rejected(self, node: str) -> None:
        """``node`` turned a pod away for a reason a change on it can lift: watch it."""
        if node not in self._watched and len(self._watched) >= MAX_WATCHED:
            self._watched.pop(min(self._watched, key=self._watched.__getitem__))
        self._watched[node] = time.monotonic()
        if node not in self._seen:
            cached = self.agents.cached_etag(node)
            self._seen[node] = cached if cached is not None else UNANSWERED

    async def _etag(self, node: str) -> str:
        try:
            async with asyncio.timeout(self.agents.timeout_s):
                etag, _ = await self.agents.capacity(node, counted=False)  # /metrics counts the scheduling calls' own
        except (TimeoutError, Unreachable):
            return UNANSWERED
        return etag or UNANSWERED

    async def sweep(self) -> None:
        now = time.monotonic()
        for node in [n for n, at in self._watched.items() if now - at > self.keep_s]:
            del self._watched[node]
            self._seen.pop(node, None)

        async def check(node: str) -> None:
            if node not in self.agents.table:  # deleted: its agent is not asked, no Node to patch
                self._watched.pop(node, None)
                self._seen.pop(node, None)
                self.patches["skipped"] += 1
                return
            etag = await self._etag(node)
            if etag == self._seen.get(node):
                return
            try:
                await self.kube.annotate_node(node, {CAPACITY_ANNOTATION: etag})
            except KubeError as exc:
                self.patches["failed"] += 1
                log_event("node_annotation_failed", logging.WARNING, node=node, error=exc)
                return
            self._seen[node] = etag
            self.patches["patched"] += 1

        await self.agents.each(list(self._watched), check)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.sweep()
