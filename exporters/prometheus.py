"""Prometheus exposition of the agent: custom Collectors that read the current snapshot.

Two collectors, so a scrape does as little as possible:
- `SnapshotCollector` yields what one snapshot fixes (GPU identity, link levels,
  bandwidths, PCIe/NVLink/IB state, findings, collector results).  Its text is rendered
  once per snapshot and reused by every scrape of that snapshot.
- `RuntimeCollector` yields what changes between scrapes (snapshot age, placement
  counters, leases): a handful of series.
Both render from one value the service's `served()` returns, taken once per scrape.

Names follow the Prometheus conventions: one `topoagent_` namespace, base units
(`_seconds`, `_bytes_per_second`), `_total` only on counters, `_info` for identity.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

import topoagent
from topoagent.documents.lease import owner_kind
from topoagent.log import log_event
from topoagent.node.findings import placement_refusals
from topoagent.probes.figures import ProbeKind
from topoagent.service.served import Served, Snapshot
from topoagent.text import one_line
from topoagent.vocabulary import MetricsDetail, Status

if TYPE_CHECKING:
    from topoagent.connections import ConnectionGuard
    from topoagent.probes.figures import ProbeFigure
    from topoagent.service.interface import Service

NS = "topoagent"
GB = 1e9  # the matrix speaks GB/s (10^9 bytes/s); Prometheus wants bytes/s

# The families below (not the counters': collectors' Family.detail says theirs) that
# /metrics serves only when [metrics] detail names their word: the series budget (issue #29).
SERVED_WITH_DETAIL = {
    "pcie_link_degraded": MetricsDetail.PCIE_LINK,  # by default the pcie-degraded finding says it
    "pcie_link_speed_transfers_per_second": MetricsDetail.PCIE_LINK,
    "pcie_link_width_lanes": MetricsDetail.PCIE_LINK,
    "infiniband_port_rate_bytes_per_second": MetricsDetail.SETTINGS,  # GET /topology has every port's rate
    # k fits while k <= capacity_free_gpus, unless its search ran out of budget (GET /capacity's proven_optimal)
    "capacity_fits": MetricsDetail.CAPACITY,
}


def _served(detail: frozenset[str], *families: Metric) -> Iterator[Metric]:
    """The families [metrics] ``detail`` serves (SERVED_WITH_DETAIL), in order."""
    for family in families:
        word = SERVED_WITH_DETAIL.get(family.name.removeprefix(f"{NS}_"))
        if word is None or word in detail:
            yield family


class Declared(Protocol):
    """What the exporter reads of a counter family's declaration (it names no collector)."""

    name: str
    detail: str
    default: tuple[tuple[str, frozenset[str]], ...]


def detail_table(counter_families: Iterable[Declared]) -> str:
    """docs/telemetry.md's table of what each [metrics] detail word serves (markdown), from
    ``counter_families`` (the counter sources' declarations) and SERVED_WITH_DETAIL."""
    lines = ["| `detail` | brings back (`topoagent_`) |", "|---|---|"]
    for word in MetricsDetail:
        names = [f"`{f.name}`" + "".join(f" (by default only {label} {', '.join(sorted(values))})" for label, values in f.default)
                 for f in counter_families if f.detail == word]
        names += [f"`{name}`" for name, served_by in SERVED_WITH_DETAIL.items() if served_by == word]
        lines.append(f'| `"{word}"` | {", ".join(names)} |')
    return "\n".join(lines) + "\n"


def _opt(value: object) -> str:
    return "" if value is None else str(value)


def nvml_bus_id(address: str | None) -> str:
    """sysfs ``0000:07:00.0`` as NVML (and dcgm-exporter) writes it: ``00000000:07:00.0``.

    NVML's busId has an 8-hex-digit domain and upper-case hex digits."""
    if not address:
        return ""
    domain, _, rest = address.partition(":")
    return f"{int(domain, 16):08X}:{rest.upper()}"


def dcgm_identity(snapshot: Snapshot) -> dict[str, dict[str, str]]:
    """GPU index -> the identity labels dcgm-exporter puts on each of its series, in its
    spellings ([metrics] dcgm_labels): a query written for it joins ours without relabelling.
    Its releases write `Hostname`, its main branch `hostname`: both, so a query written for
    either works.  Built once per snapshot (the runtime part of every scrape reads it)."""
    node = snapshot.node
    return snapshot.cached("dcgm_identity", lambda: {
        str(info.index): {"UUID": _opt(info.uuid), "modelName": _opt(info.model), "pci_bus_id": nvml_bus_id(info.pci_address),
                          "device": f"nvidia{info.index}", "Hostname": _opt(node.hostname), "hostname": _opt(node.hostname),
                          "DCGM_FI_DRIVER_VERSION": _opt(node.driver_version)}
        for info in snapshot.matrix.gpus})


def _with_dcgm_labels(families: Iterable[Metric], identity: dict[str, dict[str, str]] | None) -> Iterator[Metric]:
    """``families``, each series of a GPU (a ``gpu`` label) with ``identity``'s labels added:
    none a series has already (gpu_nic_link_level's `device` is its NIC's)."""
    for family in families:
        if identity is not None:
            family.samples = [sample._replace(labels={**sample.labels, **{k: v for k, v in identity.get(sample.labels.get("gpu", ""), {}).items()
                                                                                       if k not in sample.labels}})
                              for sample in family.samples]
        yield family


class SnapshotCollector(Collector):
    """`pairwise`: the GPU-pair and GPU-NIC link levels and expected bandwidths ([metrics]
    pairwise), n^2 series that never change between discoveries and are in /topology
    anyway; `per_link`: one series per NVLink ([metrics] per_link) instead of per GPU.
    Both off by default: at 128 GPUs they are 50k of a 56k-series page.  `detail` ([metrics]
    detail): the series each word brings back beside the defaults (detail_table() says
    which); none by default, for a page under 5k series at 128 GPUs.  `dcgm_labels` ([metrics]
    dcgm_labels): dcgm-exporter's identity labels on every series of a GPU."""

    def __init__(self, snapshot: Snapshot, *, pairwise: bool = False, per_link: bool = False,
                 detail: frozenset[str] = frozenset(), dcgm_labels: bool = False) -> None:
        self.snapshot = snapshot
        self.pairwise = pairwise
        self.per_link = per_link
        self.detail = detail
        self.dcgm = dcgm_identity(snapshot) if dcgm_labels else None

    def collect(self) -> Iterator[Metric]:
        snapshot = self.snapshot
        node, matrix = snapshot.node, snapshot.matrix

        gpu_info = InfoMetricFamily(f"{NS}_gpu", "Identity of each GPU.", labels=["gpu"])
        for info in matrix.gpus:
            # One spelling of each, snake_case (promtool check metrics is clean); `gpu` is the
            # NVML index and `device` "nvidia" and that index, as dcgm-exporter writes both, and
            # `hostname` as its main branch does.  [metrics] dcgm_labels adds its other spellings.
            identity = {"uuid": _opt(info.uuid), "model": _opt(info.model), "pci_address": _opt(info.pci_address),
                        "numa_node": _opt(info.numa_node), "device": f"nvidia{info.index}", "hostname": _opt(node.hostname),
                        "driver_version": _opt(node.driver_version)}
            gpu_info.add_metric([str(info.index)], identity)
        yield from _with_dcgm_labels([gpu_info], self.dcgm)

        if node.nvlink_domain is not None:  # absent, not empty, where NVML reports no domain
            domain = InfoMetricFamily(f"{NS}_nvlink_domain", "The multi-node NVLink domain this node's GPUs are registered in.",
                                      labels=["cluster_uuid", "clique_id"])
            domain.add_metric([node.nvlink_domain.cluster_uuid, _opt(node.nvlink_domain.clique_id)], {})
            yield domain

        if node.fabric.neighbours:  # absent where no neighbour is known (the collectors are optional)
            rail_of = {(n, rail.leaf): rail.index for rail in node.fabric.rails for n in (*rail.nics, *rail.interfaces)}
            device_nic = {nic.device: nic.name for nic in node.nics if nic.device}
            netdev_nic = {netdev: nic.name for nic in node.nics for netdev in nic.netdevs}
            neighbour = InfoMetricFamily(
                f"{NS}_port_neighbour",
                "The switch at the other end of each network port, and the node's rail it makes (rail: empty for a peer that is no switch).",
                labels=["device", "port", "interface", "switch_id", "switch_name", "switch_port", "source", "rail"])
            for n in node.fabric.neighbours:
                local = device_nic.get(n.device or "") or netdev_nic.get(n.interface or "") or n.interface or ""
                neighbour.add_metric([_opt(n.device), _opt(n.port), _opt(n.interface), n.switch_id, _opt(n.switch_name), _opt(n.switch_port),
                                      str(n.source), _opt(rail_of.get((local, n.switch_id)))], {})
            yield neighbour

        level = GaugeMetricFamily(
            f"{NS}_gpu_pair_link_level",
            "Link level between two GPUs, closest first: 1 NV, 2 PIX, 3 PXB, 4 PHB, 5 NODE, 6 SYS; the level label names it as nvidia-smi does.",
            labels=["gpu_a", "gpu_b", "level"],
        )
        expected = GaugeMetricFamily(
            f"{NS}_gpu_pair_expected_bandwidth_bytes_per_second",
            "Per-direction bandwidth a GPU pair's link level is built for.",
            labels=["gpu_a", "gpu_b"],
        )
        measured = GaugeMetricFamily(
            f"{NS}_gpu_pair_measured_bandwidth_bytes_per_second",
            "Per-direction GPU-to-GPU copy bandwidth last measured by a probe.",
            labels=["gpu_a", "gpu_b"],
        )
        measured_at = GaugeMetricFamily(
            f"{NS}_gpu_pair_measured_timestamp_seconds",
            "When the pair's bandwidth was last measured (Unix time).",
            labels=["gpu_a", "gpu_b"],
        )
        for i in range(matrix.size):
            for j in range(i + 1, matrix.size):
                labels = [str(matrix.gpus[i].index), str(matrix.gpus[j].index)]
                if self.pairwise:
                    lvl = matrix.level(i, j)
                    if node.level(matrix.gpus[i].name, matrix.gpus[j].name) is not None:  # unknown: no series, never SYS
                        level.add_metric([*labels, str(lvl)], int(lvl.kind))
                    gbps = matrix.gpu_expected_gbps[i][j]
                    if gbps is not None:
                        expected.add_metric(labels, gbps * GB)
                m = matrix.measured.get((i, j))
                if m is not None:
                    measured.add_metric(labels, m.gbps * GB)
                    measured_at.add_metric(labels, m.taken_at)
        yield from ((level, expected) if self.pairwise else ())
        yield from (measured, measured_at)

        affinity = GaugeMetricFamily(
            f"{NS}_gpu_nic_link_level",
            "Link level between a GPU and a NIC (same scale as topoagent_gpu_pair_link_level).",
            labels=["gpu", "nic", "device", "level"],
        )
        for i, row in enumerate(matrix.gpu_nic_levels if self.pairwise else ()):
            for j, nic_level in enumerate(row):
                if nic_level is not None:
                    nic_info = matrix.nics[j]
                    affinity.add_metric(
                        [str(matrix.gpus[i].index), nic_info.name, _opt(nic_info.device), str(nic_level)], int(nic_level.kind)
                    )
        if self.pairwise:
            yield from _with_dcgm_labels([affinity], self.dcgm)

        degraded = GaugeMetricFamily(
            f"{NS}_pcie_link_degraded",
            "1 when a device's PCIe link trained narrower than it supports (the pcie-degraded finding's test; its speed falls "
            "on an idle GPU); no series where a width is unknown.",
            labels=["device", "role"],
        )
        speed = GaugeMetricFamily(
            f"{NS}_pcie_link_speed_transfers_per_second",
            "PCIe link speed of a device, current and the most it supports.",
            labels=["device", "role", "state"],
        )
        width = GaugeMetricFamily(
            f"{NS}_pcie_link_width_lanes", "PCIe link width of a device, current and the most it supports.", labels=["device", "role", "state"]
        )
        for role, devices in (("gpu", node.gpus), ("nic", node.nics)):
            for dev in devices:
                link = dev.link
                if link is None or not dev.pci_address:
                    continue
                if link.current_width and link.max_width:
                    degraded.add_metric([dev.pci_address, role], 1.0 if link.width_below_max else 0.0)
                for state, gts, lanes in (("current", link.current_gts, link.current_width), ("max", link.max_gts, link.max_width)):
                    if gts is not None:
                        speed.add_metric([dev.pci_address, role, state], gts * 1e9)
                    if lanes is not None:
                        width.add_metric([dev.pci_address, role, state], lanes)
        yield from _served(self.detail, degraded, speed, width)

        active = GaugeMetricFamily(f"{NS}_gpu_nvlinks_active", "NVLinks of a GPU that are active.", labels=["gpu"])
        nvlink = GaugeMetricFamily(f"{NS}_nvlink_up", "1 when an NVLink of a GPU is active.", labels=["gpu", "link"])
        for gpu in node.gpus:
            if gpu.nvlinks:
                active.add_metric([str(gpu.index)], sum(1 for nl in gpu.nvlinks if nl.active))
            for nl in gpu.nvlinks if self.per_link else ():
                nvlink.add_metric([str(gpu.index), str(nl.link)], 1.0 if nl.active else 0.0)
        yield from _with_dcgm_labels([active, nvlink] if self.per_link else [active], self.dcgm)

        ib_state = GaugeMetricFamily(f"{NS}_infiniband_port_active", "1 when an InfiniBand port is ACTIVE; the state label says what it is.", labels=["device", "port", "state"])
        ib_rate = GaugeMetricFamily(f"{NS}_infiniband_port_rate_bytes_per_second", "Data rate of an InfiniBand port (its Gb/s rate over 8).", labels=["device", "port"])
        for nic in node.nics:
            device = nic.device or nic.name
            for port in nic.ports:
                state = port.state or "UNKNOWN"
                ib_state.add_metric([device, str(port.number), state], 1.0 if state.upper() == "ACTIVE" else 0.0)
                if port.rate_gbps is not None:
                    ib_rate.add_metric([device, str(port.number)], port.rate_gbps * 1e9 / 8)
        yield ib_state
        yield from _served(self.detail, ib_rate)

        findings = GaugeMetricFamily(f"{NS}_findings", "Findings of the last discovery, by kind and severity.", labels=["kind", "severity"])
        counts: dict[tuple[str, str], int] = {}
        for finding in snapshot.findings:
            key = (finding.kind, finding.severity)
            counts[key] = counts.get(key, 0) + 1
        for (kind, severity), count in sorted(counts.items()):
            findings.add_metric([kind, severity], count)
        yield findings

        yield from _with_dcgm_labels(telemetry_families(snapshot, per_link=self.per_link, detail=self.detail), self.dcgm)

        success = GaugeMetricFamily(f"{NS}_collector_success", "1 when the collector's last run succeeded.", labels=["collector"])
        duration = GaugeMetricFamily(f"{NS}_collector_duration_seconds", "How long the collector's last run took.", labels=["collector"])
        last_ok = GaugeMetricFamily(f"{NS}_collector_last_success_timestamp_seconds", "When the collector last succeeded (Unix time).", labels=["collector"])
        crashed = GaugeMetricFamily(f"{NS}_collector_crashed", "1 when the collector's last run failed through a fault of topoagent's own "
                                    "(a bug, not the node's: the log has its traceback, event=collector_crashed).", labels=["collector"])
        for c in snapshot.collectors:
            success.add_metric([c.name], 0.0 if c.status is Status.ERROR else 1.0)
            crashed.add_metric([c.name], 1.0 if c.bug else 0.0)
            duration.add_metric([c.name], c.seconds)
            last_success_at = snapshot.last_success_at.get(c.name)
            if last_success_at is not None:
                last_ok.add_metric([c.name], last_success_at)
        # The counter sources (telemetry loop): no_data is quiet, as for discovery's.
        for c in snapshot.telemetry.sources if snapshot.telemetry else ():
            success.add_metric([c.name], 0.0 if c.status is Status.ERROR else 1.0)
            crashed.add_metric([c.name], 1.0 if c.bug else 0.0)
            duration.add_metric([c.name], c.seconds)
        yield from (success, crashed, duration, last_ok)

        yield from _probe_figures(snapshot.probe_figures)

        stale = GaugeMetricFamily(f"{NS}_snapshot_stale", "1 when the last discovery failed and the served topology is older.")
        stale.add_metric([], 1.0 if snapshot.stale else 0.0)
        built = GaugeMetricFamily(f"{NS}_snapshot_timestamp_seconds", "When the served topology was collected (Unix time).")
        built.add_metric([], snapshot.built_at)
        gpus = GaugeMetricFamily(f"{NS}_gpus", "GPUs on this node.")
        gpus.add_metric([], matrix.size)
        yield from (stale, built, gpus)


def telemetry_families(snapshot: Snapshot, *, per_link: bool = True, detail: frozenset[str] = frozenset(MetricsDetail)) -> Iterator[Metric]:
    """The counters' and health gauges' latest values, one family per family the counter
    sources declare (the served telemetry carries the declarations).  A series of a family
    no source declares, or with other labels than its family's, is a parser's bug: logged
    and counted (``telemetry_undeclared_series``), never dropped unsaid nor a failed scrape.

    Without `per_link`, a family with a ``link`` label is served without it, its values
    summed over a GPU's links (a sum of counters is still a counter: the links of a GPU
    stay the same between discoveries), as dcgm-exporter serves its NVLink totals.  A family
    with a ``detail`` serves only its default series unless `detail` names it."""
    telemetry = snapshot.telemetry
    families: dict[str, tuple[tuple[str, ...], GaugeMetricFamily | CounterMetricFamily]] = {}
    summed: dict[str, dict[tuple[str, ...], float]] = {}  # family -> labels without link -> sum
    declarations = telemetry.families if telemetry else ()
    served_by = {declared.name: declared for declared in declarations}  # the exporter names no collector
    for declared in declarations:
        kind = CounterMetricFamily if declared.type == "counter" else GaugeMetricFamily
        served = declared.labels if per_link else tuple(k for k in declared.labels if k != "link")
        families[declared.name] = (declared.labels, kind(f"{NS}_{declared.name}", declared.help, labels=list(served)))
        if served != declared.labels:
            summed[declared.name] = {}
    undeclared: dict[str, int] = {}
    for reading in telemetry.readings if telemetry else ():
        labels, family = families.get(reading.metric, ((), None))
        if family is None or tuple(k for k, _ in reading.labels) != labels:
            undeclared[reading.metric] = undeclared.get(reading.metric, 0) + 1
            continue
        if not served_by[reading.metric].served(reading.labels, detail):
            continue
        sums = summed.get(reading.metric)
        if sums is None:
            family.add_metric([v for _, v in reading.labels], reading.value)
        else:
            key = tuple(v for k, v in reading.labels if k != "link")
            sums[key] = sums.get(key, 0.0) + reading.value
    for name, sums in summed.items():
        for key, value in sums.items():
            families[name][1].add_metric(list(key), value)
    yield from (f for _, f in families.values() if f.samples)
    if undeclared:
        errors = GaugeMetricFamily(f"{NS}_telemetry_undeclared_series",
                                   "Series a counter source emitted of a family no source declares, or with other labels: a topoagent bug; not exported.",
                                   labels=["metric"])
        for metric, count in sorted(undeclared.items()):
            log_event("metric_family_undeclared", logging.ERROR, metric=metric, series=count)
            errors.add_metric([metric], count)
        yield errors


def _probe_figures(figures: Iterable[ProbeFigure]) -> Iterator[Metric]:
    """Each probe figure (largest size, median of its repetitions) as its own series."""
    bandwidth = GaugeMetricFamily(
        f"{NS}_probe_bandwidth_bytes_per_second",
        "Copy bandwidth a probe measured (median, per direction): p2p and p2p_bidir between GPUs, h2d/d2h from a NUMA node, local_copy on one GPU.",
        labels=["kind", "direction"],
    )
    latency = GaugeMetricFamily(f"{NS}_probe_latency_seconds", "Small-copy latency a probe measured (median).", labels=["direction"])
    peer = GaugeMetricFamily(f"{NS}_probe_peer_access", "1 when a GPU can copy straight to its peer (P2P), 0 when copies go through host memory.", labels=["src", "dst"])
    for f in figures:
        direction = f.direction or ""
        if f.kind is ProbeKind.LATENCY and f.median_latency_s is not None:
            latency.add_metric([direction], f.median_latency_s)
        elif f.kind is ProbeKind.PEER_ACCESS and f.available is not None:
            peer.add_metric([str(f.src), str(f.dst)], 1.0 if f.available else 0.0)
        elif f.median_gbps is not None:
            bandwidth.add_metric([f.kind.value, direction], f.median_gbps * GB)
    yield from (bandwidth, latency, peer)


PROBE_OUTCOMES = ("ok", "timeout", "crash", "oom", "cuda_error", "unavailable", "plan_error", "backoff")


class RuntimeCollector(Collector):
    def __init__(self, served: Served, detail: frozenset[str] = frozenset(), dcgm_labels: bool = False) -> None:
        self.served = served
        self.detail = detail  # [metrics] detail
        self.dcgm = dcgm_identity(served.snapshot) if dcgm_labels and served.snapshot is not None else None

    def collect(self) -> Iterator[Metric]:
        served = self.served
        now = time.time()
        build = InfoMetricFamily(f"{NS}_build", "Version of the running agent.")
        build.add_metric([], {"version": topoagent.__version__})
        yield build
        # What GET /readyz answers, by the same rule: 0 before a topology is loaded, and while
        # a finding leaves the node's answers untrustworthy (topoagent_findings says which).
        up = GaugeMetricFamily(f"{NS}_ready", "1 when the node is ready for placement (GET /readyz answers 200): a "
                               "topology is loaded and no critical finding leaves its answers untrustworthy; else 0.")
        up.add_metric([], 1.0 if served.snapshot is not None and not served.snapshot.placement_blockers else 0.0)
        why = GaugeMetricFamily(f"{NS}_not_ready_reason", "Why topoagent_ready is 0, one series a reason: no_topology (no discovery has "
                                "succeeded yet: topoagent_discovery_runs_total and GET /readyz's discovery say why), or the kind of "
                                "each finding that blocks placement.", labels=["reason"])
        reasons = ["no_topology"] if served.snapshot is None else sorted({str(f.kind) for f in served.snapshot.placement_blockers})
        for reason in reasons:
            why.add_metric([reason], 1.0)
        yield from (up, why)
        if served.snapshot is not None:
            age = GaugeMetricFamily(f"{NS}_snapshot_age_seconds", "Seconds since the served topology was collected.")
            age.add_metric([], max(0.0, now - served.snapshot.built_at))
            yield age
        requests = CounterMetricFamily(f"{NS}_placement_requests", "Placement requests answered, by outcome.", labels=["outcome"])
        for outcome in ("placed", "nofit", "reserved", "invalid"):
            requests.add_metric([outcome], served.placement_requests.get(outcome, 0))
        yield requests
        refreshes = CounterMetricFamily(f"{NS}_discovery_runs", "Discovery runs, by outcome.", labels=["outcome"])
        for outcome in ("success", "failure"):
            refreshes.add_metric([outcome], served.discovery_runs.get(outcome, 0))
        yield refreshes
        active = served.active_leases()
        leases = GaugeMetricFamily(f"{NS}_leases", "Leases currently held.")
        leases.add_metric([], len(active))
        holding = served.holding()
        leased = GaugeMetricFamily(f"{NS}_leased_gpus", "GPUs currently held by a lease.")
        leased.add_metric([], len(holding.holder))  # the node's GPUs each once, found by UUID, however many leases name one
        satisfaction = GaugeMetricFamily(
            f"{NS}_lease_topology_satisfaction",
            "Share of a live lease's pattern links that are local (NVLink or one PCIe switch), from its placement.",
            labels=["lease", "owner"],
        )
        for lease in active:
            if lease.satisfaction is not None:
                satisfaction.add_metric([lease.id, lease.owner], lease.satisfaction)
        orphaned = GaugeMetricFamily(f"{NS}_leases_orphaned", "Live leases one of whose GPUs left the node: they hold the ones left until released or expired.")
        orphaned.add_metric([], len(holding.orphaned))
        yield from (leases, leased, satisfaction, orphaned)
        recovered = GaugeMetricFamily(
            f"{NS}_leases_recovered_from_corrupt_state",
            "1 when the lease state file was unreadable at start-up and was moved aside: leases granted before may be lost.",
        )
        recovered.add_metric([], 1.0 if served.lease_recovery is not None else 0.0)
        yield recovered
        quarantined = GaugeMetricFamily(
            f"{NS}_leases_quarantined",
            "Lease state entries refused on loading and kept aside in leases.quarantine.json (the GPUs they named stay held).",
        )
        quarantined.add_metric([], float(len(served.lease_quarantine.entries)) if served.lease_quarantine is not None else 0.0)
        yield quarantined
        # Who holds a leased GPU, for a join by (instance, gpu): the pod and namespace of a pod's
        # lease (owner namespace/name/uid), which dcgm-exporter needs kubelet's pod-resources
        # API for.  Labels on this series, not a family of their own: no series added.
        busy = GaugeMetricFamily(f"{NS}_gpu_busy", "1 when a GPU is leased or NVML sees a process on it (placement keeps off it); "
                                 "a leased one names its lease and owner kind (pod, slurm_job, other), and a pod's namespace and name.",
                                 labels=["gpu", "reason", "lease", "owner_kind", "namespace", "pod"])
        running = served.running
        for gpu in sorted(set(holding.holder) | running):
            holder = holding.holder.get(gpu)
            if holder is None:
                busy.add_metric([str(gpu), "processes", "", "", "", ""], 1.0)
            else:
                busy.add_metric([str(gpu), "lease", holder.id, *owner_kind(holder.owner)], 1.0)
        yield from _with_dcgm_labels([busy], self.dcgm)
        yield from self._capacity()
        yield from self._probes(now)

    def _capacity(self) -> Iterator[Metric]:
        """GET /capacity's figures (cached per snapshot and busy set), for cluster views: the
        latest computed (the /metrics handler waits a bounded time for current ones first).
        None while a finding blocks placement, as /capacity answers 503 then: a node whose
        fabric is down would otherwise count every GPU free (topoagent_ready says why)."""
        served, snapshot = self.served.capacity, self.served.snapshot
        if served is None or snapshot is None or placement_refusals(snapshot.findings):
            return
        figures = served.capacity
        stale = GaugeMetricFamily(f"{NS}_capacity_stale", "1 when the capacity figures are of an earlier snapshot or busy set: the current ones were still being computed.")
        stale.add_metric([], 1.0 if served.stale else 0.0)
        yield stale
        free = GaugeMetricFamily(f"{NS}_capacity_free_gpus", "GPUs free now: not leased, running no process, without a critical finding.")
        free.add_metric([], len(figures.free))
        zone = GaugeMetricFamily(f"{NS}_capacity_largest_free_zone_gpus", "Free GPUs in the largest group joined by NVLink or one PCIe switch among themselves.")
        zone.add_metric([], len(figures.largest_free_zone))
        fragmentation = GaugeMetricFamily(f"{NS}_capacity_fragmentation", "1 - largest free zone (NVLink or one PCIe switch) / free GPUs (0 when nothing is free).")
        fragmentation.add_metric([], figures.fragmentation)
        fits = GaugeMetricFamily(f"{NS}_capacity_fits", "1 when a k-GPU job fits on the free GPUs now.", labels=["k"])
        for fit in figures.fits:
            fits.add_metric([str(fit.gpus)], 1.0 if fit.fits else 0.0)
        yield from (free, zone, fragmentation)
        yield from _served(self.detail, fits)

    def _probes(self, now: float) -> Iterator[Metric]:
        probes = self.served.probes
        enabled = GaugeMetricFamily(f"{NS}_probes_enabled", "1 when the agent measures its links ([probes] enabled).")
        enabled.add_metric([], 1.0 if probes.enabled else 0.0)
        yield enabled
        if not probes.enabled:
            return
        rounds = CounterMetricFamily(f"{NS}_probe_rounds", "Probe worker runs, by outcome: ok, or why it failed (backoff: skipped after failures).", labels=["outcome"])
        for outcome in PROBE_OUTCOMES:
            rounds.add_metric([outcome], probes.rounds.get(outcome, 0))
        seconds = CounterMetricFamily(f"{NS}_probe_seconds", "Wall time spent probing; its rate is the probe duty cycle.")
        seconds.add_metric([], probes.seconds_total)
        yield from (rounds, seconds)
        latest = probes.latest_round
        if latest is not None:
            duration = GaugeMetricFamily(f"{NS}_probe_last_duration_seconds", "How long the last probe worker run took.")
            duration.add_metric([], latest.duration_s)
            started = GaugeMetricFamily(f"{NS}_probe_last_run_timestamp_seconds", "When the last probe worker run started (Unix time).")
            started.add_metric([], latest.started_at)
            yield from (duration, started)
        if probes.consecutive_failures is not None:  # the probe service exists (after the first discovery)
            failures = GaugeMetricFamily(f"{NS}_probe_consecutive_failures", "Probe rounds failed in a row (the worker backs off geometrically).")
            failures.add_metric([], probes.consecutive_failures)
            running = GaugeMetricFamily(f"{NS}_probe_in_progress", "1 while a probe worker runs.")
            running.add_metric([], 1.0 if probes.in_progress else 0.0)
            yield from (failures, running)


class HttpCollector(Collector):
    """What the listener and the request gates turned away (see topoagent/connections.py)."""

    def __init__(self, guard: ConnectionGuard | None, refused: dict[str, int]) -> None:
        self.guard = guard
        self.refused = refused  # reason -> requests refused before any work

    def collect(self) -> Iterator[Metric]:
        guard = self.guard
        if guard is not None:
            open_now = GaugeMetricFamily(f"{NS}_http_connections", "Client connections held open now.")
            open_now.add_metric([], guard.open_connections)
            cap = GaugeMetricFamily(f"{NS}_http_connections_limit", "Most client connections held at once ([http] max_connections, kept below the open-file limit).")
            cap.add_metric([], guard.cap)
            closed = CounterMetricFamily(
                f"{NS}_http_connections_closed",
                "Connections the agent closed: no request head in time (header_timeout, keepalive_timeout), the longest-idle one "
                "closed for a new one at the limit (evicted), or a new one answered 503 with every connection busy (refused).",
                labels=["reason"],
            )
            for reason in ("header_timeout", "keepalive_timeout", "evicted", "refused"):
                closed.add_metric([reason], guard.stats[reason])
            yield from (open_now, cap, closed)
        refused = CounterMetricFamily(f"{NS}_http_requests_refused", "Requests refused before any work: rate_limited (429), misdirected_host (421).", labels=["reason"])
        for reason, count in sorted(self.refused.items()):
            refused.add_metric([reason], count)
        yield refused


def _render(collector: Collector) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_OneLineLabels(collector))
    return generate_latest(registry)


class _OneLineLabels(Collector):
    """``collector``'s metrics with every label value made one line of encodable text: the
    Host made the machine's text safe where it entered, and this page keeps its own grammar
    too, so one bad value (generate_latest cannot encode a lone surrogate) costs that value,
    never the page."""

    def __init__(self, collector: Collector) -> None:
        self.collector = collector

    def collect(self) -> Iterator[Metric]:
        for metric in self.collector.collect():
            metric.samples = [s._replace(labels={k: one_line(v) for k, v in s.labels.items()}) for s in metric.samples]
            yield metric


class MetricsPage:
    """The /metrics text: the snapshot part rendered once per snapshot, plus the runtime part."""

    def __init__(self, service: Service, http: HttpCollector | None = None) -> None:
        self.service = service
        self._http = http
        self._cached: tuple[tuple[int, bool, bool, frozenset[MetricsDetail], bool], bytes] | None = None

    def render(self) -> bytes:
        served = self.service.served()  # one value for the whole page
        snapshot = served.snapshot
        static = b""
        config = self.service.config  # read per page: a SIGHUP reload may change [metrics]
        if snapshot is not None:
            key = (snapshot.version, config.metrics_pairwise, config.metrics_per_link, config.metrics_detail, config.metrics_dcgm_labels)
            if self._cached is None or self._cached[0] != key:
                self._cached = (key, _render(SnapshotCollector(snapshot, pairwise=config.metrics_pairwise, per_link=config.metrics_per_link,
                                                               detail=config.metrics_detail, dcgm_labels=config.metrics_dcgm_labels)))
            static = self._cached[1]
        runtime = RuntimeCollector(served, config.metrics_detail, dcgm_labels=config.metrics_dcgm_labels)
        return static + _render(runtime) + (_render(self._http) if self._http is not None else b"")
