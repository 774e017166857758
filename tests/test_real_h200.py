"""The first real GPU node the agent met: one NVIDIA H200 in a VM, driver 580.159.04
(fixtures/snapshots/h200-vm, recorded there by `topoagent snapshot`; fixtures/SOURCES.md).
What a user checks of it: `discover` finds a healthy GPU on a PCIe Gen5 x16 link and has
nothing to warn about, the node is ready, `place` gives its one GPU and calls two never
fitting (exit 3; 422 at POST /place), and /metrics serves the counters NVML answered there.

The served answers are read from the node's golden outputs (expected/), which
tests/test_golden_outputs.py checks against a real `topoagent serve --root` of it."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import FIXTURES, SHARED
from service_helpers import metric_value

from topoagent.commands.discover import discover_root
from topoagent.node.findings import placement_blockers

H200 = FIXTURES / "snapshots" / "h200-vm"
EXPECTED = H200 / "expected"
# The recording as it came off the node (fixtures/build_snapshots.py copies it into H200).
TARBALL = SHARED / "real-nodes" / "h200-vm" / "snapshot-nvml-read-right.tar.gz"


def topoagent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *args], capture_output=True, text=True, timeout=120)


def test_discover_finds_one_healthy_h200_on_pcie_gen5_x16_and_warns_of_nothing():
    shown = topoagent("discover", "--root", str(H200))
    assert shown.returncode == 0
    # No finding and no collector warning (the real topo header read as one, escape codes and all).
    assert shown.stderr == ""
    assert shown.stdout.splitlines()[1].split() == ["GPU0", "X", "0-15", "0"]

    node = json.loads(topoagent("discover", "--json", "--root", str(H200)).stdout)
    (gpu,) = node["gpus"]
    assert (gpu["model"], gpu["address"], gpu["memory_bytes"]) == ("NVIDIA H200", "0000:00:06.0", 150754820096)
    assert gpu["link"] == {"current_gts": 32.0, "current_width": 16, "max_gts": 32.0, "max_width": 16,
                           "current_gen": 5, "max_gen": 5}
    assert [f for f in node["findings"] if f["severity"] != "info"] == []
    # Every source read, with no warning; what the node lacks (an RDMA NIC, lldpd) said as such.
    assert {name: (c["status"], c["message"], c["warnings"]) for name, c in node["collectors"].items()} == {
        **{name: ("ok", None, []) for name in ("numa", "cpu", "pci", "interfaces", "gpudirect", "nvml", "nvidia_driver",
                                               "nvidia_smi")},
        "infiniband": ("no_data", "/sys/class/infiniband: no RDMA devices", []),
        "ib_neighbours": ("no_data", "no active InfiniBand port", []),
        "lldp": ("no_data", "lldpctl not found (install lldpd to learn each Ethernet port's switch)", []),
    }
    # NVML's fabric answer on this PCIe GPU is "not supported": no NVLink domain, and no finding.
    assert node["nvlink_domain"] is None


def test_the_node_is_ready_for_placement():
    assert placement_blockers(discover_root(str(H200)).findings) == ()
    metrics = (EXPECTED / "metrics.txt").read_text()
    assert metric_value(metrics, "topoagent_ready") == 1.0
    assert metric_value(metrics, "topoagent_gpus") == 1.0


def test_place_gives_gpu_0_and_calls_two_gpus_never_fitting():
    one = topoagent("place", "--root", str(H200), "--gpus", "1", "--json")
    assert one.returncode == 0, one.stderr
    assert [g["index"] for g in json.loads(one.stdout)["gpus"]] == [0]
    two = topoagent("place", "--root", str(H200), "--gpus", "2")
    assert two.returncode == 3  # never fits, as on every recorded node (tests/test_place_never_fits.py)
    assert two.stderr == "topoagent place: never fits this node: 2 GPUs requested, 1 free of 1\n"

    served = {row["name"]: row for row in json.loads((EXPECTED / "place.json").read_text())}
    assert served["k1"]["status"] == 200 and [g["index"] for g in served["k1"]["answer"]["gpus"]] == [0]
    assert served["k2"]["status"] == 422 and served["k2"]["answer"]["error"] == "never_fits"
    assert served["k2"]["answer"]["nofit"]["never_fits"] is True


# Each NVML counter the recording holds -> its /metrics series (name, labels, factor from
# NVML's units), or the `[metrics] detail` word that serves it (not on the default page).
DEFAULT_PAGE = {
    "temperature_c": ("topoagent_gpu_temperature_celsius", {}, 1),
    "memory_temperature_c": ("topoagent_gpu_memory_temperature_celsius", {}, 1),
    "power_w": ("topoagent_gpu_power_watts", {}, 1),
    "energy_mj_total": ("topoagent_gpu_energy_joules_total", {}, 1e-3),
    "utilization_gpu_percent": ("topoagent_gpu_utilization_ratio", {}, 1e-2),
    "utilization_memory_percent": ("topoagent_gpu_memory_utilization_ratio", {}, 1e-2),
    "sm_clock_mhz": ("topoagent_gpu_sm_clock_hertz", {}, 1e6),
    "memory_clock_mhz": ("topoagent_gpu_memory_clock_hertz", {}, 1e6),
    "memory_used_bytes": ("topoagent_gpu_memory_used_bytes", {}, 1),
    "memory_free_bytes": ("topoagent_gpu_memory_free_bytes", {}, 1),
    "memory_reserved_bytes": ("topoagent_gpu_memory_reserved_bytes", {}, 1),
    "ecc_uncorrected_total": ("topoagent_gpu_ecc_errors_total", {"type": "uncorrected"}, 1),
    "remapped_rows.uncorrectable": ("topoagent_gpu_remapped_rows", {"state": "uncorrectable"}, 1),
    "remapped_rows.pending": ("topoagent_gpu_remapped_rows", {"state": "pending"}, 1),
    "remapped_rows.failure": ("topoagent_gpu_remapped_rows", {"state": "failure"}, 1),
    "throttle_reasons": ("topoagent_gpu_clock_throttle_reasons", {}, 1),
    "pcie_replays_total": ("topoagent_pcie_replays_total", {}, 1),
    "pcie_tx_bytes_total": ("topoagent_pcie_transmitted_bytes_total", {}, 1),
    "pcie_rx_bytes_total": ("topoagent_pcie_received_bytes_total", {}, 1),
    "retired_pages_pending": ("topoagent_gpu_retired_pages_pending", {}, 1),
    "xid_last": ("topoagent_gpu_xid_last", {}, 1),
}
DETAIL_ONLY = {
    "power_limit_w": ("settings", "topoagent_gpu_power_limit_watts", {}),
    "encoder_utilization_percent": ("video", "topoagent_gpu_encoder_utilization_ratio", {}),
    "decoder_utilization_percent": ("video", "topoagent_gpu_decoder_utilization_ratio", {}),
    "ecc_corrected_total": ("errors", "topoagent_gpu_ecc_errors_total", {"type": "corrected"}),
    "remapped_rows.correctable": ("errors", "topoagent_gpu_remapped_rows", {"state": "correctable"}),
}


def recorded_counters() -> dict:
    """The GPU's counters in the recording's last sample (what /metrics serves), nested
    answers flattened as ``remapped_rows.pending``."""
    telemetry = json.loads((H200 / "telemetry.json").read_text())
    (gpu,) = telemetry["samples"][-1]["sources"]["nvml_counters"]["gpus"]
    flat = {}
    for key, value in gpu["counters"].items():
        if isinstance(value, dict) and key != "xid_errors":
            flat.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            flat[key] = value
    return flat


def assert_serves_the_recorded_counters(metrics: str) -> None:
    """Every counter of the recording's last sample on the default page with its value in base
    units, and none where NVML gave none."""
    counters = recorded_counters()
    served = 0
    for key, (name, labels, factor) in DEFAULT_PAGE.items():
        value = counters[key]
        got = metric_value(metrics, name, {"gpu": "0", **labels})
        if value is None:
            assert got is None, f"{name}: NVML gave no {key}, so no series (absent, not zero)"
        else:
            assert got == pytest.approx(value * factor), (key, name)
            served += 1
    assert served >= 18  # the H200 answered all but page retirement and an Xid


def test_metrics_serve_every_gpu_counter_the_recording_holds():
    metrics = (EXPECTED / "metrics.txt").read_text()
    counters = recorded_counters()
    placed = set(DEFAULT_PAGE) | set(DETAIL_ONLY) | {"xid_errors"}
    assert set(counters) - placed == set(), "a counter of the recording this test does not place"
    assert_serves_the_recorded_counters(metrics)
    # No Xid on this node: the actionable class is served from zero, no "last Xid" yet.
    assert counters["xid_errors"] == {}
    assert metric_value(metrics, "topoagent_gpu_xid_events_total", {"gpu": "0", "class": "actionable"}) == 0.0
    for key, (_word, name, labels) in DETAIL_ONLY.items():
        assert counters[key] is not None
        assert metric_value(metrics, name, {"gpu": "0", **labels}) is None, f"{name} is served only with its detail word"
    # Named once, in snake_case, with what NVML said of the GPU (dcgm-exporter's spellings
    # only with [metrics] dcgm_labels).
    info = next(line for line in metrics.splitlines() if line.startswith("topoagent_gpu_info{"))
    assert 'driver_version="580.159.04"' in info and 'model="NVIDIA H200"' in info
    assert 'uuid="GPU-8aa1497e-909b-15e4-767c-dcfa583dff29"' in info and "UUID" not in info and "modelName" not in info


def test_the_fixture_replays_as_the_recording_it_was_copied_from():
    """What build_snapshots.py changed to keep the recording in git (fixtures/SOURCES.md)
    changes nothing discovery sees: the fixture and the recorded tarball discover alike."""
    if not TARBALL.is_file():
        pytest.fail(f"{TARBALL} not found: the tests need ../shared beside the repo")

    def document(root: str) -> dict:
        node = json.loads(topoagent("discover", "--json", "--root", root).stdout)
        for collector in node["collectors"].values():
            collector["seconds"] = None
        return node

    assert document(str(H200)) == document(str(TARBALL))
