"""The words topoagent says, each written once: collector status, finding severity and
kind, communication pattern.  Every module, every JSON document, the OpenAPI document
and the metrics take them from here.

They are ``StrEnum``s: a member *is* its string, so JSON, Prometheus labels and
comparisons with plain strings need no conversion.
"""

from __future__ import annotations

import enum

# The extended resource a pod asks for GPUs by: what the device plugin registers with kubelet
# and the extender reads from a pod's limits (both take --resource-name to change it).
GPU_RESOURCE = "nvidia.com/gpu"
# The highest GPU index a request or a lease may name: far above any node's GPU count.
GPU_INDEX_MAX = 1023


class Status(enum.StrEnum):
    """How a collector's read went (node_exporter's rule: an absent source is quiet)."""

    OK = "ok"
    NO_DATA = "no_data"  # the source is simply absent on this node: still a success
    ERROR = "error"


class Severity(enum.StrEnum):
    """How much a finding matters, least first.

    ``critical``: placement keeps off the GPU or link it names (a GPU off the fabric, a
    link far below its level, a source that failed); ``warning``: worth a look, the
    figures already account for it; ``info``: how the node is, not a fault.
    """

    INFO = "info"
    WARNING = "warning"
    CRITICAL = "critical"


class FindingKind(enum.StrEnum):
    """What a finding is about.  Discovery's kinds, then the probes'."""

    COLLECTOR_ERROR = "collector-error"
    GPU_NOT_IN_SYSFS = "gpu-not-in-sysfs"
    NVLINK_UNKNOWN = "nvlink-unknown"
    LEVEL_DISAGREEMENT = "level-disagreement"
    NVLINK_DOWN = "nvlink-down"
    GPU_OUTSIDE_FABRIC = "gpu-outside-fabric"
    PCIE_DEGRADED = "pcie-degraded"
    PCIE_SLOW = "pcie-slow"
    IB_PORT_DOWN = "ib-port-down"
    LINKS_UNKNOWN = "links-unknown"
    DUPLICATE_GPU = "duplicate-gpu"  # a source lists one GPU twice, or two GPUs with one identity
    NUMA_DISAGREEMENT = "numa-disagreement"  # NVML and sysfs place a device on different NUMA nodes
    GPU_UNLEASABLE = "gpu-unleasable"  # its identity (UUID, index) cannot be stored in a lease: never leased
    # A witness the node's answers rest on is missing (topoagent/node/findings.py).
    GPU_STACK_MISSING = "gpu-stack-missing"  # GPUs on the PCI bus, but neither NVML nor nvidia-smi answers
    NO_GPUS = "no-gpus"  # a GPU node that shows no GPU at all
    GPUDIRECT_MISSING = "gpudirect-missing"  # RDMA NICs and GPUs, no peer-memory module loaded
    NVSWITCH_NO_NVLINK = "nvswitch-no-nvlink"  # NVSwitches on the PCI bus, no GPU with an active NVLink
    FABRIC_NOT_READY = "fabric-not-ready"  # NVML: a GPU's NVLink fabric registration not completed
    # From measurements (probes/overlay.py).
    DEGRADED_LINK = "degraded_link"
    LEVEL_CONTRADICTION = "level_contradiction"
    NO_PEER_ACCESS = "no_peer_access"
    HOST_LINK_DEGRADED = "host_link_degraded"
    NUMA_AFFINITY_MISMATCH = "numa_affinity_mismatch"
    HIGH_LATENCY = "high_latency"
    LINK_DECAY = "link_decay"
    PROBED_UNDER_LOAD = "probed_under_load"  # info: figures not judged (a busy GPU shared the path)
    PROBES_UNAVAILABLE = "probes_unavailable"  # warning: probes are on but the worker cannot import torch
    # From counters' rates (the thresholds the counter sources declare: collectors/registry.py).
    IB_ERRORS_RISING = "ib-errors-rising"
    NVLINK_ERRORS_RISING = "nvlink-errors-rising"
    PCIE_AER_ERRORS = "pcie-aer-errors"
    GPU_XID = "gpu-xid"
    GPU_ECC_UNCORRECTED = "gpu-ecc-uncorrected"
    GPU_ROW_REMAP_FAILED = "gpu-row-remap-failed"
    COUNTER_STUCK = "counter-stuck"  # a counter saturated, or frozen while its port carries traffic


# Critical findings no placement can route around (it keeps off a GPU a finding names, but
# not off a node whose GPUs it cannot see, nor one whose NVLink fabric is down or not yet
# up, where CUDA itself may not start): while one stands, the node is not ready for
# placement (GET /readyz says why), /capacity has no figures, exports that state every
# pair's links are held back, and the device plugin reports every GPU Unhealthy.  Here,
# beside the kinds, so the agent (topoagent.node.findings) and the cluster side read one set.
PLACEMENT_BLOCKERS = frozenset({FindingKind.GPU_STACK_MISSING, FindingKind.NO_GPUS,
                                FindingKind.NVSWITCH_NO_NVLINK, FindingKind.FABRIC_NOT_READY})
# The error code of the 503 a blocked node answers (/readyz, /place, /capacity): a refusal
# its clients (extender, Slurm prolog) pass on with the agent's detail, never a silence to retry.
NOT_READY_FOR_PLACEMENT = "not_ready_for_placement"


class FabricSource(enum.StrEnum):
    """Who said what is at the other end of a network port."""

    INFINIBAND = "infiniband"  # directed-route SMPs to the port's peer (smpquery)
    LLDP = "lldp"  # what the switch announced, as lldpd heard it (lldpctl)


class PeerKind(enum.StrEnum):
    """What is at the other end of a network port (a neighbour's ``switch_kind``): only a
    switch is a leaf, and only leaves make rails (topoagent.node.fabric)."""

    SWITCH = "switch"  # InfiniBand NodeType 2; LLDP: a peer that bridges or routes, or says nothing
    HOST = "host"  # InfiniBand channel adapter, LLDP station: a back-to-back cable
    ROUTER = "router"  # InfiniBand NodeType 3


class Pattern(enum.StrEnum):
    """How a job's ranks talk, which decides which of its links matter."""

    ALLREDUCE = "allreduce"  # a ring: every consecutive pair and the last back to the first
    ALLTOALL = "alltoall"  # every pair
    PIPELINE = "pipeline"  # a path: consecutive pairs
    INDEPENDENT = "independent"  # no links

    @property
    def shape(self) -> str:
        """The word for the links this pattern uses ('ring', 'path', 'all pairs', 'none')."""
        return {"allreduce": "ring", "alltoall": "all pairs", "pipeline": "path", "independent": "none"}[self.value]

    @property
    def latency_bound(self) -> bool:
        """Whether its links are ranked by one message's time, not bandwidth alone
        (many messages between pairs, often small: topoagent.placement.latency)."""
        return self in (Pattern.ALLTOALL, Pattern.PIPELINE)


class EstimateModel(enum.StrEnum):
    """Which model an answer's estimate is, by the request's pattern (placement.tiers)."""

    RING_ALLREDUCE = "ring_allreduce"  # allreduce: NCCL's ring model
    ALLTOALL = "alltoall"  # one message to each peer, a rank's sends in turn
    PIPELINE_P2P = "pipeline_p2p"  # one message per stage; the slowest stage sets the pace


class Affinity(enum.StrEnum):
    """How close a job's GPUs must be (a request's ``affinity``); tiers from strictest.
    topoagent.placement.tiers says exactly what each one requires."""

    BEST = "best"  # every pattern link at the node's best level, one NUMA node
    BETTER = "better"  # no pattern link crosses the socket interconnect; one socket
    ANY = "any"  # whatever fits

    def fallbacks(self) -> tuple[Affinity, ...]:
        """The tiers below this one, strictest first: what ``fallback`` may settle for."""
        order = list(Affinity)
        return tuple(order[order.index(self) + 1 :])


class Detail(enum.StrEnum):
    """The sections a placement answer adds when the request's ``detail`` names them; the
    lean answer (the choice, its objective and reasons by code) is always there.  Which fields
    each section holds is said once, beside the fields (topoagent.documents.agent; its
    sections_table() renders docs/placement.md's table)."""

    BINDINGS = "bindings"
    LAUNCH = "launch"
    EXPLAIN = "explain"


# What each section is for (docs/placement.md's table says it beside the fields it adds).
DETAIL_PURPOSE = {
    Detail.BINDINGS: "how to bind each rank, and the job's environment (CUDA_VISIBLE_DEVICES, NCCL_IB_HCA or NCCL_SOCKET_IFNAME)",
    Detail.LAUNCH: "ready launcher forms of the bindings: a torchrun wrapper, srun options, an Open MPI rankfile",
    Detail.EXPLAIN: "the answer in words: the reasons, the pattern's links, zones broken, a time estimate, the request as understood",
}


# In a request's ``detail``: every section (Detail) at once.
DETAIL_ALL = "all"


class ProbeKind(enum.StrEnum):
    """What a measurement copies (the plan's ``kind``)."""

    PEER_ACCESS = "peer_access"  # can src copy straight to dst (no figure, a yes/no)
    P2P = "p2p"  # src -> dst, one direction at a time
    P2P_BIDIR = "p2p_bidir"  # both directions at once, one figure each
    LATENCY = "latency"  # small copies src -> dst, microseconds each
    H2D = "h2d"  # host memory on a NUMA node -> device
    D2H = "d2h"  # device -> host memory on a NUMA node
    LOCAL_COPY = "local_copy"  # one device's memory onto itself

    @property
    def is_pair(self) -> bool:
        return self in (ProbeKind.PEER_ACCESS, ProbeKind.P2P, ProbeKind.P2P_BIDIR, ProbeKind.LATENCY)

    @property
    def is_host(self) -> bool:
        return self in (ProbeKind.H2D, ProbeKind.D2H)


class Unit(enum.StrEnum):
    GBPS = "GB/s"  # 10^9 bytes per second, per direction
    MICROSECONDS = "us"  # per copy (latency)


class Unanswered(enum.StrEnum):
    """What the scheduler extender does with a node whose agent does not answer."""

    FILTER = "filter"  # out, with the reason in FailedNodes: kube-scheduler picks among the others
    PASS = "pass"  # kept, with the lowest score: the node is chosen only when no agent answered better


class MetricsDetail(enum.StrEnum):
    """What ``[metrics] detail`` brings back to /metrics beyond its default series budget
    (each family says which of these serves it: collectors/counters.py ``Family.detail``)."""

    # Which families each word serves: exporters/prometheus.py detail_table() (docs/telemetry.md).
    XID = "xid"  # one series per Xid (by default: per class)
    THROTTLE = "throttle"  # one 0/1 series per throttle reason (by default: the bitmask)
    ERRORS = "errors"  # every error counter, not only those the agent judges
    PACKETS = "packets"  # InfiniBand packet counters (by default: bytes only)
    PCIE_LINK = "pcie_link"  # each device's PCIe link (by default: the pcie-degraded finding)
    SETTINGS = "settings"  # what the node is set to, not what it does: power limits, port rates
    VIDEO = "video"  # the video engines' utilisation (dcgm-exporter's ENC/DEC_UTIL): idle on training nodes
    CAPACITY = "capacity"  # capacity_fits by job size (GET /capacity has it; by default: free GPUs, largest zone)
