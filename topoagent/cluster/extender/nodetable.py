"""Where each node's agent is, as the API server's Node objects say: the only table the
extender resolves a node name through.

A filter body is the caller's word, not the cluster's: a node named ``127.0.0.2``, or a
``Nodes.items`` entry giving a real node another InternalIP, must never choose where the
agents' token goes.  So the extender keeps name -> address from the Node objects itself,
and answers no request for a name the table does not hold.

The table lists the Node objects once (paged), then watches them from that list's
resourceVersion: a node added, deleted or given another address is in the table as soon
as its event arrives.  The API server ends each watch after ``resync_s``; the next one
goes on from the last resourceVersion seen (bookmarks keep it fresh), without a list.  A
410 Gone (the version is older than the server keeps), a stream that breaks, or an
ERROR event starts over with a list, one a second at first, backing off to one every
``MAX_PAUSE_S`` while the API server fails (logged once a minute).  While no watch is open,
a name the table does not know makes it list at once (at most every ``min_gap_s``): a node
that just joined is still found within a call.  While one is open, such a name waits up
to ``min_gap_s`` for the watch to bring it.

A list is a snapshot of its own moment, and the watch may apply an event while one is
under way (a list for an unknown name starts between two watches, and the next watch opens
without waiting for it): such a list is older than the table and is dropped, never applied.
Otherwise a node deleted, or given another address, during the list would come back from
it and stay, since the watch has gone on past its event.

An event that cannot be read (not JSON, no type or object, a Node without a name, larger
than ``MAX_EVENT_BYTES``) is skipped and counted; the table may then miss that change, so
the next watch starts with a list.

Memory: one name and one address per node of the cluster; one event at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Collection, Iterator, Mapping
from typing import Any, Protocol

from topoagent.cluster.extender.kube import KubeError, WatchCall, WatchThread
from topoagent.cluster.extender.wire import NODE_NAME, node_address
from topoagent.connections import Throttled

LIST_PAGE = 500
MAX_EVENT_BYTES = 4 * 1024 * 1024  # etcd keeps objects below 1.5 MiB; a Node as JSON stays well below this
MAX_PAUSE_S = 30.0
CHANGES = ("ADDED", "MODIFIED", "DELETED")
# Why a watch started again, for /metrics: "ended" goes on from the last resourceVersion,
# the others list first.
RESTARTS = ("ended", "expired", "broken", "error", "list_failed")


class NodeApi(Protocol):
    """The API server calls the table makes (``extender.kube.Kube``); blocking."""

    def list_nodes_page(self, limit: int, token: str | None) -> dict[str, Any]: ...

    def open_node_watch(self, resource_version: str, timeout_s: int, call: WatchCall) -> Any: ...

    def watch_lines(self, resp: Any, call: WatchCall, max_event_bytes: int) -> Iterator[bytes | None]: ...


class Gone(Exception):
    """The watch cannot go on from its resourceVersion: list first.  ``reason``: a RESTARTS word."""

    def __init__(self, reason: str, detail: str, status: int | None = None) -> None:
        super().__init__(detail)
        self.reason, self.status = reason, status


class NodeTable:
    def __init__(self, api: NodeApi | None, *, resync_s: float = 30.0, min_gap_s: float = 0.5) -> None:
        self.api = api
        self.resync_s = resync_s
        self.min_gap_s = min_gap_s
        self._addresses: dict[str, str | None] = {}
        self._tried_at = float("-inf")  # monotonic time of the last list started, complete or not
        self._listing: asyncio.Task[str | None] | None = None
        self._listing_after = 0  # the running list started after this many watch lines
        # Watch lines taken, in order (a resourceVersion is opaque: a local count orders them).
        self._lines = 0
        self._changed = asyncio.Event()  # set (and replaced) at each change the watch applies
        self.watching = False  # a watch stream is open: the table follows the API server
        self.lists = 0  # complete lists, for tests
        # For /metrics: watches started again, by why (RESTARTS); events skipped unread.
        self.restarts = dict.fromkeys(RESTARTS, 0)
        self.malformed = 0
        self._stale = False  # an event was skipped: the next watch starts with a list
        self._throttled = Throttled()

    def __contains__(self, name: str) -> bool:
        return name in self._addresses

    def __len__(self) -> int:
        return len(self._addresses)

    def names(self) -> list[str]:
        """Every node the table holds (a copy: the watch may change the table meanwhile)."""
        return list(self._addresses)

    def address(self, name: str) -> str | None:
        """The node's address (InternalIP, else ExternalIP, else Hostname); None when the
        Node has none usable or the table does not know the node."""
        return self._addresses.get(name)

    def replace(self, nodes: Mapping[str, str | None]) -> None:
        """The whole table at once (a complete list)."""
        self._addresses = {name: address for name, address in nodes.items() if NODE_NAME.fullmatch(name)}
        self.lists += 1
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    # -- listing ------------------------------------------------------------------------

    async def refresh(self, wanted: Collection[str] = ()) -> None:
        """Bring the table up to date for ``wanted`` (names not in it).  With a watch open,
        wait up to ``min_gap_s`` for its events to bring them (the API server told the
        caller of them a moment ago).  Without one: a list that started now or later, the
        one running, else a new one once ``min_gap_s`` has passed since the last started
        (callers wait for it, and share it): unknown names in a flood of calls cost two
        lists a second at most."""
        if self.api is None:
            return
        if self.watching:
            deadline = time.monotonic() + self.min_gap_s
            while self.watching and any(name not in self._addresses for name in wanted):
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), left)
            if self.watching:
                return
        await self.list_now()

    async def list_now(self) -> str | None:
        """The resourceVersion of a complete list that started now or later; None when it
        failed, or when a watch applied an event while it ran (the table is newer: the watch
        that did so brings the rest)."""
        if not self._joinable():
            wait = self.min_gap_s - (time.monotonic() - self._tried_at)
            if wait > 0:
                await asyncio.sleep(wait)
            if not self._joinable():  # no other caller started one meanwhile
                self._tried_at = time.monotonic()
                self._listing_after = self._lines
                self._listing = asyncio.create_task(self._list(self._lines))
        assert self._listing is not None
        return await asyncio.shield(self._listing)

    def _joinable(self) -> bool:
        """A list is running that no watch line has overtaken."""
        return self._listing is not None and not self._listing.done() and self._listing_after == self._lines

    async def _list(self, after: int) -> str | None:
        try:
            nodes, version = await asyncio.to_thread(self._list_all)
        except KubeError as exc:
            # Once a minute: unknown names in a flood of calls ask for a list twice a second.
            self._throttled("node_list_failed", "node_list_failed", logging.WARNING, error=exc,
                            kept=f"the last list's {len(self._addresses)} nodes")
            return None
        if self.watching or self._lines != after:
            # The watch has gone on past this list's moment: applied, the list would bring back
            # a node deleted since, or its old address.  The open watch brings what it holds.
            return None
        self.replace(nodes)
        return version

    def _list_all(self) -> tuple[dict[str, str | None], str]:
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
            meta = meta if isinstance(meta, dict) else {}
            token = meta.get("continue")
            if not token or not isinstance(token, str):
                version = meta.get("resourceVersion")
                return found, version if isinstance(version, str) else ""

    # -- list, then watch ---------------------------------------------------------------

    async def run(self, version: str | None = None) -> None:
        """List (unless ``version``, a list's, is given), then watch and watch again, until
        cancelled; never raises for the API server's sake."""
        pause = 1.0  # between lists that fail or watches that break: doubling to MAX_PAUSE_S
        # version: where the next watch goes on from; None: list first
        while True:
            started = time.monotonic()
            try:
                if version is None or self._stale:
                    self._stale = False
                    version = await self.list_now()
                    if version is None:
                        raise Gone("list_failed", "the Node list failed")  # the list logs its failure itself
                    if not version:  # no resourceVersion to watch from: the list alone, every resync_s
                        version = None
                        await asyncio.sleep(self.resync_s)
                        continue
                version = await self.watch(version)
                self.restarts["ended"] += 1  # the server's timeout: on from where it left off, without a list
                failed = False
            except Gone as exc:
                self.restarts[exc.reason] += 1
                if exc.reason != "list_failed":
                    # Once a minute for each kind: a refusal (403: no RBAC watch) is not hidden behind a cut stream.
                    self._throttled(("node_watch", exc.reason, exc.status), "node_watch_restarted", logging.WARNING, reason=exc.reason,
                                    error=str(exc)[:300], then="list the Node objects again")
                version, failed = None, True
            except Exception as exc:  # a bug: said, and the table goes on
                self.restarts["error"] += 1
                self._throttled("node_watch_error", "node_watch_restarted", logging.WARNING, reason="error",
                                error=f"{type(exc).__name__}: {exc}"[:300], then="list the Node objects again")
                version, failed = None, True
            # At most one watch a second even when each ends at once (a proxy that cuts them).
            await asyncio.sleep(max(0.0, pause - (time.monotonic() - started)))
            pause = min(MAX_PAUSE_S, pause * 2) if failed else 1.0

    async def watch(self, version: str) -> str:
        """Apply the events after ``version`` until the server ends the stream; the last
        resourceVersion seen.  Gone when the watch cannot go on from there.  However it ends
        (cancelled included), its thread has ended too."""
        assert self.api is not None
        api, timeout_s = self.api, max(1, int(self.resync_s))

        def stream(call: WatchCall) -> Iterator[tuple[str, bytes | None]]:
            resp = api.open_node_watch(version, timeout_s, call)
            yield "open", None
            for line in api.watch_lines(resp, call, MAX_EVENT_BYTES):
                yield "line", line

        try:
            async with WatchThread(stream, "node-watch") as items:
                try:
                    async for what, line in items:
                        if what == "open":
                            self.watching = True
                        else:
                            self._lines += 1  # before it applies: a list under way is older from here on
                            version = self._apply(line, version)
                finally:
                    self.watching = False  # from the end of the stream on, not once its thread has ended
            return version
        except KubeError as exc:  # the client's own; any other exception is a bug, which run counts as one
            raise Gone("expired" if exc.status == 410 else "broken", str(exc), exc.status) from None

    def _apply(self, line: bytes | None, version: str) -> str:
        """One event line: the table changed, and the resourceVersion it brings."""
        event = _event(line)
        if event is None:
            self.malformed += 1
            self._stale = True
            self._throttled("node_watch_malformed", "node_watch_event_skipped", logging.WARNING, skipped=self.malformed,
                            then="the next watch starts with a list")
            return version
        kind, obj = event
        if kind == "ERROR":
            code = obj.get("code")
            message = f"{obj.get('reason') or 'error'} {code}: {str(obj.get('message', ''))[:160]}"
            raise Gone("expired" if code == 410 else "error", f"watch nodes: {message}")
        meta = obj["metadata"]
        new_version = meta.get("resourceVersion")
        if kind in CHANGES:
            name = meta["name"]
            if kind == "DELETED":
                self._addresses.pop(name, None)
            elif NODE_NAME.fullmatch(name):
                self._addresses[name] = node_address(obj)
            self._wake()
        return new_version if isinstance(new_version, str) and new_version else version


def _event(line: bytes | None) -> tuple[str, dict[str, Any]] | None:
    """(type, object) of a watch event as the API server writes it; None when it is not one."""
    if line is None:
        return None
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        return None
    kind, obj = event.get("type"), event["object"]
    if kind == "ERROR":
        return kind, obj
    meta = obj.get("metadata")
    if kind == "BOOKMARK" and isinstance(meta, dict):
        return kind, obj
    if kind in CHANGES and isinstance(meta, dict) and isinstance(meta.get("name"), str):
        return kind, obj
    return None
