"""What the node cannot see is said, never filled in (issue 27): a GPU stack that does not
answer, a node without GPUs, a missing GPUDirect module, counters that cannot move.

Each case is a recording under fixtures/snapshots/ (fixtures/SOURCES.md says how each was
made), or hwloc's own recording of a real node with saturated counters (tests/data/hwloc/).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile

import pytest
from conftest import FIXTURES, TESTS
from service_helpers import start_agent, wait_for

from topoagent.collectors import ib_counters
from topoagent.commands.discover import discover_root
from topoagent.config import Config
from topoagent.exporters.nfd import nfd_features
from topoagent.node.findings import placement_blockers
from topoagent.service.exports import rendered
from topoagent.service.telemetry import History, Sample, served

SNAPSHOTS = FIXTURES / "snapshots"
HWLOC_QIB = TESTS / "data" / "hwloc" / "40intel64-2g2n4c+pcilocality.tar.bz2"
STACKLESS = ["no-gpu-stack", "no-nvidia-driver"]


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *argv], capture_output=True, text=True, timeout=120)


def kinds(node) -> dict[str, str]:
    return {f.kind: f.severity for f in node.findings}


# --- discovery: a finding with its remedy, links unknown ---------------------------------


@pytest.mark.parametrize("name", STACKLESS)
def test_gpus_no_witness_answers_for_are_a_critical_finding_with_links_unknown(name):
    node = discover_root(str(SNAPSHOTS / name))
    stack = [f for f in node.findings if f.kind == "gpu-stack-missing"]
    assert len(stack) == 1 and stack[0].severity == "critical"
    assert "8 NVIDIA GPU(s) on the PCI bus" in stack[0].message and "Remedy: " in stack[0].message
    # The GPUs are the ones the PCI bus shows; between them, no level is guessed.
    assert len(node.gpus) == 8
    gpu_pairs = [p for p in node.pairs if p.a.startswith("GPU") and p.b.startswith("GPU")]
    assert gpu_pairs and all(p.level is None for p in gpu_pairs)
    # GPU to NIC is the PCIe path, which sysfs alone shows.
    assert node.level("GPU0", "NIC0") is not None
    assert placement_blockers(node.findings) == tuple(stack)


def test_the_cause_and_remedy_follow_what_is_missing():
    pod = discover_root(str(SNAPSHOTS / "no-gpu-stack")).findings[0].message
    driver = next(f for f in discover_root(str(SNAPSHOTS / "no-nvidia-driver")).findings if f.kind == "gpu-stack-missing").message
    assert "nvidia-smi not found" in pod and "NVIDIA container runtime" in pod
    assert "the NVIDIA driver is not loaded" in driver and "modprobe nvidia" in driver
    assert "couldn't communicate with the NVIDIA driver" in driver


def test_a_node_without_gpus_is_a_critical_finding():
    node = discover_root(str(SNAPSHOTS / "no-gpus"))
    assert node.gpus == () and kinds(node)["no-gpus"] == "critical"
    assert [f.kind for f in placement_blockers(node.findings)] == ["no-gpus"]


def test_rdma_nics_without_the_peer_memory_module_are_a_warning_only_where_the_module_list_was_seen():
    node = discover_root(str(SNAPSHOTS / "no-gpudirect"))
    gdr = [f for f in node.findings if f.kind == "gpudirect-missing"]
    assert [(f.severity, f.subject) for f in gdr] == [("warning", "gpudirect")]
    assert "modprobe nvidia_peermem" in gdr[0].message and node.peer_memory is None
    assert placement_blockers(node.findings) == ()
    # The same node recorded without its module list: nothing seen, nothing said.
    assert "gpudirect-missing" not in kinds(discover_root(str(SNAPSHOTS / "hgx-h100")))


def test_a_loaded_peer_memory_module_raises_nothing(tmp_path):
    import shutil

    root = tmp_path / "node"
    shutil.copytree(SNAPSHOTS / "no-gpudirect", root, symlinks=True)
    (root / "sys/module/nvidia_peermem").mkdir()
    (root / "sys/module/nvidia_peermem/version").write_text("535.161.08\n")
    node = discover_root(str(root))
    assert node.peer_memory == "nvidia_peermem" and "gpudirect-missing" not in kinds(node)


# --- what the doors say ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["no-gpu-stack", "no-gpus"])
def test_readyz_says_not_ready_for_placement_and_why_while_healthz_stays_alive(name, tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / name)
    try:
        ready = agent.get("/readyz")
        assert ready.status == 503
        body = ready.json()
        kind = "gpu-stack-missing" if name == "no-gpu-stack" else "no-gpus"
        assert body["error"] == "not_ready_for_placement" and body["detail"].startswith(kind)
        assert [f["kind"] for f in body["findings"]] == [kind] and body["findings"][0]["severity"] == "critical"
        assert isinstance(body["snapshot_version"], int) and body["stale"] is False
        assert agent.get("/healthz").status == 200
        placed = agent.post("/place", {"gpus": 2})
        if name == "no-gpu-stack":
            assert placed.status == 503 and placed.json() == {k: body[k] for k in ("error", "detail", "findings")}
        else:  # no GPU: the core's own answer, as at every door (tests/test_cli_doors.py): it never fits
            assert placed.status == 422 and placed.json()["nofit"]["reason"] == "2 GPUs requested; no GPUs found on this node"
        # What the node did see is still served, the finding with it; an unseen link is no series.
        topology = agent.get("/topology").json()
        assert kind in {f["kind"] for f in topology["findings"]}
        metrics = agent.get("/metrics").body.decode()
        assert f'topoagent_findings{{kind="{kind}",severity="critical"}} 1.0' in metrics
        assert "topoagent_gpu_pair_link_level{" not in metrics
    finally:
        assert agent.stop() == 0


def test_a_warning_leaves_the_node_ready(tmp_path):
    agent = start_agent(tmp_path, root=SNAPSHOTS / "no-gpudirect")
    try:
        assert agent.get("/readyz").status == 200
        assert agent.post("/place", {"gpus": 2}).status == 200
    finally:
        assert agent.stop() == 0


def test_nfd_labels_state_no_nvlink_fact_nobody_saw_and_say_health():
    labels = nfd_features(discover_root(str(SNAPSHOTS / "no-gpu-stack")), "t.io")
    assert labels["t.io/health"] == "gpu-stack-missing"
    assert not [k for k in labels if k.startswith("t.io/nvlink")], labels
    assert labels["t.io/gpu.count"] == "8" and labels["t.io/findings.errors"] == "1"
    # A node whose witnesses answered has no health label, and its NVLink facts.
    healthy = nfd_features(discover_root(str(SNAPSHOTS / "hgx-h100")), "t.io")
    assert "t.io/health" not in healthy and healthy["t.io/nvlink.zone-size"] == "8"


@pytest.mark.parametrize("fmt", ["gres", "nccl-xml"])
def test_exports_that_state_links_are_held_back_with_the_reason(fmt, tmp_path):
    out = tmp_path / "file"
    done = run("export", fmt, "--root", str(SNAPSHOTS / "no-gpu-stack"), "-o", str(out))
    assert done.returncode == 1 and not out.exists()
    assert done.stderr.startswith(f"topoagent export {fmt}: gpu-stack-missing: ") and "nothing written" in done.stderr
    config = Config(export_nfd_path=str(tmp_path / "nfd"), export_gres_path=str(tmp_path / "gres"),
                    export_nccl_path=str(tmp_path / "nccl.xml"))
    # The agent's own exports: the NFD file (with its health label) only.
    assert list(rendered(config, discover_root(str(SNAPSHOTS / "no-gpu-stack")))) == [str(tmp_path / "nfd")]


def test_place_on_the_command_line_refuses_with_the_reason():
    done = run("place", "--gpus", "8", "--root", str(SNAPSHOTS / "no-gpu-stack"))
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("topoagent place: not ready for placement: gpu-stack-missing (gpu-stack): ")


# --- counters that cannot move -----------------------------------------------------------


def stuck(findings) -> dict[tuple[str, str], str]:
    return {(f.subject, f.message.split(" ", 1)[0]): f.message for f in findings if f.kind == "counter-stuck"}


def test_the_real_qib0_counters_saturated_at_2_32_minus_1_are_each_a_warning(tmp_path):
    """hwloc's 40intel64 recording: the four data and packet counters of qib0 port 1 read
    4294967295.  Served by a real agent reading the recording's sysfs."""
    with tarfile.open(HWLOC_QIB) as archive:
        archive.extractall(tmp_path / "rec", filter="data")
    (root,) = (tmp_path / "rec").iterdir()
    assert (root / "sys/class/infiniband/qib0/ports/1/counters/port_xmit_data").read_text().strip() == "4294967295"
    agent = start_agent(tmp_path, root=root, config="[telemetry]\ninterval_s = 0.5\n")
    try:
        findings = wait_for("counter-stuck findings", lambda: [f for f in agent.get("/topology").json()["findings"] if f["kind"] == "counter-stuck"],
                            agent, timeout=30)
    finally:
        assert agent.stop() == 0
    said = {(f["subject"], f["message"].split(" ", 1)[0]): f for f in findings}
    assert set(said) == {("qib0 port 1", c) for c in ("port_xmit_data", "port_rcv_data", "port_xmit_packets", "port_rcv_packets")}
    for f in said.values():
        assert f["severity"] == "warning" and f["source"] == "telemetry"
        assert "saturated at 4294967295 (2^32-1)" in f["message"]


def port(data: int, packets: int, rcv: int = 10**6) -> dict[str, str]:
    base = "mlx5_0/1/counters"
    return {f"{base}/port_xmit_data": f"{data}\n", f"{base}/port_xmit_packets": f"{packets}\n",
            f"{base}/port_rcv_data": f"{rcv}\n", f"{base}/port_rcv_packets": f"{rcv // 256}\n"}


def telemetry_of(*raws: dict[str, str]):
    history = History()
    for n, raw in enumerate(raws):
        history.add(Sample(ib_counters.SOURCE.name, 100.0 + 10 * n, raw), ib_counters.parse)
    return served(history, {}, None)


def test_a_counter_frozen_while_its_port_carries_traffic_is_a_warning_naming_port_and_counter():
    frozen = telemetry_of(port(5000, 100), port(5000, 900))
    assert stuck(frozen.findings) == {("mlx5_0 port 1", "port_xmit_data"):
                                      "port_xmit_data is frozen at 5000 while port_xmit_packets rises at 80/s: the counter no longer counts"}
    # Both standing still is an idle port, and both rising a busy one: nothing to say.
    assert stuck(telemetry_of(port(5000, 100), port(5000, 100)).findings) == {}
    assert stuck(telemetry_of(port(5000, 100), port(9000, 900)).findings) == {}


def test_a_counter_at_its_maximum_is_saturated_and_one_below_it_is_not():
    assert list(stuck(telemetry_of(port(2**64 - 1, 100)).findings)) == [("mlx5_0 port 1", "port_xmit_data")]
    assert list(stuck(telemetry_of(port(2**32 - 1, 100)).findings)) == [("mlx5_0 port 1", "port_xmit_data")]
    assert stuck(telemetry_of(port(2**32 - 2, 100)).findings) == {}
    # Series are floats: a 64-bit counter is judged to within float precision (2^11 counts
    # of 2^64), which no counter crosses in its working life before it stops.
    assert stuck(telemetry_of(port(2**64 - 2**14, 100)).findings) == {}


@pytest.mark.parametrize("name", sorted(p.name for p in SNAPSHOTS.iterdir() if (p / "telemetry.json").is_file()))
def test_the_recorded_nodes_counters_all_move(name):
    from topoagent.node.host import Host
    from topoagent.service.telemetry import replayed

    telemetry = replayed(Host(SNAPSHOTS / name), None)
    assert telemetry is not None and stuck(telemetry.findings) == {}


def test_the_qib_recording_is_kept_with_its_licence():
    assert (HWLOC_QIB.parent / "COPYING").read_text().startswith("SPDX-License-Identifier: BSD-3-Clause")
    assert "40intel64-2g2n4c+pcilocality" in (FIXTURES / "SOURCES.md").read_text()
    assert json.loads((SNAPSHOTS / "no-gpus" / "snapshot.json").read_text())["hostname"] == "cpu-node-01"
