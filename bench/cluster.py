"""Cluster benchmark: real agents on loopback, the real extender, one stream of GPU pods.

    python -m bench.cluster                # 16 agents, 300 pods (a few minutes on 2 cores)
    python -m bench.cluster --quick        # 8 agents, 80 pods
    python -m bench.cluster --markdown     # only the table (docs/benchmarks.md, between <!-- figures:cluster -->)
    python -m bench.cluster --seeds 1,2,3  # one table per seed, then the medians over them
    python -m bench.cluster --starve [--seeds 0-8] [--quick]  # issue #39's stream, without holds and with guards

Each node is a real `topoagent serve` child on a recorded fixture, on its own loopback
address (127.x.y.n, one port for all, as a cluster's agents share theirs), so the
extender reaches every agent by one URL template, ``http://{address}:PORT``, from the
Node objects it is sent (``nodeCacheCapable: false``).  The Kubernetes API server is the
tests' loopback fake (tests/fake_apiserver.py): the extender binds through it with the
real ``kubernetes`` client.

The same seeded stream of 1/2/4/8-GPU pods is replayed, in simulated time, through three
schedulers; each reserves what it chose on the node's agent (a lease), and a job's lease
is released when it ends:

* ``topoagent``: kube-scheduler's part played as it is configured in
  deploy/kubernetes/kube-scheduler-config.yaml: the nodes with enough free GPUs by count
  (NodeResourcesFit) go to the extender's filter, those passing to prioritize, the
  highest score wins (the lowest name among equals), and the extender's bind leases the
  GPUs, annotates the pod and binds it;
* ``count-only``: any node with enough free GPUs, the lowest name first, its lowest free
  GPU indices (kube-scheduler and a device plugin without topology);
* ``zone-first``: HAMi's link-zone order (bench/baselines.py, ``HamiZonePolicy``) across
  the cluster: the node holding the zone with the fewest free GPUs that still takes the
  pod, that zone's lowest GPUs; when no zone can, the node with the fewest free GPUs.

A pod that fits nowhere waits (FIFO) and is tried again whenever a job ends.  (``--starve``
instead runs issue #39's stream through a model of kube-scheduler's queue, ``ExtenderQueue``.)  Reported
per policy: jobs placed, jobs that waited, ring bandwidth of each multi-GPU job (the
best ring through its GPUs, GB/s per direction: median and p10), topology satisfaction
and NUMA distance (means over multi-GPU jobs), and, for the extender, the time of each
scheduling cycle (filter + prioritize + bind as kube-scheduler would call them: p50, p99;
loopback, on this machine, with every agent on it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import secrets
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.baselines import HamiZonePolicy, first_fit
from bench.kube_queue import HoldSetting, KubeQueue, Queued, starve_figures, starve_table
from bench.stats import percentile
from topoagent.cluster.deviceplugin.pods import ANNOTATION, parse_choice
from topoagent.cluster.extender.wire import LEASE_ANNOTATION
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Placement, Request, numa_distance, place
from topoagent.vocabulary import GPU_RESOURCE

ROOT = Path(__file__).resolve().parents[1]
SNAPSHOTS = ROOT / "fixtures" / "snapshots"
sys.path.insert(0, str(ROOT / "tests"))
from fake_apiserver import FakeApiServer  # noqa: E402  (the tests' API server double)

# NVSwitch, hybrid cube mesh, PCIe two sockets, a degraded HGX H100: node-01, node-02, ...
MIX = ("pcie-2socket", "dgx1-v100", "degraded", "dgx-a100")
SIZES, WEIGHTS = (1, 2, 4, 8), (0.35, 0.30, 0.20, 0.15)
RESOURCE = GPU_RESOURCE
WAIT_S = 60.0


# --- the cluster: agents and the extender as child processes -----------------------------


@dataclass
class Node:
    name: str
    fixture: str
    address: str
    port: int
    proc: subprocess.Popen
    matrix: DistanceMatrix
    gpus: int = 0  # healthy GPUs, as the device plugin would offer them
    uuid_index: dict[str, int] = field(default_factory=dict)
    conn: http.client.HTTPConnection | None = None

    def request(self, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
        return _request(self, method, path, body, token)

    def node_object(self) -> dict[str, Any]:
        return {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": self.name, "labels": {"kubernetes.io/hostname": self.name, "topoagent.io/fixture": self.fixture}},
            "status": {
                "addresses": [{"type": "InternalIP", "address": self.address}, {"type": "Hostname", "address": self.name}],
                "capacity": {RESOURCE: str(self.matrix.size)}, "allocatable": {RESOURCE: str(self.gpus)},
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            },
        }


def _request(holder: Any, method: str, path: str, body: Any = None, token: str | None = None) -> tuple[int, Any]:
    """One request on the holder's kept-alive connection (reopened once if it was closed)."""
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    payload = json.dumps(body).encode() if body is not None else None
    for attempt in (0, 1):
        if holder.conn is None:
            holder.conn = http.client.HTTPConnection(holder.address, holder.port, timeout=WAIT_S)
        try:
            holder.conn.request(method, path, body=payload, headers=headers)
            resp = holder.conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None
        except (ConnectionError, http.client.HTTPException):
            holder.conn.close()
            holder.conn = None
            if attempt:
                raise
    raise AssertionError("unreachable")


@dataclass
class Extender:
    proc: subprocess.Popen
    address: str
    port: int
    prefix: str = "/scheduler"
    conn: http.client.HTTPConnection | None = None

    def call(self, verb: str, body: Any) -> Any:
        status, doc = _request(self, "POST", f"{self.prefix}/{verb}", body)
        if status != 200:
            raise AssertionError(f"extender {verb}: HTTP {status}: {doc}")
        return doc


def matrix_of(fixture: str) -> DistanceMatrix:
    from topoagent.commands.discover import discover_root

    return discover_root(str(SNAPSHOTS / fixture)).distance_matrix()


def _free_port(address: str) -> int:
    with socket.socket() as s:
        s.bind((address, 0))
        return s.getsockname()[1]


def _child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "CREDENTIALS_DIRECTORY")}
    env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _wait_line(proc: subprocess.Popen, what: str, log: Path) -> str:
    line = proc.stdout.readline() if proc.stdout else ""
    if not line:
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} did not start:\n{log.read_text()[-3000:]}")
    return line


@dataclass
class Cluster:
    nodes: list[Node]
    extender: Extender
    api: FakeApiServer
    token: str
    work: Path
    unanswering: list[tuple[str, str]] = field(default_factory=list)  # (node name, address): nothing answers there
    extender_argv: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)  # every child, stopped on the way out

    def stop_extender(self) -> None:
        self.extender.proc.terminate()
        assert self.extender.proc.wait(timeout=20) == 0

    def start_extender(self) -> None:
        """A new extender with the same arguments (after ``stop_extender``): one that remembers nothing."""
        self.extender = _start_extender(self.extender_argv, self.work / "extender.log", self.procs)

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def node_objects(self, names: list[str] | None = None) -> list[dict[str, Any]]:
        objects = {n.name: n.node_object() for n in self.nodes}
        for name, address in self.unanswering:
            objects[name] = unanswering_node(name, address)
        return [objects[n] for n in (names if names is not None else sorted(objects))]


def _start_extender(argv: list[str], log: Path, procs: list[subprocess.Popen]) -> Extender:
    """The extender child (stopped with ``procs`` on the way out), once it listens."""
    with open(log, "a") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
    procs.append(proc)
    line = _wait_line(proc, "extender", log)
    return Extender(proc, "127.0.0.1", int(line.split("http://127.0.0.1:", 1)[1].split("/", 1)[0]))


def unanswering_node(name: str, address: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
            "status": {"addresses": [{"type": "InternalIP", "address": address}]}}


@contextmanager
def cluster(fixtures: list[str], extender_args: list[str] | None = None, work: Path | None = None) -> Iterator[Cluster]:
    """Agents on ``fixtures`` (node-01, node-02, ...), the fake API server, the extender
    with --bind; everything stopped on the way out."""
    own_work = work is None
    work = work or Path(tempfile.mkdtemp(prefix="cluster-"))
    procs: list[subprocess.Popen] = []
    api = FakeApiServer()
    net = f"127.{random.randint(1, 254)}.{random.randint(0, 254)}"
    port = _free_port(f"{net}.1")
    token = secrets.token_urlsafe(24)
    token_file = work / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    # The replay runs hours of a cluster's binds and releases in seconds, all from one
    # loopback address: lift the agents' per-client limit on changes (2 a second).  And a
    # placement's answer must not depend on how busy this machine is: a search the agent's
    # 20 ms deadline stops answers with its first cheap set, so the deadline is generous.
    config = work / "agent.toml"
    config.write_text("[http]\nrate_limit_per_s = 10000\nrate_limit_burst = 100000\n[placement]\ndeadline_ms = 60000\n")
    try:
        nodes = []
        for n, fixture in enumerate(fixtures, start=1):
            address = f"{net}.{n}"
            log = work / f"agent-{n}.log"
            with open(log, "w") as err:
                proc = subprocess.Popen(
                    [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(SNAPSHOTS / fixture), "--listen", f"{address}:{port}",
                     "--state-dir", str(work / f"state-{n}"), "--token-file", str(token_file), "--config", str(config)],
                    stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
            procs.append(proc)
            _wait_line(proc, f"agent {fixture} on {address}:{port}", log)
            nodes.append(Node(f"node-{n:02d}", fixture, address, port, proc, matrix_of(fixture)))
        for node in nodes:
            api.add_node(node.node_object())  # the extender learns names and addresses from the API server only
            _wait_ready(node)
            topo = _get_ok(node, "/topology")
            node.uuid_index = {g["uuid"]: g["index"] for g in topo["gpus"] if g.get("uuid")}
            node.gpus = _get_ok(node, "/capacity")["free_gpus"]
        argv = [sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--agent-url", f"http://{{address}}:{port}",
                "--agent-token-file", str(token_file), "--bind", "--kube-api", api.url, "--lease-ttl", "86400", *(extender_args or [])]
        yield Cluster(nodes, _start_extender(argv, work / "extender.log", procs), api, token, work, extender_argv=argv, procs=procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout:
                proc.stdout.close()
        api.close()
        if own_work:
            shutil.rmtree(work, ignore_errors=True)


def _get_ok(node: Node, path: str) -> Any:
    status, doc = node.request("GET", path)
    if status != 200:
        raise AssertionError(f"{node.name} GET {path}: HTTP {status}: {doc}")
    return doc


def _wait_ready(node: Node) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if node.request("GET", "/readyz")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"agent {node.name} ({node.fixture}) never became ready")


# --- the stream and the schedulers ---------------------------------------------------------


@dataclass(frozen=True)
class Job:
    id: int
    arrive: float
    gpus: int
    duration: float


def job_stream(count: int, total_gpus: int, load: float, seed: int) -> list[Job]:
    """Poisson arrivals (rate 1), sizes by WEIGHTS, exponential lengths set so the offered
    load is ``load`` of the cluster's GPUs."""
    rng = random.Random(seed)
    mean_size = sum(s * w for s, w in zip(SIZES, WEIGHTS))
    mean_length = load * total_gpus / mean_size
    jobs, t = [], 0.0
    for n in range(count):
        t += rng.expovariate(1.0)
        jobs.append(Job(n, t, rng.choices(SIZES, WEIGHTS)[0], rng.expovariate(1.0 / mean_length)))
    return jobs


# Issue #39: small pods' pressure against a whole-node pod (bench.kube_queue runs it through
# kube-scheduler's queue; bench.cluster_replay in process, ``--starve`` here through real agents).
STARVE_FIXTURES = ("dgx-a100", "pcie-2socket")  # one NVSwitch node, one PCIe node: 16 GPUs
STARVE_PATTERN, STARVE_ROUNDS = (1, 1, 1, 1, 8), 6  # one pod a second
SMALL_LIFE_S = {"normal": 8.0, "overload": 20.0}  # 1-GPU pods: ~6 or ~16 in flight
BIG_LIFE_S = 8.0  # the issue names the 1-GPU pods' lives only; 8-GPU pods live as long as normal ones


def starve_stream(load: str, seed: int, rounds: int = STARVE_ROUNDS) -> list[Job]:
    """``STARVE_PATTERN`` x ``rounds``, one a second; seed 0 exactly so, other seeds with
    each arrival moved by up to 0.3 s and each lifetime by up to 20 %."""
    rng = random.Random(seed)
    jobs = []
    for n, gpus in enumerate(STARVE_PATTERN * rounds):
        life = SMALL_LIFE_S[load] if gpus == 1 else BIG_LIFE_S
        jitter, stretch = (rng.uniform(-0.3, 0.3), rng.uniform(0.8, 1.2)) if seed else (0.0, 1.0)
        jobs.append(Job(n, max(0.0, n + jitter), gpus, life * stretch))
    return sorted(jobs, key=lambda j: (j.arrive, j.id))


@dataclass
class Placed:
    job: Job
    node: str
    gpus: tuple[int, ...]  # nvidia-smi indices in rank order
    lease: str


class Scheduler:
    """Places a job on the cluster (reserving on the node's agent) or says None."""

    name = ""

    def __init__(self, c: Cluster) -> None:
        self.c = c
        self.free_count = {n.name: n.gpus for n in c.nodes}  # kube-scheduler's own count of the resource

    def place(self, job: Job) -> Placed | None:
        raise NotImplementedError

    def release(self, placed: Placed) -> None:
        status, doc = self.c.node(placed.node).request("DELETE", f"/leases/{placed.lease}", token=self.c.token)
        if status != 200:
            raise AssertionError(f"release {placed.lease} on {placed.node}: HTTP {status}: {doc}")
        self.free_count[placed.node] += placed.job.gpus

    def _reserve(self, job: Job, node: Node, gpus: tuple[int, ...]) -> Placed:
        body = {"gpus": job.gpus, "include": list(gpus), "reserve": {"owner": f"{self.name}/job-{job.id}", "ttl_s": 86400}}
        status, doc = node.request("POST", "/place", body, token=self.c.token)
        if status != 200:
            raise AssertionError(f"{self.name}: reserve {gpus} on {node.name}: HTTP {status}: {doc}")
        self.free_count[node.name] -= job.gpus
        return Placed(job, node.name, tuple(g["index"] for g in doc["gpus"]), doc["lease"]["id"])

    def _free(self, node: Node) -> list[int]:
        return list(_get_ok(node, "/capacity")["free"])


class CountOnly(Scheduler):
    name = "count-only"

    def place(self, job: Job) -> Placed | None:
        for node in sorted(self.c.nodes, key=lambda n: n.name):
            if self.free_count[node.name] >= job.gpus:
                free = set(self._free(node))
                busy = {g.index for g in node.matrix.gpus if g.index not in free}
                got = first_fit(node.matrix, job.gpus, busy)
                if got:
                    return self._reserve(job, node, got)
        return None


class ZoneFirst(Scheduler):
    name = "zone-first"

    def __init__(self, c: Cluster) -> None:
        super().__init__(c)
        self.policy = {n.name: HamiZonePolicy(n.matrix) for n in c.nodes}

    def place(self, job: Job) -> Placed | None:
        best: tuple[tuple[int, int, str], Node, tuple[int, ...]] | None = None
        for node in self.c.nodes:
            if self.free_count[node.name] < job.gpus:
                continue
            free = set(self._free(node))
            positions = {p for p, g in enumerate(node.matrix.gpus) if g.index in free}
            zones = [len(z & positions) for z in self.policy[node.name].zones]
            fitting = [f for f in zones if f >= job.gpus]
            # A fitting zone first (the fewest free in it), else the node with the fewest free.
            rank = (0, min(fitting), node.name) if fitting else (1, len(positions), node.name)
            busy = {g.index for g in node.matrix.gpus if g.index not in free}
            got = self.policy[node.name](job.gpus, busy)
            if got and (best is None or rank < best[0]):
                best = (rank, node, got)
        return self._reserve(job, best[1], best[2]) if best else None


KEPT_OFF = ("held for pod ", "kept for pod ")  # a hold's or a guard's reason (extender.holds): no agent failed


class ThroughExtender(Scheduler):
    """kube-scheduler's calls, as deploy/kubernetes/kube-scheduler-config.yaml configures them."""

    name = "topoagent"

    def __init__(self, c: Cluster) -> None:
        super().__init__(c)
        self.cycles_s: list[float] = []
        self.scores_seen: list[int] = []
        self.pods: dict[int, dict[str, Any]] = {}

    def pod(self, job: Job, annotations: dict[str, str] | None = None) -> dict[str, Any]:
        """The job's pod, created in the API server on its first try."""
        if job.id in self.pods:
            return self.pods[job.id]
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"job-{job.id}", "namespace": "bench", "uid": str(uuid.uuid4()), "annotations": dict(annotations or {})},
            "spec": {"schedulerName": "default-scheduler",
                     "containers": [{"name": "train", "image": "trainer:1", "resources": {"limits": {RESOURCE: str(job.gpus)}}}]},
            "status": {"phase": "Pending"},
        }
        self.c.api.add_pod(pod)
        self.pods[job.id] = pod
        return pod

    def place(self, job: Job) -> Placed | None:
        fits = [n.name for n in sorted(self.c.nodes, key=lambda n: n.name) if self.free_count[n.name] >= job.gpus]
        if not fits:
            return None  # kube-scheduler's own filter stops the cycle before the extender
        placed = self.cycle(job, fits)
        if placed is not None:
            self.free_count[placed.node] -= job.gpus
        return placed

    def cycle(self, job: Job, fits: list[str]) -> Placed | None:
        """Filter, prioritize and bind for the job's pod among ``fits`` (the nodes kube-scheduler's
        count leaves); None when the filter passes none."""
        pod = self.pod(job)
        t0 = time.perf_counter()
        filtered = self.c.extender.call("filter", {"Pod": pod, "Nodes": {"items": self.c.node_objects(fits)}, "NodeNames": None})
        passed = filtered["Nodes"]["items"] if filtered.get("Nodes") else []
        failed = {**(filtered.get("FailedNodes") or {}), **(filtered.get("FailedAndUnresolvableNodes") or {})}
        failed = {node: why for node, why in failed.items() if not why.startswith(KEPT_OFF)}
        if failed:  # each node passed has enough free GPUs: a failure here (an agent late on a busy machine) would skew the figures
            raise AssertionError(f"extender filter failed nodes with enough free GPUs for job-{job.id}: {failed}")
        if not passed:
            self.cycles_s.append(time.perf_counter() - t0)
            return None
        priorities = self.c.extender.call("prioritize", {"Pod": pod, "Nodes": {"items": passed}, "NodeNames": None})
        self.scores_seen += [p["Score"] for p in priorities]
        best = max(priorities, key=lambda p: (p["Score"], [-ord(ch) for ch in p["Host"]]))["Host"]
        meta = pod["metadata"]
        result = self.c.extender.call("bind", {"PodName": meta["name"], "PodNamespace": meta["namespace"], "PodUID": meta["uid"], "Node": best})
        self.cycles_s.append(time.perf_counter() - t0)
        if result.get("Error"):
            raise AssertionError(f"bind {meta['name']} to {best}: {result['Error']}")
        bound = self.c.api.pod(meta["name"], meta["namespace"])
        node = self.c.node(best)
        uuids = parse_choice(bound["metadata"]["annotations"][ANNOTATION])
        return Placed(job, best, tuple(node.uuid_index[u] for u in uuids), bound["metadata"]["annotations"][LEASE_ANNOTATION])


# --- the replay ------------------------------------------------------------------------------


@dataclass
class Outcome:
    policy: str
    placed: list[Placed]
    waited: int  # jobs that did not start on arrival (placed later or never)
    never: int  # still waiting when the stream ran out
    ring_gbps: list[float]  # per multi-GPU job
    satisfaction: list[float]
    numa: list[int]
    cycles_s: list[float]


def replay(c: Cluster, scheduler: Scheduler, jobs: list[Job], check: Callable[[Cluster, list[Placed]], None] | None = None) -> Outcome:
    """The stream in simulated time: at each arrival, end the jobs due (after each end,
    retry the waiting, oldest first), then try the new one; it waits when it fits nowhere.
    ``check(cluster, running)`` runs after each start."""
    running: list[tuple[float, Placed]] = []
    waiting: list[Job] = []
    placed: list[Placed] = []
    waited: set[int] = set()
    now = 0.0

    def start(job: Job) -> bool:
        got = scheduler.place(job)
        if got is None:
            return False
        placed.append(got)
        running.append((now + job.duration, got))
        if check:
            check(c, [p for _, p in running])
        return True

    def retry() -> None:
        for job in list(waiting):
            if start(job):
                waiting.remove(job)

    def end_until(t: float) -> None:
        nonlocal now
        while running and min(e for e, _ in running) <= t:
            end, done = min(running, key=lambda r: r[0])
            running.remove((end, done))
            now = end
            scheduler.release(done)
            retry()

    for job in jobs:
        end_until(job.arrive)
        now = job.arrive
        if not start(job):  # a pod that fits starts, waiting ones or not (as kube-scheduler does)
            waiting.append(job)
            waited.add(job.id)
    end_until(float("inf"))
    rings, sats, numa = [], [], []
    for p in placed:
        if p.job.gpus < 2:
            continue
        m = c.node(p.node).matrix
        others = [g.index for g in m.gpus if g.index not in p.gpus]
        ev = place(m, Request(gpus=p.job.gpus, include=tuple(sorted(p.gpus))), others)
        assert isinstance(ev, Placement)
        rings.append(ev.bandwidth_gbps or 0.0)
        sats.append(ev.satisfaction)
        distance = numa_distance(m, p.gpus)
        if distance is not None:
            numa.append(distance)
    cycles = scheduler.cycles_s if isinstance(scheduler, ThroughExtender) else []
    return Outcome(scheduler.name, placed, len(waited), len(waiting), rings, sats, numa, cycles)


class ExtenderQueue(KubeQueue):
    """Issue #39's stream through kube-scheduler's queue (bench.kube_queue, simulated time) in
    front of the real extender and agents: a cycle is kube-scheduler's count filter, then
    ``ThroughExtender.cycle``; a pod's end releases its lease on the agent; kube-scheduler's
    ``Unschedulable`` mark on a large pod is written on the pod in the API server, and the
    queue goes on once the extender's pod watch has seen it (``GET /holds`` lists it waiting).

    The queue's time is simulated, the extender's is not: a guard or hold measures its
    seconds on the extender's clock, so this runs guards that end only with their pod
    (``--hold-guard`` far past the run) and no holds (``--hold-after 0``); the replay found the
    guard's length changes nothing on this stream (bench.cluster_replay, docs/benchmarks.md)."""

    def __init__(self, c: Cluster, guards: bool) -> None:
        super().__init__({n.name: n.gpus for n in c.nodes})
        self.c, self.guards = c, guards
        self.through = ThroughExtender(c)
        self.marked: set[int] = set()

    def schedule(self, q: Queued) -> Placed | None:
        fits = [n.name for n in sorted(self.c.nodes, key=lambda n: n.name) if self.free_count[n.name] >= q.job.gpus]
        return self.through.cycle(q.job, fits) if fits else None

    def release(self, placed: Placed) -> None:
        status, doc = self.c.node(placed.node).request("DELETE", f"/leases/{placed.lease}", token=self.c.token)
        if status != 200:
            raise AssertionError(f"release {placed.lease} on {placed.node}: HTTP {status}: {doc}")

    def unschedulable(self, q: Queued) -> None:
        if not self.guards or q.job.gpus < 8 or q.job.id in self.marked:
            return
        self.marked.add(q.job.id)
        meta = self.through.pod(q.job)["metadata"]
        self.c.api.set_pod_condition(meta["name"], {"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}, meta["namespace"])
        wanted = f"{meta['namespace']}/{meta['name']}"
        deadline = time.monotonic() + WAIT_S
        while wanted not in {w["pod"] for w in _request(self.c.extender, "GET", "/holds")[1]["waiting"]}:
            if time.monotonic() > deadline:
                raise AssertionError(f"the extender's pod watch never saw {wanted} unschedulable")
            time.sleep(0.01)


# The extender's flags for each column: guards that end with their pod only (see ExtenderQueue).
STARVE_SETTINGS = {HoldSetting(0, 0): ["--hold-after", "0", "--hold-guard", "0"],
                   HoldSetting(0, 86400): ["--hold-after", "0", "--hold-guard", "86400"]}


def starve(loads: list[str], seeds: list[int], rounds: int) -> str:
    """Issue #39's stream on real agents (dgx-a100, pcie-2socket) and the real extender, without
    holds and with guards: the table of bench.cluster_replay --starve."""
    figures = {}
    first, flags = next(iter(STARVE_SETTINGS.items()))
    with cluster(list(STARVE_FIXTURES), extender_args=flags) as c:
        base = c.extender_argv[: -len(flags)]
        for setting, flags in STARVE_SETTINGS.items():
            if setting != first:  # an extender with this setting's flags, remembering nothing
                c.stop_extender()
                c.extender_argv = base + flags
                c.start_extender()
            for load in loads:
                for seed in seeds:
                    jobs = starve_stream(load, seed, rounds)
                    figures[load, seed, setting] = starve_figures(jobs, ExtenderQueue(c, guards=bool(setting.guard_s)).run(jobs))
                    for namespace, pod in list(c.api.pods):
                        c.api.delete_pod(pod, namespace)
                    if any(_get_ok(n, "/leases")["leases"] for n in c.nodes):
                        raise AssertionError(f"leases left after the stream ({load}, seed {seed}, {setting.name()})")
    return starve_table({load: SMALL_LIFE_S[load] for load in loads}, seeds, list(STARVE_SETTINGS),
                        lambda load, seed, setting: figures[load, seed, setting])


def table(outcomes: list[Outcome], nodes: int, jobs: int) -> str:
    lines = [
        f"| policy ({nodes} nodes, {jobs} pods) | placed | waited | ring GB/s median | ring GB/s p10 | satisfaction | NUMA distance | cycle p50 ms | cycle p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for o in outcomes:
        cycle = (f"{1000 * statistics.median(o.cycles_s):.1f} | {1000 * percentile(o.cycles_s, 0.99):.1f}" if o.cycles_s else "- | -")
        lines.append(
            f"| {o.policy} | {len(o.placed)} | {o.waited} | {statistics.median(o.ring_gbps):.1f} | {percentile(o.ring_gbps, 0.10):.1f}"
            f" | {statistics.mean(o.satisfaction):.3f} | {statistics.mean(o.numa):.1f} | {cycle} |"
        )
    return "\n".join(lines)


def fixtures_for(count: int) -> list[str]:
    return [MIX[n % len(MIX)] for n in range(count)]


# The figures are outcomes in simulated time: an agent or a call late on a busy machine must
# not change them (the bench fails instead), so the extender waits long for its agents.
GENEROUS_TIMEOUTS = ["--agent-timeout", "60", "--call-timeout", "120"]


def run(nodes: int, pods: int, load: float, seeds: list[int]) -> tuple[dict[int, list[Outcome]], int]:
    """Each seed's stream through the three schedulers, on one cluster (every job's lease
    is released by the end of a replay, so each replay starts from idle agents)."""
    outcomes: dict[int, list[Outcome]] = {}
    with cluster(fixtures_for(nodes), extender_args=GENEROUS_TIMEOUTS) as c:
        total = sum(n.gpus for n in c.nodes)
        for seed in seeds:
            jobs = job_stream(pods, total, load, seed)
            outcomes[seed] = [replay(c, scheduler, jobs) for scheduler in (ThroughExtender(c), CountOnly(c), ZoneFirst(c))]
    return outcomes, total


def median_table(outcomes: dict[int, list[Outcome]], nodes: int, jobs: int) -> str:
    """Per policy, the median over seeds of each seed's figure."""
    seeds = sorted(outcomes)
    lines = [
        f"| policy ({nodes} nodes, {jobs} pods, median of seeds {','.join(map(str, seeds))}) | placed | waited"
        " | ring GB/s median | ring GB/s p10 | satisfaction | NUMA distance | cycle p50 ms | cycle p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n, first in enumerate(outcomes[seeds[0]]):
        runs = [outcomes[s][n] for s in seeds]

        def med(figure: Callable[[Outcome], float], runs: list[Outcome] = runs) -> float:
            return statistics.median(figure(o) for o in runs)

        cycle = (f"{1000 * med(lambda o: statistics.median(o.cycles_s)):.1f} | {1000 * med(lambda o: percentile(o.cycles_s, 0.99)):.1f}"
                 if first.cycles_s else "- | -")
        lines.append(
            f"| {first.policy} | {med(lambda o: len(o.placed)):g} | {med(lambda o: o.waited):g} | {med(lambda o: statistics.median(o.ring_gbps)):.1f}"
            f" | {med(lambda o: percentile(o.ring_gbps, 0.10)):.1f} | {med(lambda o: statistics.mean(o.satisfaction)):.3f}"
            f" | {med(lambda o: statistics.mean(o.numa)):.1f} | {cycle} |"
        )
    return "\n".join(lines)


def seed_list(text: str) -> list[int]:
    """Seeds as ``7,8,9``, a range ``1-200``, or both (``1-5,9``)."""
    seeds: list[int] = []
    for part in text.split(","):
        low, dash, high = part.partition("-")
        try:
            seeds += list(range(int(low), int(high) + 1)) if dash else [int(part)]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seeds as integers separated by commas (7,8,9) or a range (1-200), got {text!r}") from None
    if not seeds:
        raise argparse.ArgumentTypeError(f"no seed in {text!r}")
    if len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"a seed is named twice in {text!r}")
    return seeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="8 agents, 80 pods")
    parser.add_argument("--nodes", type=int, help="agents to start (default 16; --quick 8)")
    parser.add_argument("--pods", type=int, help="pods in the stream (default 300; --quick 80)")
    parser.add_argument("--load", type=float, default=0.9, help="offered load, share of the cluster's GPUs (default 0.9)")
    parser.add_argument("--seed", type=int, default=7, help="the stream's seed (default 7)")
    parser.add_argument("--seeds", type=seed_list, metavar="S1,S2,...|FIRST-LAST",
                        help="several streams, one table each and a table of the medians over them (instead of --seed)")
    parser.add_argument("--markdown", action="store_true", help="print only the table (the figures:cluster block in docs/benchmarks.md; with --seeds the medians)")
    parser.add_argument("--starve", action="store_true",
                        help="issue #39 instead: [1,1,1,1,8] x --rounds, one pod a second, on dgx-a100 + pcie-2socket, through "
                             "kube-scheduler's queue (bench.kube_queue), without holds and with guards (--seeds, default 0; "
                             "--quick: overload only)")
    parser.add_argument("--rounds", type=int, default=STARVE_ROUNDS, help=f"with --starve: rounds of the pattern (default {STARVE_ROUNDS})")
    args = parser.parse_args()
    if args.starve:
        seeds = args.seeds or [0]
        loads = ["overload"] if args.quick else list(SMALL_LIFE_S)
        heading = "" if args.markdown else "## Holds (issue #39), real agents and extender: "
        print(f"{heading}{list(STARVE_PATTERN)} x {args.rounds}, one a second, {', '.join(STARVE_FIXTURES)}; 8-GPU pods live "
              f"{BIG_LIFE_S:g} s; seeds {','.join(map(str, seeds))}; real agents, the real extender\n")
        print(starve(loads, seeds, args.rounds))
        return
    nodes = args.nodes or (8 if args.quick else 16)
    pods = args.pods or (80 if args.quick else 300)
    seeds = args.seeds or [args.seed]
    outcomes, total = run(nodes, pods, args.load, seeds)
    if args.markdown:
        print(table(outcomes[seeds[0]], nodes, pods) if len(seeds) == 1 else median_table(outcomes, nodes, pods))
        return
    for seed in seeds:
        print(f"## Cluster: {nodes} real agents ({', '.join(MIX)} in turn; {total} GPUs), the extender, {pods} pods, load {args.load:g}, seed {seed}\n")
        print(table(outcomes[seed], nodes, pods) + "\n")
    if len(seeds) > 1:
        print(f"## Medians over seeds {','.join(map(str, seeds))}\n")
        print(median_table(outcomes, nodes, pods))


if __name__ == "__main__":
    main()
