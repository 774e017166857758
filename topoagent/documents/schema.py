"""The JSON form of every document topoagent emits, and the JSON Schema of each.

One table per document: each row names a JSON field, gives its JSON Schema and says how
to read it from the typed value.  ``Document.dump`` writes the JSON from the table and
``Document.json_schema`` writes the schema from the same table, so a field, an enum (taken
from topoagent.vocabulary) or the level grammar (topoagent.node.levels) is written once; the
OpenAPI document (exporters/openapi.py) is assembled from these schemas.  This module
holds the machinery and the node's documents (`discover --json`, `matrix --json`);
topoagent.documents.agent holds what the agent adds (served topology, leases, placement
answers, capacity, probe rounds, errors), so a one-shot discover never builds those.  Every
document's schema is strict (every field required, no others), and the suite validates
real output from every door against it, so the two cannot drift.

``SCHEMA_VERSION`` is the version of these shapes; every top-level document carries it.
Version 2: findings and collector status appear once in /topology (``agent.findings``
and ``agent.collectors`` are gone), one severity vocabulary (info, warning, critical),
findings of measurements keep their figures in ``expected_gbps``/``measured_gbps``.
Version 3: placement answers are lean unless the request's ``detail`` names sections
(bindings, launch, explain), and say their reasons by code (``reasons``); it also covers
answer fields added under 2 (``never_fits``; the estimate's ``model``, ``link_gbps``,
``latency_us``).  The node's and /topology's shapes are those of version 2.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from topoagent import __version__
from topoagent.node.facts import ASSUMED_NO_SMT, ASSUMED_SMT2, SYSFS
from topoagent.node.levels import PRINTED_LEVEL_PATTERN, LinkLevel
from topoagent.vocabulary import FabricSource, FindingKind, PeerKind, Severity, Status

if TYPE_CHECKING:
    from topoagent.collectors.nvidia_smi import TopoMatrix
    from topoagent.node.matrix import Measurement
    from topoagent.node.model import CollectorStatus, Finding, NodeTopology, Pair

SCHEMA_VERSION = 3

JsonSchema = dict[str, Any]
Getter = Callable[..., Any]  # (value), or (value, sections) for a Field with inner

# --- the table machinery ------------------------------------------------------------------

STRING: JsonSchema = {"type": "string"}
INTEGER: JsonSchema = {"type": "integer"}
NUMBER: JsonSchema = {"type": "number"}
BOOLEAN: JsonSchema = {"type": "boolean"}


def nullable(schema: JsonSchema) -> JsonSchema:
    if "$ref" in schema:
        return {"anyOf": [schema, {"type": "null"}]}
    kind = schema["type"]
    out = {**schema, "type": [*(kind if isinstance(kind, list) else [kind]), "null"]}
    if "enum" in schema:
        out["enum"] = [*schema["enum"], None]
    return out


def array(items: JsonSchema) -> JsonSchema:
    return {"type": "array", "items": items}


def one_of(values: type[enum.Enum] | Iterable[str]) -> JsonSchema:
    return {"type": "string", "enum": [str(v.value) if isinstance(v, enum.Enum) else v for v in values]}


@dataclass(frozen=True, slots=True)
class Field:
    """One row of a document's table: the field's JSON Schema, how to read it, what it means.

    ``section``: the field is written only when the dump is asked for that section (a
    placement answer's ``detail``), and its schema does not require it.  ``inner``: ``get``
    writes documents of its own (nested, listed), so it takes the sections asked too."""

    schema: JsonSchema
    get: Getter | None = None  # None: the attribute of the same name, as it is
    description: str | None = None
    section: str | None = None
    inner: bool = False


@dataclass(frozen=True)
class Document:
    """A JSON object shape: its fields in order, each with its schema and its reader."""

    name: str
    fields: dict[str, Field]
    description: str | None = None
    _getters: tuple[tuple[str, Getter | None], ...] = field(init=False, repr=False, compare=False)
    _rows: tuple[tuple[str, Getter | None, str | None, bool], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_getters", tuple((k, f.get) for k, f in self.fields.items()))
        object.__setattr__(self, "_rows", tuple((k, f.get, f.section, f.inner) for k, f in self.fields.items()))

    @property
    def ref(self) -> JsonSchema:
        return {"$ref": f"#/components/schemas/{self.name}"}

    def dump(self, value: Any, sections: Collection[str] | None = None) -> dict[str, Any]:
        """The JSON object: every field (``sections`` None), else the fields of no section
        and those of the sections named, in nested documents too.  A field left out is never read."""
        if sections is None:
            return {key: getattr(value, key) if get is None else get(value) for key, get in self._getters}
        return {
            key: getattr(value, key) if get is None else get(value, sections) if inner else get(value)
            for key, get, section, inner in self._rows if section is None or section in sections
        }

    def json_schema(self) -> JsonSchema:
        properties = {}
        for key, f in self.fields.items():
            description = f.description
            if f.section is not None:
                only = f"Only when the request's `detail` names `{f.section}`."
                description = f"{description.rstrip('.')}. {only}" if description else only
            properties[key] = {**f.schema, "description": description} if description else f.schema
        required = [key for key, f in self.fields.items() if f.section is None]
        schema: JsonSchema = {"type": "object", "additionalProperties": False, "required": required, "properties": properties}
        if self.description:
            schema["description"] = self.description
        return schema

    def extended(self, name: str, more: Mapping[str, Field], description: str | None = None) -> Document:
        return Document(name, {**self.fields, **more}, description or self.description)


def _schema_of_type(hint: Any) -> JsonSchema:
    """A field's JSON Schema from its Python type: int, float, str, bool, a StrEnum, X | None."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (types.UnionType, typing.Union) and len(args) == 1:
        return nullable(_schema_of_type(args[0]))
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return one_of(hint)
    simple = {int: INTEGER, float: NUMBER, str: STRING, bool: BOOLEAN}
    if hint in simple:
        return simple[hint]
    raise TypeError(f"no JSON Schema for {hint!r}")


def dataclass_document(name: str, cls: type, *, renames: Mapping[str, str] = MappingProxyType({}), description: str | None = None) -> Document:
    """A document whose fields are a dataclass's, in order (``renames``: field -> JSON name)."""
    hints = typing.get_type_hints(cls)
    fields = {
        renames.get(f.name, f.name): Field(_schema_of_type(hints[f.name]), operator.attrgetter(f.name))
        for f in dataclasses.fields(cls)
    }
    return Document(name, fields, description or (cls.__doc__ or "").strip().split("\n")[0] or None)


def nested(document: Document, attr: str, *, optional: bool = False, section: str | None = None) -> Field:
    """A field holding one ``document`` read from attribute ``attr``."""
    dump = document.dump

    def get(value: Any, sections: Collection[str] | None = None) -> Any:
        inner = getattr(value, attr)
        return None if inner is None else dump(inner, sections)

    return Field(nullable(document.ref) if optional else document.ref, get, section=section, inner=True)


def listed(document: Document, attr: str, *, section: str | None = None) -> Field:
    """A field holding a list of ``document``s read from the iterable attribute ``attr``."""
    dump = document.dump
    return Field(array(document.ref), lambda value, sections=None: [dump(x, sections) for x in getattr(value, attr)],
                 section=section, inner=True)


def level_text(level: LinkLevel | None) -> str | None:
    return None if level is None else str(level)


def _hex(digits: int, attr: str) -> Field:
    def get(value: Any) -> str | None:
        number = getattr(value, attr)
        return None if number is None else f"0x{number:0{digits}x}"

    return Field(nullable(STRING), get)


def plain_list(attr: str, items: JsonSchema, description: str | None = None, *, section: str | None = None) -> Field:
    return Field(array(items), lambda value: list(getattr(value, attr)), description, section)


LEVEL = {"type": "string", "pattern": PRINTED_LEVEL_PATTERN}
SEVERITY = one_of(Severity)
FINDING_KIND = one_of(FindingKind)
STATUS = one_of(Status)

# --- the node ---------------------------------------------------------------------------------

PCIE_LINK = Document("PcieLink", {
    "current_gts": Field(nullable(NUMBER), description="transfer rate now, GT/s"),
    "current_width": Field(nullable(INTEGER), description="lanes now"),
    "max_gts": Field(nullable(NUMBER)),
    "max_width": Field(nullable(INTEGER)),
    "current_gen": Field(nullable(INTEGER)),
    "max_gen": Field(nullable(INTEGER)),
})

NUMA_NODE = Document("NumaNode", {
    "id": Field(INTEGER),
    "cpus": Field(nullable(STRING), lambda n: n.cpulist, "CPU list, like 0-47,96-143"),
    "memory_bytes": Field(nullable(INTEGER)),
    "distances": plain_list("distances", INTEGER),
    "cpuless": Field(BOOLEAN),
    "same_cpus_as": plain_list("same_cpus_as", INTEGER),
})

PCI_DEVICE = Document("PciDevice", {
    "address": Field(STRING),
    "class": _hex(6, "class_code"),
    "vendor": _hex(4, "vendor"),
    "device": _hex(4, "device"),
    "subsystem_vendor": _hex(4, "subsystem_vendor"),
    "subsystem_device": _hex(4, "subsystem_device"),
    "kind": Field(STRING),
    "numa_node": Field(nullable(INTEGER)),
    "numa_source": Field(nullable(STRING)),
    "local_cpus": Field(nullable(STRING), lambda d: d.local_cpulist),
    "parent": Field(nullable(STRING)),
    "depth": Field(INTEGER),
    "root_complex": Field(nullable(STRING)),
    "driver": Field(nullable(STRING)),
    "listed": Field(BOOLEAN),
    "interfaces": plain_list("interfaces", STRING),
    "link": nested(PCIE_LINK, "link", optional=True),
})

NVLINK = Document("NvLink", {
    "link": Field(INTEGER),
    "active": Field(BOOLEAN),
    "version": Field(nullable(INTEGER)),
    "remote_address": Field(nullable(STRING), lambda l: l.remote_pci_address),
    "remote_type": Field(nullable(STRING)),
})

GPU = Document("Gpu", {
    "index": Field(INTEGER, description="nvidia-smi / NVML index"),
    "name": Field(STRING),
    "uuid": Field(nullable(STRING)),
    "model": Field(nullable(STRING)),
    "address": Field(nullable(STRING), lambda g: g.pci_address),
    "numa_node": Field(nullable(INTEGER)),
    "cpus": Field(nullable(STRING)),
    "memory_bytes": Field(nullable(INTEGER)),
    "device_minor": Field(nullable(INTEGER), description="N of /dev/nvidiaN"),
    "link": nested(PCIE_LINK, "link", optional=True),
    "nvlink_generation": Field(nullable(INTEGER)),
    "nvlinks": listed(NVLINK, "nvlinks"),
    "utilization_percent": Field(nullable(NUMBER)),
    "processes": plain_list("processes", INTEGER),
})

IB_PORT = Document("IbPort", {
    "port": Field(INTEGER, lambda p: p.number),
    "state": Field(nullable(STRING)),
    "phys_state": Field(nullable(STRING)),
    "rate_gbps": Field(nullable(NUMBER), description="Gb/s (bits)"),
    "rate": Field(nullable(STRING), lambda p: p.rate_text),
    "link_layer": Field(nullable(STRING)),
    "lid": Field(nullable(INTEGER)),
    "subnet_prefix": Field(nullable(STRING)),
})

NIC = Document("Nic", {
    "name": Field(STRING),
    "device": Field(nullable(STRING)),
    "address": Field(nullable(STRING), lambda n: n.pci_address),
    "numa_node": Field(nullable(INTEGER)),
    "netdev": Field(nullable(STRING), lambda n: n.netdevs[0] if n.netdevs else None),
    "netdevs": plain_list("netdevs", STRING),
    "node_guid": Field(nullable(STRING)),
    "link": nested(PCIE_LINK, "link", optional=True),
    "ports": listed(IB_PORT, "ports"),
})

INTERFACE = Document("Interface", {
    "name": Field(STRING),
    "address": Field(nullable(STRING), lambda i: i.pci_address, "the PCI function it sits on; null for a virtual interface"),
    "numa_node": Field(nullable(INTEGER)),
    "speed_mbps": Field(nullable(INTEGER), description="link speed, Mb/s; null when unknown (no link)"),
    "operstate": Field(nullable(STRING), description="up, down, unknown, ... as the kernel says"),
    "rdma_device": Field(nullable(STRING), description="the RDMA device it belongs to (mlx5_0); null for plain Ethernet"),
    "nearest_gpus": plain_list("nearest_gpus", STRING),
}, "A network interface from /sys/class/net, RDMA or not.")

NVLINK_DOMAIN = Document("NvlinkDomain", {
    "cluster_uuid": Field(STRING, description="NVML's GPU fabric cluster UUID"),
    "clique_id": Field(nullable(INTEGER), description="the clique (NVLink partition) within the cluster"),
    "gpus": plain_list("gpus", STRING),
}, "The multi-node NVLink domain (GB200 NVL72-class): nodes with the same cluster UUID and clique id are NVLink neighbours.")

NEIGHBOUR = Document("PortNeighbour", {
    "source": Field(one_of(FabricSource), description="infiniband: the peer's own answer to directed-route SMPs (smpquery); lldp: what the switch announced"),
    "device": Field(nullable(STRING), description="InfiniBand: the local RDMA device (mlx5_0)"),
    "port": Field(nullable(INTEGER), description="InfiniBand: the local port number"),
    "interface": Field(nullable(STRING), description="LLDP: the local interface"),
    "switch_id": Field(STRING, description="InfiniBand: the peer's node GUID; LLDP: its chassis id"),
    "switch_name": Field(nullable(STRING), description="InfiniBand: the peer's node description; LLDP: its system name"),
    "switch_port": Field(nullable(STRING), description="the peer's port: an InfiniBand port number, an LLDP port id (Ethernet1/5)"),
    "switch_kind": Field(one_of(PeerKind), description="what the peer is (host: a back-to-back cable)"),
}, "What is at the other end of one of the node's ports.")

RAIL = Document("Rail", {
    "rail": Field(INTEGER, lambda r: r.index, "numbered in the order of the node's NICs: rail 0 is the first NIC's"),
    "leaf": Field(STRING, description="the leaf switch's id (InfiniBand node GUID, LLDP chassis id)"),
    "leaf_name": Field(nullable(STRING), description="its description or system name; not unique across a fabric"),
    "nics": plain_list("nics", STRING),
    "interfaces": plain_list("interfaces", STRING),
    "gpus": plain_list("gpus", STRING),
}, "A leaf switch the node reaches: ports that reach different leaves are different rails; gpus are those whose closest NICs are on it.")

FABRIC = Document("Fabric", {
    "leaf": Field(nullable(STRING), lambda f: f.leaf,
                  "the node's leaf; with several rails, rails-<hash of the set of leaves> (nodes with the same set share it); null when no neighbour is known"),
    "rails": listed(RAIL, "rails"),
    "neighbours": listed(NEIGHBOUR, "neighbours"),
}, "The node's place in the cluster fabric, from the optional ib_neighbours and lldp collectors.")

CPU = Document("Cpu", {
    "arch": Field(nullable(STRING), lambda c: c.model.arch if c.model else None, "as NCCL names it: x86_64, arm64, ppc64"),
    "vendor": Field(nullable(STRING), lambda c: c.model.vendor if c.model else None),
    "family": Field(nullable(INTEGER), lambda c: c.model.family if c.model else None),
    "model": Field(nullable(INTEGER), lambda c: c.model.model if c.model else None),
    "model_name": Field(nullable(STRING), lambda c: c.model.model_name if c.model else None),
    "cores": Field(nullable(INTEGER), lambda c: len(c.core_map.all_cores) if c.core_map else None, "physical cores"),
    "cores_source": Field(nullable(one_of((SYSFS, ASSUMED_SMT2, ASSUMED_NO_SMT))), lambda c: c.core_map.source if c.core_map else None,
                          "how threads were grouped into cores: read from sysfs, or assumed"),
}, "The CPUs: identity from /proc/cpuinfo, cores from sysfs.")

FINDING = Document("Finding", {
    "kind": Field(FINDING_KIND),
    "severity": Field(SEVERITY),
    "subject": Field(STRING),
    "message": Field(STRING),
    "source": Field(one_of(("discovery", "probe", "telemetry"))),
    "expected_gbps": Field(nullable(NUMBER), description="a measurement's finding: what the level should give, GB/s"),
    "measured_gbps": Field(nullable(NUMBER), description="a measurement's finding: what was measured, GB/s"),
    "rate_per_s": Field(nullable(NUMBER), description="a counter's finding: the rate per second that raised it"),
})


@dataclass(frozen=True, slots=True)
class _PairView:
    """A pair as the node documents show it, with its measurement if one was taken."""

    pair: Pair
    measured: Measurement | None


PAIR = Document("Pair", {
    "a": Field(STRING, lambda v: v.pair.a),
    "b": Field(STRING, lambda v: v.pair.b),
    "level": Field(nullable(LEVEL), lambda v: level_text(v.pair.level)),
    "nvlinks": Field(nullable(INTEGER), lambda v: None if v.pair.level is None else v.pair.level.nvlinks),
    "expected_gbps": Field(nullable(NUMBER), lambda v: v.pair.expected_gbps, "per direction, GB/s, from the level table"),
    "source": Field(one_of(("derived", "nvidia-smi")), lambda v: v.pair.source),
    "declared": Field(nullable(LEVEL), lambda v: level_text(v.pair.declared), "what nvidia-smi topo -m says"),
    "measured_gbps": Field(nullable(NUMBER), lambda v: round(v.measured.gbps, 3) if v.measured else None, "a probe's figure, GB/s"),
    "measured_at": Field(nullable(NUMBER), lambda v: v.measured.taken_at if v.measured else None, "Unix time"),
})


@dataclass(frozen=True, slots=True)
class _CollectorView:
    """A collector's status as the node documents show it, with its last success."""

    status: CollectorStatus
    last_success_at: float | None
    timings: bool


COLLECTOR = Document("Collector", {
    "status": Field(STATUS, lambda v: v.status.status),
    "message": Field(nullable(STRING), lambda v: v.status.message),
    "warnings": Field(array(STRING), lambda v: list(v.status.warnings)),
    "seconds": Field(nullable(NUMBER), lambda v: round(v.status.seconds, 6) if v.timings else None, "how long the last run took"),
    "last_success_at": Field(nullable(NUMBER), lambda v: v.last_success_at, "Unix time of its last good run; null when unknown (a one-shot discovery keeps no history)"),
}, "How a source fared in the latest discovery run (node_exporter's rule: no_data is quiet).")


@dataclass(frozen=True, slots=True)
class NodeView:
    """What the node documents read: discovery's value, with what the agent adds to it."""

    node: NodeTopology
    findings: tuple[Finding, ...]
    collectors: tuple[CollectorStatus, ...]
    last_success_at: Mapping[str, float | None]
    measured: Mapping[tuple[str, str], Measurement]
    timings: bool = True

    @classmethod
    def of(cls, node: NodeTopology, *, timings: bool = True) -> NodeView:
        """A bare discovery (``discover --json``): no history, no measurements."""
        return cls(node, node.findings, node.collectors, {}, {}, timings)


def _pairs(view: NodeView) -> list[dict[str, Any]]:
    dump, measured = PAIR.dump, view.measured
    return [dump(_PairView(p, measured.get((p.a, p.b)))) for p in view.node.pairs]


def _collectors(view: NodeView) -> dict[str, Any]:
    dump = COLLECTOR.dump
    return {c.name: dump(_CollectorView(c, view.last_success_at.get(c.name), view.timings)) for c in view.collectors}


NODE = Document("Node", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda v: SCHEMA_VERSION),
    "agent_version": Field(STRING, lambda v: __version__),
    "hostname": Field(nullable(STRING), lambda v: v.node.hostname),
    "cpu": Field(nullable(CPU.ref), lambda v: CPU.dump(v.node.cpu) if v.node.cpu else None),
    "numa_nodes": Field(array(NUMA_NODE.ref), lambda v: [NUMA_NODE.dump(n) for n in (v.node.numa.nodes if v.node.numa else ())]),
    "pci_devices": Field(array(PCI_DEVICE.ref), lambda v: [PCI_DEVICE.dump(d) for d in (v.node.pci.devices if v.node.pci else ())]),
    "gpus": Field(array(GPU.ref), lambda v: [GPU.dump(g) for g in v.node.gpus]),
    "nics": Field(array(NIC.ref), lambda v: [NIC.dump(n) for n in v.node.nics]),
    "interfaces": Field(array(INTERFACE.ref), lambda v: [INTERFACE.dump(i) for i in v.node.interfaces], "every network interface"),
    "nvlink_domain": Field(nullable(NVLINK_DOMAIN.ref), lambda v: NVLINK_DOMAIN.dump(v.node.nvlink_domain) if v.node.nvlink_domain else None,
                           "null when NVML reports no completed GPU fabric registration"),
    "fabric": Field(FABRIC.ref, lambda v: FABRIC.dump(v.node.fabric)),
    "pairs": Field(array(PAIR.ref), _pairs, "every unordered GPU/NIC pair once"),
    "findings": Field(array(FINDING.ref), lambda v: [FINDING.dump(f) for f in v.findings], "discovery's, the probes' and the counters'"),
    "collectors": Field({"type": "object", "additionalProperties": COLLECTOR.ref}, _collectors, "by collector name"),
}, "How the node is wired: `topoagent discover --json`, and /topology without `agent`.")

def node_document(node: NodeTopology, *, timings: bool = True) -> dict[str, Any]:
    """`topoagent discover --json`; ``timings=False`` leaves out how long each source took
    (for comparing two replays of one recording)."""
    return NODE.dump(NodeView.of(node, timings=timings))


# --- nvidia-smi's matrix (`topoagent matrix --json`) -----------------------------------------

TOPO_DEVICE = Document("TopoDevice", {
    "name": Field(STRING),
    "kind": Field(one_of(("gpu", "nic"))),
    "device": Field(nullable(STRING), description="RDMA device of a NIC (NIC Legend)"),
    "cpu_affinity": Field(nullable(STRING)),
    "numa_affinity": Field(nullable(STRING)),
    "gpu_numa_id": Field(nullable(STRING)),
})

TOPO_PAIR = Document("TopoPair", {
    "a": Field(STRING, lambda t: t[0].name),
    "b": Field(STRING, lambda t: t[1].name),
    "level": Field(nullable(LEVEL), lambda t: level_text(t[2])),
    "nvlinks": Field(nullable(INTEGER), lambda t: None if t[2] is None else t[2].nvlinks),
    "expected_gbps": Field(nullable(NUMBER), lambda t: _expected(t[2])),
})


def _expected(level: LinkLevel | None) -> float | None:
    from topoagent.node.levels import expected_gbps

    return None if level is None else expected_gbps(level)


TOPO_MATRIX = Document("TopoMatrix", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda m: SCHEMA_VERSION),
    "devices": listed(TOPO_DEVICE, "devices"),
    "pairs": Field(array(TOPO_PAIR.ref), lambda m: [TOPO_PAIR.dump(p) for p in m.pairs()], "every unordered device pair once"),
    "missing_rows": plain_list("missing_rows", STRING),
    "notes": plain_list("notes", STRING),
}, "`topoagent matrix --json`: an `nvidia-smi topo -m` output, parsed.")


def topo_matrix_document(matrix: TopoMatrix) -> dict[str, Any]:
    return TOPO_MATRIX.dump(matrix)

# Every document above, for the OpenAPI components (topoagent.documents.agent has the agent's).
DOCUMENTS: tuple[Document, ...] = (
    PCIE_LINK, NUMA_NODE, PCI_DEVICE, NVLINK, GPU, IB_PORT, NIC, INTERFACE, NVLINK_DOMAIN, NEIGHBOUR, RAIL, FABRIC, CPU, FINDING, PAIR, COLLECTOR, NODE,
    TOPO_DEVICE, TOPO_PAIR, TOPO_MATRIX,
)
