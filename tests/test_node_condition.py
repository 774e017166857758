"""`topoagent device-plugin --node-condition [--taint-on-critical ...]`: the node's health on its
Node object, node-problem-detector's form, against the fake API server (tests/fake_apiserver.py)
and a real agent whose recorded GPU falls off the NVSwitch fabric and comes back."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_apiserver import FakeApiServer
from fake_kubelet import FakeKubelet, start_plugin
from service_helpers import make_root, start_agent, wait_for
from test_device_plugin import set_gpu_links

from topoagent.cluster.deviceplugin.node import Taint, camel, node_health, parse_taint, retainted

NODE = "gpu-node-1"
TAINT = "topoagent.io/unhealthy=true:NoSchedule"
ADMINS = {"key": "dedicated", "value": "ml-team", "effect": "NoSchedule"}


def test_a_critical_finding_reads_as_a_false_condition_in_kubernetes_words():
    doc = {"findings": [{"severity": "warning", "kind": "nvlink-down", "message": "one link"},
                        {"severity": "critical", "kind": "gpu-outside-fabric", "message": "GPU2 has no active NVLink"},
                        {"severity": "critical", "kind": "no-gpus", "message": "x"}]}
    sick = node_health(doc)
    assert (sick.status, sick.reason) == ("False", "GpuOutsideFabric")
    assert sick.message == "gpu-outside-fabric (+1 more): GPU2 has no active NVLink"
    assert node_health({"findings": doc["findings"][:1]}).status == "True"
    assert len(node_health({"findings": [{"severity": "critical", "kind": "k", "message": "m" * 5000}]}).message) == 1024
    assert camel("gpu-stack-missing") == "GpuStackMissing" and camel("--") == "CriticalFinding"
    forged = node_health({"findings": [{"severity": "critical", "kind": "k\x1b[31m", "message": "bad\x00\r\nReady=True\x7f\u2028x"}]})
    assert forged.message.isprintable() and forged.message == "k [31m: bad Ready=True x"  # #40: no control reaches the Node


def test_taints_are_read_as_kubectl_writes_them_and_refused_in_words():
    assert parse_taint(TAINT) == Taint("topoagent.io/unhealthy", "true", "NoSchedule")
    assert parse_taint("gpu-sick:NoExecute") == Taint("gpu-sick", "", "NoExecute")
    for bad, said in (("a=b", "EFFECT one of"), ("a=b:Sometimes", "EFFECT one of"), ("a b=c:NoSchedule", "label key"),
                      ("a=b c:NoSchedule", "label value")):
        with pytest.raises(ValueError, match=said):
            parse_taint(bad)


def test_only_our_taint_is_added_or_removed():
    ours = parse_taint(TAINT)
    assert retainted([ADMINS], ours, True) == [ADMINS, ours.document()]
    assert retainted([ADMINS, ours.document()], ours, True) is None
    assert retainted([ADMINS, ours.document()], ours, False) == [ADMINS]
    assert retainted([ADMINS], ours, False) is None and retainted(None, ours, False) is None


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    k = FakeKubelet()
    k.start()
    yield k
    k.close()


def condition(api: FakeApiServer) -> dict:
    return next((c for c in api.node(NODE).get("status", {}).get("conditions", []) if c["type"] == "TopoagentHealthy"), {})


def taints(api: FakeApiServer) -> list[dict]:
    return api.node(NODE).get("spec", {}).get("taints", [])


def test_the_condition_and_taint_follow_a_critical_finding_and_its_end(tmp_path: Path, kubelet: FakeKubelet) -> None:
    root = make_root(tmp_path)
    api = FakeApiServer(nodes=[{"metadata": {"name": NODE}, "spec": {}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}])
    api.taint_node(NODE, ADMINS)
    agent = start_agent(tmp_path, root=root)
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", NODE, "--node-condition",
                                                                "--taint-on-critical", TAINT])
    try:
        well = wait_for("TopoagentHealthy=True", lambda: condition(api).get("status") == "True" and condition(api), log=plugin.log)
        assert well["reason"] == "NoCriticalFinding" and well["lastTransitionTime"] and well["lastHeartbeatTime"]
        assert taints(api) == [ADMINS] and {c["type"] for c in api.node(NODE)["status"]["conditions"]} == {"Ready", "TopoagentHealthy"}

        set_gpu_links(root, 2, False)  # every NVLink of GPU2 down: off the NVSwitch fabric, critical
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        sick = wait_for("TopoagentHealthy=False", lambda: condition(api).get("status") == "False" and condition(api), log=plugin.log)
        critical = [f for f in agent.get("/topology").json()["findings"] if f["severity"] == "critical"]
        assert "gpu-outside-fabric" in {f["kind"] for f in critical}
        first, more = critical[0], f" (+{len(critical) - 1} more)" if len(critical) > 1 else ""
        assert sick["reason"] == camel(first["kind"]) and sick["message"] == f"{first['kind']}{more}: {first['message']}", sick
        wait_for("our taint beside the admin's", lambda: taints(api) == [ADMINS, {"key": "topoagent.io/unhealthy", "value": "true", "effect": "NoSchedule"}],
                 log=plugin.log)
        assert {c["type"] for c in api.node(NODE)["status"]["conditions"]} == {"Ready", "TopoagentHealthy"}  # merged by type

        set_gpu_links(root, 2, True)
        assert agent.post("/refresh", token=agent.token).status in (200, 202)
        back = wait_for("TopoagentHealthy=True again", lambda: condition(api).get("status") == "True" and condition(api), log=plugin.log)
        wait_for("our taint gone, the admin's kept", lambda: taints(api) == [ADMINS], log=plugin.log)
        assert back["lastTransitionTime"] >= sick["lastTransitionTime"] >= well["lastTransitionTime"]
        # Status writes go to the status subresource; only the taint touches the Node itself.
        assert {path for path, _, _ in api.node_patches} == {f"/api/v1/nodes/{NODE}/status", f"/api/v1/nodes/{NODE}"}
        assert all(set(body) == {"metadata", "spec"} for path, _, body in api.node_patches if not path.endswith("/status"))

        agent.stop()  # a stopped agent: the node's health is not known, and the taint is left as it is
        gone = wait_for("TopoagentHealthy=Unknown", lambda: condition(api).get("status") == "Unknown" and condition(api), log=plugin.log)
        assert gone["reason"] == "AgentUnreachable" and taints(api) == [ADMINS]
    finally:
        try:
            assert plugin.stop() == 0, plugin.log()
        finally:
            agent.stop()
            api.close()


def test_a_node_whose_gpus_no_driver_sees_is_marked_though_kubelet_is_offered_none(tmp_path: Path, kubelet: FakeKubelet) -> None:
    """no-gpu-stack: 8 GPUs on the bus, neither NVML nor nvidia-smi: no UUID to offer kubelet,
    and exactly then the node must say why."""
    from conftest import FIXTURES

    api = FakeApiServer(nodes=[{"metadata": {"name": NODE}}])
    agent = start_agent(tmp_path, root=FIXTURES / "snapshots" / "no-gpu-stack")
    plugin = start_plugin(tmp_path, kubelet, agent.url, extra=["--kube-api", api.url, "--node-name", NODE, "--node-condition"])
    try:
        sick = wait_for("TopoagentHealthy=False", lambda: condition(api).get("status") == "False" and condition(api), log=plugin.log)
        assert sick["reason"] == "GpuStackMissing" and "neither NVML nor nvidia-smi" in sick["message"]
        assert taints(api) == [] and all(path.endswith("/status") for path, _, _ in api.node_patches)  # no taint asked
    finally:
        try:
            assert plugin.stop() == 0, plugin.log()
        finally:
            agent.stop()
            api.close()


@pytest.mark.parametrize(("extra", "said"), [
    (["--node-condition", "--kube-api", "off", "--node-name", NODE], "--node-condition needs a Kubernetes API"),
    (["--node-condition", "--kube-api", "http://127.0.0.1:9"], "--node-condition needs --node-name"),
    (["--taint-on-critical", TAINT, "--kube-api", "off"], "--taint-on-critical needs --node-condition"),
    (["--node-condition", "--taint-on-critical", "x=y", "--kube-api", "off"], "EFFECT one of"),
])
def test_a_node_condition_without_what_it_needs_is_a_usage_error(extra: list[str], said: str) -> None:
    env = {"PATH": "/usr/bin:/bin"}
    import os

    env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "device-plugin", *extra], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 2 and said in done.stderr and "Traceback" not in done.stderr, done.stderr
