"""Fact types that collectors produce and exporters read, kept out of the collector
modules so an exporter never has to import a collector to name what it reads.

Grow this module as fact types move out of ``collectors/`` (the PCI, NUMA, NVML and
InfiniBand facts still live beside their readers and reach exporters through the model).
"""

from __future__ import annotations

from dataclasses import dataclass

from topoagent.vocabulary import FabricSource, PeerKind

# PCI device kinds, from class code (and vendor for NVIDIA's own parts).
GPU = "gpu"
NIC = "nic"
NVSWITCH = "nvswitch"
NVME = "nvme"
BRIDGE = "bridge"
DISPLAY = "display"  # a display/3D controller that is not NVIDIA's
OTHER = "other"

# How a CoreMap was obtained.
SYSFS = "sysfs"
ASSUMED_SMT2 = "assumed-smt2"
ASSUMED_NO_SMT = "assumed-no-smt"


@dataclass(frozen=True, slots=True)
class CpuModel:
    """What /proc/cpuinfo says the CPU is."""

    arch: str | None  # as NCCL names it: "x86_64", "arm64", "ppc64"
    vendor: str | None  # cpuid vendor string: "GenuineIntel", "AuthenticAMD"
    family: int | None  # cpuid family (with the extended family added, as /proc/cpuinfo prints)
    model: int | None
    model_name: str | None


@dataclass(frozen=True, slots=True)
class CoreMap:
    """OS CPU number -> Slurm's abstract core index (lstopo's ``Core L#``)."""

    core_of: dict[int, int]
    source: str  # SYSFS, ASSUMED_SMT2 or ASSUMED_NO_SMT

    @property
    def assumed(self) -> bool:
        return self.source != SYSFS

    def cores(self, cpus: frozenset[int]) -> frozenset[int]:
        return frozenset(self.core_of[c] for c in cpus if c in self.core_of)

    @property
    def all_cores(self) -> frozenset[int]:
        return frozenset(self.core_of.values())


@dataclass(frozen=True, slots=True)
class CpuFacts:
    """What the `cpu` collector found: the CPU's identity and how threads form cores."""

    model: CpuModel | None  # /proc/cpuinfo; None when the node (or recording) lacks it
    core_map: CoreMap | None  # None when neither sysfs nor NUMA says which CPUs exist


@dataclass(frozen=True, slots=True)
class PeerMemory:
    """What the ``gpudirect`` collector saw of GPUDirect RDMA's peer-memory module."""

    module: str | None  # "nvidia_peermem"; None: the kernel's module list holds none of NCCL's


@dataclass(frozen=True, slots=True)
class PortNeighbour:
    """The device at the other end of one of the node's network ports: a switch (its leaf)
    as the fabric itself says, from the subnet's management packets (InfiniBand) or LLDP."""

    source: FabricSource
    switch_id: str  # InfiniBand: its node GUID "0xec0d9a0300ec8240"; LLDP: its chassis id
    switch_name: str | None  # InfiniBand: its node description; LLDP: its system name
    switch_port: str | None  # InfiniBand: the port number ("17"); LLDP: its port id ("Ethernet1/5")
    device: str | None = None  # InfiniBand: the local RDMA device "mlx5_0"
    port: int | None = None  # InfiniBand: the local port number
    interface: str | None = None  # LLDP: the local interface "ens1f0np0"
    switch_kind: PeerKind = PeerKind.SWITCH  # a host: a back-to-back cable; only a switch is a leaf


__all__ = [
    "ASSUMED_NO_SMT", "ASSUMED_SMT2", "BRIDGE", "DISPLAY", "GPU", "NIC", "NVME", "NVSWITCH",
    "OTHER", "SYSFS", "CoreMap", "CpuFacts", "CpuModel", "PeerMemory", "PortNeighbour",
]
