"""The extender's node table follows the API server by a watch, and /metrics counts what the
extender refuses or loses.  Real processes over loopback: the extender child, the fake API
server (tests/fake_apiserver.py, serving Node watches as the real one streams them) and
small agents whose free GPUs a test sets.  The fake counts its Node LISTs: a change seen
with that count unchanged came through the watch."""

from __future__ import annotations

import http.client
import random
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer
from service_helpers import metric_value, promtool_complaints, wait_for
from test_extender_defences import Recorder as Agent
from test_extender_defences import call, gpu_pod, stop

from bench.cluster import _child_env, _free_port, _wait_line, unanswering_node


@dataclass
class World:
    api: FakeApiServer
    net: str
    one: Agent  # at {net}.1
    two: Agent  # at {net}.2, the same port
    port: int  # the extender's
    log: Path


def start_extender(api: FakeApiServer, work: Path, agent_port: int, call_timeout: str = "1") -> tuple[subprocess.Popen, int, Path]:
    """The extender child on ``api``, its agents on ``agent_port``: (process, port, log)."""
    (work / "token").write_text("extender-watch-token-0123456789\n")
    (work / "token").chmod(0o600)
    log = work / "extender.log"
    with open(log, "w") as err:
        # A long watch (--node-resync 60): a stream ends only when a test ends it.
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-token-file", str(work / "token"),
             "--kube-api", api.url, "--agent-url", f"http://{{address}}:{agent_port}", "--node-resync", "60", "--requeue-interval", "0.2",
             "--call-timeout", call_timeout, "--agent-timeout", "5", "--concurrency", "4"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    return proc, int(_wait_line(proc, "extender", log).split("http://127.0.0.1:", 1)[1].split("/", 1)[0]), log


def agents_pair() -> tuple[Agent, Agent]:
    """Two agents on one port at {net}.1 and {net}.2 of a random loopback net, started."""
    net = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}"
    port = _free_port(f"{net}.1")
    one, two = Agent(f"{net}.1", port), Agent(f"{net}.2", port)
    one.start()
    two.start()
    return one, two


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    one, two = agents_pair()
    api = FakeApiServer(nodes=[unanswering_node("node-a", one.address)])
    proc, extender_port, log = start_extender(api, tmp_path_factory.mktemp("watch"), one.port)
    net = one.address.rsplit(".", 1)[0]
    try:
        wait_for("the extender's Node watch", lambda: api.node_watches >= 1, log=log.read_text)
        yield World(api, net, one, two, extender_port, log)
    finally:
        stop(proc)
        one.stop()
        two.stop()
        api.close()


def metrics(world: World) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", world.port, timeout=10)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
    finally:
        conn.close()
    assert resp.status == 200 and promtool_complaints(body) == []
    return body.decode()


def counter(world: World, name: str, labels: dict[str, str] | None = None) -> float:
    value = metric_value(metrics(world), f"topoagent_extender_{name}_total", labels)
    assert value is not None, f"topoagent_extender_{name}_total{labels or ''} is not on /metrics"
    return value


def filtered(world: World, names: list[str], gpus: str = "1") -> dict:
    status, result = call(world.port, "POST", "/scheduler/filter", {"Pod": gpu_pod(world.api, gpus), "NodeNames": names})
    assert status == 200, result
    return result


def test_nodes_added_readdressed_relabelled_and_deleted_are_seen_through_the_watch_alone(world: World) -> None:
    # The watch is open once a node added now is answered (the first call may still list).
    world.api.add_node(unanswering_node("node-warm", world.one.address))
    wait_for("node-warm through the watch", lambda: filtered(world, ["node-warm"])["NodeNames"] == ["node-warm"])
    lists = world.api.node_lists
    unknown_before = counter(world, "unknown_nodes")

    world.api.add_node(unanswering_node("node-b", world.one.address))
    assert filtered(world, ["node-b"])["NodeNames"] == ["node-b"]  # within the call that first names it

    world.two.seen.clear()
    world.api.set_node_address("node-b", world.two.address)
    wait_for("node-b asked at its new address", lambda: filtered(world, ["node-b"])["NodeNames"] == ["node-b"] and "/capacity" in world.two.paths)

    world.api.label_node("node-b", {"topoagent.io/test": "relabelled"})
    assert filtered(world, ["node-b"])["NodeNames"] == ["node-b"]

    world.api.remove_node("node-b")
    wait_for("node-b refused once deleted",
             lambda: "not among the API server's Node objects" in filtered(world, ["node-b"])["FailedNodes"].get("node-b", ""))
    assert world.api.node_lists == lists, "a change was found by listing, not through the watch"
    assert counter(world, "unknown_nodes") > unknown_before
    world.api.remove_node("node-warm")


def test_a_410_lists_again_and_watches_on(world: World) -> None:
    lists, watches = world.api.node_lists, world.api.node_watches
    expired = counter(world, "node_watch_restarts", {"reason": "expired"})
    world.api.expire_node_watches()
    wait_for("the restart after 410", lambda: counter(world, "node_watch_restarts", {"reason": "expired"}) == expired + 1,
             log=world.log.read_text)
    wait_for("a list and a new watch", lambda: world.api.node_lists > lists and world.api.node_watches >= watches + 2)
    world.api.add_node(unanswering_node("node-after-410", world.one.address))
    wait_for("node-after-410", lambda: filtered(world, ["node-after-410"])["NodeNames"] == ["node-after-410"])
    world.api.remove_node("node-after-410")


def test_a_dropped_stream_reconnects(world: World) -> None:
    watches = world.api.node_watches
    broken = counter(world, "node_watch_restarts", {"reason": "broken"})
    world.api.break_node_watches()
    wait_for("the restart after the cut", lambda: counter(world, "node_watch_restarts", {"reason": "broken"}) == broken + 1,
             log=world.log.read_text)
    wait_for("a new watch", lambda: world.api.node_watches > watches)
    world.api.add_node(unanswering_node("node-after-cut", world.one.address))
    wait_for("node-after-cut", lambda: filtered(world, ["node-after-cut"])["NodeNames"] == ["node-after-cut"])
    world.api.remove_node("node-after-cut")


def test_malformed_and_oversized_events_are_skipped_and_counted(world: World) -> None:
    malformed = counter(world, "node_watch_malformed_events")
    lines_before = world.log.read_text().count("\n")
    world.api.node_watch_line(b"not json")
    world.api.node_watch_line(b'{"type": "ADDED", "object": {"metadata": {}}}')  # a Node without a name
    world.api.node_watch_line(b'{"type": "MODIFIED", "object": {"pad": "' + b"x" * (5 << 20) + b'"}}')  # past 4 MiB
    world.api.add_node(unanswering_node("node-after-junk", world.one.address))
    wait_for("node-after-junk", lambda: filtered(world, ["node-after-junk"])["NodeNames"] == ["node-after-junk"])
    assert counter(world, "node_watch_malformed_events") == malformed + 3
    assert call(world.port, "GET", "/healthz") == (200, {"status": "alive"})
    assert world.log.read_text().count("\n") - lines_before <= 2  # one line a minute, not one per event
    world.api.remove_node("node-after-junk")


def test_nodes_the_calls_time_runs_out_on_are_counted_apart_from_silent_agents(world: World) -> None:
    """An agent that accepts and never answers, asked with 5 s each in a call of 1 s: the
    call's time runs out first."""
    hung = socket.socket()
    hung.bind((f"{world.net}.3", world.one.port))
    hung.listen(8)  # never accepted
    world.api.add_node(unanswering_node("node-hung", hung.getsockname()[0]))
    try:
        out_of_time, unanswered = counter(world, "out_of_time_nodes"), counter(world, "unanswered_nodes")
        result = filtered(world, ["node-hung", "node-a"])
        assert result["NodeNames"] == ["node-a"]
        assert "not answered before the call's deadline" in result["FailedNodes"]["node-hung"]
        assert counter(world, "out_of_time_nodes") == out_of_time + 1
        assert counter(world, "unanswered_nodes") == unanswered
    finally:
        hung.close()
        world.api.remove_node("node-hung")


def test_requeue_patches_are_counted_by_result(world: World) -> None:
    """A node that turned a pod away for want of free GPUs: its change is written on its Node
    (patched), refused by the API server (failed), or not written once the node is gone (skipped)."""
    def patches(result: str) -> float:
        return counter(world, "requeue_patches", {"result": result})

    world.api.add_node(unanswering_node("node-full", world.two.address))
    world.two.free = 2
    try:
        wait_for("node-full turning a 4-GPU pod away", lambda: "2 of 8 GPUs free" in filtered(world, ["node-full"], "4")["FailedNodes"].get("node-full", ""))
        patched, failed, skipped = patches("patched"), patches("failed"), patches("skipped")
        world.two.free = 8
        wait_for("the change written on the Node", lambda: patches("patched") == patched + 1)
        assert world.api.node("node-full")["metadata"]["annotations"]["topoagent.io/capacity"] == '"free-8"'
        world.api.fail_node_patches = True
        world.two.free = 6
        wait_for("the refused patch counted", lambda: patches("failed") > failed)
        world.api.fail_node_patches = False
        world.api.remove_node("node-full")
        wait_for("the gone node skipped", lambda: patches("skipped") == skipped + 1)
    finally:
        world.api.fail_node_patches = False
        world.two.free = 8
        world.api.remove_node("node-full")


@pytest.mark.parametrize("answered", ["while the watch is open", "between two watches"])
def test_a_list_the_watch_overtakes_never_brings_the_older_table_back(tmp_path: Path, answered: str) -> None:
    """A call naming an unknown node lists while the watch is being renewed; the new watch
    deletes one node and readdresses another before that list answers with its older
    snapshot (while that watch is open, or once it has ended too).  The table keeps what the
    watch said, for the call that waited for the list and for the next: the deleted node
    refused as unknown, the other asked at its new address."""
    one, two = agents_pair()
    api = FakeApiServer(nodes=[unanswering_node("node-gone", one.address), unanswering_node("node-moved", one.address)])
    # --call-timeout 30: the call that names node-unknown waits for the held list (up to 3/4 of it).
    proc, port, log = start_extender(api, tmp_path, one.port, call_timeout="30")
    watches_go, lists_go = threading.Event(), threading.Event()

    def filtered_here(names: list[str]) -> dict:
        status, result = call(port, "POST", "/scheduler/filter", {"Pod": gpu_pod(api), "NodeNames": names})
        assert status == 200, result
        return result

    try:
        wait_for("the extender's Node watch", lambda: api.node_watches >= 1, log=log.read_text)
        # The watch ends as at its timeout; the next one is held: no watch is open meanwhile.
        watches = api.node_watches
        api.hold_node_watches = watches_go
        api.close_watches()
        wait_for("the renewed watch asked for", lambda: api.node_watches > watches, log=log.read_text)
        # node-unknown makes the extender list now: the snapshot is taken, its answer held.
        lists = api.node_lists
        api.hold_node_lists = lists_go
        answers: list[dict] = []
        caller = threading.Thread(target=lambda: answers.append(filtered_here(["node-gone", "node-moved", "node-unknown"])))
        caller.start()
        wait_for("the list for node-unknown", lambda: api.node_lists > lists, log=log.read_text)
        # Meanwhile node-gone is deleted and node-moved readdressed; the renewed watch brings both.
        api.remove_node("node-gone")
        api.set_node_address("node-moved", two.address)
        api.hold_node_watches = None
        watches_go.set()
        wait_for("node-moved asked at its new address through the watch",
                 lambda: filtered_here(["node-moved"])["NodeNames"] == ["node-moved"] and "/capacity" in two.paths, log=log.read_text)
        assert "not among the API server's Node objects" in filtered_here(["node-gone"])["FailedNodes"].get("node-gone", "")
        if answered == "between two watches":  # that watch ends too, and the next is held
            watches, watches_go = api.node_watches, threading.Event()
            api.hold_node_watches = watches_go
            api.close_watches()
            wait_for("the next watch asked for", lambda: api.node_watches > watches, log=log.read_text)
        # Now the list answers, with both nodes as they were when it started.
        one.seen.clear()
        two.seen.clear()
        api.hold_node_lists = None
        lists_go.set()
        caller.join(timeout=60)
        assert answers, "the call that waited for the list never answered"
        later = []
        if answered == "while the watch is open":  # (between watches, the next call would list afresh)
            later.append(filtered_here(["node-gone", "node-moved"]))
        for answer in (answers[0], *later):
            assert "not among the API server's Node objects" in answer["FailedNodes"].get("node-gone", ""), answer
            assert "node-moved" in answer["NodeNames"], answer
        assert "/capacity" in two.paths and not one.seen, "an agent was asked at an address the watch had replaced"
        assert api.node_lists == lists + 1  # no later list put the table right
    finally:
        watches_go.set()
        lists_go.set()
        stop(proc)
        one.stop()
        two.stop()
        api.close()


# Last in the file: it leaves the watch failing, backing off, for a while.
def test_without_a_watch_an_unknown_name_is_listed_for_within_the_call(world: World) -> None:
    """A ClusterRole without ``watch`` on nodes (403): the table still finds a node that just
    joined, by a list at once, and says why the watch failed."""
    world.api.node_watch_forbidden = True
    try:
        broken = counter(world, "node_watch_restarts", {"reason": "broken"})
        world.api.expire_node_watches()  # the open watch ends; the next ones are refused
        wait_for("the refused watch counted", lambda: counter(world, "node_watch_restarts", {"reason": "broken"}) > broken,
                 log=world.log.read_text)
        lists = world.api.node_lists
        world.api.add_node(unanswering_node("node-listed", world.one.address))
        assert filtered(world, ["node-listed"])["NodeNames"] == ["node-listed"]  # within the call
        assert world.api.node_lists > lists
        assert "cannot watch resource" in world.log.read_text()
    finally:
        world.api.node_watch_forbidden = False
        world.api.remove_node("node-listed")
