"""The documents the agent adds to the node's: the served topology, leases, placement
answers, capacity, probe rounds and errors.

Built from the table machinery in topoagent.documents.schema, like the node's documents, and kept
in a module of their own so that `discover` and `matrix`, which print only the node's, do
not build these tables at start-up.  ``component_schemas`` gathers every document of
both modules for the OpenAPI document.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from topoagent.documents import schema
from topoagent.documents.schema import (
    BOOLEAN,
    FINDING,
    INTEGER,
    LEVEL,
    NODE,
    NUMBER,
    SCHEMA_VERSION,
    STRING,
    Document,
    Field,
    JsonSchema,
    NodeView,
    array,
    dataclass_document,
    level_text,
    listed,
    nested,
    nullable,
    one_of,
    plain_list,
)
from topoagent.node.levels import LinkLevel
from topoagent.placement.explain import ReasonCode
from topoagent.vocabulary import DETAIL_ALL, DETAIL_PURPOSE, Affinity, Detail, EstimateModel, Pattern, ProbeKind, Unit

if TYPE_CHECKING:
    from topoagent.node.matrix import DistanceMatrix, Measurement
    from topoagent.node.model import Finding
    from topoagent.placement import NoFit, Placement
    from topoagent.probes.runner import ProbeRound
    from topoagent.service.capacity import Capacity
    from topoagent.service.leases import Lease
    from topoagent.service.served import Snapshot


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
    "include": plain_list("include", INTEGER),
    "exclude": plain_list("exclude", INTEGER),
    "nics": Field(INTEGER),
    "affinity": Field(one_of(Affinity)),
    "fallback": Field(BOOLEAN),
    "message_bytes": Field(nullable(INTEGER), description="null: the default size (256 MiB for allreduce's estimate, 1 MiB per alltoall/pipeline message)"),
    "deadline_ms": Field(nullable(INTEGER), description="when the search stops with its best so far; null: no limit"),
    "detail": Field(array(one_of(Detail)), lambda r: list(r.detail), "the answer's sections asked for beyond the lean one (`all` spelt out)"),
}, "The request as understood (defaults filled in).")

PLACED_GPU = Document("PlacedGpu", {
    "rank": Field(INTEGER),
    "index": Field(INTEGER, description="nvidia-smi index"),
    "uuid": Field(nullable(STRING)),
    "pci_address": Field(nullable(STRING)),
    "numa_node": Field(nullable(INTEGER)),
    # Detail.BINDINGS: the rank's binding.
    "nearest_nics": plain_list("nearest_nics", STRING, "the closest of the job's NICs to this GPU (with `nics` asked: of those chosen)",
                               section=Detail.BINDINGS),
    "nic_level": Field(nullable(LEVEL), lambda g: level_text(g.nic_level), "the level between this GPU and `nic`", Detail.BINDINGS),
    "cpus": Field(nullable(STRING), description="this rank's own CPUs: its share of its NUMA node's, hyperthreads of a core together, "
                  "no CPU in two ranks' lists", section=Detail.BINDINGS),
    "memory_node": Field(nullable(INTEGER), description="the NUMA node to bind this rank's memory to", section=Detail.BINDINGS),
    "nic": Field(nullable(STRING), description="this rank's NIC: the closest of the job's NICs with a port up, distinct ones where "
                 "several are as close", section=Detail.BINDINGS),
    "rail": Field(nullable(INTEGER), description="the rail of this rank's NIC (the node's fabric.rails); null when its leaf is unknown",
                  section=Detail.BINDINGS),
    "numactl": plain_list("numactl", STRING, section=Detail.BINDINGS),
}, "One rank: its GPU, and with `detail` `bindings` its CPUs, memory node and NIC.")

ESTIMATE = Document("Estimate", {
    "model": Field(one_of(EstimateModel), description=(
        "ring_allreduce (allreduce: NCCL's ring model), alltoall (one message to each peer, a rank's sends in turn), "
        "pipeline_p2p (one message per stage, the slowest stage sets the pace); independent jobs get no estimate")),
    "message_bytes": Field(INTEGER, description="ring_allreduce: the all-reduce size; alltoall, pipeline_p2p: one message"),
    "link_gbps": Field(NUMBER, description="the weakest link the model uses, GB/s per direction"),
    "latency_us": Field(NUMBER, description=(
        "ring_allreduce: NCCL's per-step latency (3.4 NVLink, 5.7 PCI); else the largest small-copy latency of its links")),
    "time_us": Field(NUMBER, description=(
        "ring_allreduce: one all-reduce; alltoall: one exchange; pipeline_p2p: one message through the slowest stage")),
    "bus_bandwidth_gbps": Field(NUMBER, description="as nccl-tests reports busbw for the pattern's collective"),
    "ring_gbps": Field(nullable(NUMBER), description="ring_allreduce: the ring's weakest link (= link_gbps); null for other models"),
    "hop_latency_us": Field(nullable(NUMBER), description="ring_allreduce: NCCL's per-step latency (= latency_us); null for other models"),
}, "The pattern's own model over the ranks in order (placement.tiers): a model of the node's links, not a measurement.")

LAUNCH = Document("Launch", {
    "torchrun_wrapper": Field(nullable(STRING), description="sh script: torchrun --nproc-per-node=K --no-python ./bind.sh python train.py"),
    "srun": plain_list("srun", STRING),
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

# A placement answer is lean unless the request's ``detail`` names sections (Detail): the
# fields without a section are the choice a scheduler reads; a field with one is written,
# and its rendering run, only when asked.
PLACEMENT = Document("Placement", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda p: SCHEMA_VERSION),
    "fit": Field({"type": "boolean", "const": True}, lambda p: True),
    "gpus": listed(PLACED_GPU, "gpus"),
    "pattern": Field(one_of(Pattern), lambda p: p.request.pattern),
    "bandwidth_gbps": Field(nullable(NUMBER)),
    "worst_level": Field(nullable(LEVEL), lambda p: level_text(p.worst_level)),
    "links": listed(PATTERN_LINK, "links", section=Detail.EXPLAIN),
    "numa_nodes": Field(array({"type": ["integer", "string"]}), lambda p: list(p.numa_nodes), section=Detail.BINDINGS),
    "cpus": Field(nullable(STRING), section=Detail.BINDINGS),
    "nics": plain_list("nics", STRING, section=Detail.BINDINGS),
    "env": Field({"type": "object", "additionalProperties": STRING}, lambda p: dict(p.env), section=Detail.BINDINGS),
    "numactl": plain_list("numactl", STRING, section=Detail.BINDINGS),
    "score": Field(NUMBER, description="10 x bandwidth - loss, comparable across nodes"),
    "objective": nested(OBJECTIVE, "objective"),
    "broken_zones": plain_list("broken_zones", STRING, section=Detail.EXPLAIN),
    "affinity": Field(one_of(Affinity), description="the strictest tier the answer meets: best, better or any"),
    "satisfaction": Field({"type": "number", "minimum": 0, "maximum": 1},
                          description="share of the pattern's links that are local (NVLink or one PCIe switch, PIX); 1 without links"),
    "estimate": nested(ESTIMATE, "estimate", optional=True, section=Detail.EXPLAIN),
    "proven_optimal": Field(BOOLEAN, description="false: the deadline stopped the search; this is the best set it found"),
    "bandwidth_bound_gbps": Field(nullable(NUMBER),
                                  description="when not proven: no set's pattern bandwidth exceeds this; null when proven or not bounded"),
    "unverified": plain_list("unverified", INTEGER, "chosen GPUs a job gave back that the probes have not checked since "
                                                     "(taken only when no set of verified GPUs has equal merit)"),
    "reasons": Field(array(one_of(ReasonCode)), lambda p: [r.code for r in p.reasons],
                     "why the answer is what it is, by code, in the order `explain` words them"),
    "launch": nested(LAUNCH, "launch", section=Detail.LAUNCH),
    "explain": Field(array(STRING), lambda p: list(p.explain), "the reasons, in words", Detail.EXPLAIN),
    "request": nested(REQUEST, "request", section=Detail.EXPLAIN),
}, "Which GPUs, in rank order, and why by code; with the request's `detail`, the bindings, launch forms and explanation.")

NOFIT = Document("NoFit", {
    "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda n: SCHEMA_VERSION),
    "fit": Field({"type": "boolean", "const": False}, lambda n: False),
    "reason": Field(STRING),
    "constraint": Field(STRING, description="the request field that cannot hold"),
    "never_fits": Field(BOOLEAN, description=(
        "true: it would not fit with every GPU free either (the same search on the idle node), so waiting will not help "
        "and `reason` is the idle node's; false: it may fit once busy GPUs are given back")),
    "free": plain_list("free", INTEGER),
    "best_available": nested(PLACEMENT, "best_available", optional=True),
    "request": nested(REQUEST, "request", optional=True, section=Detail.EXPLAIN),
}, "Why the request cannot be met now (or ever, on this node), and the best answer without the failing constraint "
   "(with the sections the request's `detail` names).")


def _holds(field: Field) -> str:
    """The fields of the document a nested or listed field holds, as " (`a`, `b`)"."""
    schema = field.schema.get("items", field.schema)
    refs = [part["$ref"] for part in (schema, *schema.get("anyOf", ())) if "$ref" in part]
    if not refs:
        return ""
    document = next(d for d in DOCUMENTS if d.ref["$ref"] == refs[0])
    return " (" + ", ".join(f"`{name}`" for name in document.fields) + ")"


def sections_table() -> str:
    """docs/placement.md's table of what each section a request's ``detail`` names adds to
    the answer (markdown), from the fields' own sections above."""
    lines = ["| section | for | adds |", "|---|---|---|"]
    for section in Detail:
        rank = [f"`{name}`{_holds(f)}" for name, f in PLACED_GPU.fields.items() if f.section == section]
        job = [f"`{name}`{_holds(f)}" for name, f in PLACEMENT.fields.items() if f.section == section]
        said = ([f"per rank: {', '.join(rank)}"] if rank else []) + ([("for the job: " if rank else "") + ", ".join(job)] if job else [])
        lines.append(f"| `{section}` | {DETAIL_PURPOSE[section]} | {'; '.join(said)} |")
    lines.append(f"| `{DETAIL_ALL}` | every section | |")
    return "\n".join(lines) + "\n"


def answer_document(answer: Placement | NoFit) -> dict[str, Any]:
    """A placement answer at every door (HTTP, `place --json`, each `--batch` line, the
    scheduler integrations through HTTP): lean, with the sections its request's ``detail``
    names (a NoFit's best answer too)."""
    sections = answer.request.detail
    return PLACEMENT.dump(answer, sections) if answer.fit else NOFIT.dump(answer, sections)


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
class ProbedGpu:
    """A GPU a probe round measured, as the node names it."""

    index: int  # the nvidia-smi index
    uuid: str | None
    pci_address: str | None


@dataclass(frozen=True, slots=True)
class ProbedNode:
    """Which node a probe round's figures belong to, so they are never laid over another's."""

    hostname: str | None
    gpus: tuple[ProbedGpu, ...]


PROBED_GPU = Document("ProbedGpu", {
    "index": Field(INTEGER, description="nvidia-smi index"),
    "uuid": Field(nullable(STRING), description="GPU-...; null when the source does not give it (nvidia-smi topo text)"),
    "pci_address": Field(nullable(STRING), description="0000:07:00.0; null when unknown"),
}, "A GPU of the node a probe round was taken on.")

PROBED_NODE = Document("ProbedNode", {
    "hostname": Field(nullable(STRING), description="the node's name; null when unknown"),
    "gpus": Field(array(PROBED_GPU.ref), lambda n: [PROBED_GPU.dump(g) for g in n.gpus],
                  "the node's GPUs the figures name (empty: the cpu backend's stand-ins, no GPU)"),
}, "The node a probe round was taken on: `place --measured` refuses figures from another node.")


@dataclass(frozen=True, slots=True)
class _RoundView:
    """What `probe --json` shows: the round, its node, pairs and findings."""

    round: ProbeRound
    node: ProbedNode | None
    pairs: tuple[ProbePairView, ...] | None
    findings: tuple[Finding, ...]


def _probe_round(result: Document, skip: Document, failure: Document) -> Document:
    return Document("ProbeRound", {
        "schema_version": Field({"type": "integer", "const": SCHEMA_VERSION}, lambda v: SCHEMA_VERSION),
        "backend": Field(STRING, lambda v: v.round.backend),
        "node": Field(nullable(PROBED_NODE.ref), lambda v: None if v.node is None else PROBED_NODE.dump(v.node),
                      "the node the figures were taken on (hostname, GPUs); files written before this field lack it"),
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


def probe_round_document(
    probe_round: ProbeRound, pairs: Iterable[ProbePairView] | None, findings: Iterable[Finding], node: ProbedNode | None = None,
) -> dict[str, Any]:
    return probe_documents()[3].dump(_RoundView(probe_round, node, None if pairs is None else tuple(pairs), tuple(findings)))


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
    "proven_optimal": Field(BOOLEAN, description="false when the capacity budget (`[placement] capacity_budget_ms`) stopped this k's search: "
                            "the best set found in time, as /place marks it; with `fits` false, none was found in time (no proof that none fits)"),
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
                               "the largest group of free GPUs joined by local links among themselves: NVLink or one PCIe switch (PIX)"),
    "largest_free_zone_gpus": Field(INTEGER, lambda v: len(v.capacity.largest_free_zone)),
    "fragmentation": Field({"type": "number", "minimum": 0, "maximum": 1}, lambda v: v.capacity.fragmentation,
                           "1 - largest_free_zone_gpus / free_gpus (0 when nothing is free)"),
    "fits": Field(array(CAPACITY_FIT.ref), lambda v: [CAPACITY_FIT.dump(f) for f in v.capacity.fits], "k = 1 .. gpus"),
    "stale": Field(BOOLEAN, lambda v: v.stale,
                   "true when these are the figures of an earlier snapshot or busy set: the current ones were still being computed "
                   "when this answer's wait ran out (docs/http-api.md: GET /capacity)"),
}, "What this node can take now, for cluster schedulers (`GET /capacity`).")


@dataclass(frozen=True, slots=True)
class _CapacityView:
    """GET /capacity's view: the figures and the snapshot they are of."""

    snapshot_version: int
    capacity: Capacity
    stale: bool = False


def capacity_document(snapshot_version: int, capacity: Capacity, stale: bool = False) -> dict[str, Any]:
    return CAPACITY.dump(_CapacityView(snapshot_version, capacity, stale))


# --- errors ------------------------------------------------------------------------------------

ERROR = Document("Error", {
    "error": Field(STRING, description="a short code: bad_request, no_fit, not_ready, ..."),
    "detail": Field(STRING, description="what was wrong; names the field"),
})


# Every document above, for the OpenAPI components.
DOCUMENTS: tuple[Document, ...] = (
    PROBE_FIGURE, AGENT_STATE, TOPOLOGY, LEASE, ERROR,
    REQUEST, PLACED_GPU, PATTERN_LINK, OBJECTIVE, ESTIMATE, LAUNCH, PLACEMENT, NOFIT, REQUEST_ERROR_DETAIL, BATCH_ERROR,
    CAPACITY_FIT, CAPACITY,
)


def component_schemas() -> dict[str, JsonSchema]:
    return {d.name: d.json_schema() for d in (*schema.DOCUMENTS, *DOCUMENTS, PROBE_PAIR, PROBED_GPU, PROBED_NODE, *probe_documents())}
