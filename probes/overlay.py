"""From measured figures to the matrix placement reads, and to findings people act on.

``overlay`` puts each GPU pair's measured P2P bandwidth (the slower of its two
directions) into ``DistanceMatrix.measured``, so ``matrix.bandwidth(i, j)`` — what
placement ranks by — returns the measurement while it is fresh.

``findings_for`` compares figures with what the declared level promises, as
``topoagent.node.model.Finding`` values (``source="probe"``, expected and measured GB/s):

- ``degraded_link``: a pair measures below ``degraded_fraction`` of what its level
  achieves (an NVLink down, a link trained at x4);
- ``level_contradiction``: the figure is what a *farther* level delivers (``PIX``
  declared, but the copy runs at host-bridge speed);
- ``no_peer_access``: a pair declared on NVLink or one PCIe switch cannot use P2P, so
  its copies are staged through host memory;
- ``host_link_degraded``: a GPU's best host↔device figure is below what its PCIe link
  achieves;
- ``numa_affinity_mismatch``: host copies from another NUMA node beat those from the
  node the GPU is declared on;
- ``high_latency``: a pair's small copies take more than ``LATENCY_FAR_FACTOR`` times
  what its level's small copies take (``LATENCY_US``).

Figures taken under load (a forced round while a busy GPU shared the probe's PCIe path,
``under_load``) are no evidence of a fault: they neither enter the matrix nor become
findings.  Nor are a stand-in backend's (``STAND_IN_BACKENDS``: the cpu backend copies host
memory in place of GPUs): they say nothing about a GPU's links, so they are never judged
against the rates those links promise.

``apply_verdicts`` acts on *confirmed* findings (seen in ``CONFIRM_ROUNDS`` rounds of
their target in a row; ``topoagent.probes.service`` counts): a NUMA mismatch moves the
GPU's ``numa_node`` and ``cpus`` -- what CPU binding and the NUMA term read -- to the node
the host copies say, keeping the claimed node in ``GpuInfo.claimed_numa_node``; a level
contradiction demotes the pair's level to the one its copies deliver (zones and damage
read ``gpu_levels``), keeping the declared level in ``DistanceMatrix.declared_levels``.

Levels promise hardware rates; copies achieve less: ``ACHIEVABLE_FRACTION`` (kept in
topoagent.node.levels, with its sources) is what a level's copies reach.  Placement reads a
measurement against that, within a tolerance band and with hysteresis
(``levels.measured_gbps``): ``overlay`` records each pair's verdict given the one it had
in the previous matrix, so a figure inside the band never flips a pair either way.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable
from dataclasses import replace
from typing import NamedTuple

from topoagent.node.cpulist import format_cpulist
from topoagent.node.levels import (
    ACHIEVABLE_FRACTION,
    LATENCY_US,
    NODE,
    PHB,
    PIX,
    PXB,
    SYS,
    LevelKind,
    LinkLevel,
    expected_gbps,
    measured_degraded,
    pcie_gbps,
)
from topoagent.node.matrix import DistanceMatrix, GpuInfo, LatencyMeasurement, Measurement
from topoagent.node.model import Finding
from topoagent.probes.figures import ProbeFigure, ProbeKind
from topoagent.vocabulary import FindingKind, Severity

DEGRADED_FRACTION = 0.5  # below half of what the level achieves: degraded
CRITICAL_FRACTION = 0.25
# A figure "looks like" a level when it is within this factor of what that level achieves.
LEVEL_FIT_FACTOR = 1.25
NUMA_TOLERANCE = 0.15
PCIE_LADDER = (PIX, PXB, PHB, NODE, SYS)
CONFIRM_ROUNDS = 2

# A pair slower than LATENCY_FAR_FACTOR times its level's small-copy figure
# (levels.LATENCY_US; 6 us) copies like a staged pair: a finding, since latency-bound
# patterns (alltoall, pipeline at small messages) pay it on every message.
LATENCY_FAR_FACTOR = 4.0


class PairBandwidth(NamedTuple):
    """A GPU pair's P2P figures: the slower direction is the pair's bandwidth."""

    gbps: float  # the slower direction's median
    taken_at: float  # Unix time the newer direction arrived
    directions: dict[str, float]  # "0->1" -> median GB/s


def unidirectional_by_pair(figures: Iterable[ProbeFigure]) -> dict[tuple[int, int], PairBandwidth]:
    """(a, b) with a < b -> the pair's one-direction-at-a-time P2P bandwidth."""
    directions: dict[tuple[int, int], list[tuple[ProbeFigure, float]]] = {}
    for f in figures:
        if f.kind is ProbeKind.P2P and f.median is not None and f.src is not None and f.dst is not None:
            a, b = f.src, f.dst
            directions.setdefault((min(a, b), max(a, b)), []).append((f, f.median))
    out = {}
    for pair, found in directions.items():
        out[pair] = PairBandwidth(
            gbps=min(median for _, median in found),
            taken_at=max(f.received_at or 0.0 for f, _ in found),
            directions={f.direction: median for f, median in found if f.direction is not None},
        )
    return out


def measurements_from_figures(
    matrix: DistanceMatrix, figures: Iterable[ProbeFigure], previous: DistanceMatrix | None = None
) -> dict[tuple[int, int], Measurement]:
    """Matrix positions -> measurement, for the pairs of GPUs the matrix knows, each with
    its verdict given the verdict the pair had in ``previous`` (hysteresis)."""
    out: dict[tuple[int, int], Measurement] = {}
    for (a, b), seen in unidirectional_by_pair(figures).items():
        try:
            i, j = matrix.gpu_by_index(a), matrix.gpu_by_index(b)
        except KeyError:
            continue  # a device the matrix does not describe
        before = None
        if previous is not None:
            try:
                before = previous.measured_degraded(previous.gpu_by_index(a), previous.gpu_by_index(b))
            except KeyError:
                before = None
        degraded = measured_degraded(matrix.gpu_expected_gbps[i][j], seen.gbps, before)
        out[(min(i, j), max(i, j))] = Measurement(gbps=seen.gbps, taken_at=seen.taken_at, degraded=degraded)
    return out


def target_gpus(figure: ProbeFigure) -> frozenset[int]:
    """The GPUs of the probe target this figure came from (a pair, or one GPU)."""
    return frozenset(g for g in (figure.src, figure.dst, figure.device) if g is not None)


# Backends whose copies stand in for GPUs (host memory): their figures are no evidence about a GPU link.
STAND_IN_BACKENDS = frozenset({"cpu"})


def evidence(figures: Iterable[ProbeFigure], under_load: Collection[frozenset[int]]) -> list[ProbeFigure]:
    """The figures that are evidence about the node's links: taken by a GPU backend, not
    under load (``under_load``: the targets' GPU sets)."""
    return [f for f in figures if target_gpus(f) not in under_load and f.backend not in STAND_IN_BACKENDS]


def overlay(
    matrix: DistanceMatrix,
    figures: Iterable[ProbeFigure],
    previous: DistanceMatrix | None = None,
    under_load: Collection[frozenset[int]] = (),
) -> DistanceMatrix:
    """The matrix with fresh measurements, judged against their levels (see module doc),
    leaving out figures taken under load (``under_load``: the targets' GPU sets) and a
    stand-in backend's (``evidence``);
    ``previous`` is the matrix placement read before, for each pair's last verdict."""
    figures = evidence(figures, under_load)
    return matrix.with_measurements(measurements_from_figures(matrix, figures, previous), latencies_from_figures(matrix, figures))


def latencies_from_figures(matrix: DistanceMatrix, figures: Iterable[ProbeFigure]) -> dict[tuple[int, int], LatencyMeasurement]:
    """Matrix positions -> the pair's small-copy latency (the slower direction), for
    placement's link model (alltoall, pipeline)."""
    out: dict[tuple[int, int], LatencyMeasurement] = {}
    for f in figures:
        if f.kind is not ProbeKind.LATENCY or f.median is None or f.src is None or f.dst is None:
            continue
        try:
            i, j = matrix.gpu_by_index(f.src), matrix.gpu_by_index(f.dst)
        except KeyError:
            continue  # a device the matrix does not describe
        key = (min(i, j), max(i, j))
        seen = out.get(key)
        if seen is None or f.median > seen.us:
            out[key] = LatencyMeasurement(f.median, max(f.received_at or 0.0, seen.taken_at if seen else 0.0))
    return out


def apply_verdicts(matrix: DistanceMatrix, confirmed: Iterable[Finding], figures: Iterable[ProbeFigure]) -> DistanceMatrix:
    """A new matrix acting on confirmed findings (see the module's docstring); the
    matrix is immutable, so the answer is a copy whatever it changes."""
    confirmed = list(confirmed)
    figures = list(figures)
    gpus = list(matrix.gpus)
    host = matrix.host
    for finding in confirmed:
        if finding.kind is not FindingKind.NUMA_AFFINITY_MISMATCH:
            continue
        node = _fastest_node(finding, gpus, figures)
        if node is None:
            continue
        pos, best = node
        gpu = gpus[pos]
        cpus = format_cpulist(sorted(host.numa_cpus[best])) if host is not None and best in host.numa_cpus else gpu.cpus
        claimed = gpu.claimed_numa_node if gpu.claimed_numa_node is not None else gpu.numa_node
        gpus[pos] = replace(gpu, numa_node=best, cpus=cpus, claimed_numa_node=claimed)
    levels = [list(row) for row in matrix.gpu_levels]
    declared = dict(matrix.declared_levels)
    for finding in confirmed:
        if finding.kind is not FindingKind.LEVEL_CONTRADICTION or finding.measured_gbps is None:
            continue
        pair = _pair_positions(matrix, finding.subject)
        if pair is None:
            continue
        i, j = pair
        level = levels[i][j]
        pcie = min(matrix.gpus[i].pcie_gbps(), matrix.gpus[j].pcie_gbps())
        fit = _farther_level_fit(level, matrix.gpu_expected_gbps[i][j] or 0.0, finding.measured_gbps, pcie)
        if fit is None:
            continue
        demoted = PIX if fit[0] == "PCIe" else LinkLevel.parse(fit[0])
        declared.setdefault((min(i, j), max(i, j)), level)
        levels[i][j] = levels[j][i] = demoted
    return replace(
        matrix,
        gpus=tuple(gpus),
        gpu_levels=tuple(tuple(row) for row in levels),
        declared_levels=declared,
    )


def _pair_positions(matrix: DistanceMatrix, subject: str) -> tuple[int, int] | None:
    by_name = {g.name: pos for pos, g in enumerate(matrix.gpus)}
    a, _, b = subject.partition("-")
    if a in by_name and b in by_name:
        return by_name[a], by_name[b]
    return None


def _fastest_node(finding: Finding, gpus: list[GpuInfo], figures: list[ProbeFigure]) -> tuple[int, int] | None:
    """(position of the finding's GPU, the NUMA node its host copies are fastest from)."""
    name = finding.subject.removesuffix(" host link")
    for pos, gpu in enumerate(gpus):
        if gpu.name != name:
            continue
        per_node = {
            f.numa_node: f.median
            for f in figures
            if f.kind is ProbeKind.H2D and f.device == gpu.index and f.numa_node is not None and f.median is not None
        }
        return (pos, max(per_node, key=lambda n: per_node[n])) if per_node else None
    return None


def _fits(measured: float, achievable: float) -> bool:
    return achievable > 0 and abs(math.log(measured / achievable)) <= math.log(LEVEL_FIT_FACTOR)


def _farther_level_fit(
    declared: LinkLevel, declared_expected: float, measured: float, pair_pcie_gbps: float
) -> tuple[str, float] | None:
    """The farther level whose achieved rate the figure matches best, if it matches one.

    For a declared NVLink pair the PCIe levels are too close to each other to tell apart
    by bandwidth alone, so the answer is then "PCIe": the copy did not use NVLink.
    """
    # Scale the PCIe ladder (built on the default link) to this pair's PCIe link: for a
    # PCIe pair its expectation already says so; for NVLink, the GPUs' own links do.
    scale = pair_pcie_gbps / pcie_gbps()
    if declared.kind in (LevelKind.PIX, LevelKind.PXB, LevelKind.PHB, LevelKind.NODE, LevelKind.SYS):
        default = expected_gbps(declared)
        if default:
            scale = declared_expected / default
    declared_achievable = declared_expected * ACHIEVABLE_FRACTION
    best: tuple[float, LinkLevel, float] | None = None
    for level in PCIE_LADDER:
        if not declared < level:
            continue
        expected = (expected_gbps(level) or 0.0) * scale
        achievable = expected * ACHIEVABLE_FRACTION
        # A farther level that promises (about) the same rate is no contradiction.
        if achievable >= declared_achievable * (1 - NUMA_TOLERANCE):
            continue
        if not _fits(measured, achievable):
            continue
        distance = abs(math.log(measured / achievable))
        if best is None or distance < best[0]:
            best = (distance, level, expected)
    if best is None:
        return None
    # Only if the figure is closer to that level than to the one declared.
    if abs(math.log(measured / declared_achievable)) <= best[0]:
        return None
    if declared.is_nvlink:
        return "PCIe", (expected_gbps(PIX) or 0.0) * scale
    return str(best[1]), best[2]


def _probe_finding(
    kind: FindingKind,
    severity: Severity,
    subject: str,
    message: str,
    expected_gbps: float | None = None,
    measured_gbps: float | None = None,
) -> Finding:
    return Finding(kind, severity, subject, message, source="probe", expected_gbps=expected_gbps, measured_gbps=measured_gbps)


def _under_load_findings(
    figures: list[ProbeFigure], under_load: Collection[frozenset[int]], name: dict[int, str]
) -> list[Finding]:
    """Say which targets' figures were not judged: why no link verdict is raised there."""
    found = []
    loaded = sorted({target_gpus(f) for f in figures} & set(under_load), key=sorted)
    for gpus in loaded:
        if not all(g in name for g in gpus):
            continue
        ordered = sorted(gpus)
        subject = "-".join(name[g] for g in ordered) if len(ordered) > 1 else f"{name[ordered[0]]} host link"
        found.append(_probe_finding(
            FindingKind.PROBED_UNDER_LOAD, Severity.INFO, subject,
            f"{subject}: the newest figures were taken under load (a forced round while a busy GPU shared the copies' "
            "path): not judged, so no degraded-link or other verdict until a quiet round measures it",
        ))
    return found


def findings_for(
    matrix: DistanceMatrix,
    figures: Iterable[ProbeFigure],
    *,
    degraded_fraction: float = DEGRADED_FRACTION,
    under_load: Collection[frozenset[int]] = (),
) -> list[Finding]:
    figures = list(figures)
    name = {g.index: g.name for g in matrix.gpus}
    found = _under_load_findings(figures, under_load, name)
    figures = evidence(figures, under_load)

    for (a, b), seen in sorted(unidirectional_by_pair(figures).items()):
        try:
            i, j = matrix.gpu_by_index(a), matrix.gpu_by_index(b)
        except KeyError:
            continue
        level = matrix.level(i, j)
        expected = matrix.gpu_expected_gbps[i][j]
        if expected is None:
            continue
        achievable = expected * ACHIEVABLE_FRACTION
        measured = seen.gbps
        subject = f"{name[a]}-{name[b]}"
        if measured < degraded_fraction * achievable:
            severity = Severity.CRITICAL if measured < CRITICAL_FRACTION * achievable else Severity.WARNING
            found.append(
                _probe_finding(
                    FindingKind.DEGRADED_LINK,
                    severity,
                    subject,
                    f"{subject} ({level}) copies at {measured:.1f} GB/s, "
                    f"{measured / achievable:.0%} of the ~{achievable:.0f} GB/s a {level} link achieves",
                    expected_gbps=expected,
                    measured_gbps=measured,
                )
            )
        # The PCIe rate these two GPUs would fall back to: the slower of their links.
        pcie = min(matrix.gpus[i].pcie_gbps(), matrix.gpus[j].pcie_gbps())
        fit = _farther_level_fit(level, expected, measured, pcie)
        if fit is not None:
            like, like_expected = fit
            found.append(
                _probe_finding(
                    FindingKind.LEVEL_CONTRADICTION,
                    Severity.WARNING,
                    subject,
                    f"{subject} is declared {level} but copies at {measured:.1f} GB/s, "
                    f"what a {like} path delivers (~{like_expected * ACHIEVABLE_FRACTION:.0f} GB/s)"
                    + (": the copy is not using NVLink" if level.is_nvlink else ""),
                    expected_gbps=expected,
                    measured_gbps=measured,
                )
            )

    for f in figures:
        if f.kind is not ProbeKind.PEER_ACCESS or f.available is not False or f.src is None or f.dst is None:
            continue
        a, b = f.src, f.dst
        try:
            level = matrix.level(matrix.gpu_by_index(a), matrix.gpu_by_index(b))
        except KeyError:
            continue
        if level.is_nvlink or level.kind in (LevelKind.PIX, LevelKind.PXB):
            subject = f"{name[a]}->{name[b]}"
            found.append(
                _probe_finding(
                    FindingKind.NO_PEER_ACCESS,
                    Severity.WARNING,
                    subject,
                    f"{subject} is declared {level} but peer access is not available; "
                    "copies are staged through host memory",
                )
            )

    found.extend(_latency_findings(matrix, figures))
    found.extend(_host_findings(matrix, figures, degraded_fraction))
    return found


def _latency_findings(matrix: DistanceMatrix, figures: list[ProbeFigure]) -> list[Finding]:
    """Pairs whose small copies (the slower direction) cost far more than their level's."""
    slowest: dict[tuple[int, int], float] = {}
    for f in figures:
        if f.kind is ProbeKind.LATENCY and f.median is not None and f.src is not None and f.dst is not None:
            key = (min(f.src, f.dst), max(f.src, f.dst))
            slowest[key] = max(slowest.get(key, 0.0), f.median)
    found = []
    for (a, b), micros in sorted(slowest.items()):
        try:
            i, j = matrix.gpu_by_index(a), matrix.gpu_by_index(b)
        except KeyError:
            continue
        level = matrix.level(i, j)
        typical = LATENCY_US.get(level.kind)
        if typical is None or micros <= LATENCY_FAR_FACTOR * typical:
            continue
        subject = f"{matrix.gpus[i].name}-{matrix.gpus[j].name}"
        found.append(
            _probe_finding(
                FindingKind.HIGH_LATENCY,
                Severity.WARNING,
                subject,
                f"{subject} ({level}) takes {micros:.1f} us per small copy, {micros / typical:.0f}x the "
                f"~{typical:g} us of a {level} pair: copies are staged or the path is congested; "
                "alltoall and pipeline jobs pay it on every small message",
            )
        )
    return found


def _host_findings(
    matrix: DistanceMatrix, figures: list[ProbeFigure], degraded_fraction: float
) -> list[Finding]:
    found: list[Finding] = []
    by_gpu: dict[int, dict[int, float]] = {}
    for f in figures:
        if f.kind is ProbeKind.H2D and f.median is not None and f.device is not None and f.numa_node is not None:
            by_gpu.setdefault(f.device, {})[f.numa_node] = f.median
    for device, per_node in sorted(by_gpu.items()):
        try:
            gpu = matrix.gpus[matrix.gpu_by_index(device)]
        except KeyError:
            continue
        link = gpu.pcie_gbps()
        achievable = link * ACHIEVABLE_FRACTION
        subject = f"{gpu.name} host link"
        best_node, best = max(per_node.items(), key=lambda item: item[1])
        if best < degraded_fraction * achievable:
            found.append(
                _probe_finding(
                    FindingKind.HOST_LINK_DEGRADED,
                    Severity.WARNING,
                    subject,
                    f"host-to-{gpu.name} copies reach {best:.1f} GB/s at best (NUMA node {best_node}), "
                    f"below half of the ~{achievable:.0f} GB/s its PCIe link achieves",
                    expected_gbps=round(link, 2),
                    measured_gbps=best,
                )
            )
        local = per_node.get(gpu.numa_node) if gpu.numa_node is not None else None
        if local is not None and best_node != gpu.numa_node and local < best * (1 - NUMA_TOLERANCE):
            found.append(
                _probe_finding(
                    FindingKind.NUMA_AFFINITY_MISMATCH,
                    Severity.WARNING,
                    subject,
                    f"{gpu.name} is declared on NUMA node {gpu.numa_node}, but host copies from node "
                    f"{best_node} run faster ({best:.1f} vs {local:.1f} GB/s)",
                    expected_gbps=best,
                    measured_gbps=local,
                )
            )
    return found
