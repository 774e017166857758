"""The JSON form of every document topoagent emits, and the JSON Schema of each.

One table per document: each row names a JSON field, gives its JSON Schema and says how
to read it from the typed value.  ``Document.dump`` writes the JSON from the table and
``Document.json_schema`` writes the schema from the same table, so a field, an enum (taken
from topoagent.vocabulary) or the level grammar (topoagent.levels) is written once; the
OpenAPI document (exporters/openapi.py) is assembled from these schemas.  Every
document's schema is strict (every field required, no others), and the suite validates
real output from every door against it, so the two cannot drift.

``SCHEMA_VERSION`` is the version of these shapes; every top-level document carries it.
Version 2: findings and collector status appear once in /topology (``agent.findings``
and ``agent.collectors`` are gone), one severity vocabulary (info, warning, critical),
findings of measurements keep their figures in ``expected_gbps``/``measured_gbps``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import types
import typing
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from topoagent import __version__
from topoagent.facts import ASSUMED_NO_SMT, ASSUMED_SMT2, SYSFS
from topoagent.levels import PRINTED_LEVEL_PATTERN, LinkLevel
from topoagent.vocabulary import Affinity, FabricSource, FindingKind, Pattern, ProbeKind, Severity, Status, Unit

if TYPE_CHECKING:
    from topoagent.capacity import Capacity
    from topoagent.collectors.nvidia_smi import TopoMatrix
    from topoagent.leases import Lease
    from topoagent.matrix import DistanceMatrix, Measurement
    from topoagent.model import CollectorStatus, Finding, NodeTopology, Pair
    from topoagent.placement import NoFit, Placement
    from topoagent.probes.runner import ProbeRound
    from topoagent.served import Snapshot

SCHEMA_VERSION = 2

JsonSchema = dict[str, Any]
Getter = Callable[[Any], Any]

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
    """One row of a document's table: the field's JSON Schema, how to read it, what it means."""

    schema: JsonSchema
    get: Getter | None = None  # None: the attribute of the same name, as it is
    description: str | None = None


@dataclass(frozen=True)
class Document:
    """A JSON object shape: its fields in order, each with its schema and its reader."""

    name: str
    fields: dict[str, Field]
    description: str | None = None
    _getters: tuple[tuple[str, Getter | None], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_getters", tuple((k, f.get) for k, f in self.fields.items()))

    @property
    def ref(self) -> JsonSchema:
        return {"$ref": f"#/components/schemas/{self.name}"}

    def dump(self, value: Any) -> dict[str, Any]:
        return {key: getattr(value, key) if get is None else get(value) for key, get in self._getters}

    def json_schema(self) -> JsonSchema:
        properties = {}
        for key, f in self.fields.items():
            properties[key] = {**f.schema, "description": f.description} if f.description else f.schema
        schema: JsonSchema = {"type": "object", "additionalProperties": False, "required": list(self.fields), "properties": properties}
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


def nested(document: Document, attr: str, *, optional: bool = False) -> Field:
    """A field holding one ``document`` read from attribute ``attr``."""
    dump = document.dump

    def get(value: Any) -> Any:
        inner = getattr(value, attr)
        return None if inner is None else dump(inner)

    return Field(nullable(document.ref) if optional else document.ref, get)


def listed(document: Document, attr: str) -> Field:
    """A field holding a list of ``document``s read from the iterable attribute ``attr``."""
    dump = document.dump
    return Field(array(document.ref), lambda value: [dump(x) for x in getattr(value, attr)])


def level_text(level: LinkLevel | None) -> str | None:
    return None if level is None else str(level)


def _hex(digits: int, attr: str) -> Field:
    def get(value: Any) -> str | None:
        number = getattr(value, attr)
        return None if number is None else f"0x{number:0{digits}x}"

    return Field(nullable(STRING), get)


def _plain_list(attr: str, items: JsonSchema, description: str | None = None) -> Field:
    return Field(array(items), lambda value: list(getattr(value, attr)), description)


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
    "distances": _plain_list("distances", INTEGER),
    "cpuless": Field(BOOLEAN),
    "same_cpus_as": _plain_list("same_cpus_as", INTEGER),
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
    "interfaces": _plain_list("interfaces", STRING),
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
    "processes": _plain_list("processes", INTEGER),
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
    "netdevs": _plain_list("netdevs", STRING),
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
    "nearest_gpus": _plain_list("nearest_gpus", STRING),
}, "A network interface from /sys/class/net, RDMA or not.")

NVLINK_DOMAIN = Document("NvlinkDomain", {
    "cluster_uuid": Field(STRING, description="NVML's GPU fabric cluster UUID"),
    "clique_id": Field(nullable(INTEGER), description="the clique (NVLink partition) within the cluster"),
    "gpus": _plain_list("gpus", STRING),
}, "The multi-node NVLink domain (GB200 NVL72-class): nodes with the same cluster UUID and clique id are NVLink neighbours.")

NEIGHBOUR = Document("PortNeighbour", {
    "source": Field(one_of(FabricSource), description="infiniband: the peer's own answer to directed-route SMPs (smpquery); lldp: what the switch announced"),
    "device": Field(nullable(STRING), description="InfiniBand: the local RDMA device (mlx5_0)"),
    "port": Field(nullable(INTEGER), description="InfiniBand: the local port number"),
    "interface": Field(nullable(STRING), description="LLDP: the local interface"),
    "switch_id": Field(STRING, description="InfiniBand: the peer's node GUID; LLDP: its chassis id"),
    "switch_name": Field(nullable(STRING), description="InfiniBand: the peer's node description; LLDP: its system name"),
    "switch_port": Field(nullable(STRING), description="the peer's port: an InfiniBand port number, an LLDP port id (Ethernet1/5)"),
    "switch_kind": Field(one_of(("switch", "host", "router")), description="what the peer is (host: a back-to-back cable)"),
}, "What is at the other end of one of the node's ports.")

RAIL = Document("Rail", {
    "rail": Field(INTEGER, lambda r: r.index, "numbered in the order of the node's NICs: rail 0 is the first NIC's"),
    "leaf": Field(STRING, description="the leaf switch's id (InfiniBand node GUID, LLDP chassis id)"),
    "leaf_name": Field(nullable(STRING), description="its description or system name; not unique across a fabric"),
    "nics": _plain_list("nics", STRING),
    "interfaces": _plain_list("interfaces", STRING),
    "gpus": _plain_list("gpus", STRING),
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

# --- the served topology: the node plus the agent's own state --------------------------------

PROBE_FIGURE = Document("ProbeFigure", {
    "kind": Field(one_of(ProbeKind)),
    "direction": Field(nullable(STRING), description='"0->1", "node0->3", "3->node0", "3"'),
    "src": Field(nullable(INTEGER), description="pair kinds: copied from this GPU"),
    "dst": Field(nullable(INTEGER), description="pair kinds: to this GPU"),
    "device": Field(nullable(INTEGER), description="local_copy, h2d, d2h: the one GPU"),
    "numa_node": Field(nullable(INTEGER), description="h2d, d2h: the host memory's NUMA node"),
    "size_bytes": Field(nullable(INTEGER), description="bytes per copy"),
    "unit": Field(nullable(one_of(Unit))),
    "median": Field(nullable(NUMBER), description="in unit"),
    "p10": Field(nullable(NUMBER)),
    "p90": Field(nullable(NUMBER)),
    "repetitions": Field(nullable(INTEGER)),
    "available": Field(nullable(BOOLEAN), description="peer_access: P2P possible"),
    "received_at": Field(nullable(NUMBER), description="Unix time the agent read it"),
    "taken_under_load": Field(BOOLEAN, lambda f: getattr(f, "taken_under_load", False), description=(
        "measured in a forced round while a busy GPU shared the copies' path: neither overlaid on the matrix nor judged "
        "(no degraded-link finding from it; a probed_under_load finding says so)")),
}, "A probe's figure: the largest size measured, median and spread of its repetitions.")

class _ServedFigure:
    """A probe figure as /topology serves it: with whether it was taken under load."""

    def __init__(self, figure: Any, taken_under_load: bool):
        self.figure = figure
        self.taken_under_load = taken_under_load

    def __getattr__(self, name: str) -> Any:
        return getattr(self.figure, name)


AGENT_STATE = Document("AgentState", {
    "snapshot_version": Field(INTEGER, lambda s: s.version, "increases with every swap"),
    "built_at": Field(NUMBER, description="Unix time the node's facts were collected"),
    "stale": Field(BOOLEAN, description="the last discovery failed; the facts are older"),
    "error": Field(nullable(STRING), description="why the last discovery failed"),
    "failed_at": Field(nullable(NUMBER)),
    "probe_figures": Field(array(PROBE_FIGURE.ref), lambda s: [
        PROBE_FIGURE.dump(_ServedFigure(f, s.taken_under_load(f))) for f in s.probe_figures
    ]),
})

TOPOLOGY = NODE.extended("Topology", {
    "agent": Field(AGENT_STATE.ref, lambda v: AGENT_STATE.dump(v.snapshot)),
}, "GET /topology: the node, then the agent's own state.")


@dataclass(frozen=True, slots=True)
class _ServedView(NodeView):
    """GET /topology's view: the node's, with the agent's snapshot."""

    snapshot: Snapshot | None = None


def node_document(node: NodeTopology, *, timings: bool = True) -> dict[str, Any]:
    """`topoagent discover --json`; ``timings=False`` leaves out how long each source took
    (for comparing two replays of one recording)."""
    return NODE.dump(NodeView.of(node, timings=timings))


def topology_document(snapshot: Snapshot) -> dict[str, Any]:
    """GET /topology."""
    node, matrix = snapshot.node, snapshot.matrix
    view = _ServedView(node, snapshot.findings, snapshot.collectors, snapshot.last_success_at, measured_by_name(matrix), True, snapshot)
    return TOPOLOGY.dump(view)


def measured_by_name(matrix: DistanceMatrix) -> dict[tuple[str, str], Measurement]:
    """The matrix's measurements keyed by GPU names, both orders."""
    out: dict[tuple[str, str], Measurement] = {}
    for (i, j), m in matrix.measured.items():
        a, b = matrix.gpus[i].name, matrix.gpus[j].name
        out[(a, b)] = out[(b, a)] = m
    return out


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
    from topoagent.levels import expected_gbps

    return None if level is None else expected_gbps(level)


TOPO_MATRIX = Document("TopoMatrix", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda m: SCHEMA_VERSION),
    "devices": listed(TOPO_DEVICE, "devices"),
    "pairs": Field(array(TOPO_PAIR.ref), lambda m: [TOPO_PAIR.dump(p) for p in m.pairs()], "every unordered device pair once"),
    "missing_rows": _plain_list("missing_rows", STRING),
    "notes": _plain_list("notes", STRING),
}, "`topoagent matrix --json`: an `nvidia-smi topo -m` output, parsed.")


def topo_matrix_document(matrix: TopoMatrix) -> dict[str, Any]:
    return TOPO_MATRIX.dump(matrix)


# --- leases ------------------------------------------------------------------------------------

LEASE = Document("Lease", {
    "id": Field(STRING),
    "owner": Field(STRING),
    "gpus": Field(array(INTEGER), lambda lease: list(lease.gpus), "nvidia-smi indices when granted, in rank order (for display)"),
    "gpu_uuids": Field(array(nullable(STRING)), lambda lease: list(lease.uuids), "what the lease holds: the same GPUs by UUID (empty when unknown)"),
    "created_at": Field(NUMBER, description="Unix time"),
    "expires_at": Field(NUMBER, description="Unix time"),
    "satisfaction": Field(nullable(NUMBER), description="the topology satisfaction of the placement it holds; null for GPUs leased by hand"),
})


def lease_document(lease: Lease) -> dict[str, Any]:
    return LEASE.dump(lease)


# --- placement answers (`/place`, `place --json`, `place --batch`) ------------------------------

REQUEST = Document("Request", {
    "gpus": Field(INTEGER),
    "pattern": Field(one_of(Pattern)),
    "min_level": Field(nullable(LEVEL), lambda r: level_text(r.min_level)),
    "single_numa": Field(BOOLEAN),
    "include": _plain_list("include", INTEGER),
    "exclude": _plain_list("exclude", INTEGER),
    "nics": Field(INTEGER),
    "affinity": Field(one_of(Affinity)),
    "fallback": Field(BOOLEAN),
    "message_bytes": Field(nullable(INTEGER), description="null: the default size (256 MiB for the estimate, 1 MiB per alltoall/pipeline message)"),
    "deadline_ms": Field(nullable(INTEGER), description="when the search stops with its best so far; null: no limit"),
}, "The request as understood (defaults filled in).")

PLACED_GPU = Document("PlacedGpu", {
    "rank": Field(INTEGER),
    "index": Field(INTEGER, description="nvidia-smi index"),
    "uuid": Field(nullable(STRING)),
    "pci_address": Field(nullable(STRING)),
    "numa_node": Field(nullable(INTEGER)),
    "nearest_nics": _plain_list("nearest_nics", STRING),
    "nic_level": Field(nullable(LEVEL), lambda g: level_text(g.nic_level)),
    "cpus": Field(nullable(STRING), description="this rank's own CPUs: its share of its NUMA node's, hyperthreads of a core together, no CPU in two ranks' lists"),
    "memory_node": Field(nullable(INTEGER), description="the NUMA node to bind this rank's memory to"),
    "nic": Field(nullable(STRING), description="this rank's NIC: the closest with a port up, distinct ones where several are as close"),
    "rail": Field(nullable(INTEGER), description="the rail of this rank's NIC (the node's fabric.rails); null when its leaf is unknown"),
    "numactl": _plain_list("numactl", STRING),
})

ESTIMATE = Document("Estimate", {
    "message_bytes": Field(INTEGER, description="the all-reduce size modelled"),
    "ring_gbps": Field(NUMBER, description="the ring's weakest link, GB/s per direction"),
    "hop_latency_us": Field(NUMBER, description="NCCL's per-step latency: 3.4 NVLink, 5.7 PCI"),
    "time_us": Field(NUMBER, description="one ring all-reduce of message_bytes"),
    "bus_bandwidth_gbps": Field(NUMBER, description="as nccl-tests reports busbw"),
}, "Ring all-reduce over the ranks in order, by NCCL's alpha-beta model (ring, Simple protocol): a model, not a measurement.")

LAUNCH = Document("Launch", {
    "torchrun_wrapper": Field(nullable(STRING), description="sh script: torchrun --nproc-per-node=K --no-python ./bind.sh python train.py"),
    "srun": _plain_list("srun", STRING),
    "srun_map_cpu": Field(nullable(STRING), description="--cpu-bind=map_cpu: one CPU per task (the first of each rank's list)"),
    "rankfile": Field(nullable(STRING), description="Open MPI rankfile (mpirun --rankfile FILE); slots are logical core indices"),
}, "Ready forms of the per-rank bindings, in rank order (null where CPUs or cores are unknown).")

PATTERN_LINK = Document("PatternLink", {
    "a": Field(INTEGER, lambda link: link.a_index, "nvidia-smi index"),
    "b": Field(INTEGER, lambda link: link.b_index, "nvidia-smi index"),
    "level": Field(LEVEL, lambda link: str(link.level)),
    "gbps": Field(NUMBER, description="per direction, measured when fresh, else expected"),
})

OBJECTIVE = Document("Objective", {
    "bandwidth_gbps": Field(nullable(NUMBER), description="(1) the pattern's weakest link"),
    "link_time_us": Field(nullable(NUMBER), description=(
        "(1) for alltoall and pipeline, what they are ranked by: one message of message_bytes (default 1 MiB) over the slowest "
        "link, small-copy latency + size / bandwidth; null for other patterns")),
    "bottleneck_level": Field(nullable(LEVEL), lambda o: level_text(o.bottleneck_level)),
    "numa_distance": Field(nullable(INTEGER), description=(
        "(2) the largest SLIT distance between the NUMA nodes spanned; null when the node has no distances")),
    "numa_nodes": Field(INTEGER, description="(3) NUMA nodes spanned"),
    "nic_cost": Field(INTEGER, description="(4) 0 when no NICs were asked for"),
    "damage": Field(INTEGER, description="(5) damage to the free zones"),
    "unverified_gpus": Field(INTEGER, description="(6) GPUs taken that a job gave back and the probes have not checked since"),
    "nic_traffic_steps": Field(INTEGER, description=(
        "(6) traffic now on the GPUs' nearest NICs, summed in tenths of each port's line rate (0 without telemetry)")),
}, "The terms of the objective for this answer, in the order they count.")

PLACEMENT = Document("Placement", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda p: SCHEMA_VERSION),
    "fit": Field({"type": "boolean", "const": True}, lambda p: True),
    "gpus": listed(PLACED_GPU, "gpus"),
    "pattern": Field(one_of(Pattern), lambda p: p.request.pattern),
    "bandwidth_gbps": Field(nullable(NUMBER)),
    "worst_level": Field(nullable(LEVEL), lambda p: level_text(p.worst_level)),
    "links": listed(PATTERN_LINK, "links"),
    "numa_nodes": Field(array({"type": ["integer", "string"]}), lambda p: list(p.numa_nodes)),
    "cpus": Field(nullable(STRING)),
    "nics": _plain_list("nics", STRING),
    "env": Field({"type": "object", "additionalProperties": STRING}, lambda p: dict(p.env)),
    "numactl": _plain_list("numactl", STRING),
    "score": Field(NUMBER, description="10 x bandwidth - loss, comparable across nodes"),
    "objective": nested(OBJECTIVE, "objective"),
    "broken_zones": _plain_list("broken_zones", STRING),
    "affinity": Field(one_of(Affinity), description="the strictest tier the answer meets: best, better or any"),
    "satisfaction": Field({"type": "number", "minimum": 0, "maximum": 1},
                          description="share of the pattern's links that are local (NVLink or one PCIe switch, PIX); 1 without links"),
    "estimate": nested(ESTIMATE, "estimate", optional=True),
    "proven_optimal": Field(BOOLEAN, description="false: the deadline stopped the search; this is the best set it found"),
    "bandwidth_bound_gbps": Field(nullable(NUMBER),
                                  description="when not proven: no set's pattern bandwidth exceeds this; null when proven or not bounded"),
    "unverified": _plain_list("unverified", INTEGER, "chosen GPUs a job gave back that the probes have not checked since "
                                                     "(taken only when no set of verified GPUs has equal merit)"),
    "launch": nested(LAUNCH, "launch"),
    "explain": Field(array(STRING), lambda p: list(p.explain), "the reasons, in words"),
    "request": nested(REQUEST, "request"),
}, "Which GPUs, in rank order, with the CPUs, NICs and launch environment to use.")

NOFIT = Document("NoFit", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda n: SCHEMA_VERSION),
    "fit": Field({"type": "boolean", "const": False}, lambda n: False),
    "reason": Field(STRING),
    "constraint": Field(STRING, description="the request field that cannot hold"),
    "free": _plain_list("free", INTEGER),
    "best_available": nested(PLACEMENT, "best_available", optional=True),
    "request": nested(REQUEST, "request", optional=True),
}, "Why the request cannot be met now, and the best answer without the failing constraint.")


def answer_document(answer: Placement | NoFit) -> dict[str, Any]:
    """A placement answer at every door (HTTP, `place --json`, each `--batch` line)."""
    return PLACEMENT.dump(answer) if answer.fit else NOFIT.dump(answer)


REQUEST_ERROR_DETAIL = Document("RequestErrorDetail", {
    "line": Field(INTEGER, description="the input line (1 = first)"),
    "field": Field(nullable(STRING), description="the request field, with a list position: include[1]"),
    "message": Field(STRING),
})

BATCH_ERROR = Document("BatchError", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda e: SCHEMA_VERSION),
    "error": Field(REQUEST_ERROR_DETAIL.ref, lambda e: REQUEST_ERROR_DETAIL.dump(e)),
}, "A `place --batch` line that is not a valid request.")


@dataclass(frozen=True, slots=True)
class BatchLineError:
    """A `place --batch` input line that is not a valid request."""

    line: int
    field: str | None
    message: str


def batch_error_document(line: int, field: str | None, message: str) -> dict[str, Any]:
    return BATCH_ERROR.dump(BatchLineError(line, field, message))


# --- a probe round (`topoagent probe --json`) --------------------------------------------------

@functools.cache
def probe_documents() -> tuple[Document, ...]:
    """The probe round's documents, built on first use: they name the probe worker's
    record types, which one-shot commands such as `discover` should not load."""
    from topoagent.probes.figures import WIRE_NAMES, FailureKind, ProbeFigure, ProbeSkip

    result = dataclass_document("ProbeResult", ProbeFigure, renames=WIRE_NAMES,
                                description="One figure as the worker measured it (fields as on the worker's line).")
    skip = dataclass_document("ProbeSkip", ProbeSkip, renames=WIRE_NAMES)
    failure = Document("ProbeFailure", {
        "kind": Field(one_of(FailureKind)),
        "message": Field(STRING),
        "exit_code": Field(nullable(INTEGER)),
    }, "Why the round ended early.")
    return result, skip, failure, _probe_round(result, skip, failure)


PROBE_PAIR = Document("ProbePair", {
    "a": Field(STRING),
    "b": Field(STRING),
    "level": Field(LEVEL, lambda p: str(p.level)),
    "expected_gbps": Field(nullable(NUMBER)),
    "measured_gbps": Field(nullable(NUMBER)),
    "bandwidth_gbps": Field(nullable(NUMBER), description=(
        "what placement ranks by: expected, unless a fresh measurement is clearly below what the level "
        "achieves (then measured / the achievable fraction, on the same peak scale)")),
})


@dataclass(frozen=True, slots=True)
class ProbePairView:
    """A GPU pair in a probe round: its level, expectation and measurement."""

    a: str
    b: str
    level: LinkLevel
    expected_gbps: float | None
    measured_gbps: float | None
    bandwidth_gbps: float | None


@dataclass(frozen=True, slots=True)
class _RoundView:
    """What `probe --json` shows: the round, its pairs and findings."""

    round: ProbeRound
    pairs: tuple[ProbePairView, ...] | None
    findings: tuple[Finding, ...]


def _probe_round(result: Document, skip: Document, failure: Document) -> Document:
    return Document("ProbeRound", {
        "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda v: SCHEMA_VERSION),
        "backend": Field(STRING, lambda v: v.round.backend),
        "started_at": Field(NUMBER, lambda v: v.round.started_at, "Unix time"),
        "duration_s": Field(NUMBER, lambda v: round(v.round.duration_s, 6)),
        "worker": Field(nullable({"type": "object"}), lambda v: dict(v.round.worker) if v.round.worker else None,
                        "the worker's hello: backend, torch version, devices"),
        "failure": Field(nullable(failure.ref), lambda v: failure.dump(v.round.failure) if v.round.failure else None),
        "figures": Field(array(result.ref), lambda v: [result.dump(f) for f in v.round.figures()],
                         "one per measurement and direction: the largest size"),
        "results": Field(array(result.ref), lambda v: [result.dump(f) for f in v.round.results]),
        "skipped": Field(array(skip.ref), lambda v: [skip.dump(f) for f in v.round.skipped]),
        "pairs": Field(nullable(array(PROBE_PAIR.ref)), lambda v: None if v.pairs is None else [PROBE_PAIR.dump(p) for p in v.pairs],
                       "with a topology: each GPU pair's level, expectation and measurement"),
        "findings": Field(array(FINDING.ref), lambda v: [FINDING.dump(f) for f in v.findings]),
    }, "`topoagent probe --json`: one round of measurements.")


def probe_round_document(probe_round: ProbeRound, pairs: Iterable[ProbePairView] | None, findings: Iterable[Finding]) -> dict[str, Any]:
    return probe_documents()[3].dump(_RoundView(probe_round, None if pairs is None else tuple(pairs), tuple(findings)))


# --- capacity (`GET /capacity`) ----------------------------------------------------------------

CAPACITY_FIT = Document("CapacityFit", {
    "gpus": Field(INTEGER, description="k: a k-GPU all-reduce job"),
    "fits": Field(BOOLEAN, description="whether it fits on the free GPUs now; every figure below is null when not"),
    "indices": Field(array(INTEGER), lambda f: list(f.indices), "the GPUs the best answer takes (nvidia-smi indices)"),
    "score": Field(nullable(NUMBER), description="the best answer's score, as /place gives it: comparable across nodes"),
    "bandwidth_gbps": Field(nullable(NUMBER), description="its ring's weakest link, GB/s per direction (null for one GPU)"),
    "numa_distance": Field(nullable(INTEGER), description="its largest SLIT distance between the NUMA nodes spanned"),
    "affinity": Field(nullable(one_of(Affinity)), description="the strictest tier it meets"),
    "satisfaction": Field(nullable({"type": "number", "minimum": 0, "maximum": 1}), description="share of its ring's links that are local"),
}, "The best placement for k GPUs now.")

CAPACITY = Document("Capacity", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda c: SCHEMA_VERSION),
    "snapshot_version": Field(INTEGER, lambda v: v.snapshot_version, "the /topology snapshot these figures are of"),
    "gpus": Field(INTEGER, lambda v: v.capacity.gpus, "GPUs on the node"),
    "free": Field(array(INTEGER), lambda v: list(v.capacity.free), "not leased, running no process, without a critical finding"),
    "free_gpus": Field(INTEGER, lambda v: len(v.capacity.free)),
    "leased": Field(array(INTEGER), lambda v: list(v.capacity.leased)),
    "running": Field(array(INTEGER), lambda v: list(v.capacity.running), "running processes the agent did not place"),
    "unhealthy": Field(array(INTEGER), lambda v: list(v.capacity.unhealthy), "otherwise free, kept off by a critical finding"),
    "largest_free_zone": Field(array(INTEGER), lambda v: list(v.capacity.largest_free_zone),
                               "the largest group of free GPUs joined by NVLink among themselves"),
    "largest_free_zone_gpus": Field(INTEGER, lambda v: len(v.capacity.largest_free_zone)),
    "fragmentation": Field({"type": "number", "minimum": 0, "maximum": 1}, lambda v: v.capacity.fragmentation,
                           "1 - largest_free_zone_gpus / free_gpus (0 when nothing is free)"),
    "fits": Field(array(CAPACITY_FIT.ref), lambda v: [CAPACITY_FIT.dump(f) for f in v.capacity.fits], "k = 1 .. gpus"),
}, "What this node can take now, for cluster schedulers (`GET /capacity`).")


@dataclass(frozen=True, slots=True)
class _CapacityView:
    """GET /capacity's view: the figures and the snapshot they are of."""

    snapshot_version: int
    capacity: Capacity


def capacity_document(snapshot_version: int, capacity: Capacity) -> dict[str, Any]:
    return CAPACITY.dump(_CapacityView(snapshot_version, capacity))


# --- errors ------------------------------------------------------------------------------------

ERROR = Document("Error", {
    "error": Field(STRING, description="a short code: bad_request, no_fit, not_ready, ..."),
    "detail": Field(STRING, description="what was wrong; names the field"),
})

# Every document above, for the OpenAPI components.
DOCUMENTS: tuple[Document, ...] = (
    PCIE_LINK, NUMA_NODE, PCI_DEVICE, NVLINK, GPU, IB_PORT, NIC, INTERFACE, NVLINK_DOMAIN, NEIGHBOUR, RAIL, FABRIC, CPU, FINDING, PAIR, COLLECTOR, NODE,
    PROBE_FIGURE, AGENT_STATE, TOPOLOGY, TOPO_DEVICE, TOPO_PAIR, TOPO_MATRIX, LEASE, ERROR,
    REQUEST, PLACED_GPU, PATTERN_LINK, OBJECTIVE, ESTIMATE, LAUNCH, PLACEMENT, NOFIT, REQUEST_ERROR_DETAIL, BATCH_ERROR,
    CAPACITY_FIT, CAPACITY,
)


def component_schemas() -> dict[str, JsonSchema]:
    return {d.name: d.json_schema() for d in (*DOCUMENTS, PROBE_PAIR, *probe_documents())}
