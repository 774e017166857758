"""The one vocabulary of link levels, and what bandwidth each level is expected to give.

Levels use the words users know from ``nvidia-smi topo -m``, ordered closest first:

    SELF < NV(n) < PIX < PXB < PHB < NODE < SYS < NET_SUBNET < NET_OTHER

``NV(n)`` with more links sorts before ``NV(m)`` with fewer.  ``SOC`` (printed by old
drivers) is read as ``SYS``.  The last two reach beyond the node: a peer on the same
InfiniBand subnet, and any other peer.

Expected bandwidths are **per direction, in GB/s (10^9 bytes/s)**, the rates the
hardware is built for.  They are the prior; a fresh probe measurement replaces one only
when it shows the pair clearly below what its level achieves (``measured_gbps``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from functools import total_ordering

from topoagent.errors import TopoagentError
from topoagent.text import shown


class LevelKind(enum.IntEnum):
    """Link kinds, in order from closest to farthest."""

    SELF = 0
    NV = 1
    PIX = 2
    PXB = 3
    PHB = 4
    NODE = 5
    SYS = 6
    NET_SUBNET = 7
    NET_OTHER = 8


class LevelError(TopoagentError, ValueError):  # ValueError: request parsers catch it
    """A string is not a link level."""


_NV_RE = re.compile(r"NV([0-9]+)")  # ASCII digits: int() would also read '١٢'
# An NV level's link count: NVSwitch systems bond 18 today; three digits leave room, and
# a bound keeps a count of thousands of digits from reaching int() (which refuses those).
MAX_NVLINKS = 999
_ALIASES = {"X": LevelKind.SELF, "SELF": LevelKind.SELF, "SOC": LevelKind.SYS}

# The grammar of a level between two GPUs of one node, as requests write it (``min_level``,
# ``--min-level``): NV alone = any NVLink, NV<n> = at least n bonded links (1 to 999), then
# the PCIe/CPU words; SOC is SYS; any case, nothing around it.  Written once, as a JSON
# Schema (ECMAScript) pattern, so the OpenAPI document and parse_gpu_pair_level agree.
GPU_PAIR_LEVEL_WORDS = ("PIX", "PXB", "PHB", "NODE", "SYS", "SOC")
GPU_PAIR_LEVEL_HELP = f"NV, NV<links> (1 to {MAX_NVLINKS}) such as NV12, PIX, PXB, PHB, NODE, SYS; any case"


def _any_case(word: str) -> str:
    return "".join(f"[{c.upper()}{c.lower()}]" for c in word)


GPU_PAIR_LEVEL_PATTERN = (
    "^(?:"
    + _any_case("nv")
    + "(?:0*[1-9][0-9]{0,2})?|"
    + "|".join(_any_case(w) for w in GPU_PAIR_LEVEL_WORDS)
    + ")$"
)
# A level as we print it (``str(level)``, every JSON document): nvidia-smi's words.
PRINTED_LEVEL_PATTERN = "^(?:X|NV[1-9][0-9]{0,2}|" + "|".join(k.name for k in LevelKind if k not in (LevelKind.SELF, LevelKind.NV)) + ")$"



@total_ordering
@dataclass(frozen=True, slots=True)
class LinkLevel:
    """One level; ``nvlinks`` is the bonded link count for NV, 0 otherwise."""

    kind: LevelKind
    nvlinks: int = 0

    def __post_init__(self) -> None:
        if self.kind is LevelKind.NV and not 1 <= self.nvlinks <= MAX_NVLINKS:
            raise LevelError(f"an NV level has 1 to {MAX_NVLINKS} links, not {self.nvlinks}")
        if self.kind is not LevelKind.NV and self.nvlinks:
            raise LevelError(f"{self.kind.name} carries no NVLink count")

    @classmethod
    def parse(cls, text: str) -> LinkLevel:
        """Read a level as nvidia-smi prints it (``X``, ``NV12``, ``PIX``, ``SOC``...)."""
        token = text.strip().upper()
        if token in _ALIASES:
            return cls(_ALIASES[token])
        match = _NV_RE.fullmatch(token)
        if match:
            digits = match.group(1).lstrip("0")
            if not digits:
                raise LevelError(f"{text!r}: NV needs at least one link")
            if len(digits) > len(str(MAX_NVLINKS)):
                raise LevelError(f"{shown(text, 24)}: an NV link count is at most {MAX_NVLINKS}")
            return cls(LevelKind.NV, int(digits))
        try:
            kind = LevelKind[token]
        except KeyError:
            raise LevelError(f"{text!r} is not a link level") from None
        if kind is LevelKind.NV:
            raise LevelError(f"{text!r}: NV needs a link count, like NV12")
        return cls(kind)

    def sort_key(self) -> tuple[int, int]:
        """Closer sorts first; among NV levels, more links is closer."""
        return (int(self.kind), -self.nvlinks)

    def __lt__(self, other: object) -> bool:
        if not isinstance(other, LinkLevel):
            return NotImplemented
        return self.sort_key() < other.sort_key()

    @property
    def is_nvlink(self) -> bool:
        return self.kind is LevelKind.NV

    def __str__(self) -> str:
        if self.kind is LevelKind.SELF:
            return "X"
        if self.kind is LevelKind.NV:
            return f"NV{self.nvlinks}"
        return self.kind.name


SELF = LinkLevel(LevelKind.SELF)
PIX = LinkLevel(LevelKind.PIX)
PXB = LinkLevel(LevelKind.PXB)
PHB = LinkLevel(LevelKind.PHB)
NODE = LinkLevel(LevelKind.NODE)
SYS = LinkLevel(LevelKind.SYS)


_SHARED: dict[LinkLevel, LinkLevel] = {}


def shared(level: LinkLevel) -> LinkLevel:
    """The one object for this level (at most a few thousand distinct ones exist): a
    128-GPU matrix holds 16k pair levels, which as separate objects made every full
    garbage collection in the service longer."""
    return _SHARED.setdefault(level, level)


def nv(links: int) -> LinkLevel:
    return LinkLevel(LevelKind.NV, links)


def parse_gpu_pair_level(text: str) -> LinkLevel:
    """A level between two GPUs of a node, by GPU_PAIR_LEVEL_PATTERN; "NV" is nv(1)."""
    # re compiles the pattern on the first request and keeps it: compiling it on import
    # would cost every command that parses no request (discover) a third of a millisecond.
    if not re.fullmatch(GPU_PAIR_LEVEL_PATTERN, text):
        raise LevelError(f"{shown(text, 40)} is not a GPU-to-GPU link level ({GPU_PAIR_LEVEL_HELP})")
    if text.upper() == "NV":
        return nv(1)  # "any NVLink"
    return LinkLevel.parse(text)  # the grammar is a subset of what parse reads


# --- Expected bandwidth tables -------------------------------------------------------
#
# NVLink, GB/s per link per direction, by NVLink generation.  Sources: NVIDIA's product
# briefs -- P100 (NVLink 1): 4 links, 160 GB/s bidirectional = 20 GB/s/link/direction;
# V100 (NVLink 2): 6 links, 300 GB/s = 25; A100 (NVLink 3): 12 links, 600 GB/s = 25;
# H100/H200 (NVLink 4): 18 links, 900 GB/s = 25; B200 (NVLink 5): 18 links, 1.8 TB/s = 50.
# NCCL's topo.h keeps lower *achievable* constants (e.g. SM80_NVLINK_BW 20.0,
# SM90_NVLINK_BW 20.6, SM100_NVLINK_BW 40.1 GB/s per link); we keep the hardware rate
# here and let probes report what is achieved.
NVLINK_GBPS_PER_LINK: dict[int, float] = {1: 20.0, 2: 25.0, 3: 25.0, 4: 25.0, 5: 50.0}
# When nvidia-smi tells only the link count, the generation is unknown: NVLink 2-4
# (V100..H200, the bulk of deployed machines) all run 25 GB/s per link.
NVLINK_GBPS_PER_LINK_GENERIC = 25.0

# PCIe, GB/s per lane per direction after line encoding: transfer rate × encoding / 8.
# Gen1/2: 2.5/5 GT/s with 8b/10b; Gen3/4/5: 8/16/32 GT/s with 128b/130b (PCI-SIG base
# specifications); Gen6: 64 GT/s PAM4 with FLIT mode (242/256 efficiency).
PCIE_GBPS_PER_LANE: dict[int, float] = {
    1: 2.5 * 0.8 / 8,
    2: 5.0 * 0.8 / 8,
    3: 8.0 * 128 / 130 / 8,
    4: 16.0 * 128 / 130 / 8,
    5: 32.0 * 128 / 130 / 8,
    6: 64.0 * 242 / 256 / 8,
}
# PCIe link speed as sysfs prints it (``current_link_speed``) -> generation.
PCIE_GT_S_TO_GEN: dict[float, int] = {2.5: 1, 5.0: 2, 8.0: 3, 16.0: 4, 32.0: 5, 64.0: 6}
# Unknown link (nvidia-smi alone): Gen3 x16, as NCCL assumes (its PCI_BW of 12 GB/s is
# the achieved rate of a Gen3 x16 link).  It keeps every NV level above every PCIe level,
# the order nvidia-smi itself declares; discovery fills in the real generation and width.
DEFAULT_PCIE_GEN = 3
DEFAULT_PCIE_WIDTH = 16

# Small-copy (4 bytes) latency per level, microseconds, as p2pBandwidthLatencyTest's
# "P2P=Enabled Latency (P2P Writes)" matrices in shared/corpus/bandwidth/ read:
# RTX 6000 Ada on a Threadripper PRO, PHB: 1.12-1.14 us; on a 2-socket EPYC, NODE and SYS
# alike: 1.21-1.44 us.  The same tools' "P2P=Disabled" rows (copies staged through host
# memory) read 10.3-14.2 us, and 13.6-15.0 us on the 2x RTX 2080 Ti without P2P: about
# ten times more.  The corpus holds no NVLink latency matrix; NVLink copies take a copy
# engine's fixed cost like PCIe ones, so NVLink gets the PCIe figure, rounded up.
# Placement's alpha-beta model (placement.latency) takes it as a link's alpha where no
# fresh measurement says otherwise; the probes judge measured latencies against it.
LATENCY_US = {
    LevelKind.NV: 1.5,
    LevelKind.PIX: 1.5,
    LevelKind.PXB: 1.5,
    LevelKind.PHB: 1.5,
    LevelKind.NODE: 1.5,
    LevelKind.SYS: 1.5,
}

# Crossing host bridges costs P2P throughput even on the same socket.  Fractions of the
# PCIe link rate, from NVIDIA's p2pBandwidthLatencyTest on PCIe servers (see
# shared/corpus/bandwidth: RTX 6000 Ada pairs across root ports reach ~0.8 of the
# same-switch rate) and NCCL, which models PHB/NODE paths as PCIe but penalises them.
PHB_FRACTION = 0.8
NODE_FRACTION = 0.7

# Socket interconnect, GB/s per direction for one link.  Intel UPI at 10.4 GT/s moves
# 2 bytes per transfer = 20.8 GB/s (Intel Xeon Scalable datasheets); AMD xGMI-2 links
# are ~18-25 GB/s per direction.  NCCL's constants are lower (QPI_BW 6, SKL_QPI_BW 10,
# AMD_BW 16) because they model achieved GPU P2P through the CPUs.
SOCKET_LINK_GBPS = 20.8

# Beyond the node: a network port, by default one 200 Gb/s HDR port = 25 GB/s.
NET_SUBNET_GBPS = 25.0
NET_OTHER_GBPS = 12.5


def pcie_gbps(gen: int | None = None, width: int | None = None) -> float:
    """Per-direction bandwidth of a PCIe link of this generation and width."""
    lane = PCIE_GBPS_PER_LANE.get(gen or DEFAULT_PCIE_GEN, PCIE_GBPS_PER_LANE[DEFAULT_PCIE_GEN])
    return lane * (width or DEFAULT_PCIE_WIDTH)


def nvlink_gbps(links: int, generation: int | None = None) -> float:
    rate = NVLINK_GBPS_PER_LINK.get(generation or 0, NVLINK_GBPS_PER_LINK_GENERIC)
    return rate * links


def expected_gbps(
    level: LinkLevel,
    *,
    nvlink_generation: int | None = None,
    pcie_gen: int | None = None,
    pcie_width: int | None = None,
) -> float | None:
    """Expected per-direction bandwidth of a pair at this level (None for SELF).

    ``pcie_gen``/``pcie_width`` describe the narrowest PCIe link on the path when known.
    """
    pcie = pcie_gbps(pcie_gen, pcie_width)
    match level.kind:
        case LevelKind.SELF:
            return None
        case LevelKind.NV:
            return nvlink_gbps(level.nvlinks, nvlink_generation)
        case LevelKind.PIX | LevelKind.PXB:
            return round(pcie, 2)
        case LevelKind.PHB:
            return round(pcie * PHB_FRACTION, 2)
        case LevelKind.NODE:
            return round(pcie * NODE_FRACTION, 2)
        case LevelKind.SYS:
            return round(min(pcie * NODE_FRACTION, SOCKET_LINK_GBPS), 2)
        case LevelKind.NET_SUBNET:
            return NET_SUBNET_GBPS
        case LevelKind.NET_OTHER:
            return NET_OTHER_GBPS
    raise AssertionError(level)  # pragma: no cover - the match is exhaustive


# --- Measured figures against a level ----------------------------------------------------
#
# Levels promise hardware rates; copies achieve less.  ACHIEVABLE_FRACTION is the ratio
# seen in the NVIDIA tools' outputs kept in shared/corpus/bandwidth/: PCIe Gen4 x16 P2P
# 26.3 of 31.5 GB/s (0.84), H100 NVLink4 376 of 450 (0.84), nvbandwidth on H100 371 of
# 450 (0.82), GB200 NVL4 747 of 900 (0.83), A100 276 of 300 (0.92).
ACHIEVABLE_FRACTION = 0.83
# Placement reads a measurement against what its level achieves, with hysteresis: a pair
# counts as degraded once it measures below DEGRADED_BELOW of that, and as healthy again
# only once it reaches RECOVERED_AT; in between it keeps its previous verdict.  Noise of a
# few per cent (and the spread of ACHIEVABLE_FRACTION across machines, 0.82-0.92) stays
# far inside the band, so it never changes an answer; a link running at x8, or an NVLink
# pair with links down, falls well outside it.
DEGRADED_BELOW = 0.75
RECOVERED_AT = 0.90


def measured_degraded(expected: float | None, measured: float, previously: bool | None = None) -> bool:
    """Whether a measured pair counts as degraded, given its verdict before (None: none)."""
    if expected is None or expected <= 0:
        return False
    ratio = measured / (expected * ACHIEVABLE_FRACTION)
    if previously:
        return ratio < RECOVERED_AT
    return ratio < DEGRADED_BELOW


def measured_gbps(expected: float | None, measured: float, previously: bool | None = None) -> float:
    """The figure placement ranks a measured pair by, on the levels' peak scale.

    A pair within its level's band is the level's own: its expected figure, so measured
    and unmeasured pairs of one level compare equal.  A degraded pair gets what it
    achieves scaled by 1/ACHIEVABLE_FRACTION, i.e. the peak a level achieving that would
    promise, so it ranks below every healthy pair of its level.
    """
    if expected is None:
        return round(measured / ACHIEVABLE_FRACTION, 2)
    if not measured_degraded(expected, measured, previously):
        return expected
    return min(expected, round(measured / ACHIEVABLE_FRACTION, 2))


# Architecture (NVML/CUDA compute capability major) -> NVLink generation.
NVLINK_GENERATION_BY_MODEL = (
    ("P100", 1),
    ("V100", 2),
    ("A100", 3),
    ("A800", 3),
    ("H100", 4),
    ("H200", 4),
    ("H800", 4),
    ("H20", 4),
    ("GH200", 4),
    ("B200", 5),
    ("B100", 5),
    ("GB200", 5),
    ("B300", 5),
    ("GB300", 5),
)


def nvlink_generation_for_model(model: str | None) -> int | None:
    """NVLink generation from a GPU model name such as 'NVIDIA A100-SXM4-80GB'."""
    if not model:
        return None
    upper = model.upper()
    # Longest names first so 'GH200' is not taken for 'H200'.
    for name, gen in sorted(NVLINK_GENERATION_BY_MODEL, key=lambda item: -len(item[0])):
        if re.search(rf"(?<![A-Z0-9]){name}(?![0-9])", upper):
            return gen
    return None
