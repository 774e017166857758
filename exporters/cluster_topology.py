"""The cluster's topology for its schedulers, from every agent's /topology document.

* Slurm ``topology.conf`` (topology/tree): one leaf switch per leaf the nodes report, the
  nodes under it, and one top switch over the leaves.  A node's leaf is its
  ``fabric.leaf``: the switch its ports reach, or for a node whose rails reach several
  leaves (rail-optimised) the set of those leaves, which the nodes of one scalable unit
  share.  The agents see their own leaves only, not the spines above them; a two-tier
  fat tree's spines join every leaf, which one top switch says exactly.
* Slurm ``topology.yaml`` (Slurm 24.05+): the same tree, and a block topology of the
  nodes' multi-node NVLink domains when any node has one.  Debian's Slurm 22.05 cannot
  load it (it reads topology.conf only); it follows topology.yaml(5).
* A Kueue ``Topology`` (kueue.x-k8s.io/v1beta2): the node labels that name each level,
  leaf first, then the NVLink domain when any node has one, then the host.  The labels
  are the ones ``topoagent export nfd`` writes (exporters/nfd.py), ours or topograph's.

Pure: documents in, text out.  Reading the agents is topoagent/commands/cluster_topology.py.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from topoagent.documents.schema import SCHEMA_VERSION
from topoagent.errors import TopoagentError
from topoagent.exporters.nfd import HOSTNAME_LABEL, LABEL_PREFIX, check_label, leaf_label_key, nvlink_domain_label_key, nvlink_domain_value

TOP_SWITCH = "fabric"  # the switch over every leaf in topology.conf
# The documents whose fields this module reads as it does: version 3 changed placement
# answers only, so a cluster half-way through an upgrade still writes its files.
KNOWN_SCHEMA_VERSIONS = (2, SCHEMA_VERSION)
MAX_NODE_NAME = 63  # a DNS label: a host name up to its first dot
MAX_ID = 1024  # a leaf or cluster id: a GUID is 18 characters, an LLDP chassis id 255 octets (765 as hex pairs)
MAX_CLIQUE_ID = (1 << 32) - 1  # NVML's clique id is an unsigned 32-bit number
_SLURM_NAME_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")
_TRAILING_NUMBER = re.compile(r"^(.*?)(\d+)$")


class ClusterTopologyError(TopoagentError):
    """An agent's document cannot be placed in the cluster (says which and why)."""


@dataclass(frozen=True, slots=True)
class ClusterNode:
    name: str  # the Slurm node name: the host name up to its first dot
    leaf: str | None  # fabric.leaf: its leaf, or its rail group
    rail_leaves: tuple[tuple[str, str | None], ...]  # (leaf id, leaf name) per rail
    nvlink_domain: str | None  # "<cluster uuid>.<clique id>", topograph's accelerator value


def node_of(document: Mapping[str, Any], where: str) -> ClusterNode:
    """The parts of a /topology (or `discover --json`) document the cluster files need; a
    document of another schema version, or whose parts are not of their types, is refused."""
    if not isinstance(document, Mapping):
        raise ClusterTopologyError(f"{where}: not a topology document (a JSON object)")
    version = document.get("schema_version")
    if not _is_integer(version) or version not in KNOWN_SCHEMA_VERSIONS:
        said = "no schema_version" if version is None else f"schema_version {_shown(version)}"
        known = ", ".join(map(str, KNOWN_SCHEMA_VERSIONS))
        raise ClusterTopologyError(f"{where}: the document has {said}; this build reads schema_version {known}")
    hostname = document.get("hostname")
    if not isinstance(hostname, str) or not hostname.strip():
        raise ClusterTopologyError(f"{where}: the document names no hostname")
    name = hostname.strip().split(".")[0]
    # A DNS label, as a host name's first part is: also keeps hostlist's numbers small.
    if not name or len(name) > MAX_NODE_NAME or _SLURM_NAME_UNSAFE.search(name):  # ".lan" leaves no name before the dot
        raise ClusterTopologyError(f"{where}: hostname {_shown(hostname)} is not a Slurm node name "
                                   f"(letters, digits, '_', '-', '.', at most {MAX_NODE_NAME} before the first dot)")
    fabric = document.get("fabric")
    if not isinstance(fabric, Mapping) or not isinstance(fabric.get("rails"), list):
        raise ClusterTopologyError(f"{where}: no fabric in the document (an agent older than this command?)")
    leaf = fabric.get("leaf")
    if leaf is not None:
        _check_id(leaf, "fabric.leaf", where)
    rails = []
    for k, rail in enumerate(fabric["rails"]):
        if not isinstance(rail, Mapping) or rail.get("leaf") is None:
            raise ClusterTopologyError(f"{where}: fabric.rails[{k}] has no leaf")
        _check_id(rail["leaf"], f"fabric.rails[{k}].leaf", where)
        leaf_name = rail.get("leaf_name")
        if leaf_name is not None and not isinstance(leaf_name, str):
            raise ClusterTopologyError(f"{where}: fabric.rails[{k}].leaf_name is {_shown(leaf_name)}, not text")
        rails.append((rail["leaf"], leaf_name))
    domain = document.get("nvlink_domain")
    nvlink = None
    if domain is not None:
        if not isinstance(domain, Mapping):
            raise ClusterTopologyError(f"{where}: nvlink_domain is {_shown(domain)}, not an object")
        _check_id(domain.get("cluster_uuid"), "nvlink_domain.cluster_uuid", where)
        clique = domain.get("clique_id")
        if clique is not None and not (_is_integer(clique) and 0 <= clique <= MAX_CLIQUE_ID):
            raise ClusterTopologyError(f"{where}: nvlink_domain.clique_id is {_shown(clique)}, not a whole number 0..{MAX_CLIQUE_ID}")
        nvlink = nvlink_domain_value(domain["cluster_uuid"], clique)
    return ClusterNode(name, leaf, tuple(rails), nvlink)


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _shown(value: Any) -> str:
    """A value from a document, shown in an error: as JSON, cut short."""
    try:
        text = json.dumps(value, ensure_ascii=True)
    except (TypeError, ValueError, RecursionError):
        text = type(value).__name__
    return text if len(text) <= 80 else text[:79] + "…"


def _check_id(value: Any, field: str, where: str) -> None:
    if not isinstance(value, str) or not value or len(value) > MAX_ID:
        raise ClusterTopologyError(f"{where}: {field} is {_shown(value)}, not an id of 1..{MAX_ID} characters")


def check_unique(nodes: Sequence[ClusterNode]) -> None:
    seen: set[str] = set()
    for node in nodes:
        if node.name in seen:
            raise ClusterTopologyError(f"node {node.name} is reported twice (two agents with one hostname?)")
        seen.add(node.name)


def hostlist(names: Iterable[str]) -> str:
    """Slurm's hostlist expression: ``gpu001,gpu002,gpu003,node7`` -> ``gpu[001-003],node7``.
    Names keep their zero padding; only runs of the same width are joined."""
    groups: dict[tuple[str, int], list[int]] = {}
    plain: list[str] = []
    for name in sorted(set(names)):
        match = _TRAILING_NUMBER.match(name)
        if match:
            groups.setdefault((match.group(1), len(match.group(2))), []).append(int(match.group(2)))
        else:
            plain.append(name)
    parts = list(plain)
    for (prefix, width), numbers in groups.items():
        numbers.sort()
        runs: list[list[int]] = []
        for n in numbers:
            if runs and n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        if len(numbers) == 1:
            parts.append(f"{prefix}{numbers[0]:0{width}d}")
            continue
        ranges = [f"{a:0{width}d}" if a == b else f"{a:0{width}d}-{b:0{width}d}" for a, b in runs]
        parts.append(f"{prefix}[{','.join(ranges)}]")
    return ",".join(sorted(parts))


def switch_name(leaf: str) -> str:
    """A leaf id as a Slurm switch name: ``0xec0d9a0300ec8240`` -> ``leaf-ec0d9a0300ec8240``."""
    text = leaf[2:] if leaf.lower().startswith("0x") else leaf
    return "leaf-" + _SLURM_NAME_UNSAFE.sub("-", text).strip("-")


def _switches(nodes: Sequence[ClusterNode]) -> dict[str, list[ClusterNode]]:
    """Switch name -> the nodes under it, one switch per leaf.  Leaves whose ids read as
    one name (``a b`` and ``a-b``; ``0xAA`` and ``aa``) each get their id's hash after it:
    two ``SwitchName=`` lines of one name would merge two leaves into one."""
    by_leaf: dict[str, list[ClusterNode]] = {}
    for node in nodes:
        if node.leaf is not None:
            by_leaf.setdefault(node.leaf, []).append(node)
    named: dict[str, list[str]] = {}
    for leaf in by_leaf:
        named.setdefault(switch_name(leaf), []).append(leaf)
    out: dict[str, list[ClusterNode]] = {}
    for name, leaves in named.items():
        for leaf in leaves:
            out[name if len(leaves) == 1 else f"{name}-{hashlib.sha256(leaf.encode()).hexdigest()[:8]}"] = by_leaf[leaf]
    return dict(sorted(out.items()))


def unplaced(nodes: Sequence[ClusterNode]) -> list[str]:
    """The nodes no switch can hold: their agents know no neighbour."""
    return sorted(n.name for n in nodes if n.leaf is None)


def _printable(text: str) -> str:
    """Text from an agent, safe in a comment line: no line breaks or other controls."""
    return "".join(c if c.isprintable() else "?" for c in text)[:120]


def _describe(members: Sequence[ClusterNode]) -> str:
    rails = members[0].rail_leaves
    names = sorted({_printable(name or leaf) for leaf, name in rails})
    if len(rails) <= 1:
        return f"leaf {', '.join(names)}"
    return f"{len(rails)} rails, leaves: " + ", ".join(sorted({switch_name(leaf) for leaf, _ in rails}))


def slurm_topology_conf(nodes: Sequence[ClusterNode]) -> str:
    """topology.conf for TopologyPlugin=topology/tree."""
    check_unique(nodes)
    switches = _switches(nodes)
    lines = ["# topology.conf for TopologyPlugin=topology/tree, written by topoagent cluster-topology",
             "# from each agent's /topology: a leaf switch per leaf (or rail group) the nodes report."]
    missing = unplaced(nodes)
    if missing:
        lines.append(f"# Not placed (their agents know no neighbour switch): {hostlist(missing)}")
    for switch, members in switches.items():
        lines.append(f"# {_describe(members)}")
        lines.append(f"SwitchName={switch} Nodes={hostlist(m.name for m in members)}")
    if len(switches) > 1:
        # Listed, not compressed: a GUID's trailing digits are no host number.
        lines.append(f"SwitchName={TOP_SWITCH} Switches={','.join(switches)}")
    return "\n".join(lines) + "\n"


def _yaml_text(text: str) -> str:
    """A YAML scalar that stays a string (hostlists hold '[' and ',')."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _block_sizes(blocks: Mapping[str, Sequence[ClusterNode]]) -> list[int]:
    """The planning base block size: the largest power of two every block can hold
    (topology.yaml(5): successive sizes are powers of two times the first)."""
    smallest = min(len(members) for members in blocks.values())
    size = 1
    while size * 2 <= smallest:
        size *= 2
    return [size]


def slurm_topology_yaml(nodes: Sequence[ClusterNode]) -> str:
    """topology.yaml (Slurm 24.05+): the tree, and NVLink domains as blocks when any node has one."""
    check_unique(nodes)
    switches = _switches(nodes)
    out = ["# topology.yaml (Slurm 24.05 and later), written by topoagent cluster-topology",
           "- topology: fabric",
           "  cluster_default: true",
           "  tree:",
           "    switches:"]
    for switch, members in switches.items():
        out.append(f"      - switch: {switch}")
        out.append(f"        nodes: {_yaml_text(hostlist(m.name for m in members))}")
    if len(switches) > 1:
        out.append(f"      - switch: {TOP_SWITCH}")
        out.append(f"        children: {_yaml_text(','.join(switches))}")
    blocks: dict[str, list[ClusterNode]] = {}
    for node in nodes:
        if node.nvlink_domain is not None:
            blocks.setdefault(node.nvlink_domain, []).append(node)
    if blocks:
        out += ["- topology: nvlink",
                "  cluster_default: false",
                "  block:",
                f"    block_sizes: [{', '.join(map(str, _block_sizes(blocks)))}]",
                "    blocks:"]
        for k, (domain, members) in enumerate(sorted(blocks.items())):
            out.append(f"      - block: nvl{k}  # NVLink domain {domain}")
            out.append(f"        nodes: {_yaml_text(hostlist(m.name for m in members))}")
    return "\n".join(out) + "\n"


def kueue_topology(nodes: Sequence[ClusterNode], name: str = "topoagent", prefix: str = "topoagent.io", topograph: bool = False) -> str:
    """A Kueue Topology (kueue.x-k8s.io/v1beta2) over the labels `topoagent export nfd` writes."""
    if len(name) > 253 or not LABEL_PREFIX.match(name):
        raise ClusterTopologyError(f"Kueue Topology name {name[:80]!r} is not a DNS-1123 subdomain (lower-case letters, digits, '-', '.')")
    levels = [leaf_label_key(prefix, topograph)]
    if any(n.nvlink_domain is not None for n in nodes):
        levels.append(nvlink_domain_label_key(prefix, topograph))
    levels.append(HOSTNAME_LABEL)
    for key in levels:
        check_label(key, "")
    lines = ["# Kueue Topology, written by topoagent cluster-topology: each level is a node label",
             "# that topoagent export nfd (or the agent's [exports] nfd_path) sets.",
             "apiVersion: kueue.x-k8s.io/v1beta2",
             "kind: Topology",
             "metadata:",
             f"  name: {name}",
             "spec:",
             "  levels:"]
    lines += [f"  - nodeLabel: {_yaml_text(key)}" for key in levels]
    return "\n".join(lines) + "\n"


__all__ = ["TOP_SWITCH", "ClusterNode", "ClusterTopologyError", "hostlist", "kueue_topology", "node_of",
           "slurm_topology_conf", "slurm_topology_yaml", "switch_name", "unplaced"]
