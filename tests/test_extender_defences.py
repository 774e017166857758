"""`topoagent extender` held to the agent's standard: slow and half-sent clients, huge and
hostile bodies, silent agents, and where the agents' token goes.  Real processes over
loopback: the extender child, the fake API server (tests/fake_apiserver.py) and small
recording agents; every flood is bounded and stops by itself."""

from __future__ import annotations

import http.client
import json
import random
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from fake_apiserver import FakeApiServer
from service_helpers import metric_value, wait_for

from bench.cluster import RESOURCE, _child_env, _free_port, _wait_line, unanswering_node

TOKEN = "extender-defences-token-0123456789"


@dataclass
class Recorder:
    """An agent that answers like one, with ``free`` of 8 GPUs free (its capacity ETag says
    which), and writes down every request: (method, path, Authorization)."""

    address: str
    port: int
    free: int = 8
    seen: list[tuple[str, str, str]] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    @property
    def paths(self) -> list[str]:
        return [path for _, path, _ in self.seen]

    def start(self) -> None:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self, doc: Any, etag: str | None = None) -> None:
                data = json.dumps(doc).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if etag:
                    self.send_header("ETag", etag)
                self.end_headers()
                self.wfile.write(data)

            def _note(self) -> None:
                recorder.seen.append((self.command, self.path, self.headers.get("Authorization", "")))

            def do_GET(self) -> None:
                self._note()
                self._answer({"gpus": 8, "free_gpus": recorder.free}, f'"free-{recorder.free}"')

            def do_POST(self) -> None:
                self._note()
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                answer: dict[str, Any] = {"gpus": [{"index": i, "uuid": f"GPU-{i}"} for i in range(body.get("gpus", 1))],
                                          "bandwidth_gbps": 100.0, "objective": {"numa_distance": 10, "damage": 0}}
                if "reserve" in body:
                    answer["lease"] = {"id": "l-" + uuid.uuid4().hex[:16]}
                self._answer(answer)

            def do_DELETE(self) -> None:
                self._note()
                self._answer({})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((self.address, self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Setup:
    api: FakeApiServer
    net: str
    port: int  # the agents' port, one for all
    work: Path
    real: Recorder
    decoy: Recorder


def start_extender(s: Setup, *flags: str, name: str = "extender") -> tuple[subprocess.Popen, int, Path]:
    log = s.work / f"{name}.log"
    token = s.work / "token"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-token-file", str(token),
             "--kube-api", s.api.url, *flags],
            stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    line = _wait_line(proc, name, log)
    return proc, int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0]), log


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    assert proc.wait(timeout=20) == 0
    assert proc.stdout is not None
    proc.stdout.close()


def call(port: int, method: str, path: str, body: Any = None, timeout: float = 30) -> tuple[int, Any]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        raw = body if isinstance(body, bytes) else (json.dumps(body).encode() if body is not None else None)
        conn.request(method, path, body=raw, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, json.loads(data) if data else None
    finally:
        conn.close()


def out_of_time_nodes(port: int) -> float:
    """The extender's count of candidates its calls' deadline left unanswered (/metrics)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request("GET", "/metrics")
        page = conn.getresponse().read().decode()
    finally:
        conn.close()
    value = metric_value(page, "topoagent_extender_out_of_time_nodes_total")
    assert value is not None, page
    return value


def gpu_pod(api: FakeApiServer, gpus: Any = "1", name: str | None = None) -> dict:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name or f"pod-{uuid.uuid4().hex[:8]}", "namespace": "team-a", "uid": str(uuid.uuid4())},
           "spec": {"containers": [{"name": "main", "resources": {"limits": {RESOURCE: gpus}}}]}, "status": {"phase": "Pending"}}
    api.add_pod(pod)
    return pod


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    work = tmp_path_factory.mktemp("defences")
    (work / "token").write_text(TOKEN + "\n")
    (work / "token").chmod(0o600)
    net = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}"
    port = _free_port(f"{net}.1")
    real, decoy = Recorder(f"{net}.1", port), Recorder(f"{net}.2", port)
    real.start()
    decoy.start()
    api = FakeApiServer(nodes=[unanswering_node("node-real", real.address)])
    try:
        yield Setup(api, net, port, work, real, decoy)
    finally:
        real.stop()
        decoy.stop()
        api.close()


@pytest.fixture(scope="module")
def extender(setup: Setup) -> Iterator[tuple[int, Path]]:
    proc, port, log = start_extender(setup, "--agent-url", f"http://{{address}}:{setup.port}", "--bind", "--max-connections", "64",
                                     "--header-timeout", "2", "--call-timeout", "1.5", "--agent-timeout", "1", "--concurrency", "4")
    try:
        yield port, log
    finally:
        stop(proc)


def test_the_token_goes_only_to_the_address_the_api_server_gives_and_only_with_changes(setup: Setup, extender: tuple[int, Path]) -> None:
    port, _ = extender
    setup.real.seen.clear()
    setup.decoy.seen.clear()
    pod = gpu_pod(setup.api, "2", name="where-to")
    # The body says node-real is at the decoy's address, and names a node the cluster does not have.
    lying = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-real"},
             "status": {"addresses": [{"type": "InternalIP", "address": setup.decoy.address}]}}
    stranger = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-stranger"},
                "status": {"addresses": [{"type": "InternalIP", "address": setup.decoy.address}]}}
    status, result = call(port, "POST", "/scheduler/filter", {"Pod": pod, "Nodes": {"items": [lying, stranger]}})
    assert status == 200 and [n["metadata"]["name"] for n in result["Nodes"]["items"]] == ["node-real"]
    assert "not among the API server's Node objects" in result["FailedNodes"]["node-stranger"]
    # Then bind, as kube-scheduler would: the reserve goes where the Node object says.
    status, bound = call(port, "POST", "/scheduler/bind", {"PodName": "where-to", "PodNamespace": "team-a",
                                                           "PodUID": pod["metadata"]["uid"], "Node": "node-real"})
    assert (status, bound) == (200, {"Error": ""})
    assert setup.decoy.seen == [], "a request reached the address a filter body gave"
    # /capacity and the dry run carry no token; the reserve (the last POST /place) does.  (The
    # resync's lease sweep, GET /leases, may come at any time, tokenless too.)
    scheduling = [seen for seen in setup.real.seen if seen[:2] != ("GET", "/leases")]
    assert scheduling[0] == ("GET", "/capacity", "") and ("POST", "/place", "") in scheduling
    assert [(m, p, auth) for m, p, auth in setup.real.seen if auth] == [("POST", "/place", f"Bearer {TOKEN}")], setup.real.seen
    assert setup.api.pod("where-to", "team-a")["spec"]["nodeName"] == "node-real"


def test_a_node_named_like_an_address_gets_no_request(setup: Setup) -> None:
    """With {node} in --agent-url, a name the API server does not know is never put into a URL."""
    named = Recorder("127.0.0.2", _free_port("127.0.0.2"))
    named.start()
    proc, port, _ = start_extender(setup, "--agent-url", f"http://{{node}}:{named.port}", name="extender-by-name")
    try:
        pod = gpu_pod(setup.api, "1")
        status, result = call(port, "POST", "/scheduler/filter", {"Pod": pod, "NodeNames": ["127.0.0.2"]})
        assert status == 200 and result["NodeNames"] == []
        assert "not among the API server's Node objects" in result["FailedNodes"]["127.0.0.2"]
        status, scores = call(port, "POST", "/scheduler/prioritize", {"Pod": pod, "NodeNames": ["127.0.0.2"]})
        assert status == 200 and scores == [{"Host": "127.0.0.2", "Score": 0}]
        assert named.seen == [], "the token went to a node the cluster does not have"
    finally:
        stop(proc)
        named.stop()


def test_a_node_that_joins_is_asked_within_the_call(setup: Setup, extender: tuple[int, Path]) -> None:
    port, _ = extender
    pod = gpu_pod(setup.api, "1")
    setup.api.add_node(unanswering_node("node-new", setup.real.address))
    try:
        status, result = call(port, "POST", "/scheduler/filter", {"Pod": pod, "NodeNames": ["node-new"]})
        assert status == 200 and result["NodeNames"] == ["node-new"], result
    finally:
        setup.api.remove_node("node-new")


def test_the_call_answers_in_time_with_silent_agents_marking_the_rest(setup: Setup, extender: tuple[int, Path]) -> None:
    """40 agents that accept and say nothing, 4 asked at once, 1 s each: 10 s of asking, in a
    call capped at 1.5 s (below kube-scheduler's httpTimeout).  The cap is seen by what it
    leaves: nodes marked unanswered at the call's deadline, not each agent's own timeout."""
    port, _ = extender
    hung = socket.socket()
    hung.bind((f"{setup.net}.3", setup.port))
    hung.listen(64)  # never accepted
    silent = [f"node-silent-{n:02d}" for n in range(40)]
    for name in silent:
        setup.api.add_node(unanswering_node(name, f"{setup.net}.3"))
    try:
        pod = gpu_pod(setup.api, "1")
        names = [*silent, "node-real"]
        status, result = call(port, "POST", "/scheduler/filter", {"Pod": pod, "NodeNames": names})
        assert status == 200, result
        failed = result["FailedNodes"]
        assert set(failed) | set(result["NodeNames"]) == set(names)
        assert sum("not answered before the call's deadline" in why for why in failed.values()) >= 20, sorted(failed.items())
        assert all("did not answer" in why or "the call's deadline" in why for why in failed.values())
        out_of_time = out_of_time_nodes(port)
        status, scores = call(port, "POST", "/scheduler/prioritize", {"Pod": pod, "NodeNames": names})
        assert status == 200 and {s["Host"] for s in scores} == set(names)
        assert out_of_time_nodes(port) >= out_of_time + 20  # prioritize kept to the call's deadline too
    finally:
        hung.close()
        for name in silent:
            setup.api.remove_node(name)


def test_huge_and_hostile_bodies_are_refused_quickly_and_healthz_stays_up(setup: Setup, extender: tuple[int, Path]) -> None:
    port, log = extender
    lines_before = log.read_text().count("\n")
    pod = gpu_pod(setup.api, "1")
    many = json.dumps({"Pod": pod, "NodeNames": [f"node-{n}" for n in range(1_000_000)]}).encode()
    answers: list[tuple[int, Any]] = []
    sender = threading.Thread(target=lambda: answers.append(call(port, "POST", "/scheduler/filter", many)))
    sender.start()
    while sender.is_alive():  # /healthz answers all along
        assert call(port, "GET", "/healthz", timeout=5) == (200, {"status": "alive"})
        time.sleep(0.05)
    sender.join()
    ((status, doc),) = answers
    assert status == 400 and "more than --max-nodes 5000" in doc["detail"]
    # A count no int64 holds: 400 naming the limit, not a 500.
    huge = gpu_pod(setup.api, "9" * 5000)
    status, doc = call(port, "POST", "/scheduler/filter", {"Pod": huge, "NodeNames": ["node-real"]})
    assert status == 400 and "a Kubernetes quantity has at most 19" in doc["detail"], doc
    assert log.read_text().count("\n") - lines_before < 10  # never a line per name


def test_slow_and_half_sent_clients_do_not_take_healthz_down_or_flood_the_log(setup: Setup, extender: tuple[int, Path]) -> None:
    port, log = extender
    lines_before = log.read_text().count("\n")
    held: list[socket.socket] = []
    try:
        for n in range(300):  # past the cap of 64: the longest-idle ones are closed for new ones
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if n % 2:  # half-sent: a head, then a body that never comes
                s.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"Pod\":")
            else:
                s.sendall(b"GET /healthz HTTP/1.1\r\nHo")
            held.append(s)
        assert call(port, "GET", "/healthz", timeout=10) == (200, {"status": "alive"})  # answered within its timeout
        # Every one is closed (cut at the cap, or past the 2 s timeouts), a half-sent body told 408 first.
        for s in held[-20:]:
            s.settimeout(10)
            try:
                got = s.recv(65536)
            except ConnectionResetError:
                got = b""
            assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
    finally:
        for s in held:
            s.close()
    assert call(port, "GET", "/healthz", timeout=10) == (200, {"status": "alive"})
    wait_for("the guard's log line", lambda: "event=slow_clients_closed" in log.read_text() or "event=connections_at_cap" in log.read_text(),
             log=log.read_text)
    assert log.read_text().count("\n") - lines_before < 10, log.read_text()[-3000:]
