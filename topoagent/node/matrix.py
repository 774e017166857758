"""The distance matrix the placement core and the exporters read.

One value per GPU pair (level, expected bandwidth, measured bandwidth when a probe has
run) and per GPU↔NIC pair (level).  It can be built from an `nvidia-smi topo -m` matrix
alone, or from a discovered NodeTopology with richer facts (UUIDs, PCI addresses,
PCIe generation and width, NVLink generation).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from topoagent.node.levels import (
    LATENCY_US,
    SYS,
    LinkLevel,
    expected_gbps,
    measured_degraded,
    measured_gbps,
    nvlink_generation_for_model,
    pcie_gbps,
    shared,
)

if TYPE_CHECKING:
    from topoagent.collectors.nvidia_smi import TopoMatrix


@dataclass(frozen=True, slots=True)
class GpuInfo:
    index: int  # the index nvidia-smi / NVML print (GPU3 -> 3)
    name: str  # "GPU3"
    uuid: str | None = None
    pci_address: str | None = None  # "0000:07:00.0"
    numa_node: int | None = None
    cpus: str | None = None  # cpulist of the CPUs close to this GPU, "0-47,96-143"
    model: str | None = None
    # The GPU's own PCIe link as it can train (generation, lanes); None when unknown.
    pcie_gen: int | None = None
    pcie_width: int | None = None
    # Why placement keeps off this GPU unless a request names it (a critical finding:
    # off the bus, outside the NVSwitch fabric, every NVLink down); None when healthy.
    unhealthy: str | None = None
    # False when some of this GPU's levels to other GPUs are unknown (sysfs does not show
    # it and nvidia-smi did not say): its links count as the farthest level, at no
    # bandwidth, and placement takes it only after every GPU whose links are known.
    links_known: bool = True
    # The NUMA node the GPU claims, when a confirmed probe finding moved ``numa_node`` (and
    # ``cpus``) to the node its host copies run fastest from (topoagent.probes.overlay).
    claimed_numa_node: int | None = None
    # Plain (non-RDMA) interfaces that are up and nearest this GPU in the PCIe tree: what
    # NCCL's socket transport should use for it when no RDMA NIC serves.
    socket_interfaces: tuple[str, ...] = ()

    def pcie_gbps(self) -> float:
        """Per-direction rate of this GPU's host link (the default link when unknown)."""
        return pcie_gbps(self.pcie_gen, self.pcie_width)


@dataclass(frozen=True, slots=True)
class NicInfo:
    name: str  # as nvidia-smi names it: "NIC0" or "mlx5_0"
    device: str | None = None  # RDMA device, "mlx5_1"
    pci_address: str | None = None
    numa_node: int | None = None
    netdev: str | None = None  # "ibp12s0"
    rate_gbps: float | None = None  # port rate in Gb/s, e.g. 400
    active: bool | None = None
    rail: int | None = None  # the node's rail its leaf switch makes (topoagent.node.fabric); None: unknown


@dataclass(frozen=True, slots=True)
class HostLayout:
    """What per-rank bindings read beyond the GPUs (topoagent.placement.binding): each NUMA
    node's CPUs, how threads form cores, which NUMA nodes share a socket, the host's name.
    Built from a discovered node; a matrix read from nvidia-smi text has none."""

    hostname: str | None = None
    numa_cpus: Mapping[int, frozenset[int]] = field(default_factory=dict)  # NUMA node -> its CPUs
    core_of: Mapping[int, int] = field(default_factory=dict)  # OS CPU -> core index (lstopo's Core L#)
    socket_of: Mapping[int, int] = field(default_factory=dict)  # NUMA node -> socket (lowest node id in it)


# NUMA nodes whose SLIT distance is below this share a socket: ACPI gives 10 for a node to
# itself, sub-NUMA clusters of one socket 11-12 (Intel SNC, AMD NPS2/4: 12 on a DGX A100),
# and nodes on another socket 20 or more (21 on two-socket Xeons, 32 on the DGX A100).
SAME_SOCKET_DISTANCE = 20


def sockets_from_distances(distances: Mapping[int, tuple[int, ...]], node_ids: tuple[int, ...]) -> dict[int, int]:
    """NUMA node -> socket, grouping nodes closer than SAME_SOCKET_DISTANCE (and the nodes
    joined through them); a node without distances is a socket of its own."""
    socket_of = {node: node for node in node_ids}

    def root(node: int) -> int:
        while socket_of[node] != node:
            node = socket_of[node]
        return node

    for a in node_ids:
        row = distances.get(a, ())
        if len(row) != len(node_ids):
            continue
        for b, d in zip(node_ids, row):
            if b != a and d < SAME_SOCKET_DISTANCE:
                ra, rb = root(a), root(b)
                socket_of[max(ra, rb)] = min(ra, rb)
    return {node: root(node) for node in node_ids}


@dataclass(frozen=True, slots=True)
class Measurement:
    """A measured GPU→GPU copy bandwidth (GB/s, per direction) and when it was taken."""

    gbps: float
    taken_at: float  # Unix time
    # The verdict recorded when the figure was overlaid, given the pair's previous one
    # (hysteresis, see levels.measured_degraded); None: judge the figure on its own.
    degraded: bool | None = None


@dataclass(frozen=True, slots=True)
class LatencyMeasurement:
    """A measured GPU→GPU small-copy latency (microseconds, the slower direction)."""

    us: float
    taken_at: float  # Unix time


@dataclass(frozen=True)
class DistanceMatrix:
    gpus: tuple[GpuInfo, ...]
    nics: tuple[NicInfo, ...]
    gpu_levels: tuple[tuple[LinkLevel, ...], ...]
    gpu_expected_gbps: tuple[tuple[float | None, ...], ...]
    gpu_nic_levels: tuple[tuple[LinkLevel | None, ...], ...] = ()
    # (i, j) -> measurement, i < j; fresh measurements override expectations.
    measured: dict[tuple[int, int], Measurement] = field(default_factory=dict)
    # Measurements older than this (seconds) no longer override the expectation.
    measurement_max_age_s: float = 24 * 3600.0
    # (i, j) -> measured small-copy latency, i < j; fresh ones replace the level's figure.
    measured_latency: dict[tuple[int, int], LatencyMeasurement] = field(default_factory=dict)
    # CPUs, cores and sockets for per-rank bindings; None when only nvidia-smi text is known.
    host: HostLayout | None = None
    # SLIT distances between NUMA node ids, (a, b) -> distance, both orders and a node
    # with itself ({} when the node has no SLIT table: placement then counts nodes).
    numa_distances: dict[tuple[int, int], int] = field(default_factory=dict)
    # (i, j) -> the declared level, i < j, for pairs a confirmed probe finding demoted in
    # ``gpu_levels`` to the level their copies deliver (topoagent.probes.overlay).
    declared_levels: dict[tuple[int, int], LinkLevel] = field(default_factory=dict)
    # Tables other modules derive from this (immutable) value, built once per instance:
    # e.g. the placement core's bitmasks.  Not part of the value: excluded from ==, repr,
    # and from ``replace()`` (a replaced matrix starts with an empty cache).
    derived_cache: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "gpu_levels", tuple(tuple(map(shared, row)) for row in self.gpu_levels))
        n = len(self.gpus)
        if len(self.gpu_levels) != n or any(len(row) != n for row in self.gpu_levels):
            raise ValueError("gpu_levels must be a square matrix over the GPUs")
        if len(self.gpu_expected_gbps) != n or any(len(r) != n for r in self.gpu_expected_gbps):
            raise ValueError("gpu_expected_gbps must be a square matrix over the GPUs")
        if self.gpu_nic_levels and (
            len(self.gpu_nic_levels) != n
            or any(len(row) != len(self.nics) for row in self.gpu_nic_levels)
        ):
            raise ValueError("gpu_nic_levels must have one row per GPU and one column per NIC")

    @property
    def size(self) -> int:
        return len(self.gpus)

    def level(self, a_pos: int, b_pos: int) -> LinkLevel:
        """The level between the GPUs at these positions in ``gpus`` (not indices)."""
        return self.gpu_levels[a_pos][b_pos]

    def bandwidth(self, a_pos: int, b_pos: int, now: float | None = None) -> float | None:
        """The figure placement ranks this pair by (GB/s, on the levels' peak scale);
        None for a GPU with itself.

        Expected, unless a fresh measurement shows the pair clearly below what its level
        achieves: then what it achieves, scaled to the peak scale so it compares with the
        other pairs' expectations (levels.measured_gbps).  Noise never changes a figure.
        """
        if a_pos == b_pos:
            return None
        expected = self.gpu_expected_gbps[a_pos][b_pos]
        m = self.fresh_measurement(a_pos, b_pos, now)
        if m is None:
            return expected
        return measured_gbps(expected, m.gbps, m.degraded)

    def latency_us(self, a_pos: int, b_pos: int, now: float | None = None) -> float:
        """A pair's small-copy latency, the alpha of placement's link model: measured when
        fresh, else its level's figure (levels.LATENCY_US); 0 for a GPU with itself."""
        if a_pos == b_pos:
            return 0.0
        m = self.measured_latency.get((a_pos, b_pos) if a_pos < b_pos else (b_pos, a_pos))
        if m is not None and (now is None or now - m.taken_at <= self.measurement_max_age_s):
            return m.us
        return LATENCY_US.get(self.gpu_levels[a_pos][b_pos].kind, max(LATENCY_US.values()))

    def fresh_measurement(self, a_pos: int, b_pos: int, now: float | None = None) -> Measurement | None:
        key = (a_pos, b_pos) if a_pos < b_pos else (b_pos, a_pos)
        m = self.measured.get(key)
        if m is not None and (now is None or now - m.taken_at <= self.measurement_max_age_s):
            return m
        return None

    def measured_degraded(self, a_pos: int, b_pos: int, now: float | None = None) -> bool | None:
        """Whether the pair's fresh measurement counts as degraded; None when unmeasured."""
        m = self.fresh_measurement(a_pos, b_pos, now)
        expected = self.gpu_expected_gbps[a_pos][b_pos]
        if m is None or expected is None:
            return None
        return measured_degraded(expected, m.gbps, m.degraded)

    def numa_distance(self, a: int, b: int) -> int | None:
        """The SLIT distance between two NUMA node ids; None when not known."""
        return self.numa_distances.get((a, b))

    def with_measurements(
        self, measured: dict[tuple[int, int], Measurement], latency: dict[tuple[int, int], LatencyMeasurement] | None = None
    ) -> DistanceMatrix:
        merged = dict(self.measured)
        for (i, j), m in measured.items():
            merged[(min(i, j), max(i, j))] = m
        latencies = dict(self.measured_latency)
        for (i, j), lat in (latency or {}).items():
            latencies[(min(i, j), max(i, j))] = lat
        return replace(self, measured=merged, measured_latency=latencies)

    def gpu_by_index(self, index: int) -> int:
        """Position in ``gpus`` of the GPU with this nvidia-smi index."""
        for pos, gpu in enumerate(self.gpus):
            if gpu.index == index:
                return pos
        raise KeyError(index)

    @classmethod
    def from_topo_matrix(
        cls,
        topo: TopoMatrix,
        *,
        pcie_gen: int | None = None,
        pcie_width: int | None = None,
        leave_out: Collection[str] = (),
    ) -> DistanceMatrix:
        """Build from a parsed `nvidia-smi topo -m` (the declared witness alone).

        ``leave_out`` names GPUs to build the matrix without (see ``gpus_with_unknown_pairs``).

        nvidia-smi does not say how the GPUs' PCIe links run; a caller that knows
        (``pcie_gen``, ``pcie_width``) gets PCIe-level expectations for that link instead
        of the default.  GPU pairs whose level is unknown (both rows cut off) are refused:
        a placement on guessed levels would be a silent wrong answer.
        """
        from topoagent.collectors.nvidia_smi import first_numa_node  # loaded already: ``topo`` is its type

        gpu_rows = [i for i, d in enumerate(topo.devices) if d.kind == "gpu" and d.name not in leave_out]
        nic_rows = [i for i, d in enumerate(topo.devices) if d.kind == "nic"]
        gpus = tuple(
            GpuInfo(
                index=int(topo.devices[i].name[3:]),
                name=topo.devices[i].name,
                numa_node=first_numa_node(topo.devices[i].numa_affinity),
                cpus=topo.devices[i].cpu_affinity,
                pcie_gen=pcie_gen,
                pcie_width=pcie_width,
            )
            for i in gpu_rows
        )
        nics = tuple(
            NicInfo(name=topo.devices[i].name, device=topo.devices[i].device) for i in nic_rows
        )
        levels = []
        for i in gpu_rows:
            row = []
            for j in gpu_rows:
                level = topo.levels[i][j]
                if level is None:
                    raise ValueError(
                        f"level of {topo.devices[i].name}/{topo.devices[j].name} is unknown "
                        "(truncated nvidia-smi output)"
                    )
                row.append(level)
            levels.append(tuple(row))
        expected = tuple(
            tuple(expected_gbps(level, pcie_gen=pcie_gen, pcie_width=pcie_width) for level in row)
            for row in levels
        )
        gpu_nic = tuple(tuple(topo.levels[i][j] for j in nic_rows) for i in gpu_rows)
        return cls(
            gpus=gpus,
            nics=nics,
            gpu_levels=tuple(levels),
            gpu_expected_gbps=expected,
            gpu_nic_levels=gpu_nic,
        )


# The level a pair whose level is unknown is counted at: the farthest within a node,
# with no expected bandwidth (see GpuInfo.links_known).
UNKNOWN_LINK = SYS


def gpus_with_unknown_pairs(topo: TopoMatrix) -> tuple[str, ...]:
    """GPUs whose level to some other GPU is unknown (both rows cut off a pasted output).

    Leaving them out keeps the rest exact: every pair among the others is known, and so is
    each one's CPU and NUMA affinity (a GPU whose own row is cut off lacks those too).
    """
    gpu_rows = [i for i, d in enumerate(topo.devices) if d.kind == "gpu"]
    return tuple(
        topo.devices[i].name
        for i in gpu_rows
        if any(topo.levels[i][j] is None for j in gpu_rows if j != i)
    )





def nvlink_generation(gpus: tuple[GpuInfo, ...]) -> int | None:
    gens = {nvlink_generation_for_model(g.model) for g in gpus}
    return gens.pop() if len(gens) == 1 else None
