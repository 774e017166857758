"""An NVSwitch node whose NVLink fabric is down or not yet up fails closed (issue 27, item 1):
NVSwitches on the PCI bus with not one active NVLink (``nvswitch-no-nvlink``: an A100 or
H100 board whose fabric manager never trained the links), or GPUs whose NVLink fabric
registration NVML reports not completed (``fabric-not-ready``: CUDA does not start on them).

Each case is a recording under fixtures/snapshots/ (fixtures/SOURCES.md): ``no-fabric-manager``
(dgx-a100, every NVLink inactive), ``fabric-not-started`` (hgx-h100, links inactive, fabric
state not_started), ``fabric-in-progress`` (hgx-h100, links active, fabric state in_progress).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import FIXTURES
from service_helpers import start_agent

from topoagent.collectors.base import SourceError
from topoagent.collectors.nvml import parse_nvml
from topoagent.commands.discover import discover_root
from topoagent.exporters.nfd import nfd_features
from topoagent.node.findings import fabric_findings, nvlink_findings, placement_blockers

SNAPSHOTS = FIXTURES / "snapshots"
# Each recording and the critical findings it must show, in the order discovery gives them.
CASES = {
    "no-fabric-manager": ["nvswitch-no-nvlink"],
    "fabric-not-started": ["nvswitch-no-nvlink", "fabric-not-ready"],
    "fabric-in-progress": ["fabric-not-ready"],
}


def critical(node) -> list[str]:
    return [f.kind for f in node.findings if f.severity == "critical"]


def gpu_levels(node) -> dict[tuple[str, str], object]:
    return {(p.a, p.b): p.level for p in node.pairs if p.a.startswith("GPU") and p.b.startswith("GPU")}


# --- discovery ---------------------------------------------------------------------------


def test_nvswitches_without_one_active_nvlink_are_one_critical_finding_and_pairs_are_their_pcie_path():
    node = discover_root(str(SNAPSHOTS / "no-fabric-manager"))
    (finding,) = node.findings  # one finding for the node, not an nvlink-down on each of its 8 GPUs
    assert (finding.kind, finding.severity, finding.subject) == ("nvswitch-no-nvlink", "critical", "nvswitch")
    assert finding.message.startswith("6 NVSwitch(es) on the PCI bus but none of the 8 GPUs has an active NVLink (0 of 96")
    assert "Remedy: start the fabric manager (systemctl start nvidia-fabricmanager" in finding.message
    assert placement_blockers(node.findings) == (finding,)
    # No pair is presented as NVLink: each is the PCIe path sysfs shows, as nvidia-smi says too.
    levels = gpu_levels(node)
    assert len(levels) == 28 and all(lvl is not None and not lvl.is_nvlink for lvl in levels.values())
    assert str(node.level("GPU0", "GPU1")) == "PXB" and str(node.level("GPU0", "GPU7")) == "SYS"
    assert all(p.declared == p.level for p in node.pairs if (p.a, p.b) in levels)
    # The same board with its fabric up says nothing.
    healthy = discover_root(str(SNAPSHOTS / "dgx-a100"))
    assert critical(healthy) == [] and str(healthy.level("GPU0", "GPU7")) == "NV12"


def test_a_fabric_registration_not_completed_is_critical_and_links_seen_active_stay_as_seen():
    node = discover_root(str(SNAPSHOTS / "fabric-in-progress"))
    assert critical(node) == ["fabric-not-ready"]
    (finding,) = placement_blockers(node.findings)
    assert finding.subject == "nvlink-fabric"
    assert finding.message.startswith("NVLink fabric registration not completed on 8 of 8 GPUs "
                                      "(in_progress: GPU0, GPU1, GPU2, GPU3, GPU4, GPU5, GPU6, GPU7)")
    assert "systemctl status nvidia-fabricmanager" in finding.message
    assert {str(lvl) for lvl in gpu_levels(node).values()} == {"NV18"}


def test_a_fabric_never_started_shows_both_what_nvml_said_and_what_the_links_do():
    node = discover_root(str(SNAPSHOTS / "fabric-not-started"))
    assert [f.kind for f in placement_blockers(node.findings)] == ["nvswitch-no-nvlink", "fabric-not-ready"]
    assert "(not_started: GPU0," in node.findings[1].message
    assert not any(lvl.is_nvlink for lvl in gpu_levels(node).values() if lvl is not None)


def gpu(index: int, fabric: dict | None, active: bool = True) -> dict:
    raw: dict = {"index": index, "nvlinks": [{"link": 0, "active": active}, {"link": 1, "active": active}]}
    if fabric is not None:
        raw["fabric"] = fabric
    return raw


@pytest.mark.parametrize(("fabric", "said"), [
    (None, None),  # not asked (before R550), or recorded before it was: nothing seen, nothing said
    ({"state": "not_supported"}, None),  # pre-Hopper GPUs: the A100's links say it instead
    ({"state": "completed", "status": 0}, None),
    ({"state": "completed", "status": None}, None),  # status unknown: not an error seen
    ({"state": "completed", "status": 999}, "completed with error 999: GPU0"),
    ({"state": "in_progress", "status": None}, "in_progress: GPU0"),
    ({"state": "not_started"}, "not_started: GPU0"),
])
def test_the_fabric_state_rule(fabric, said):
    nvml = parse_nvml({"gpus": [gpu(0, fabric), gpu(1, {"state": "completed", "status": 0})]})
    found = fabric_findings(nvml, 0)  # GPU1's completed state says a fabric exists
    if said is None:
        assert found == []
    else:
        (f,) = found
        assert f.kind == "fabric-not-ready" and f.severity == "critical"
        assert f.message.startswith(f"NVLink fabric registration not completed on 1 of 2 GPUs ({said}):")


def test_a_fabric_state_nobody_can_read_is_not_taken_as_completed():
    """A state number nvml.h does not name (a newer driver's), or an NVML error: judged not
    ready, saying what NVML said, beside the GPUs still registering."""
    nvml = parse_nvml({"gpus": [gpu(0, {"state": "unknown", "status": 0, "unknown": "state 7"}), gpu(1, {"state": "in_progress"}),
                                gpu(2, {"state": "completed", "status": 0})]})
    (f,) = fabric_findings(nvml, 0)
    assert f.kind == "fabric-not-ready" and f.severity == "critical"
    assert f.message.startswith("NVLink fabric registration not completed on 1 of 3 GPUs (in_progress: GPU1)")
    assert "NVLink fabric state unreadable on 1 of 3 GPUs (GPU0 (state 7)): a state number this topoagent does not know" in f.message
    assert "upgrade topoagent" in f.message


def test_an_nvml_error_for_the_fabric_state_on_an_nvswitch_node_blocks_with_the_drivers_remedy():
    """On NVSwitches an unreadable state still blocks: CUDA may not start.  The remedy is
    the driver's and the fabric manager's, not "upgrade topoagent" (that is for a state
    number we do not know)."""
    nvml = parse_nvml({"gpus": [gpu(0, {"state": "unknown", "unknown": "error 15"}), gpu(1, {"state": "completed", "status": 0})]})
    (f,) = fabric_findings(nvml, 6)
    assert f.kind == "fabric-not-ready" and f.severity == "critical"
    assert "unreadable on 1 of 2 GPUs (GPU0 (error 15)): NVML answered an error" in f.message
    assert "nvidia-fabricmanager" in f.message and "upgrade topoagent" not in f.message


@pytest.mark.parametrize("said", ["state of mind", "error", "completed", "state 7 and more"])
def test_a_recording_whose_unknown_fabric_state_says_neither_a_state_nor_an_error_is_refused_by_name(said):
    """What NVML said is read once, where the recording enters: a state number or an NVML
    error, nothing else (the findings no longer guess the kind from the words)."""
    with pytest.raises(SourceError, match=r"gpus\[0\]\.fabric\.unknown: .* is not 'state N' or 'error N'"):
        parse_nvml({"gpus": [gpu(0, {"state": "unknown", "unknown": said})]})


@pytest.mark.parametrize("fabric", [
    {"state": "unknown", "unknown": "error 999"},  # NVML said an error
    {"state": "not_supported", "status": 0, "clique_id": 0},  # the real H200's answer
    None,
])
def test_a_pcie_gpu_without_a_fabric_is_never_judged_by_its_fabric_state(fabric):
    """No NVSwitch, no NVLink to a switch, no GPU that NVML says is on a fabric: the fabric
    state is no fact this node's placement needs, whatever NVML answered for it."""
    raw = {"gpus": [{"index": 0, "nvlinks": [], **({"fabric": fabric} if fabric else {})}]}
    assert fabric_findings(parse_nvml(raw), 0) == []


def test_the_gb200_tray_with_one_gpu_still_registering_names_that_gpu():
    nvml = parse_nvml(json.loads((FIXTURES / "nvml" / "gb200-nvl72-tray.json").read_text()))
    (f,) = fabric_findings(nvml, 0)  # its switches are in other trays: NVML says the fabric
    assert "on 1 of 4 GPUs (in_progress: GPU3)" in f.message


def test_links_all_down_without_nvswitches_stay_per_gpu_and_one_active_link_rules_the_finding_out():
    down = parse_nvml({"gpus": [gpu(0, None, active=False), gpu(1, None, active=False)]})
    # No NVSwitch on the bus: not a fabric, each GPU's links are its own (nvlink-down per GPU).
    assert [(f.kind, f.subject) for f in nvlink_findings(down, set(), {}, 0)] == [("nvlink-down", "GPU0"), ("nvlink-down", "GPU1")]
    assert [f.kind for f in nvlink_findings(down, set(), {}, 6)] == ["nvswitch-no-nvlink"]
    one_up = parse_nvml({"gpus": [gpu(0, None, active=False), {"index": 1, "nvlinks": [{"link": 0, "active": True}]}]})
    assert "nvswitch-no-nvlink" not in [f.kind for f in nvlink_findings(one_up, set(), {}, 6)]
    # NVML answered for no link at all: their state was not seen, so it is not said to be down.
    unseen = parse_nvml({"gpus": [{"index": 0, "nvlinks": []}, {"index": 1, "nvlinks": []}]})
    assert nvlink_findings(unseen, set(), {}, 6) == []


# --- what the doors say ------------------------------------------------------------------


def metric(page: str, name: str) -> str | None:
    return next((line.split(" ")[-1] for line in page.splitlines() if line.startswith(name + " ")), None)


@pytest.mark.parametrize("name", sorted(CASES))
def test_readyz_place_and_metrics_say_not_ready_and_why(name, tmp_path):
    kinds = CASES[name]
    agent = start_agent(tmp_path, root=SNAPSHOTS / name, extra=["--log-level", "debug"])
    try:
        ready = agent.get("/readyz")
        assert ready.status == 503
        body = ready.json()
        assert body["error"] == "not_ready_for_placement" and body["detail"].startswith(kinds[0])
        assert [f["kind"] for f in body["findings"]] == kinds and {f["severity"] for f in body["findings"]} == {"critical"}
        assert agent.get("/healthz").status == 200
        # A placement is refused with the same reason: its GPUs may not even start CUDA.
        placed = agent.post("/place", {"gpus": 2})
        assert placed.status == 503 and placed.json() == {k: body[k] for k in ("error", "detail", "findings")}
        # No capacity figures either: the fabric findings name no GPU, so every GPU would look free.
        capacity = agent.get("/capacity")
        assert capacity.status == 503 and capacity.json() == placed.json()
        page = agent.get("/metrics").body.decode()
        assert metric(page, "topoagent_ready") == "0.0"  # what /readyz says
        assert "topoagent_capacity_" not in page
        for kind in kinds:
            assert metric(page, f'topoagent_findings{{kind="{kind}",severity="critical"}}') == "1.0"
        assert set(kinds) <= {f["kind"] for f in agent.get("/topology").json()["findings"]}
        # Figures no door serves are not computed either (a 128-GPU node's searches cost seconds).
        assert "event=capacity_computed" not in agent.log()
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize(("name", "ready"), [("no-gpu-stack", "0.0"), ("no-gpudirect", "1.0")])
def test_topoagent_ready_follows_readyz_on_the_other_recordings(name, ready, tmp_path):
    """A blind node is 0 as its /readyz is 503; a warning (no GPUDirect module) leaves it 1."""
    agent = start_agent(tmp_path, root=SNAPSHOTS / name)
    try:
        status = agent.get("/readyz").status
        page = agent.get("/metrics").body.decode()
        assert metric(page, "topoagent_ready") == ready
        assert status == (200 if ready == "1.0" else 503)
        # /capacity and its gauges follow: figures only for a node ready for placement.
        capacity = agent.get("/capacity")
        assert capacity.status == status
        assert (metric(page, "topoagent_capacity_free_gpus") is not None) == (ready == "1.0")
        if status == 503:
            assert capacity.json()["error"] == "not_ready_for_placement"
            assert capacity.json()["detail"].startswith("gpu-stack-missing (gpu-stack): ")
    finally:
        assert agent.stop() == 0


def test_nfd_labels_say_health_and_only_the_nvlink_facts_seen():
    labels = nfd_features(discover_root(str(SNAPSHOTS / "no-fabric-manager")), "t.io")
    assert labels["t.io/health"] == "nvswitch-no-nvlink" and labels["t.io/findings.errors"] == "1"
    # Seen: six NVSwitches on the bus, and no GPU joined to another by an active NVLink.
    assert labels["t.io/nvswitch"] == "true" and labels["t.io/nvswitch.count"] == "6"
    assert labels["t.io/nvlink.zone-size"] == "0" and "t.io/nvlink.links-per-pair" not in labels
    assert nfd_features(discover_root(str(SNAPSHOTS / "fabric-in-progress")), "t.io")["t.io/health"] == "fabric-not-ready"


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *argv], capture_output=True, text=True, timeout=120)


def test_the_command_line_refuses_to_place_or_write_links_with_the_reason(tmp_path):
    root = str(SNAPSHOTS / "no-fabric-manager")
    done = run("place", "--gpus", "8", "--root", root)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("topoagent place: not ready for placement: nvswitch-no-nvlink (nvswitch): ")
    out = tmp_path / "gres.conf"
    done = run("export", "gres", "--root", root, "-o", str(out))
    assert done.returncode == 1 and not out.exists()
    assert done.stderr.startswith("topoagent export gres: nvswitch-no-nvlink: ") and "nothing written" in done.stderr
