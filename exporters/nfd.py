"""A Node Feature Discovery local feature file (``features.d``): one ``name=value`` per line.

nfd-worker's local source reads every file in
/etc/kubernetes/node-feature-discovery/features.d/ and nfd-master turns each line into a
node label.  Names carry our own prefix (``topoagent.io/``); NFD from v0.13 allows any
namespace but kubernetes.io's (older ones need ``-extra-label-ns``: see docs/kubernetes.md).  Every name and value is checked against Kubernetes' label syntax here,
so a bad model string can never make nfd-master drop the whole file.
"""

from __future__ import annotations

import re
from collections import Counter

from topoagent.errors import TopoagentError
from topoagent.node.findings import placement_blockers
from topoagent.node.levels import LevelKind
from topoagent.node.model import NodeTopology
from topoagent.vocabulary import Severity

DEFAULT_PREFIX = "topoagent.io"
# NVIDIA topograph's node label names (its Kubernetes engine's defaults), written as well when
# asked, so Kueue / Volcano / KAI set-ups made for topograph work unchanged.
TOPOGRAPH_LEAF = "network.topology.nvidia.com/leaf"
TOPOGRAPH_ACCELERATOR = "network.topology.nvidia.com/accelerator"
HOSTNAME_LABEL = "kubernetes.io/hostname"

# Kubernetes label syntax (k8s.io/apimachinery validation): a qualified name is an optional
# DNS-subdomain prefix and '/', then a name of at most 63 characters; a value is at most 63
# characters of the same alphabet, or empty.
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_PREFIX = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


class LabelError(TopoagentError):
    """A label name or value Kubernetes would refuse."""


def check_label(key: str, value: str) -> None:
    prefix, sep, name = key.rpartition("/")
    if sep and (len(prefix) > 253 or not LABEL_PREFIX.match(prefix)):
        raise LabelError(f"{key!r}: prefix is not a DNS subdomain")
    if len(name) > 63 or not LABEL_NAME.match(name):
        raise LabelError(f"{key!r}: name is not a valid label name")
    if len(value) > 63 or not LABEL_VALUE.match(value):
        raise LabelError(f"{key!r}: value {value!r} is not a valid label value")


def label_value(text: str) -> str:
    """Any text made into a valid label value: other characters become '-', ends trimmed."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text.strip())[:63]
    return re.sub(r"^[^A-Za-z0-9]+|[^A-Za-z0-9]+$", "", value)


def gpu_product(model: str) -> str:
    """The GPU Operator's ``nvidia.com/gpu.product`` spelling of an NVML name: spaces become
    dashes (gpu-feature-discovery's ``strings.ReplaceAll(name, " ", "-")``), so
    ``NVIDIA A100-SXM4-40GB`` is ``NVIDIA-A100-SXM4-40GB`` and one nodeSelector value fits
    both labels.  A name that would still not be a label value is made into one."""
    value = model.strip().replace(" ", "-")
    return value if len(value) <= 63 and LABEL_VALUE.match(value) else label_value(model)


def leaf_label_key(prefix: str = DEFAULT_PREFIX, topograph: bool = False) -> str:
    """The label naming a node's leaf switch (its fabric position); equal values share a leaf."""
    return TOPOGRAPH_LEAF if topograph else f"{prefix}/fabric.leaf"


def nvlink_domain_label_key(prefix: str = DEFAULT_PREFIX, topograph: bool = False) -> str:
    """The label naming a node's multi-node NVLink domain; equal values are NVLink neighbours."""
    return TOPOGRAPH_ACCELERATOR if topograph else f"{prefix}/nvlink.domain"


def nvlink_domain_value(cluster_uuid: str, clique_id: int | None) -> str:
    """topograph's accelerator value: ``<ClusterUUID>.<CliqueID>`` (the NVLink partition)."""
    return label_value(cluster_uuid if clique_id is None else f"{cluster_uuid}.{clique_id}")


def nvlink_zones(topology: NodeTopology) -> list[set[str]]:
    """GPUs joined by NVLink (directly or through other GPUs/NVSwitches), largest first."""
    names = [g.name for g in topology.gpus]
    parent = {n: n for n in names}

    def find(n: str) -> str:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for i, a in enumerate(names):
        for b in names[i + 1:]:
            level = topology.level(a, b)
            if level is not None and level.is_nvlink:
                parent[find(a)] = find(b)
    zones: dict[str, set[str]] = {}
    for n in names:
        zones.setdefault(find(n), set()).add(n)
    return sorted(zones.values(), key=len, reverse=True)


def nfd_features(topology: NodeTopology, prefix: str = DEFAULT_PREFIX, topograph: bool = False) -> dict[str, str]:
    """Label name -> value; ``topograph`` adds topograph's leaf and accelerator labels."""
    gpus, nics = topology.gpus, topology.nics
    features: dict[str, str] = {"gpu.count": str(len(gpus))}
    models = {g.model for g in gpus if g.model}
    if models:
        model = models.pop() if len(models) == 1 else "mixed"
        features["gpu.model"] = (gpu_product(model) if model != "mixed" else model) or "unknown"
    # A link no witness classified is not "no NVLink": where any GPU pair's level is
    # unknown, the NVLink labels are left out rather than written as zero.
    links_seen = not topology.gpus_with_unknown_links()
    if gpus and links_seen:
        zones = nvlink_zones(topology)
        largest = len(zones[0]) if zones and len(zones[0]) > 1 else 0
        features["nvlink.zone-size"] = str(largest)
        features["nvlink.zones"] = str(sum(1 for z in zones if len(z) > 1))
        links = [
            topology.level(a.name, b.name)
            for i, a in enumerate(gpus) for b in gpus[i + 1:]
        ]
        nv_counts = [lvl.nvlinks for lvl in links if lvl is not None and lvl.is_nvlink]
        if nv_counts:
            features["nvlink.links-per-pair"] = str(min(nv_counts))
    if topology.nvlink_domain is not None:
        # Nodes with equal labels share one NVLink domain (GB200 NVL72): a nodeSelector or a
        # scheduler's topology key can keep a job inside it.
        features["nvlink.cluster-uuid"] = label_value(topology.nvlink_domain.cluster_uuid)
        if topology.nvlink_domain.clique_id is not None:
            features["nvlink.clique-id"] = str(topology.nvlink_domain.clique_id)
        features["nvlink.domain"] = nvlink_domain_value(topology.nvlink_domain.cluster_uuid, topology.nvlink_domain.clique_id)
    fabric = topology.fabric
    if fabric.leaf is not None:
        # The node's place in the fabric: its leaf (or its set of rail leaves), each rail's
        # leaf, and how many rails: a topology key for Kueue, a nodeSelector for a rail group.
        features["fabric.leaf"] = label_value(fabric.leaf)
        features["fabric.rails"] = str(len(fabric.rails))
        for rail in fabric.rails:
            features[f"fabric.rail{rail.index}.leaf"] = label_value(rail.leaf)
    nvswitches = len(topology.pci.of_kind("nvswitch")) if topology.pci else 0
    via_fabric = any(l.remote_type == "switch" and l.active for g in gpus for l in g.nvlinks)
    features["nvswitch"] = "true" if nvswitches or via_fabric else "false"
    if nvswitches:
        features["nvswitch.count"] = str(nvswitches)
    per_node = Counter(g.numa_node for g in gpus if g.numa_node is not None)
    if per_node:
        # Integers, so nodeAffinity's Gt/Lt can compare them: the fewest GPUs on a NUMA node
        # that has any (what NUMA-aligned placement can count on) and the most.
        features["gpu.per-numa-node"] = str(min(per_node.values()))
        features["gpu.per-numa-node.max"] = str(max(per_node.values()))
        features["gpu.numa-nodes"] = str(len(per_node))
    rdma = [n for n in nics if n.ports]
    features["nic.count"] = str(len(rdma))
    if gpus:
        close = {
            n.name for n in rdma for g in gpus
            if (lvl := topology.level(g.name, n.name)) is not None
            and lvl.kind in (LevelKind.PIX, LevelKind.PXB)
        }
        # Per mille, an integer Gt/Lt can compare: 1000 is one NIC per GPU, 500 one per two.
        features["nic.per-gpu-permille"] = str(round(1000 * len(close) / len(gpus)))
    active = [p for n in rdma for p in n.ports if p.active]
    features["ib.active-ports"] = str(len(active))
    rates = [p.rate_gbps for p in active if p.rate_gbps]
    if rates:
        # Whole Gb/s (every IB/RoCE rate since QDR is one); an integer Gt/Lt can compare.
        features["ib.rate-gbps"] = str(int(max(rates)))
    severities = Counter(f.severity for f in topology.findings)
    features["findings"] = str(len(topology.findings))
    # The label kept its name when discovery's "error" severity became critical.
    features["findings.errors"] = str(severities.get(Severity.CRITICAL, 0))
    features["findings.warnings"] = str(severities.get(Severity.WARNING, 0))
    blockers = placement_blockers(topology.findings)
    if blockers:
        # Written only while the node's answers cannot be trusted: the first blocking
        # finding's kind, so a selector can keep jobs off it (health DoesNotExist).
        features["health"] = str(blockers[0].kind)
    labelled = {f"{prefix}/{name}": value for name, value in features.items()}
    if topograph:
        if fabric.leaf is not None:
            labelled[TOPOGRAPH_LEAF] = features["fabric.leaf"]
        if "nvlink.domain" in features:
            labelled[TOPOGRAPH_ACCELERATOR] = features["nvlink.domain"]
    for key, value in labelled.items():
        check_label(key, value)
    return labelled


def render_nfd(topology: NodeTopology, prefix: str = DEFAULT_PREFIX, topograph: bool = False) -> str:
    lines = [f"# Node Feature Discovery features for {topology.hostname or 'this node'}, "
             "written by topoagent export nfd"]
    lines += [f"{key}={value}" for key, value in nfd_features(topology, prefix, topograph).items()]
    return "\n".join(lines) + "\n"


__all__ = ["DEFAULT_PREFIX", "HOSTNAME_LABEL", "LABEL_NAME", "LABEL_PREFIX", "LABEL_VALUE", "TOPOGRAPH_ACCELERATOR", "TOPOGRAPH_LEAF",
           "LabelError", "check_label", "gpu_product", "label_value", "leaf_label_key", "nfd_features", "nvlink_domain_label_key",
           "nvlink_domain_value", "nvlink_zones", "render_nfd"]
