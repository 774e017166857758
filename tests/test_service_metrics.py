"""/metrics passes Prometheus' own linter and says what an operator looks for."""

from __future__ import annotations

import asyncio
import gzip
import json
import shutil
import subprocess

import pytest
from conftest import FIXTURES, REPO
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import DCGM_LABELS_LINT, metric_value, promtool_complaints, start_agent, wait_counters_read, wait_for

from topoagent.config import Config
from topoagent.exporters.prometheus import SERVED_WITH_DETAIL, MetricsPage
from topoagent.node.matrix import Measurement
from topoagent.placement import Request
from topoagent.service.agent import Agent
from topoagent.vocabulary import MetricsDetail

SNAPSHOTS = FIXTURES / "snapshots"


def metrics_of(snapshot: str, tmp_path, measured: bool = False, root: str | None = None, **config) -> str:
    """Discover a recorded node with the real collectors and render /metrics ([metrics] keys in `config`)."""

    async def build() -> bytes:
        agent = Agent(Config(root=root or str(SNAPSHOTS / snapshot), state_dir=str(tmp_path / "state"), udev=False, **config))
        await agent.start()
        try:
            await agent.request_refresh("test")
            if measured:  # a probe result, as the probe scheduler overlays it
                snap = agent.snapshot
                matrix = snap.matrix.with_measurements({(0, 1): Measurement(gbps=231.5, taken_at=1.7e9)})
                agent.snapshot = snap.with_probes(snap.version + 1, matrix, snap.probe_figures, snap.probe_findings)
            for _ in range(3):  # three dry runs answered
                await agent.place(Request(gpus=1))
            return MetricsPage(agent).render()
        finally:
            await agent.stop()

    return asyncio.run(build()).decode()


@pytest.mark.parametrize("snapshot", ["dgx-a100", "degraded", "pcie-2socket", "vm-1gpu"])
def test_promtool_finds_nothing_on_the_default_page(snapshot, tmp_path):
    text = metrics_of(snapshot, tmp_path, measured=snapshot == "dgx-a100")
    assert promtool_complaints(text.encode()) == []


def test_promtool_lints_only_the_camel_case_of_dcgm_labels_and_the_docs_say_so(tmp_path):
    """With [metrics] dcgm_labels = true, promtool exits 3 with one line per GPU family for
    dcgm-exporter's modelName, and nothing else; the default page is clean (exit 0), as the
    endpoint table (http-api.md) and the telemetry page say."""
    text = metrics_of("dgx-a100", tmp_path, metrics_dcgm_labels=True)
    done = subprocess.run([shutil.which("promtool") or "promtool", "check", "metrics"], input=text.encode(), capture_output=True, timeout=30)
    said = [line for line in (done.stdout + done.stderr).decode().splitlines() if line.strip()]
    gpu_families = sorted({f.name + ("_total" if f.type == "counter" else "") for f in text_string_to_metric_families(text)
                           if any("gpu" in s.labels for s in f.samples)})
    assert done.returncode == 3 and sorted(set(said)) == [DCGM_LABELS_LINT.format(family=name) for name in gpu_families], (done.returncode, said)
    assert promtool_complaints(text.replace("modelName=", "model_name=").encode()) == []  # that label alone
    api = " ".join((REPO / "docs" / "http-api.md").read_text().split())
    telemetry = " ".join((REPO / "docs" / "telemetry.md").read_text().split())
    cell = api.split("| `GET /metrics` |", 1)[1].split(" |", 1)[0]  # the endpoint table's row
    assert "exit 0" in cell and "dcgm_labels" in cell, cell
    assert "dcgm_labels = true" in telemetry and DCGM_LABELS_LINT.format(family="topoagent_gpu_info") in telemetry


def series_labels(text: str, name: str) -> list[dict[str, str]]:
    return [dict(sample.labels) for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name == name]


# One series of dcgm-exporter 4.x as its template (internal/pkg/rendermetrics) writes it for
# GPU 0 of the DGX A100 fixture (with DCGM_FI_DRIVER_VERSION, a `label` field of its default
# csv): the labels a join with topoagent_gpu_info must match.  Its main branch writes
# `hostname` instead of `Hostname`.
DCGM_GPU0 = ('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a13ea39b-79e0-dde4-386c-854e124e28d7",'
             'pci_bus_id="00000000:07:00.0",device="nvidia0",modelName="NVIDIA A100-SXM4-40GB",'
             'Hostname="gpu01",DCGM_FI_DRIVER_VERSION="@DRIVER@"} 87\n')
DCGM_MAIN_GPU0 = DCGM_GPU0.replace("Hostname=", "hostname=")


DGX_A100_DRIVER = json.loads((SNAPSHOTS / "dgx-a100" / "nvml.json").read_text())["driver_version"]


def test_gpu_info_names_each_gpu_once_and_dcgm_labels_put_dcgm_exporters_identity_on_every_gpu_series(tmp_path):
    root = shutil.copytree(SNAPSHOTS / "dgx-a100", tmp_path / "node", symlinks=True)
    (root / "proc/sys/kernel").mkdir(parents=True)
    (root / "proc/sys/kernel/hostname").write_text("gpu01\n")
    info = {s["gpu"]: s for s in series_labels(metrics_of("dgx-a100", tmp_path, root=str(root)), "topoagent_gpu_info")}
    assert info["0"] == {
        "gpu": "0", "uuid": "GPU-a13ea39b-79e0-dde4-386c-854e124e28d7", "pci_address": "0000:07:00.0",
        "model": "NVIDIA A100-SXM4-40GB", "numa_node": "3", "device": "nvidia0", "hostname": "gpu01", "driver_version": DGX_A100_DRIVER}
    assert info["7"]["device"] == "nvidia7"
    # The opt-in: each GPU series carries what dcgm-exporter's do, so a dcgm query joins
    # on its own labels (UUID, Hostname) without group_left.
    text = metrics_of("dgx-a100", tmp_path / "dcgm", root=str(root), metrics_dcgm_labels=True)
    for sample in (DCGM_GPU0, DCGM_MAIN_GPU0):
        dcgm = series_labels(sample.replace("@DRIVER@", DGX_A100_DRIVER), "DCGM_FI_DEV_GPU_UTIL")[0]
        for name in ("topoagent_gpu_info", "topoagent_gpu_nvlinks_active"):
            (ours,) = [s for s in series_labels(text, name) if s["gpu"] == "0"]
            assert {key: ours.get(key) for key in dcgm} == dcgm, name
    # NVML writes hex digits upper case: the B7 bus of GPU 6 (sysfs 0000:b7:00.0).
    (six,) = [s for s in series_labels(text, "topoagent_gpu_info") if s["gpu"] == "6"]
    assert six["pci_address"] == "0000:b7:00.0" and six["pci_bus_id"] == "00000000:B7:00.0"
    # Every series with a gpu label has them, and no other series does.
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            assert ("UUID" in s.labels) == ("gpu" in s.labels), (s.name, s.labels)


def test_a_leased_gpu_names_the_pod_and_namespace_of_its_lease(tmp_path):
    """The join dcgm-exporter needs kubelet's pod-resources API for: a pod's lease (owner
    namespace/name/uid, as the extender and the device plugin write it) names the pod on the
    GPU's busy series; a Slurm job's or a person's lease says its kind only, and so does one
    with a pod's UID but an empty name, which no pod has."""
    pod = "ml-team/trainer-0/0f6c1b2e-3a4d-4e5f-8a9b-0c1d2e3f4a5b"
    nameless = "ml-team//0f6c1b2e-3a4d-4e5f-8a9b-0c1d2e3f4a5c"

    async def run() -> tuple[str, dict[str, str]]:
        agent = Agent(Config(root=str(SNAPSHOTS / "dgx-a100"), state_dir=str(tmp_path / "state"), udev=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            ids = {}
            for owner, gpus in ((pod, 2), ("slurm-job-4711", 1), ("alice", 1), (nameless, 1)):
                _, lease = await agent.reserve(Request(gpus=gpus), owner, 600)
                assert lease is not None
                ids[owner] = lease.id
            return MetricsPage(agent).render().decode(), ids
        finally:
            await agent.stop()

    text, ids = asyncio.run(run())
    busy = series_labels(text, "topoagent_gpu_busy")
    by_kind = sorted((s["owner_kind"], s.get("namespace", ""), s.get("pod", ""), s["lease"]) for s in busy)
    assert by_kind == sorted([("pod", "ml-team", "trainer-0", ids[pod])] * 2 + [("slurm_job", "", "", ids["slurm-job-4711"]),
                                                                               ("other", "", "", ids["alice"]),
                                                                               ("other", "", "", ids[nameless])])
    assert all(s["reason"] == "lease" for s in busy)
    assert promtool_complaints(text.encode()) == []


def test_dcgm_labels_on_the_runtime_series_are_built_once_per_snapshot(tmp_path, monkeypatch):
    """Each scrape built dcgm-exporter's identity labels of every GPU again for the busy
    series; they are the snapshot's, built when it is first scraped."""
    from topoagent.exporters import prometheus

    built: list[str] = []
    real = prometheus.nvml_bus_id
    monkeypatch.setattr(prometheus, "nvml_bus_id", lambda address: built.append(address) or real(address))

    async def run() -> tuple[list[str], set[int]]:
        agent = Agent(Config(root=str(SNAPSHOTS / "dgx-a100"), state_dir=str(tmp_path / "state"), udev=False, metrics_dcgm_labels=True))
        await agent.start()
        try:
            await agent.request_refresh("test")
            page = MetricsPage(agent)
            texts, versions = [], set()

            def scrape() -> None:  # the snapshots it may have read: a counter read swaps in a new one
                before = agent.served().snapshot
                texts.append(page.render().decode())
                versions.update(s.version for s in (before, agent.served().snapshot) if s is not None)

            scrape()
            _, lease = await agent.reserve(Request(gpus=2), "job", 600)  # the busy series change, the snapshot does not
            assert lease is not None
            for _ in range(3):
                scrape()
            return texts, versions
        finally:
            await agent.stop()

    texts, versions = asyncio.run(run())
    assert 8 <= len(built) <= 8 * len(versions) < 8 * len(texts)  # one identity per GPU and snapshot, not per scrape
    busy = series_labels(texts[-1], "topoagent_gpu_busy")
    assert len(busy) == 2 and all(s["UUID"].startswith("GPU-") and s["device"] == f"nvidia{s['gpu']}" for s in busy)


def test_pairwise_topology_and_per_link_series_only_when_asked(tmp_path):
    """By default the n^2 pairwise levels and the per-NVLink series stay off the page
    (GET /topology has the levels); NVLink state is counted per GPU instead."""
    text = metrics_of("dgx-a100", tmp_path, measured=True)
    for family in ("topoagent_gpu_pair_link_level", "topoagent_gpu_pair_expected_bandwidth_bytes_per_second",
                   "topoagent_gpu_nic_link_level", "topoagent_nvlink_up"):
        assert f"\n{family}{{" not in text, family
    assert metric_value(text, "topoagent_gpu_nvlinks_active", {"gpu": "0"}) == 12  # NV12 to the NVSwitches
    # What a probe measured stays: it is a fact of this node's links, not of its model.
    assert metric_value(text, "topoagent_gpu_pair_measured_bandwidth_bytes_per_second", {"gpu_a": "0", "gpu_b": "1"}) == 231.5e9


def test_dgx_a100_identity_links_and_base_units(tmp_path):
    text = metrics_of("dgx-a100", tmp_path, measured=True, metrics_pairwise=True, metrics_per_link=True,
                      metrics_detail=frozenset({MetricsDetail.PCIE_LINK}))
    assert metric_value(text, "topoagent_gpu_info", {"gpu": "0", "model": "NVIDIA A100-SXM4-40GB", "numa_node": "3",
                                                     "pci_address": "0000:07:00.0"}) == 1
    assert metric_value(text, "topoagent_gpu_pair_link_level", {"gpu_a": "0", "gpu_b": "1", "level": "NV12"}) == 1
    assert metric_value(text, "topoagent_gpu_pair_expected_bandwidth_bytes_per_second", {"gpu_a": "0", "gpu_b": "1"}) == 300e9
    assert metric_value(text, "topoagent_gpu_pair_measured_bandwidth_bytes_per_second", {"gpu_a": "0", "gpu_b": "1"}) == 231.5e9
    assert metric_value(text, "topoagent_gpu_nic_link_level", {"gpu": "0", "nic": "NIC0", "level": "PXB"}) == 3
    assert metric_value(text, "topoagent_pcie_link_speed_transfers_per_second", {"device": "0000:07:00.0", "state": "max"}) == 16e9
    assert metric_value(text, "topoagent_pcie_link_width_lanes", {"device": "0000:07:00.0", "state": "current"}) == 16
    assert metric_value(text, "topoagent_nvlink_up", {"gpu": "0", "link": "11"}) == 1
    for collector in ("numa", "pci", "infiniband", "nvml", "nvidia_smi"):
        assert metric_value(text, "topoagent_collector_success", {"collector": collector}) == 1
        assert metric_value(text, "topoagent_collector_duration_seconds", {"collector": collector}) >= 0
        assert metric_value(text, "topoagent_collector_last_success_timestamp_seconds", {"collector": collector}) > 1.7e9
    assert metric_value(text, "topoagent_placement_requests_total", {"outcome": "placed"}) == 3
    assert metric_value(text, "topoagent_build_info") == 1
    assert metric_value(text, "topoagent_snapshot_age_seconds") >= 0
    # one namespace; counters, and only counters, end in _total
    for line in text.splitlines():
        if line.startswith("# TYPE"):
            _, _, name, kind = line.split()
            assert name.startswith("topoagent_")
            assert name.endswith("_total") == (kind == "counter"), line


def test_degraded_node_shows_its_faults(tmp_path):
    text = metrics_of("degraded", tmp_path, metrics_per_link=True)
    assert metric_value(text, "topoagent_findings", {"kind": "pcie-degraded", "severity": "warning"}) == 1
    assert metric_value(text, "topoagent_findings", {"kind": "nvlink-down"}) == 1
    assert metric_value(text, "topoagent_findings", {"kind": "ib-port-down"}) == 1
    assert metric_value(text, "topoagent_nvlink_up", {"gpu": "5", "link": "7"}) == 0
    assert metric_value(text, "topoagent_gpu_nvlinks_active", {"gpu": "5"}) == metric_value(text, "topoagent_gpu_nvlinks_active", {"gpu": "4"}) - 1
    assert metric_value(text, "topoagent_infiniband_port_active", {"device": "mlx5_6", "state": "DOWN"}) == 0
    # By default the finding says a link lost lanes; the link, with its lane counts, with
    # [metrics] detail = ["pcie_link"]; port rates with "settings".
    assert not any(f"topoagent_{name}" in text for name in SERVED_WITH_DETAIL)
    text = metrics_of("degraded", tmp_path, metrics_detail=frozenset({MetricsDetail.PCIE_LINK, MetricsDetail.SETTINGS}))
    assert metric_value(text, "topoagent_infiniband_port_rate_bytes_per_second", {"device": "mlx5_0"}) == 50e9
    assert metric_value(text, "topoagent_pcie_link_degraded", {"role": "gpu", "device": "0000:5d:00.0"}) == 1
    assert metric_value(text, "topoagent_pcie_link_degraded", {"role": "gpu", "device": "0000:18:00.0"}) == 0
    assert metric_value(text, "topoagent_pcie_link_width_lanes", {"role": "gpu", "state": "current", "device": "0000:5d:00.0"}) == 8
    assert metric_value(text, "topoagent_pcie_link_width_lanes", {"role": "gpu", "state": "max", "device": "0000:5d:00.0"}) == 16


def test_promtool_on_the_live_service(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx-a100")
    try:
        agent.post("/place", {"gpus": 2})
        assert promtool_complaints(agent.get("/metrics").body) == []
    finally:
        agent.stop()


def test_metrics_are_gzipped_when_the_scraper_asks_and_plain_otherwise(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx-a100")
    try:
        wait_counters_read(agent)  # the page it serves from then on: before, a counters' read may grow it between two scrapes
        plain = agent.get("/metrics")
        assert "content-encoding" not in plain.headers and plain.body.startswith(b"# HELP")
        # What Prometheus sends (scrape.go: "Accept-Encoding: gzip").
        packed = agent.get("/metrics", headers={"Accept-Encoding": "gzip"})
        assert packed.status == 200 and packed.headers["content-encoding"] == "gzip"
        assert "accept-encoding" in packed.headers["vary"].lower()
        page = gzip.decompress(packed.body)
        assert len(packed.body) < len(page) / 4 and abs(len(page) - len(plain.body)) < len(plain.body) / 10
        assert promtool_complaints(page) == []
        assert metric_value(page.decode(), "topoagent_gpus") == 8
        refused = agent.get("/metrics", headers={"Accept-Encoding": "gzip;q=0, identity"})
        assert "content-encoding" not in refused.headers and refused.body.startswith(b"# HELP")
    finally:
        agent.stop()


def test_live_leases_show_their_topology_satisfaction_also_after_a_restart(tmp_path):
    from topoagent.placement import Request

    async def run(step: str) -> tuple[str, str, str]:
        agent = Agent(Config(root=str(SNAPSHOTS / "pcie-2socket"), state_dir=str(tmp_path / "state"), udev=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            if step == "restart":  # the leases come back from the state file
                return MetricsPage(agent).render().decode(), "", ""
            _, local = await agent.reserve(Request(gpus=2), "job-local", 600)
            _, wide = await agent.reserve(Request(gpus=6), "job-wide", 600)
            assert local is not None and wide is not None
            before = MetricsPage(agent).render().decode()
            await agent.release(wide.id)
            return before, MetricsPage(agent).render().decode(), local.id + " " + wide.id
        finally:
            await agent.stop()

    before, after, ids = asyncio.run(run("grant"))
    local_id, wide_id = ids.split()
    name = "topoagent_lease_topology_satisfaction"
    assert metric_value(before, name, {"lease": local_id, "owner": "job-local"}) == 1.0  # one PCIe switch
    # Six GPUs of two sockets' switches (four each): two of the six ring links cross the sockets.
    assert metric_value(before, name, {"lease": wide_id, "owner": "job-wide"}) == pytest.approx(4 / 6, abs=1e-4)
    assert metric_value(after, name, {"lease": wide_id, "owner": "job-wide"}) is None  # released: gone
    assert promtool_complaints(before.encode()) == []
    restarted, _, _ = asyncio.run(run("restart"))
    assert metric_value(restarted, name, {"lease": local_id, "owner": "job-local"}) == 1.0


def test_counters_are_served_from_the_first_snapshot_not_an_interval_later(tmp_path):
    """The counters' first read comes with discovery's first snapshot: with an hour between
    reads, the recorded InfiniBand counters are still on /metrics within the first scrapes
    (they were missing for a whole interval, 10 s by default)."""
    agent = start_agent(tmp_path, root=SNAPSHOTS / "dgx-a100", config="[telemetry]\ninterval_s = 3600\n")
    try:
        def counters_served() -> bool:
            reply = agent.get("/metrics")
            return reply.status == 200 and "topoagent_infiniband_port_received_bytes_total{" in reply.body.decode()

        wait_for("the recorded InfiniBand counters on /metrics", counters_served, agent, timeout=120)  # a bound for a loaded machine, not an expectation
    finally:
        assert agent.stop() == 0
