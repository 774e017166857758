"""`topoagent device-plugin` against kubelet's protocol: a real agent child on a recorded
node, a real plugin child, and kubelet played from the same api.proto over unix sockets."""

from __future__ import annotations

import http.client
import json
import random
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from math import comb, factorial
from pathlib import Path

import grpc
import pytest
from conftest import NOT_READY
from fake_apiserver import FakeApiServer
from fake_kubelet import FakeKubelet, PluginProcess, start_plugin
from placement_oracle import best_keys, numa_distance, numa_key, pattern_key
from service_helpers import DGX_A100, Agent, make_root, start_agent, wait_counters_read, wait_for, without_leases

from topoagent.cluster.deviceplugin import api_pb2
from topoagent.node.discovery import discover
from topoagent.node.host import Host
from topoagent.placement import Request

SNAPSHOTS = DGX_A100.parent
# Not-ready nodes answer /place 503 (tests/test_witnesses.py): no answer to hold kubelet's to.
FIXTURES = sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir() and p.name not in NOT_READY)


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    k = FakeKubelet()
    k.start()
    yield k
    k.close()


@pytest.fixture(scope="module")
def dgx_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Agent]:
    """One agent on the recorded DGX A100 (read only) for every test that leaves the node
    as recorded: a start costs seconds of CPU, and what a test changes is its leases."""
    agent = start_agent(tmp_path_factory.mktemp("dgx-agent"))
    yield agent
    assert agent.stop() == 0, agent.log()[-2000:]


@pytest.fixture
def agent(dgx_agent: Agent) -> Agent:
    """The module's agent as a fresh one starts: running, and not one lease held."""
    without_leases(dgx_agent)
    assert dgx_agent.get("/capacity").json()["free_gpus"] == 8
    return dgx_agent


def running(tmp: Path, kubelet: FakeKubelet, *, root: Path = DGX_A100, extra: list[str] | None = None) -> tuple[Agent, PluginProcess]:
    agent = start_agent(tmp, root=root)
    plugin = start_plugin(tmp, kubelet, agent.url, extra=extra)
    return agent, plugin


def stop(agent: Agent, plugin: PluginProcess) -> None:
    """Both stopped at once (each takes about a second to drain); each must exit 0."""
    agent.proc.send_signal(signal.SIGTERM)
    try:
        assert plugin.stop() == 0, plugin.log()
    finally:
        try:
            agent.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.stop()  # kills it and fails, with its log


def kept_off_by_findings(agent: Agent) -> set[int]:
    """The GPUs the agent keeps off answers for a critical finding, once the recorded
    counters have been read and /capacity has its figures."""
    wait_counters_read(agent)
    capacity = wait_for("current capacity figures", lambda: (lambda r: r.status == 200 and not r.json().get("stale") and r)(
        agent.get("/capacity")), agent=agent, timeout=120)
    return set(capacity.json()["unhealthy"])


def preferred(kubelet: FakeKubelet, available: list[str], must: list[str], size: int) -> list[str]:
    want = api_pb2.ContainerPreferredAllocationRequest(available_deviceIDs=available, must_include_deviceIDs=must, allocation_size=size)
    reply = kubelet.plugin().GetPreferredAllocation(api_pb2.PreferredAllocationRequest(container_requests=[want]), timeout=30)
    return list(reply.container_responses[0].deviceIDs)


def allocate(kubelet: FakeKubelet, ids: list[str]) -> dict[str, str]:
    reply = kubelet.plugin().Allocate(api_pb2.AllocateRequest(container_requests=[api_pb2.ContainerAllocateRequest(devices_ids=ids)]), timeout=30)
    return dict(reply.container_responses[0].envs)


def test_registers_and_lists_the_gpus_by_uuid(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    plugin = start_plugin(tmp_path, kubelet, agent.url)
    try:
        reg = kubelet.next_registration()
        assert (reg.version, reg.resource_name, reg.endpoint) == ("v1beta1", "nvidia.com/gpu", "topoagent.sock")
        assert reg.options.get_preferred_allocation_available and not reg.options.pre_start_required
        devices = kubelet.wait_listing(lambda d: len(d) > 0)
        gpus = agent.get("/topology").json()["gpus"]
        assert [d.ID for d in devices] == [g["uuid"] for g in gpus] and len(devices) == 8
        assert {d.health for d in devices} == {"Healthy"}
        assert [[n.ID for n in d.topology.nodes] for d in devices] == [[g["numa_node"]] for g in gpus]
        options = kubelet.plugin().GetDevicePluginOptions(api_pb2.Empty(), timeout=10)
        assert options.get_preferred_allocation_available
    finally:
        assert plugin.stop() == 0, plugin.log()
    assert not (kubelet.dir / "topoagent.sock").exists()  # its socket goes with it


def test_resource_name_and_socket_are_configurable(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--resource-name", "topoagent.io/gpu", "--socket-name", "ta.sock"])
    try:
        reg = kubelet.next_registration()
        assert (reg.resource_name, reg.endpoint) == ("topoagent.io/gpu", "ta.sock")
        assert len(kubelet.wait_listing(lambda d: len(d) > 0)) == 8
    finally:
        assert plugin.stop() == 0, plugin.log()


def set_gpu_links(root: Path, index: int, active: bool) -> None:
    path = root / "nvml.json"
    nvml = json.loads(path.read_text())
    for link in nvml["gpus"][index]["nvlinks"]:
        link["active"] = active
    path.write_text(json.dumps(nvml))


def test_a_gpu_with_a_critical_finding_turns_unhealthy_and_back(tmp_path: Path, kubelet: FakeKubelet) -> None:
    root = make_root(tmp_path)
    agent, plugin = running(tmp_path, kubelet, root=root)
    try:
        kubelet.next_registration()
        devices = kubelet.wait_listing(lambda d: len(d) == 8)
        gpu2 = devices[2].ID
        # Every NVLink of GPU2 down: it is off the NVSwitch fabric, a critical finding.
        set_gpu_links(root, 2, False)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        sick = kubelet.wait_listing(lambda d: {x.ID: x.health for x in d}.get(gpu2) == "Unhealthy")
        assert [d.ID for d in sick if d.health == "Unhealthy"] == [gpu2]
        findings = agent.get("/topology").json()["findings"]
        assert {(f["subject"], f["severity"]) for f in findings if f["kind"] == "gpu-outside-fabric"} == {("GPU2", "critical")}
        set_gpu_links(root, 2, True)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        well = kubelet.wait_listing(lambda d: {x.ID: x.health for x in d}.get(gpu2) == "Healthy")
        assert {d.health for d in well} == {"Healthy"} and len(well) == 8
    finally:
        stop(agent, plugin)


def test_every_gpu_is_unhealthy_while_the_nvlink_fabric_is_down_and_healthy_again_after(tmp_path: Path, kubelet: FakeKubelet) -> None:
    """A finding that blocks placement names the fabric, not a GPU: still, no GPU of the node
    is offered to a pod while it stands (the agent answers /place 503 meanwhile)."""
    root = make_root(tmp_path)
    agent, plugin = running(tmp_path, kubelet, root=root)
    try:
        kubelet.next_registration()
        assert {d.health for d in kubelet.wait_listing(lambda d: len(d) == 8)} == {"Healthy"}
        for index in range(8):  # the fabric manager stopped: not one NVLink active behind the NVSwitches
            set_gpu_links(root, index, False)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        sick = kubelet.wait_listing(lambda d: len(d) == 8 and {x.health for x in d} == {"Unhealthy"})
        assert len(sick) == 8
        critical = [(f["kind"], f["subject"]) for f in agent.get("/topology").json()["findings"] if f["severity"] == "critical"]
        assert critical == [("nvswitch-no-nvlink", "nvswitch")]  # no GPU named: the fabric rule alone took them all
        for index in range(8):
            set_gpu_links(root, index, True)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        well = kubelet.wait_listing(lambda d: len(d) == 8 and {x.health for x in d} == {"Healthy"})
        assert len(well) == 8
    finally:
        stop(agent, plugin)


def test_registers_again_when_kubelet_restarts(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    plugin = start_plugin(tmp_path, kubelet, agent.url)
    try:
        kubelet.next_registration()
        kubelet.wait_listing(lambda d: len(d) == 8)
        kubelet.restart()
        again = kubelet.next_registration()
        assert (again.version, again.resource_name) == ("v1beta1", "nvidia.com/gpu")
        # The new kubelet gets the whole list on its new stream, and the plugin answers on it.
        assert len(kubelet.wait_listing(lambda d: len(d) == 8)) == 8
        assert (kubelet.dir / again.endpoint).is_socket()
        assert kubelet.plugin().GetDevicePluginOptions(api_pb2.Empty(), timeout=10).get_preferred_allocation_available
    finally:
        assert plugin.stop() == 0, plugin.log()


def test_waits_for_kubelet_then_registers(tmp_path: Path, agent: Agent) -> None:
    """Started before kubelet (a node booting): registers once kubelet's socket appears."""
    kubelet = FakeKubelet()
    plugin = start_plugin(tmp_path, kubelet, agent.url)
    try:
        assert kubelet.registrations.empty()
        # It says which socket it waits for (a wrong --plugin-dir is seen at once), and says so once.
        wait_for("the plugin to name kubelet's socket", lambda: f"event=waiting_for_kubelet socket={kubelet.socket}" in plugin.log(),
                 log=plugin.log)
        kubelet.start()
        assert kubelet.next_registration().resource_name == "nvidia.com/gpu"
        assert plugin.log().count("event=waiting_for_kubelet") == 1
    finally:
        assert plugin.stop() == 0, plugin.log()
        kubelet.close()


def fixture_matrix(name: str):
    import asyncio

    with Host(SNAPSHOTS / name) as host:
        return asyncio.run(discover(host)).distance_matrix()


# The oracle tries every k-subset in every ring order: past this many it takes minutes
# (16 GPUs, k = 8: 12870 sets x 5040 orders; here 16 GPUs stop at k = 4), and such cases are held to the agent's own
# /place answer only, which tests/test_placement_exact.py holds to the oracle.
ORACLE_BUDGET = 20_000


def oracle_cost(free: int, k: int) -> int:
    return comb(free, k) * factorial(max(k - 1, 0))


@pytest.mark.parametrize("name", FIXTURES)
def test_preferred_allocations_are_optimal_on_every_fixture(name: str, tmp_path: Path, kubelet: FakeKubelet) -> None:
    """Against the agent's own /place answer for the same request and, where brute force
    is quick, the oracle (bottleneck of the ring, NUMA nodes spanned), over whole and
    partial offers."""
    agent, plugin = running(tmp_path, kubelet, root=SNAPSHOTS / name)
    try:
        kubelet.next_registration()
        devices = kubelet.wait_listing(lambda d: len(d) > 0)
        gpus = agent.get("/topology").json()["gpus"]
        index = {g["uuid"]: g["index"] for g in gpus}
        uuids = [d.ID for d in devices]
        matrix = fixture_matrix(name)
        # The agent keeps GPUs with a critical finding (some come from the recorded counters,
        # read just after discovery) off every answer it was not told to include: so does the
        # oracle, once those counters are in.
        unhealthy = kept_off_by_findings(agent)
        rng = random.Random(name)
        cases = [(uuids, [], k) for k in range(1, len(uuids) + 1)]
        for _ in range(10):
            offered = rng.sample(uuids, rng.randint(1, len(uuids)))
            size = rng.randint(1, len(offered))
            must = rng.sample(offered, rng.randint(0, min(2, size)))
            cases.append((offered, must, size))
        checked = 0
        for offered, must, size in cases:
            got = preferred(kubelet, offered, must, size)
            assert len(got) == len(set(got)) == size and set(must) <= set(got) <= set(offered), (offered, must, size, got)
            req = Request(gpus=size, include=tuple(sorted(index[u] for u in must)),
                          exclude=tuple(sorted(index[u] for u in uuids if u not in offered)))
            reply = agent.post("/place", {"gpus": size, "include": list(req.include), "exclude": list(req.exclude)})
            if reply.status != 200:  # no fit without the GPUs a finding keeps off: kubelet still got a valid set (above)
                assert reply.status in (409, 422) and unhealthy, (reply.status, reply.body[:300])
                continue
            assert got == [g["uuid"] for g in reply.json()["gpus"]]
            if oracle_cost(len(offered), size) > ORACLE_BUDGET:
                continue
            checked += 1
            expected_pattern, expected_distance, expected_numa, *_ = best_keys(matrix, req, tuple(sorted(unhealthy - set(req.include))))
            positions = tuple(sorted(matrix.gpu_by_index(index[u]) for u in got))
            assert pattern_key(matrix, positions, req.pattern) == expected_pattern, (offered, must, size, got)
            assert numa_distance(matrix, positions) == expected_distance, (offered, must, size, got)
            assert len({numa_key(matrix, p) for p in positions}) == expected_numa, (offered, must, size, got)
        assert checked >= min(len(cases), 4)
    finally:
        stop(agent, plugin)


def test_allocate_gives_the_container_its_gpus_in_rank_order(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    plugin = start_plugin(tmp_path, kubelet, agent.url)
    try:
        kubelet.next_registration()
        uuids = [d.ID for d in kubelet.wait_listing(lambda d: len(d) == 8)]
        topo = agent.get("/topology").json()
        asked = [uuids[7], uuids[1], uuids[2], uuids[5]]  # kubelet's order carries no meaning
        env = allocate(kubelet, asked)
        placed = agent.post("/place", {"gpus": 4, "include": [1, 2, 5, 7], "detail": ["bindings"]}).json()["gpus"]
        rank_order = [g["uuid"] for g in placed]
        assert sorted(rank_order) == sorted(asked)
        assert env["NVIDIA_VISIBLE_DEVICES"] == env["CUDA_VISIBLE_DEVICES"] == ",".join(rank_order)
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
        # One NIC per rank, the one nearest its GPU: on a DGX A100 each GPU pair shares a
        # PCIe switch with two ConnectX-6, and mlx5_0..7 are the compute NICs.
        nics = env["NCCL_IB_HCA"].removeprefix("=").split(",")
        assert nics == [g["nearest_nics"][0] for g in placed]
        names = {n["device"] for n in topo["nics"]}
        assert len(nics) == 4 and set(nics) <= names
        with pytest.raises(grpc.RpcError) as refused:
            allocate(kubelet, ["GPU-not-on-this-node"])
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "GPU-not-on-this-node" in refused.value.details()
    finally:
        assert plugin.stop() == 0, plugin.log()


def pod(name: str, gpus: list[str], lease: str, uid: str | None = None, namespace: str = "default") -> dict:
    """A pending pod as the extender's bind leaves it: its GPUs and its lease on it."""
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()),
                         "annotations": {"topoagent.io/gpus": ",".join(gpus), "topoagent.io/lease": lease}},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": str(len(gpus))}}}]},
            "status": {"phase": "Pending"}}


def lease_for(agent: Agent, indices: list[int], owner: str) -> str:
    """A lease on exactly these GPUs, as the extender's bind takes it."""
    reply = agent.post("/place", {"gpus": len(indices), "include": indices, "reserve": {"owner": owner, "ttl_s": 3600}}, token=agent.token)
    assert reply.status == 200, reply.text
    return reply.json()["lease"]["id"]


def test_the_extenders_choice_wins_when_it_is_the_one_that_fits(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    uuids = [g["uuid"] for g in json.loads((DGX_A100 / "nvml.json").read_text())["gpus"]]
    chosen = [uuids[6], uuids[0]]  # not what the agent would pick for 2 GPUs, in the extender's rank order
    api = FakeApiServer()
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", "gpu-node-1"])
    try:
        kubelet.next_registration()
        kubelet.wait_listing(lambda d: len(d) == 8)
        # Without the annotation the agent's order would be the other one.
        assert [g["index"] for g in agent.post("/place", {"gpus": 2, "include": [0, 6]}).json()["gpus"]] == [0, 6]
        for name, gpus, indices in (("train-0", chosen, [0, 6]), ("train-1", uuids[1:5], [1, 2, 3, 4])):
            uid = str(uuid.uuid4())
            api.add_pod(pod(name, gpus, lease_for(agent, indices, f"default/{name}/{uid}"), uid))
        assert preferred(kubelet, uuids, [], 2) == chosen
        env = allocate(kubelet, chosen[::-1])
        assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(chosen)
        # A choice that does not fit the offer (GPU6 taken) is not used: the agent answers.
        offered = [u for u in uuids if u != uuids[6]]
        direct = agent.post("/place", {"gpus": 2, "exclude": [6]}).json()
        assert preferred(kubelet, offered, [], 2) == [g["uuid"] for g in direct["gpus"]] != chosen
        assert api.queries[0]["path"] == "/api/v1/pods"
        assert api.queries[0]["fieldSelector"] == ["spec.nodeName=gpu-node-1,status.phase=Pending"]
    finally:
        assert plugin.stop() == 0, plugin.log()
        api.close()


def test_an_annotation_counts_only_with_the_agents_lease_for_that_pod(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """Anyone who can edit a pod can annotate it: any pending pod on the node, in any
    namespace, must not steer another pod's GPUs without the lease the extender took."""
    uuids = [g["uuid"] for g in json.loads((DGX_A100 / "nvml.json").read_text())["gpus"]]
    api = FakeApiServer()
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", "gpu-node-1"])
    try:
        kubelet.next_registration()
        kubelet.wait_listing(lambda d: len(d) == 8)
        steer = [uuids[7], uuids[5]]  # not the agent's pick
        victim_uid = str(uuid.uuid4())
        victims_lease = lease_for(agent, [1, 2, 3, 4], f"team-a/victim/{victim_uid}")
        api.add_pod(pod("no-lease", steer, "", namespace="other"))  # the gpus annotation alone
        api.add_pod(pod("copied", steer, victims_lease, namespace="other"))  # another pod's lease named
        forged_uid = str(uuid.uuid4())  # its own lease, but on other GPUs than the annotation says
        api.add_pod(pod("mismatch", steer, lease_for(agent, [0], f"other/mismatch/{forged_uid}"), forged_uid, namespace="other"))
        agents_pick = [g["uuid"] for g in agent.post("/place", {"gpus": 2}).json()["gpus"]]  # from the free GPUs 5, 6, 7
        assert sorted(agents_pick) != sorted(steer)
        assert preferred(kubelet, uuids[5:], [], 2) == agents_pick
        # kubelet allocated the steered GPUs anyway: the rank order is the agent's, not the annotation's.
        agents_order = [g["uuid"] for g in agent.post("/place", {"gpus": 2, "include": [5, 7]}).json()["gpus"]]
        assert agents_order != steer
        assert allocate(kubelet, steer)["NVIDIA_VISIBLE_DEVICES"].split(",") == agents_order
        assert plugin.log().count("event=annotation_ignored") >= 2
    finally:
        assert plugin.stop() == 0, plugin.log()
        api.close()


def gpu_pod(name: str, gpus: int, namespace: str = "team-b", annotations: dict | None = None, uid: str | None = None) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "uid": uid or str(uuid.uuid4()), "annotations": annotations or {}},
            "spec": {"nodeName": "gpu-node-1", "containers": [{"name": "main", "resources": {"limits": {"nvidia.com/gpu": str(gpus)}}}]},
            "status": {"phase": "Pending"}}


def test_allocate_leases_the_gpus_for_the_pod_and_the_lease_ends_with_it(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    held = lambda: agent.get("/leases").json()["leases"]  # noqa: E731
    with leasing(tmp_path, kubelet, agent) as (api, plugin, uuids):
        train = gpu_pod("train", 2)
        api.add_pod(train)
        uid = train["metadata"]["uid"]
        ids = preferred(kubelet, uuids, [], 2)
        allocate(kubelet, ids)
        (lease,) = held()
        assert lease["owner"] == f"team-b/train/{uid}" and sorted(lease["gpu_uuids"]) == sorted(ids)
        # An out-of-band caller of the agent now sees them taken.
        assert agent.get("/capacity").json()["free_gpus"] == 6
        taken = [g["index"] for g in agent.get("/topology").json()["gpus"] if g["uuid"] in ids]
        assert agent.post("/place", {"gpus": 2, "include": taken}).status == 409
        t0 = time.monotonic()
        api.delete_pod("train", "team-b")
        wait_for("the deleted pod's lease released", lambda: not held(), timeout=5, log=plugin.log)
        print(f"device plugin: deleted pod -> lease released in {time.monotonic() - t0:.2f} s")
        assert agent.get("/capacity").json()["free_gpus"] == 8
        # Two pods that could be the one kubelet allocates for: none is guessed, the allocation is refused.
        api.add_pod(gpu_pod("one", 1))
        api.add_pod(gpu_pod("other", 1))
        with pytest.raises(grpc.RpcError) as refused:
            allocate(kubelet, [uuids[0]])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot tell which" in refused.value.details()
        assert held() == []
        api.delete_pod("one", "team-b")
        api.delete_pod("other", "team-b")
        # The extender's lease already holds a pod's GPUs: no second one; it ends with the pod too.
        extender_uid = str(uuid.uuid4())
        extender_lease = lease_for(agent, [4, 5], f"team-b/bound/{extender_uid}")
        api.add_pod(gpu_pod("bound", 2, uid=extender_uid, annotations={"topoagent.io/gpus": f"{uuids[5]},{uuids[4]}", "topoagent.io/lease": extender_lease}))
        allocate(kubelet, [uuids[4], uuids[5]])
        assert [x["id"] for x in held()] == [extender_lease] and "by=extender" in plugin.log()
        api.set_phase("bound", "Succeeded", "team-b")
        wait_for("the finished pod's lease released", lambda: not held(), timeout=5, log=plugin.log)


def test_a_lease_whose_pod_is_gone_is_swept_on_the_node(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """Pods deleted while no watch ran (the plugin restarting): the resync finds their leases."""
    api = FakeApiServer()
    gone = lease_for(agent, [0, 1], f"team-b/gone/{uuid.uuid4()}")
    alive = gpu_pod("alive", 2)
    api.add_pod(alive)
    kept = lease_for(agent, [2, 3], f"team-b/alive/{alive['metadata']['uid']}")
    by_hand = lease_for(agent, [6], "someone-by-hand")
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", "gpu-node-1",
                                                                "--agent-token-file", str(agent.token_file), "--pod-resync", "1"])
    ids = lambda: {x["id"] for x in agent.get("/leases").json()["leases"]}  # noqa: E731
    try:
        wait_for("the gone pod's lease swept", lambda: gone not in ids(), timeout=10, log=plugin.log)
        assert {kept, by_hand} <= ids()
    finally:
        try:
            assert plugin.stop() == 0, plugin.log()
        finally:
            api.close()


class LyingAgent:
    """A loopback proxy in front of a real agent that answers chosen paths with chosen bodies."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.override: dict[str, tuple[int, bytes]] = {}
        self.asked: dict[str, int] = {}
        self.hang: set[str] = set()  # paths answered only when the proxy closes (a hung agent)
        self.after: dict[str, Callable[[], None]] = {}  # run once the agent has answered, before the answer is passed on
        self.cycle: dict[str, list[tuple[int, bytes]]] = {}  # answered in turn, one per request
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _relay(self, method: str) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                path = self.path.split("?", 1)[0]
                outer.asked[path] = outer.asked.get(path, 0) + 1
                if path in outer.hang:
                    outer.closing.wait()
                if path in outer.cycle:
                    turns = outer.cycle[path]
                    status, raw = turns[(outer.asked[path] - 1) % len(turns)]
                    headers = {"Content-Type": "application/json"}
                elif path in outer.override:
                    status, raw = outer.override[path]
                    headers = {"Content-Type": "application/json"}
                else:
                    conn = http.client.HTTPConnection(agent.host, agent.port, timeout=30)
                    forwarded = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "if-none-match", "authorization")}
                    conn.request(method, self.path, body=body, headers=forwarded)
                    resp = conn.getresponse()
                    status, raw = resp.status, resp.read()
                    headers = {k: v for k, v in resp.getheaders() if k.lower() in ("content-type", "etag")}
                    conn.close()
                    if path in outer.after:
                        outer.after.pop(path)()
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:
                self._relay("GET")

            def do_POST(self) -> None:
                self._relay("POST")

            def do_DELETE(self) -> None:
                self._relay("DELETE")

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.closing.set()
        self.server.shutdown()
        self.server.server_close()


def test_a_malformed_topology_is_logged_and_polling_goes_on(tmp_path: Path, kubelet: FakeKubelet) -> None:
    root = make_root(tmp_path)
    agent = start_agent(tmp_path, root=root)
    liar = LyingAgent(agent)
    plugin = start_plugin(tmp_path, kubelet, liar.url)
    try:
        kubelet.next_registration()
        gpu2 = kubelet.wait_listing(lambda d: len(d) == 8)[2].ID
        for bad in (b"not json", b"[]", b'{"gpus": [{"uuid": 5, "index": "x"}], "findings": []}', b'{"gpus": 3}'):
            asked = liar.asked.get("/topology", 0)
            liar.override["/topology"] = (200, bad)
            wait_for("the plugin to poll the bad answer twice", lambda: liar.asked.get("/topology", 0) >= asked + 2, log=plugin.log)
        del liar.override["/topology"]
        assert plugin.proc.poll() is None
        assert plugin.log().count("event=agent_answer_refused") == 4, plugin.log()  # each once, not once per poll
        # The poller lives on: a GPU that goes critical now still reaches kubelet.
        set_gpu_links(root, 2, False)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        sick = kubelet.wait_listing(lambda d: {x.ID: x.health for x in d}.get(gpu2) == "Unhealthy")
        assert [d.ID for d in sick if d.health == "Unhealthy"] == [gpu2]
        assert "event=agent_reachable" in plugin.log()
    finally:
        try:
            stop(agent, plugin)
        finally:
            liar.close()


def test_a_lying_agent_and_bad_requests_never_reach_kubelet(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    liar = LyingAgent(agent)
    plugin = start_plugin(tmp_path, kubelet, liar.url)
    try:
        kubelet.next_registration()
        uuids = [d.ID for d in kubelet.wait_listing(lambda d: len(d) == 8)]
        twice = json.dumps({"gpus": [{"index": 7, "uuid": uuids[7]}, {"index": 7, "uuid": uuids[7]}]}).encode()
        liar.override["/place"] = (200, twice)
        got = preferred(kubelet, uuids, [], 2)
        assert len(got) == 2 == len(set(got)) and set(got) <= set(uuids), got
        liar.override["/place"] = (200, json.dumps({"gpus": [{"index": 0, "uuid": "GPU-not-offered"}, {"index": 1, "uuid": uuids[1]}]}).encode())
        got = preferred(kubelet, uuids[1:], [uuids[3]], 2)
        assert len(set(got)) == 2 and set(got) <= set(uuids[1:]) and uuids[3] in got, got
        env = allocate(kubelet, [uuids[2], uuids[5]])  # the lie names other GPUs: kubelet's own are used
        assert sorted(env["NVIDIA_VISIBLE_DEVICES"].split(",")) == sorted([uuids[2], uuids[5]])
        assert "NCCL_IB_HCA" not in env
        assert "event=agent_answer_refused" in plugin.log()
        for available, must, size in ((uuids, [], -5), (uuids, [], 0), (uuids[:3], [], 4), (uuids[:2] + uuids[:1], [], 2), (uuids[1:], [uuids[0]], 2)):
            with pytest.raises(grpc.RpcError) as refused:
                preferred(kubelet, available, must, size)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (size, refused.value.details())
        with pytest.raises(grpc.RpcError) as refused:
            preferred(kubelet, uuids, [], -5)
        assert "allocation_size -5" in refused.value.details()
        for ids, said in (([uuids[1], uuids[1]], "twice"), ([], "no devices")):
            with pytest.raises(grpc.RpcError) as refused:
                allocate(kubelet, ids)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and said in refused.value.details()
        assert plugin.proc.poll() is None
    finally:
        try:
            assert plugin.stop() == 0, plugin.log()
        finally:
            liar.close()


def test_help_does_not_import_grpc_and_a_bad_flag_exits_2() -> None:
    import subprocess
    import sys

    # Registering every subcommand (top-level help) must not import grpc.
    probe = "import sys; from topoagent.cli import build_parser; build_parser(); print('grpc' in sys.modules)"
    done = subprocess.run([sys.executable, "-P", "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "False", done.stderr
    bad = subprocess.run([sys.executable, "-P", "-m", "topoagent", "device-plugin", "--poll-interval", "0"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--poll-interval" in bad.stderr


def test_allocate_refuses_gpus_the_agent_holds_for_someone_else(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """A pod bound past the extender (an outage with ignorable: true, another scheduler)
    must not start on GPUs leased to a Slurm job or to a pod already running."""
    api = FakeApiServer()
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", "gpu-node-1"])
    try:
        kubelet.next_registration()
        uuids = [d.ID for d in kubelet.wait_listing(lambda d: len(d) == 8)]
        by_index = {g["index"]: g["uuid"] for g in agent.get("/topology").json()["gpus"]}
        lease_for(agent, [0], "slurm/job-42")
        running_uid = str(uuid.uuid4())
        lease_for(agent, [1], f"team-a/running/{running_uid}")  # its pod runs: not Pending here
        api.add_pod(gpu_pod("newcomer", 1))
        for index in (0, 1):
            with pytest.raises(grpc.RpcError) as refused:
                allocate(kubelet, [by_index[index]])
            assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "held by the agent's lease" in refused.value.details() and "not for a pod starting on this node" in refused.value.details()
        # A free GPU, and one leased to a pod Pending on this node (it may be this one), are allocated.
        assert allocate(kubelet, [by_index[2]])["NVIDIA_VISIBLE_DEVICES"] == by_index[2]
        own_uid = str(uuid.uuid4())
        lease_for(agent, [3], f"team-b/bound/{own_uid}")
        api.add_pod(gpu_pod("bound", 1, uid=own_uid))
        assert allocate(kubelet, [by_index[3]])["NVIDIA_VISIBLE_DEVICES"] == by_index[3]
        assert plugin.log().count("event=allocate_refused") == 2 and set(by_index.values()) == set(uuids)
    finally:
        assert plugin.stop() == 0, plugin.log()
        api.close()


# -- #40: what kubelet allocates is exactly what a lease holds, for exactly that pod -----------


def leasing_plugin(tmp_path: Path, kubelet: FakeKubelet, agent: Agent, api: FakeApiServer, *, agent_url: str | None = None,
                   resync_s: int = 2) -> PluginProcess:
    """The plugin as a cluster runs it: pods read from the API server, leases taken at Allocate."""
    return start_plugin(tmp_path, kubelet, agent_url or agent.url, extra=[
        "--kube-api", api.url, "--node-name", "gpu-node-1", "--agent-token-file", str(agent.token_file), "--pod-resync", str(resync_s)])


@contextmanager
def leasing(tmp_path: Path, kubelet: FakeKubelet, agent: Agent, *, through: LyingAgent | None = None,
            resync_s: int = 2) -> Iterator[tuple[FakeApiServer, PluginProcess, list[str]]]:
    """(API server, plugin, the 8 GPUs' UUIDs): ``leasing_plugin`` registered with kubelet and
    listing every GPU, asking the agent through ``through`` where given; after, the plugin
    stopped (it must exit 0), ``through`` and the API server closed."""
    api = FakeApiServer()
    try:
        plugin = leasing_plugin(tmp_path, kubelet, agent, api, agent_url=through.url if through else None, resync_s=resync_s)
        try:
            kubelet.next_registration()
            yield api, plugin, [d.ID for d in kubelet.wait_listing(lambda d: len(d) == 8)]
        finally:
            assert plugin.stop() == 0, plugin.log()
    finally:
        if through is not None:
            through.close()
        api.close()


def holders(agent: Agent) -> dict[str, str]:
    """Who the agent leases each GPU to, by UUID."""
    return {u: x["owner"] for x in agent.get("/leases").json()["leases"] for u in x["gpu_uuids"]}


def owner(pod: dict) -> str:
    meta = pod["metadata"]
    return f"{meta['namespace']}/{meta['name']}/{meta['uid']}"


def extender_bound(agent: Agent, name: str, gpus: list[str], indices: list[int], namespace: str = "team-a") -> dict:
    """A pending pod as the extender's bind leaves it: a lease on these GPUs, and the annotations naming it."""
    uid = str(uuid.uuid4())
    lease = lease_for(agent, indices, f"{namespace}/{name}/{uid}")
    return gpu_pod(name, len(indices), namespace, uid=uid, annotations={"topoagent.io/gpus": ",".join(gpus), "topoagent.io/lease": lease})


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_a_pod_bound_past_the_extender_is_never_put_on_another_pods_lease(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 scenario 1: pod x holds the extender's lease on GPUs 0,1; pod y (2 GPUs, bound past
    the extender) is admitted first.  kubelet does not say which pod it admits."""
    with leasing(tmp_path, kubelet, agent) as (api, plugin, uuids):
        x = extender_bound(agent, "x", [uuids[1], uuids[0]], [0, 1])
        api.add_pod(x)
        y = gpu_pod("y", 2)
        api.add_pod(y)
        got = preferred(kubelet, uuids, [], 2)
        assert not set(got) & {uuids[0], uuids[1]}, "y steered onto x's GPUs"
        assert "event=preferred_allocation_unattributed" in plugin.log()  # it says it cannot tell
        refused = refusal(lambda: allocate(kubelet, got))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot tell" in refused.details(), refused.details()
        assert holders(agent) == {uuids[0]: owner(x), uuids[1]: owner(x)}  # y's allocation is nobody's, x's lease untouched
        # kubelet fails y's admission; x is admitted next, onto its own GPUs in the extender's order.
        api.set_phase("y", "Failed", "team-b")
        assert preferred(kubelet, uuids, [], 2) == [uuids[1], uuids[0]]
        assert allocate(kubelet, [uuids[0], uuids[1]])["NVIDIA_VISIBLE_DEVICES"] == f"{uuids[1]},{uuids[0]}"
        # A pod bound past the extender, the only one kubelet can be admitting: leased before the answer.
        z = gpu_pod("z", 2)
        api.add_pod(z)
        got = preferred(kubelet, uuids[2:], [], 2)
        allocate(kubelet, got)
        assert holders(agent) == {uuids[0]: owner(x), uuids[1]: owner(x), got[0]: owner(z), got[1]: owner(z)}
        assert "allocation_not_leased" not in plugin.log()


def test_two_same_size_pods_run_on_the_gpus_their_leases_hold(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 scenario 2: two 1-GPU pods bound by the extender at once (leases on GPU 0 and 1).
    Preference and Allocate name the pod by the GPUs its lease holds; nothing is counted."""
    with leasing(tmp_path, kubelet, agent) as (api, plugin, uuids):
        a = extender_bound(agent, "a", [uuids[0]], [0])
        b = extender_bound(agent, "b", [uuids[1]], [1])
        api.add_pod(a)
        api.add_pod(b)
        first = preferred(kubelet, uuids, [], 1)
        assert first in ([uuids[0]], [uuids[1]]), first
        allocate(kubelet, first)
        second = preferred(kubelet, [u for u in uuids if u not in first], [], 1)
        assert sorted(first + second) == sorted(uuids[:2]), second
        allocate(kubelet, second)
        assert holders(agent) == {uuids[0]: owner(a), uuids[1]: owner(b)}  # no second lease, none idle
        for index in (0, 1):  # a Slurm job cannot take a GPU a pod runs on
            assert agent.post("/place", {"gpus": 1, "include": [index], "reserve": {"owner": "slurm/job-77", "ttl_s": 60}},
                              token=agent.token).status == 409
        assert "allocation_not_leased" not in plugin.log()
        # Two pods bound past the extender, same size: the plugin cannot tell which kubelet admits.
        c, d = gpu_pod("c", 1), gpu_pod("d", 1)
        api.add_pod(c)
        api.add_pod(d)
        got = preferred(kubelet, uuids[2:], [], 1)
        assert "event=preferred_allocation_unattributed" in plugin.log()
        refused = refusal(lambda: allocate(kubelet, got))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "cannot tell" in refused.details()
        assert holders(agent) == {uuids[0]: owner(a), uuids[1]: owner(b)}


def test_allocate_leases_before_it_answers_and_a_reserver_in_between_wins(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 scenario 3: a Slurm job reserves the GPU right after the plugin read who holds
    what; Allocate must not answer success with the GPU leased to the job."""
    liar = LyingAgent(agent)
    with leasing(tmp_path, kubelet, agent, through=liar, resync_s=3600) as (api, plugin, uuids):
        wait_for("the pod watch's first resync", lambda: liar.asked.get("/leases", 0) >= 1, log=plugin.log)
        api.add_pod(gpu_pod("y", 1))
        liar.after["/leases"] = lambda: lease_for(agent, [2], "slurm/job-77")
        refused = refusal(lambda: allocate(kubelet, [uuids[2]]))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "slurm/job-77" in refused.details(), refused.details()
        assert not liar.after  # the reserve did come in between
        assert holders(agent) == {uuids[2]: "slurm/job-77"}
        assert "allocation_not_leased" not in plugin.log()


def test_a_pods_own_lease_gives_it_its_nics(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 scenario 4: the GPUs leased to the very pod being allocated are no conflict."""
    with leasing(tmp_path, kubelet, agent) as (api, _, uuids):
        x = extender_bound(agent, "x", [uuids[0], uuids[3]], [0, 3])
        api.add_pod(x)
        lease = x["metadata"]["annotations"]["topoagent.io/lease"]
        assert agent.post("/place", {"gpus": 2, "include": [0, 3], "detail": ["bindings"]}).status == 409  # leased: to anyone else
        own = agent.post("/place", {"gpus": 2, "include": [0, 3], "detail": ["bindings"], "lease": lease})
        assert own.status == 200, own.text
        nics = {g["uuid"]: g["nearest_nics"][0] for g in own.json()["gpus"]}
        reserve = {"owner": "me", "ttl_s": 60}
        for bad in ({"gpus": 1, "lease": "not an id!"}, {"gpus": 1, "lease": lease, "reserve": reserve}):
            assert agent.post("/place", bad, token=agent.token).status == 400, bad  # a dry run's field, a lease id
        env = allocate(kubelet, [uuids[3], uuids[0]])
        assert env["NVIDIA_VISIBLE_DEVICES"] == f"{uuids[0]},{uuids[3]}"
        assert env["NCCL_IB_HCA"] == f"={nics[uuids[0]]},{nics[uuids[3]]}"
        # A pod bound past the extender gets its NICs from the lease taken for it.
        z = gpu_pod("z", 2)
        api.add_pod(z)
        env = allocate(kubelet, [uuids[5], uuids[6]])
        assert holders(agent)[uuids[5]] == owner(z) and env["NCCL_IB_HCA"].startswith("=")
        assert len(env["NCCL_IB_HCA"].removeprefix("=").split(",")) == 2


def test_allocate_fails_closed_when_the_agent_or_the_pods_cannot_be_read(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 scenario 6: an answer the plugin cannot read refuses Allocate, with the reason,
    within the plugin's own bound (5 s), never lets a GPU through unchecked."""
    liar = LyingAgent(agent)
    with leasing(tmp_path, kubelet, agent, through=liar, resync_s=3600) as (api, plugin, uuids):
        wait_for("the pod watch's first resync", lambda: liar.asked.get("/leases", 0) >= 1, log=plugin.log)
        lease_for(agent, [0], "slurm/job-42")
        api.add_pod(gpu_pod("y", 1))
        for status, body in ((500, b'{"error": "internal"}'), (200, b"not json"), (200, b'{"leases": 5}')):
            liar.override["/leases"] = (status, body)
            for ids in ([uuids[0]], [uuids[3]]):
                refused = refusal(lambda ids=ids: allocate(kubelet, ids))
                assert refused.code() == grpc.StatusCode.UNAVAILABLE and "GET /leases" in refused.details(), refused.details()
        del liar.override["/leases"]
        liar.hang.add("/leases")
        refused = refusal(lambda: allocate(kubelet, [uuids[3]]))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "within 5 s" in refused.details(), refused.details()
        liar.hang.clear()
        api.hold_pod_lists = threading.Event()
        try:
            refused = refusal(lambda: allocate(kubelet, [uuids[3]]))
        finally:
            api.hold_pod_lists.set()
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "pods" in refused.details(), refused.details()
        assert holders(agent) == {uuids[0]: "slurm/job-42"}  # nothing let through, nothing leased
        allocate(kubelet, [uuids[3]])  # all readable again: y gets its GPU, under its lease
        assert holders(agent)[uuids[3]].startswith("team-b/y/")


def test_a_refused_allocate_leaves_no_lease_and_two_containers_never_share_a_gpu(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 item 7: one Allocate for a pod of two 1-GPU containers, the second on a GPU a
    Slurm job holds: refused whole, the first container's lease given back."""
    with leasing(tmp_path, kubelet, agent) as (api, _, uuids):
        lease_for(agent, [0], "slurm/job-42")
        pair = gpu_pod("pair", 1)
        pair["spec"]["containers"].append({"name": "side", "resources": {"limits": {"nvidia.com/gpu": "1"}}})
        api.add_pod(pair)

        def both(first: str, second: str) -> dict:
            containers = [api_pb2.ContainerAllocateRequest(devices_ids=[d]) for d in (first, second)]
            return kubelet.plugin().Allocate(api_pb2.AllocateRequest(container_requests=containers), timeout=30)

        refused = refusal(lambda: both(uuids[2], uuids[0]))
        assert refused.code() == grpc.StatusCode.FAILED_PRECONDITION and "slurm/job-42" in refused.details(), refused.details()
        assert holders(agent) == {uuids[0]: "slurm/job-42"}  # GPU 2's lease, taken for the first container, is gone
        refused = refusal(lambda: both(uuids[3], uuids[3]))
        assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT and "two containers" in refused.details()
        reply = both(uuids[3], uuids[4])  # the pod's two containers, each its own GPU, each under the pod's lease
        assert [c.envs["NVIDIA_VISIBLE_DEVICES"] for c in reply.container_responses] == [uuids[3], uuids[4]]
        assert holders(agent) == {uuids[0]: "slurm/job-42", uuids[3]: owner(pair), uuids[4]: owner(pair)}


def test_no_gpu_runs_a_pod_while_leased_to_another_owner_or_to_no_one(tmp_path: Path, kubelet: FakeKubelet) -> None:
    """#40, done when: a mixed stream of extender-bound, unannotated and same-size pods, pods
    ending, and a Slurm job reserving and releasing GPUs beside them; a watcher checks that
    every GPU a started pod runs on is leased to that pod the whole time.  kubelet is played as
    it admits: one pod at a time, oldest first, offering the GPUs it has not allocated; a
    refused admission fails the pod.  Its own agent: every caller here shares one loopback
    address, more changes a second than the default rate limit lets through."""
    agent = start_agent(tmp_path, config="[http]\nrate_limit_per_s = 1000\nrate_limit_burst = 10000\n")
    api = FakeApiServer()
    plugin = leasing_plugin(tmp_path, kubelet, agent, api)
    rng = random.Random(40)
    running: dict[str, tuple[dict, list[str]]] = {}  # pod name -> (pod, its GPUs), set only after Allocate answered
    lock = threading.Lock()
    violations: list[str] = []
    done = threading.Event()

    def check() -> None:
        with lock:
            table = {name: (owner(pod), gpus) for name, (pod, gpus) in running.items()}
        held = holders(agent)
        with lock:  # a pod ended meanwhile is no longer the test's to check
            table = {name: row for name, row in table.items() if name in running}
        for name, (who, gpus) in table.items():
            for gpu in gpus:
                if held.get(gpu) != who:
                    violations.append(f"{name} runs on {gpu[-8:]}, leased to {held.get(gpu)}")

    def watcher() -> None:
        while not done.is_set():
            check()
            done.wait(0.05)

    slurm_grants = []

    def slurm() -> None:
        job = 0
        while not done.is_set():
            job += 1
            reply = agent.post("/place", {"gpus": 1, "include": [rng.randrange(8)], "reserve": {"owner": f"slurm/job-{job}", "ttl_s": 60}},
                               token=agent.token)
            if reply.status == 200:
                slurm_grants.append(job)
                done.wait(0.1)
                agent.request("DELETE", f"/leases/{reply.json()['lease']['id']}", token=agent.token)
            done.wait(0.05)

    try:
        kubelet.next_registration()
        uuids = [d.ID for d in kubelet.wait_listing(lambda d: len(d) == 8)]
        threads = [threading.Thread(target=watcher, daemon=True), threading.Thread(target=slurm, daemon=True)]
        for t in threads:
            t.start()
        started = {"extender": 0, "unannotated": 0}
        refused_count = 0
        clock = 0
        for _round in range(30):
            # New pods, bound to this node at about the same time.
            batch = []
            for _ in range(rng.randint(1, 3)):
                clock += 1
                size, name = rng.choice((1, 1, 2)), f"p{clock}"
                created = f"2026-12-04T20:{clock // 60:02d}:{clock % 60:02d}Z"
                if rng.random() < 0.6:  # the extender's bind: a lease first, then the annotations
                    uid = str(uuid.uuid4())
                    reply = agent.post("/place", {"gpus": size, "reserve": {"owner": f"team-a/{name}/{uid}", "ttl_s": 600}}, token=agent.token)
                    if reply.status != 200:
                        continue  # no room on this node: the extender binds it elsewhere
                    lease = reply.json()["lease"]
                    pod = gpu_pod(name, size, "team-a", uid=uid, annotations={
                        "topoagent.io/gpus": ",".join(g["uuid"] for g in reply.json()["gpus"]), "topoagent.io/lease": lease["id"]})
                    kind = "extender"
                else:
                    pod, kind = gpu_pod(name, size, "team-a"), "unannotated"
                pod["metadata"]["creationTimestamp"] = created
                api.add_pod(pod)
                batch.append((pod, kind))
            for pod, kind in batch:  # kubelet admits them one at a time, oldest first
                size = int(pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"])
                with lock:
                    allocated = {g for _, gpus in running.values() for g in gpus}
                offered = [u for u in uuids if u not in allocated]
                name = pod["metadata"]["name"]
                try:
                    if len(offered) < size:
                        raise LookupError("no room")
                    ids = preferred(kubelet, offered, [], size)
                    env = allocate(kubelet, ids)
                except (grpc.RpcError, LookupError):
                    refused_count += 1
                    api.set_phase(name, "Failed", "team-a")  # kubelet rejects the pod
                    continue
                with lock:
                    running[name] = (pod, env["NVIDIA_VISIBLE_DEVICES"].split(","))
                started[kind] += 1
                api.set_phase(name, "Running", "team-a")
                check()
            # Some pods end: the test stops counting them first, then kubelet reports the end.
            with lock:
                ending = [n for n in running if rng.random() < 0.4]
                for n in ending:
                    del running[n]
            for n in ending:
                if rng.random() < 0.5:
                    api.set_phase(n, "Succeeded", "team-a")
                else:
                    api.delete_pod(n, "team-a")
        done.set()
        for t in threads:
            t.join(timeout=30)
        check()
        assert not violations, violations[:10]
        assert started["extender"] >= 5 and started["unannotated"] >= 2 and slurm_grants, (started, len(slurm_grants))
        print(f"device plugin watcher: started {started}, refused {refused_count}, slurm leases {len(slurm_grants)}")
    finally:
        done.set()
        try:
            stop(agent, plugin)
        finally:
            api.close()


def test_a_finding_flapping_every_poll_moves_no_gpu_health(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 item 7: a critical finding on GPU2 that comes and goes at every poll sends kubelet
    nothing; one that holds (3 polls) marks GPU2 Unhealthy."""
    liar = LyingAgent(agent)
    plugin = start_plugin(tmp_path, kubelet, liar.url)
    try:
        kubelet.next_registration()
        devices = kubelet.wait_listing(lambda d: len(d) == 8 and {x.health for x in d} == {"Healthy"})
        well = agent.get("/topology").json()
        sick = {**well, "findings": [*well["findings"], {"severity": "critical", "kind": "gpu-outside-fabric", "subject": "GPU2",
                                                       "message": "GPU2 has no active NVLink"}]}
        well_body, sick_body = json.dumps(well).encode(), json.dumps(sick).encode()
        liar.cycle["/topology"] = [(200, sick_body), (200, well_body)]
        asked = liar.asked.get("/topology", 0)
        wait_for("40 polls of a flapping finding", lambda: liar.asked.get("/topology", 0) >= asked + 40, log=plugin.log)
        liar.cycle["/topology"] = [(200, well_body)]
        asked = liar.asked.get("/topology", 0)
        wait_for("the plugin to poll the steady answer", lambda: liar.asked.get("/topology", 0) >= asked + 3, log=plugin.log)
        assert kubelet.listings.empty(), "a flapping finding reached kubelet"
        liar.cycle["/topology"] = [(200, sick_body)]
        sick_listing = kubelet.wait_listing(lambda d: {x.ID: x.health for x in d}.get(devices[2].ID) == "Unhealthy")
        assert [d.ID for d in sick_listing if d.health == "Unhealthy"] == [devices[2].ID]
    finally:
        try:
            assert plugin.stop() == 0, plugin.log()
        finally:
            liar.close()


def test_a_lease_the_agent_answers_is_checked_against_the_gpus_kubelet_allocated(tmp_path: Path, kubelet: FakeKubelet, agent: Agent) -> None:
    """#40 item 5: a reserve answered with a lease on other GPUs than kubelet allocated is no
    lease for this allocation: refused, never answered success."""
    liar = LyingAgent(agent)
    with leasing(tmp_path, kubelet, agent, through=liar) as (api, _, uuids):
        api.add_pod(gpu_pod("y", 1))
        other = {"gpus": [{"index": 4, "uuid": uuids[4]}], "lease": {"id": "lease-elsewhere", "owner": "team-b/y", "gpus": [4],
                                                                      "gpu_uuids": [uuids[4]]}}
        liar.override["/place"] = (200, json.dumps(other).encode())
        refused = refusal(lambda: allocate(kubelet, [uuids[3]]))
        assert refused.code() == grpc.StatusCode.UNAVAILABLE and "not the GPUs kubelet allocated" in refused.details(), refused.details()
        assert liar.asked.get("/leases/lease-elsewhere") == 1  # what it was given is given back
        del liar.override["/place"]
        allocate(kubelet, [uuids[3]])
        assert holders(agent)[uuids[3]].startswith("team-b/y/")
