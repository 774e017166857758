"""Which nodes the node DaemonSet lands on: its node affinity and tolerations, evaluated
against Node objects labelled (and tainted) the ways clusters label GPU nodes.

The matching is kube-scheduler's, in small: a pod fits a node when some nodeSelectorTerm has
every one of its matchExpressions true of the node's labels, and every NoSchedule/NoExecute
taint of the node is tolerated (k8s.io/component-helpers/scheduling/corev1 and the taint
toleration plugin, as documented under "Assigning Pods to Nodes" and "Taints and Tolerations").
"""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml
from conftest import REPO

DEPLOY = REPO / "deploy" / "kubernetes"
(DAEMONSET,) = [d for d in yaml.safe_load_all((DEPLOY / "node.yaml").read_text()) if d and d["kind"] == "DaemonSet"]
POD = DAEMONSET["spec"]["template"]["spec"]


def expression_holds(expression: dict, labels: dict[str, str]) -> bool:
    key, operator, values = expression["key"], expression["operator"], expression.get("values", [])
    if operator == "In":
        return key in labels and labels[key] in values
    if operator == "NotIn":
        return key not in labels or labels[key] not in values
    if operator == "Exists":
        return key in labels
    if operator == "DoesNotExist":
        return key not in labels
    raise ValueError(f"operator {operator!r} is not matched by this helper")


def term_holds(term: dict, labels: dict[str, str]) -> bool:
    if "matchFields" in term:
        raise ValueError("matchFields is not matched by this helper")
    # An empty term selects nothing (kube-scheduler: "a null or empty term matches no objects").
    expressions = term.get("matchExpressions", [])
    return bool(expressions) and all(expression_holds(e, labels) for e in expressions)


def tolerated(taint: dict, tolerations: list[dict]) -> bool:
    for toleration in tolerations:
        if toleration.get("effect") and toleration["effect"] != taint["effect"]:
            continue
        if toleration.get("operator", "Equal") == "Exists":
            if not toleration.get("key") or toleration["key"] == taint["key"]:
                return True
        elif toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", ""):
            return True
    return False


def lands_on(pod: dict, node: dict) -> bool:
    labels = node["metadata"].get("labels", {})
    if any(labels.get(k) != v for k, v in pod.get("nodeSelector", {}).items()):
        return False
    required = pod.get("affinity", {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    if required is not None and not any(term_holds(t, labels) for t in required["nodeSelectorTerms"]):
        return False
    taints = [t for t in node.get("spec", {}).get("taints", []) if t["effect"] in ("NoSchedule", "NoExecute")]
    return all(tolerated(t, pod.get("tolerations", [])) for t in taints)


def node(name: str, labels: dict[str, str], taints: list[dict] | None = None) -> dict:
    obj = {"apiVersion": "v1", "kind": "Node",
           "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux", **labels}},
           "spec": {"taints": taints or []}}
    kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)  # a real Node object
    return obj


NFD = {"feature.node.kubernetes.io/pci-10de.present": "true"}
GPU_OPERATOR = {"nvidia.com/gpu.present": "true"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


@pytest.mark.parametrize(("name", "labels", "taints", "selected"), [
    ("nfd-labelled", NFD, None, True),
    ("gpu-operator-labelled", GPU_OPERATOR, None, True),
    ("labelled-both-ways", {**NFD, **GPU_OPERATOR}, None, True),
    ("gpu-node-tainted-for-gpu-work", GPU_OPERATOR, [GPU_TAINT], True),
    ("critical-addons-only", NFD, [{"key": "CriticalAddonsOnly", "value": "true", "effect": "NoSchedule"}], True),
    ("unlabelled", {}, None, False),
    ("gpu-operator-says-no-gpu", {"nvidia.com/gpu.present": "false"}, None, False),
    ("nfd-says-no-nvidia", {"feature.node.kubernetes.io/pci-10de.present": "false"}, None, False),
    ("cpu-node-with-other-nfd-labels", {"feature.node.kubernetes.io/pci-8086.present": "true"}, None, False),
    ("gpu-node-kept-for-another-team", NFD, [{"key": "dedicated", "value": "infra", "effect": "NoSchedule"}], False),
])
def test_the_daemonset_lands_on_gpu_nodes_labelled_either_way_and_nowhere_else(name, labels, taints, selected) -> None:
    assert lands_on(POD, node(name, labels, taints)) is selected


def test_the_helper_matches_each_operator_it_claims() -> None:
    labels = {"a": "1"}
    assert expression_holds({"key": "a", "operator": "In", "values": ["1", "2"]}, labels)
    assert not expression_holds({"key": "b", "operator": "In", "values": ["1"]}, labels)
    assert expression_holds({"key": "a", "operator": "NotIn", "values": ["2"]}, labels)
    assert expression_holds({"key": "b", "operator": "NotIn", "values": ["1"]}, labels)
    assert not expression_holds({"key": "a", "operator": "NotIn", "values": ["1"]}, labels)
    assert expression_holds({"key": "a", "operator": "Exists"}, labels)
    assert not expression_holds({"key": "b", "operator": "Exists"}, labels)
    assert expression_holds({"key": "b", "operator": "DoesNotExist"}, labels)
    assert not expression_holds({"key": "a", "operator": "DoesNotExist"}, labels)
    assert not term_holds({}, labels) and not term_holds({"matchExpressions": []}, labels)
    with pytest.raises(ValueError, match="Gt"):
        expression_holds({"key": "a", "operator": "Gt", "values": ["0"]}, labels)


def test_the_node_pod_tolerates_what_nvidias_device_plugin_chart_tolerates() -> None:
    tolerations = {(t["key"], t["operator"], t.get("effect")) for t in POD["tolerations"]}
    assert tolerations == {("nvidia.com/gpu", "Exists", "NoSchedule"), ("CriticalAddonsOnly", "Exists", None)}
    assert "nodeSelector" not in POD  # one place selects the nodes: the affinity's terms


def test_the_image_is_named_once_in_the_kustomization_and_every_container_is_rewritten_by_it() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    objects = sorted(p.name for p in DEPLOY.glob("*.yaml") if p.name not in ("kustomization.yaml", "kube-scheduler-config.yaml"))
    assert sorted(kustomization["resources"]) == objects
    (image,) = kustomization["images"]
    named = f"{image['newName']}:{image['newTag']}"
    for path in objects:
        for doc in yaml.safe_load_all((DEPLOY / path).read_text()):
            spec = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                # kustomize matches by name (the part before the tag); as applied without it,
                # each says what the kustomization names.
                assert container["image"].rsplit(":", 1)[0] == image["name"], (path, container["name"])
                assert container["image"] == named, (path, container["name"])
