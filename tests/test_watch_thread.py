"""A watch's thread (``kube.WatchThread``) hands the loop what its stream gives, as it is: the
items in order, past the queue's bound (the thread waits for the loop); the client's KubeError
as the API server's word; any other exception as the bug of ours it is, which the Node table and
the pod watch count and log as a bug, never as a broken stream or an API server's refusal.
The API side here is a stand-in of our own call Protocols (``nodetable.NodeApi``,
``podwatch.PodApi``) whose stream hits a bug in the watch's thread; the real client against
the loopback API server is tests/test_watch_stop.py's and tests/test_extender_watch.py's."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any, TypeVar

import pytest

from topoagent.cluster.extender.kube import KubeError, WatchCall, WatchThread
from topoagent.cluster.extender.nodetable import NodeTable
from topoagent.cluster.podwatch import PodWatch

_T = TypeVar("_T")


def watch_threads() -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name in ("node-watch", "pod-watch", "test-watch")]


async def until(what: str, condition: Callable[[], bool]) -> None:
    """Wait for ``condition`` without blocking the loop; fail naming ``what`` after a minute."""
    deadline = time.monotonic() + 60
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within a minute"
        await asyncio.sleep(0.01)


@pytest.fixture
def events(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    logger = logging.getLogger("topoagent")  # a CLI test may have stopped it propagating
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="topoagent"):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)


@pytest.mark.parametrize("error", [KubeError("watch pods: the stream broke off inside an event"), KeyError("type")])
def test_the_items_come_in_order_then_the_streams_exception_as_it_is(error: Exception) -> None:
    def stream(call: WatchCall) -> Iterator[int]:
        yield from range(3 * WatchThread.QUEUED)  # more than the queue holds: the thread waits
        raise error

    async def main() -> list[int]:
        seen: list[int] = []
        with pytest.raises(type(error)) as raised:
            async with WatchThread(stream, "test-watch") as items:
                async for item in items:
                    seen.append(item)
        assert raised.value is error
        return seen

    assert asyncio.run(main()) == list(range(3 * WatchThread.QUEUED))
    assert watch_threads() == []


class NodesWithABug:
    """``nodetable.NodeApi``: one node listed; the watch brings node-b, then its thread hits a bug."""

    def list_nodes_page(self, limit: int, token: str | None) -> dict[str, Any]:
        node = {"metadata": {"name": "node-a"}, "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.1"}]}}
        return {"kind": "NodeList", "items": [node], "metadata": {"resourceVersion": "7"}}

    def open_node_watch(self, resource_version: str, timeout_s: int, call: WatchCall) -> Any:
        return None

    def watch_lines(self, resp: Any, call: WatchCall, max_event_bytes: int) -> Iterator[bytes | None]:
        node = {"metadata": {"name": "node-b", "resourceVersion": "8"},
                "status": {"addresses": [{"type": "InternalIP", "address": "10.0.0.2"}]}}
        yield json.dumps({"type": "ADDED", "object": node}).encode()
        raise AttributeError("'NoneType' object has no attribute 'read1'")


def test_a_bug_in_the_node_watch_thread_is_counted_as_one_not_as_a_broken_stream(events: pytest.LogCaptureFixture) -> None:
    async def main() -> NodeTable:
        table = NodeTable(NodesWithABug(), resync_s=60)
        task = asyncio.create_task(table.run())
        try:
            await until("the watch restarted", lambda: sum(table.restarts.values()) >= 1)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return table

    table = asyncio.run(main())
    assert table.address("node-b") == "10.0.0.2"  # the event before the bug was applied
    assert table.restarts["error"] == 1 and table.restarts["broken"] == 0
    assert 'event=node_watch_restarted reason=error error="AttributeError: ' in events.text
    assert watch_threads() == []


class NoLeases:
    """The agents' side of the pod watch (``podwatch.Keeper``): no node holds a lease."""

    async def release(self, node: str, lease_id: str) -> bool:
        return False

    async def leases(self, node: str) -> list[dict[str, Any]] | None:
        return []

    async def each(self, nodes: Iterable[str], ask: Callable[[str], Awaitable[_T]]) -> list[_T]:
        return [await ask(node) for node in nodes]


class PodsWithABug:
    """``podwatch.PodApi``: no pods; the watch brings one, then its thread hits a bug."""

    def list_pods_page(self, limit: int, token: str | None, field_selector: str | None = None) -> dict[str, Any]:
        return {"kind": "PodList", "items": [], "metadata": {"resourceVersion": "7"}}

    def watch_pods(self, resource_version: str, timeout_s: int, max_event_bytes: int, call: WatchCall,
                   field_selector: str | None = None) -> Iterator[dict[str, Any]]:
        yield {"type": "ADDED", "object": {"metadata": {"name": "p", "namespace": "default", "uid": "u-1"}}}
        raise TypeError("'int' object is not subscriptable")


def test_a_bug_in_the_pod_watch_thread_is_logged_as_one_not_as_the_api_servers_word(events: pytest.LogCaptureFixture) -> None:
    async def main() -> list[str]:
        seen: list[str] = []
        watch = PodWatch(PodsWithABug(), NoLeases(), resync_s=60, on_event=lambda kind, pod: seen.append(kind))
        task = asyncio.create_task(watch.run())
        try:
            await until("the watch failed", lambda: "event=pod_watch_failed" in events.text)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return seen

    assert asyncio.run(main())[:1] == ["ADDED"]  # the event before the bug was handled
    assert 'event=pod_watch_failed who=extender error="TypeError: ' in events.text
    assert watch_threads() == []
