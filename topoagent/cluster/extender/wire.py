"""The scheduler extender API's documents, and what a pod asks for.

The documents are those of ``k8s.io/kube-scheduler/extender/v1`` (types.go).  Its structs
carry no JSON tags, so kube-scheduler writes the Go field names as they are (``Pod``,
``Nodes``, ``NodeNames``, ``FailedNodes``, ``FailedAndUnresolvableNodes``, ``Error``,
``Host``, ``Score``, ``PodName``, ``PodNamespace``, ``PodUID``, ``Node``) and reads ours
the way Go's decoder does, matching names without regard to case: we write the exact
names and read them the same tolerant way.  The pod and the nodes inside are the core v1
objects, with their usual lower-case JSON names.

With ``nodeCacheCapable: true`` kube-scheduler sends node names only (``NodeNames``) and
reads the names back; otherwise it sends whole Node objects (``Nodes.items``) and reads
the objects back.  We answer in the form we were asked in.

A pod's request: its GPU count from its containers' limits of the managed resource
(default ``nvidia.com/gpu``; requests when no limit is set), and its wishes from
annotations, read through the agent's own request parser so the extender accepts
exactly the agent's words and says the same errors.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from topoagent.placement.request import REQUEST_LIMITS, RequestError, parse_request
from topoagent.text import quoted
from topoagent.vocabulary import GPU_RESOURCE

MAX_EXTENDER_PRIORITY = 10  # extenderv1.MaxExtenderPriority (MinExtenderPriority is 0)
DEFAULT_RESOURCE = GPU_RESOURCE

# Annotation -> the request field it sets.  Values are the agent's words: "allreduce",
# "best", "NV2", "true".
WISHES = {
    "topoagent.io/pattern": "pattern",
    "topoagent.io/affinity": "affinity",
    "topoagent.io/min-level": "min_level",
    "topoagent.io/single-numa": "single_numa",
}
# Written by the extender's bind beside topoagent.io/gpus: the agent's lease that holds
# the pod's GPUs, so whoever ends the pod's job can release it (DELETE /leases/{id}).
LEASE_ANNOTATION = "topoagent.io/lease"

# A node name goes into the agent's URL: only what Kubernetes allows in one (a DNS-1123
# subdomain) may, so no name can point the extender at another path or host.
NODE_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")
HOST_NAME = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9.]{0,251}[A-Za-z0-9])?")


# An int64, as the API server stores a quantity's value: 19 digits at most.
MAX_QUANTITY_DIGITS = 19


class WireError(ValueError):
    """The document is not what kube-scheduler sends: HTTP 400."""


class PodError(ValueError):
    """The pod asks for something no node can give (a bad annotation, a bad quantity):
    every node fails with this message, and preemption would not help."""


def _object(doc: Mapping[str, Any], key: str) -> dict[str, Any]:
    """``doc[key]`` when it is a JSON object, else an empty one."""
    value = doc.get(key)
    return value if isinstance(value, dict) else {}


def field(doc: Mapping[str, Any], name: str) -> Any:
    """``doc[name]``, matched as Go's encoding/json matches it (case-insensitively)."""
    if name in doc:
        return doc[name]
    folded = name.casefold()
    for key, value in doc.items():
        if isinstance(key, str) and key.casefold() == folded:
            return value
    return None


@dataclass(frozen=True, slots=True)
class Candidate:
    name: str
    address: str | None  # the Node's InternalIP (else ExternalIP, else Hostname), when sent
    node: dict[str, Any] | None  # the Node object as sent, echoed back when it passes


@dataclass(frozen=True, slots=True)
class ExtenderArgs:
    pod: dict[str, Any]
    candidates: tuple[Candidate, ...]
    by_name: bool  # nodeCacheCapable: names in, names out


def parse_extender_args(doc: Any, max_nodes: int | None = None) -> ExtenderArgs:
    """The arguments; WireError past ``max_nodes`` candidates, counted before any is read."""
    if not isinstance(doc, dict):
        raise WireError("body: expected ExtenderArgs, a JSON object with Pod and Nodes or NodeNames")
    pod = field(doc, "Pod")
    if not isinstance(pod, dict):
        raise WireError("Pod: expected a Pod object")
    names, nodes = field(doc, "NodeNames"), field(doc, "Nodes")
    if max_nodes is not None:
        items = nodes.get("items") if isinstance(nodes, dict) else None
        given = names if isinstance(names, list) else items if isinstance(items, list) else []
        if len(given) > max_nodes:
            raise WireError(f"{len(given)} candidate nodes, more than --max-nodes {max_nodes}: kube-scheduler "
                            "sends only the nodes that passed its own filters")
    if names is not None:
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            raise WireError("NodeNames: expected a list of node names")
        return ExtenderArgs(pod, tuple(Candidate(n, None, None) for n in names), by_name=True)
    if nodes is None:
        raise WireError("expected Nodes (nodeCacheCapable: false) or NodeNames (nodeCacheCapable: true)")
    items = nodes.get("items") if isinstance(nodes, dict) else None
    if not isinstance(items, list) or not all(isinstance(n, dict) for n in items):
        raise WireError("Nodes: expected a NodeList with items")
    candidates = []
    for n, node in enumerate(items):
        name = _object(node, "metadata").get("name")
        if not isinstance(name, str):
            raise WireError(f"Nodes.items[{n}].metadata.name: expected a string")
        candidates.append(Candidate(name, node_address(node), node))
    return ExtenderArgs(pod, tuple(candidates), by_name=False)


def node_address(node: Mapping[str, Any]) -> str | None:
    """The address to reach the node's agent at: InternalIP, else ExternalIP, else Hostname."""
    status = node.get("status")
    addresses = status.get("addresses") if isinstance(status, dict) else None
    if not isinstance(addresses, list):
        return None
    # Entries of another shape (a type that is no string, an address that is none) are
    # skipped: one malformed Node must cost that node its address, never the whole call.
    usable = [(a["type"], a["address"]) for a in addresses
              if isinstance(a, dict) and isinstance(a.get("type"), str) and isinstance(a.get("address"), str)
              and usable_host(a["address"])]
    for kind in ("InternalIP", "ExternalIP", "Hostname"):
        for type_, address in usable:  # the first of a kind, as kubelet lists its primary first
            if type_ == kind:
                return address
    return None


def usable_host(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return HOST_NAME.fullmatch(text) is not None
    return True


def filter_result(args: ExtenderArgs, passed: list[str], failed: Mapping[str, str], unresolvable: Mapping[str, str]) -> dict[str, Any]:
    """ExtenderFilterResult, in the form the arguments came in."""
    keep = set(passed)
    out: dict[str, Any] = {"Nodes": None, "NodeNames": None}
    if args.by_name:
        out["NodeNames"] = [c.name for c in args.candidates if c.name in keep]
    else:
        out["Nodes"] = {"apiVersion": "v1", "kind": "NodeList", "metadata": {},
                        "items": [c.node for c in args.candidates if c.name in keep]}
    out["FailedNodes"] = dict(failed)
    out["FailedAndUnresolvableNodes"] = dict(unresolvable)
    out["Error"] = ""
    return out


def filter_error(message: str) -> dict[str, Any]:
    return {"Nodes": None, "NodeNames": None, "FailedNodes": {}, "FailedAndUnresolvableNodes": {}, "Error": message}


def host_priorities(scores: Mapping[str, int]) -> list[dict[str, Any]]:
    """HostPriorityList."""
    return [{"Host": host, "Score": score} for host, score in scores.items()]


@dataclass(frozen=True, slots=True)
class BindingArgs:
    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def parse_binding_args(doc: Any) -> BindingArgs:
    if not isinstance(doc, dict):
        raise WireError("body: expected ExtenderBindingArgs, a JSON object")
    values = {}
    for name in ("PodName", "PodNamespace", "PodUID", "Node"):
        value = field(doc, name)
        if not isinstance(value, str) or not value:
            raise WireError(f"{name}: expected a non-empty string")
        values[name] = value
    return BindingArgs(values["PodName"], values["PodNamespace"], values["PodUID"], values["Node"])


# --- the pod's request ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodRef:
    namespace: str
    name: str
    uid: str

    def owner(self, limit: int) -> str:
        """The lease owner, ``namespace/name/uid``, the name cut to fit ``limit``: the UID
        alone tells pods apart."""
        room = max(1, limit - len(self.namespace) - len(self.uid) - 2)
        return f"{self.namespace}/{self.name[:room]}/{self.uid}"[:limit]

    def __str__(self) -> str:
        return f"{self.namespace}/{self.name}"


def pod_ref(pod: Mapping[str, Any]) -> PodRef:
    meta = _object(pod, "metadata")

    def text(key: str, default: str = "") -> str:  # a value of another type is no name: not str()'d into a lease owner
        value = meta.get(key)
        return value if isinstance(value, str) and value else default

    return PodRef(text("namespace", "default"), text("name"), text("uid"))


def _quantity(value: Any, where: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        if len(value) > MAX_QUANTITY_DIGITS:  # int() of thousands of digits raises (and costs) before any bound is checked
            raise WireError(f"{where}: {len(value)} digits; a Kubernetes quantity has at most {MAX_QUANTITY_DIGITS}")
        count = int(value)
    else:
        raise PodError(f"{where}: expected a whole number of GPUs, got {quoted(value)}")
    if count > REQUEST_LIMITS["gpus_max"]:
        raise PodError(f"{where}: more than {REQUEST_LIMITS['gpus_max']} GPUs")
    return count


def _container_gpus(container: Any, resource: str, where: str) -> int:
    resources = _object(container, "resources") if isinstance(container, dict) else {}
    for kind in ("limits", "requests"):  # extended resources: requests, when set, equal limits
        table = resources.get(kind)
        if isinstance(table, dict) and resource in table:
            return _quantity(table[resource], f"{where}.resources.{kind}[{resource}]")
    return 0


def gpus_wanted(pod: Mapping[str, Any], resource: str = DEFAULT_RESOURCE) -> int:
    """The pod's GPUs: its containers' sum, or its largest init container's if larger
    (init containers run one at a time, before the others)."""
    spec = _object(pod, "spec")
    total = 0
    for n, container in enumerate(_list(spec, "containers")):
        total += _container_gpus(container, resource, f"containers[{n}]")
    for n, container in enumerate(_list(spec, "initContainers")):
        total = max(total, _container_gpus(container, resource, f"initContainers[{n}]"))
    return total


def _list(spec: Mapping[str, Any], key: str) -> list[Any]:
    value = spec.get(key) or []
    if not isinstance(value, list):
        raise PodError(f"spec.{key}: expected a list, got {type(value).__name__}")
    return value


def _wish_value(field_name: str, text: Any) -> Any:
    if field_name == "single_numa" and isinstance(text, str) and text.lower() in ("true", "false"):
        return text.lower() == "true"  # annotation values are strings
    return text


def pod_request(pod: Mapping[str, Any], resource: str = DEFAULT_RESOURCE) -> dict[str, Any] | None:
    """The request to ask every agent (the JSON object of ``POST /place``), or None when
    the pod wants no GPU.  PodError names the annotation or limit that is wrong."""
    gpus = gpus_wanted(pod, resource)
    if gpus == 0:
        return None
    meta = _object(pod, "metadata")
    annotations = _object(meta, "annotations")
    request: dict[str, Any] = {"gpus": gpus}
    for annotation, field_name in WISHES.items():
        if annotation in annotations:
            request[field_name] = _wish_value(field_name, annotations[annotation])
    try:
        parse_request(request)
    except RequestError as exc:
        where = next((a for a, f in WISHES.items() if f == exc.field), f"limits[{resource}]")
        raise PodError(f"{where}: {exc.message}") from None
    return request
