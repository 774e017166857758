"""Where each node's agent is, as the API server's Node objects say: the only table the
extender resolves a node name through.

A filter body is the caller's word, not the cluster's: a node named ``127.0.0.2``, or a
``Nodes.items`` entry giving a real node another InternalIP, must never choose where the
agents' token goes.  So the extender lists the Node objects itself (paged, every
``resync_s``, and at once, at most every ``min_gap_s``, when asked about a name it does not
know: a node that just joined is found within a call), keeps name -> address, and
answers no request for a name the table does not hold.

Memory: one name and one address per node of the cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Any, Protocol

from topoagent.cluster.extender.kube import KubeError
from topoagent.cluster.extender.wire import NODE_NAME, node_address
from topoagent.connections import Throttled

LIST_PAGE = 500


class NodeApi(Protocol):
    """The API server call the table makes (``extender.kube.Kube``); blocking."""

    def list_nodes_page(self, limit: int, token: str | None) -> dict[str, Any]: ...


class NodeTable:
    def __init__(self, api: NodeApi | None, *, resync_s: float = 30.0, min_gap_s: float = 0.5) -> None:
        self.api = api
        self.resync_s = resync_s
        self.min_gap_s = min_gap_s
        self._addresses: dict[str, str | None] = {}
        self._listed_at: float | None = None  # monotonic time of the last complete list
        self._tried_at = float("-inf")  # of the last list started, complete or not
        self._listing: asyncio.Task[None] | None = None
        self.lists = 0  # complete lists, for /metrics and tests
        self._throttled = Throttled()

    def __contains__(self, name: str) -> bool:
        return name in self._addresses

    def __len__(self) -> int:
        return len(self._addresses)

    def address(self, name: str) -> str | None:
        """The node's address (InternalIP, else ExternalIP, else Hostname); None when the
        Node has none usable or the table does not know the node."""
        return self._addresses.get(name)

    def replace(self, nodes: Mapping[str, str | None]) -> None:
        """The whole table at once (a complete list)."""
        self._addresses = {name: address for name, address in nodes.items() if NODE_NAME.fullmatch(name)}
        self._listed_at = time.monotonic()
        self.lists += 1

    async def refresh(self) -> None:
        """A list of the Node objects that started now or later: the one running, else a new
        one once ``min_gap_s`` has passed since the last started (callers wait for it, and
        share it): unknown names in a flood of calls cost two lists a second at most."""
        if self.api is None:
            return
        if self._listing is None or self._listing.done():
            wait = self.min_gap_s - (time.monotonic() - self._tried_at)
            if wait > 0:
                await asyncio.sleep(wait)
            if self._listing is None or self._listing.done():  # no other caller started one meanwhile
                self._tried_at = time.monotonic()
                self._listing = asyncio.create_task(self._list())
        await asyncio.shield(self._listing)

    async def _list(self) -> None:
        try:
            nodes = await asyncio.to_thread(self._list_all)
        except KubeError as exc:
            # Once a minute: unknown names in a flood of calls ask for a list twice a second.
            self._throttled("node_list_failed", "node_list_failed", logging.WARNING, error=exc,
                            kept=f"the last list's {len(self._addresses)} nodes")
            return
        self.replace(nodes)

    def _list_all(self) -> dict[str, str | None]:
        assert self.api is not None
        found: dict[str, str | None] = {}
        token: str | None = None
        while True:
            page = self.api.list_nodes_page(LIST_PAGE, token)
            for node in page["items"]:
                meta = node.get("metadata") if isinstance(node, dict) else None
                name = meta.get("name") if isinstance(meta, dict) else None
                if isinstance(name, str):
                    found[name] = node_address(node)
            meta = page.get("metadata")
            token = meta.get("continue") if isinstance(meta, dict) else None
            if not token or not isinstance(token, str):
                return found

    async def run(self) -> None:
        """List every ``resync_s`` until cancelled."""
        while True:
            await self.refresh()
            await asyncio.sleep(self.resync_s)
