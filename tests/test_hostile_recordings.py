"""Recordings an attacker shaped: a collector tripped into a bug, a symlink thousands of
components deep, a FIFO where a sysfs file should be, GPUs listed twice.

Each is built here from the DGX A100 fixture and run through the real CLI in a child with
a timeout, so a hang fails the test instead of hanging the suite: discovery must finish,
say what was wrong, and never hand out one GPU twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest
from service_helpers import DGX_A100, make_root

from topoagent.collectors.base import NoData, run_collector
from topoagent.collectors.lldp import LldpParseError, parse_lldpctl_json
from topoagent.node.discovery import COLLECTORS, Collector, run_collectors, run_collectors_sync
from topoagent.node.findings import collector_findings
from topoagent.node.host import Host, HostError, NotAFile
from topoagent.vocabulary import Severity, Status

CLI_TIMEOUT_S = 60
LLDP_RECORDING = "commands/lldpctl_-f_json.out"
UNHASHABLE_LLDP = {"lldp": {"interface": {"enp225s0f0": {
    "chassis": {"sw1": {"id": {"type": "mac", "value": "aa:bb"}, "capability": [{"type": ["Bridge"], "enabled": True}]}},
    "port": {"id": {"type": "ifname", "value": "p1"}},
}}}}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


def discover_json(root: Path | str) -> dict[str, Any]:
    result = run_cli("discover", "--json", "--root", str(root))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


# --- a collector's bug stays that collector's failure ----------------------------------------


def test_an_lldp_capability_that_is_not_text_is_a_parse_error():
    with pytest.raises(LldpParseError, match="capability type: expected text, found list"):
        parse_lldpctl_json(json.dumps(UNHASHABLE_LLDP))


def test_a_bad_lldpctl_answer_is_a_warning_and_discovery_goes_on(tmp_path):
    root = make_root(tmp_path)
    (root / LLDP_RECORDING).write_text(json.dumps(UNHASHABLE_LLDP))
    node = discover_json(root)
    assert node["collectors"]["lldp"]["status"] == "error"
    assert "capability type" in node["collectors"]["lldp"]["message"]
    assert [f["severity"] for f in node["findings"] if f["subject"] == "lldp"] == ["warning"]
    assert len(node["gpus"]) == 8 and node["collectors"]["pci"]["status"] == "ok"


async def _raises_type_error(host: Host) -> Any:
    async def read() -> tuple[Any, tuple[str, ...]]:
        raise TypeError("unhashable type: 'list'")

    return await run_collector("lldp", read, optional=True)


async def _raises_outside_the_runner(host: Host) -> Any:
    raise TypeError("a bug before run_collector was reached")


async def _no_data(host: Host) -> Any:
    async def read() -> tuple[Any, tuple[str, ...]]:
        raise NoData("absent")

    return await run_collector("quiet", read)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_collector_that_raises_a_type_error_gets_an_error_status(driver):
    table = (
        *[c for c in COLLECTORS if c.name in ("numa", "pci")],
        Collector("lldp", _raises_type_error, optional=True),
        Collector("pci_again", _raises_outside_the_runner),
        Collector("quiet", _no_data),
    )
    with Host(DGX_A100) as host:
        results = run_collectors_sync(host, table) if driver == "sync" else asyncio.run(run_collectors(host, table))
    assert results["numa"].status == Status.OK and results["pci"].status == Status.OK
    assert results["quiet"].status == Status.NO_DATA
    lldp, bug = results["lldp"], results["pci_again"]
    assert lldp.status == Status.ERROR and bug.status == Status.ERROR
    assert "TypeError: unhashable type: 'list'" in (lldp.message or "") and "topoagent bug" in (lldp.message or "")
    assert "TypeError: a bug before run_collector" in (bug.message or "")
    severity = {f.subject: f.severity for f in collector_findings(results.values())}
    assert severity == {"lldp": Severity.WARNING, "pci_again": Severity.CRITICAL}


# --- a symlink thousands of components deep ---------------------------------------------------

DEEP = 1900  # "./" components: a 3,800-byte target, legal under PATH_MAX


def deepen_a_link(root: Path, name: str = "mlx5_2") -> Path:
    """Rewrite a sysfs link to the same place by way of DEEP ``./`` components."""
    link = root / "sys/class/infiniband" / name
    target = os.readlink(link)
    link.unlink()
    os.symlink("./" * DEEP + target, link)
    return link


def test_a_link_thousands_of_components_deep_resolves_without_recursion(tmp_path):
    root = make_root(tmp_path)
    deepen_a_link(root)
    with Host(root) as host:
        assert host.realpath("/sys/class/infiniband/mlx5_2").endswith("/infiniband/mlx5_2")
        assert host.read_optional("/sys/class/infiniband/mlx5_2/ports/1/state") is not None


def test_links_deeper_than_any_path_are_refused_as_too_deep(tmp_path):
    root = tmp_path / "root"
    (root / "sys").mkdir(parents=True)
    (root / "sys/file").write_text("x\n")
    # Three links of 2,000 components each: every one legal, together past any real path.
    os.symlink("./" * 2000 + "file", root / "sys/c")
    os.symlink("./" * 2000 + "c", root / "sys/b")
    os.symlink("./" * 2000 + "b", root / "sys/a")
    with Host(root) as host:
        assert host.read_optional("/sys/c") == "x"
        with pytest.raises(HostError, match="path too deep"):
            host.realpath("/sys/a")
        assert host.read_optional("/sys/a") is None and not host.exists("/sys/a")


@pytest.mark.parametrize("packed", [False, True])
def test_discover_reads_a_recording_with_a_deep_link(tmp_path, packed):
    root = make_root(tmp_path)
    deepen_a_link(root)
    given: Path = root
    if packed:
        given = tmp_path / "deep.tar.gz"
        with tarfile.open(given, "w:gz") as archive:
            archive.add(root, arcname="deep")
    node = discover_json(given)
    assert len(node["gpus"]) == 8
    assert "mlx5_2" in [n["device"] for n in node["nics"]]


# --- a FIFO where a file should be -------------------------------------------------------------

IB_RATE = "sys/class/infiniband/mlx5_0/ports/1/rate"


def fifo_in_place_of(root: Path, relative: str) -> Path:
    path = (root / relative).resolve()  # the file itself, not the sysfs link above it
    path.unlink(missing_ok=True)
    os.mkfifo(path)
    return path


def test_the_host_refuses_a_fifo_without_waiting_for_a_writer(tmp_path):
    root = make_root(tmp_path)
    fifo_in_place_of(root, IB_RATE)
    with Host(root) as host:
        with pytest.raises(NotAFile, match="not a regular file \\(a FIFO\\)"):
            host.read_bytes("/" + IB_RATE)
        assert host.read_optional("/" + IB_RATE) is None
    fifo = tmp_path / "live-fifo"
    os.mkfifo(fifo)
    with pytest.raises(NotAFile):  # the live node is read the same way
        Host("/").read_bytes(str(fifo))
    with pytest.raises(IsADirectoryError):
        Host("/").read_bytes(str(tmp_path))


def test_discover_finishes_with_fifos_for_a_sysfs_file(tmp_path):
    root = make_root(tmp_path)
    fifo_in_place_of(root, IB_RATE)
    node = discover_json(root)
    assert node["collectors"]["infiniband"]["status"] == "ok"
    port = next(n for n in node["nics"] if n["device"] == "mlx5_0")["ports"][0]
    assert port["rate_gbps"] is None  # unreadable: unknown, not a number
    assert len(node["gpus"]) == 8


@pytest.mark.parametrize(("recorded", "collector"), [("commands/nvidia-smi_topo_-m.out", "nvidia_smi"), ("nvml.json", "nvml")])
def test_discover_finishes_with_a_fifo_for_a_recorded_answer(tmp_path, recorded, collector):
    root = make_root(tmp_path)
    fifo_in_place_of(root, recorded)
    node = discover_json(root)
    assert node["collectors"][collector]["status"] == "error"
    assert "not a regular file (a FIFO)" in node["collectors"][collector]["message"]


@pytest.mark.parametrize("counters", ["fifo", '{"samples": [[1]]}', "{not json"])
def test_unreadable_recorded_counters_do_not_stop_a_one_shot_command(tmp_path, counters):
    root = make_root(tmp_path)
    if counters == "fifo":
        fifo_in_place_of(root, "telemetry.json")
        fifo_in_place_of(root, "snapshot.json")
    else:
        (root / "telemetry.json").write_text(counters)
    assert run_cli("discover", "--root", str(root)).returncode == 0
    placed = run_cli("place", "--root", str(root), "--gpus", "2")
    assert placed.returncode == 0, placed.stderr[-2000:]
    assert "telemetry.json: " in placed.stderr and "placing without NIC traffic" in placed.stderr


# --- GPUs listed twice, or two GPUs with one identity ------------------------------------------


def edit_nvml(root: Path, edit: Any) -> None:
    path = root / "nvml.json"
    document = json.loads(path.read_text())
    edit(document["gpus"])
    path.write_text(json.dumps(document))


def _append_gpu0_as_8(gpus: list[dict]) -> None:
    gpus.append({**gpus[0], "index": 8})


def _gpu1_takes_gpu0s_uuid(gpus: list[dict]) -> None:
    gpus[1]["uuid"] = gpus[0]["uuid"]


def _gpu1_takes_index_0(gpus: list[dict]) -> None:
    gpus[1]["index"] = 0


def _gpu0_elsewhere_first(gpus: list[dict]) -> None:
    """A first GPU0 sysfs does not show, then the real one under the same index."""
    gpus.insert(0, {**gpus[0], "uuid": "GPU-00000000-0000-0000-0000-000000000000", "pci_bus_id": "0000:99:00.0"})


@pytest.mark.parametrize(("edit", "severity", "subject"), [
    (_append_gpu0_as_8, "warning", "GPU8"),
    (_gpu1_takes_gpu0s_uuid, "critical", "GPU1"),
    (_gpu1_takes_index_0, "critical", "GPU0"),
])
def test_a_gpu_nvml_lists_twice_is_kept_once_and_named(tmp_path, edit, severity, subject):
    root = make_root(tmp_path)
    edit_nvml(root, edit)
    node = discover_json(root)
    gpus = node["gpus"]
    assert len(gpus) == 8
    uuids = [g["uuid"] for g in gpus if g["uuid"]]
    assert len(uuids) == len(set(uuids))
    addresses = [g["address"] for g in gpus if g["address"]]
    assert len(addresses) == len(set(addresses))
    assert len({g["index"] for g in gpus}) == 8
    found = [f for f in node["findings"] if f["kind"] == "duplicate-gpu"]
    assert [(f["severity"], f["subject"]) for f in found] == [(severity, subject)]
    assert "dropped this entry" in found[0]["message"] and "kept GPU0" in found[0]["message"]


def test_placement_on_a_doubled_gpu_list_never_hands_one_gpu_out_twice(tmp_path):
    root = make_root(tmp_path)
    edit_nvml(root, _append_gpu0_as_8)
    nine = run_cli("place", "--root", str(root), "--gpus", "9")
    assert nine.returncode != 0 and "8 free of 8" in nine.stderr
    eight = run_cli("place", "--root", str(root), "--include", "0,8", "--gpus", "2")
    assert eight.returncode != 0 and "GPU 8 is not on this node" in eight.stderr
    gres = run_cli("export", "gres", "--root", str(root))
    assert gres.returncode == 0 and len([line for line in gres.stdout.splitlines() if line.startswith("Name=")]) == 8


def test_two_gpus_with_one_uuid_are_never_placed_together(tmp_path):
    root = make_root(tmp_path)
    edit_nvml(root, _gpu1_takes_gpu0s_uuid)
    every = run_cli("place", "--root", str(root), "--gpus", "8")
    assert every.returncode != 0  # the GPU whose UUID was another's is kept off
    placed = run_cli("place", "--root", str(root), "--gpus", "7", "--json")
    assert placed.returncode == 0, placed.stderr
    uuids = [g["uuid"] for g in json.loads(placed.stdout)["gpus"]]
    assert None not in uuids and len(set(uuids)) == 7


def test_of_two_gpus_with_one_index_the_one_sysfs_shows_is_kept(tmp_path):
    root = make_root(tmp_path)
    edit_nvml(root, _gpu0_elsewhere_first)
    node = discover_json(root)
    assert next(g for g in node["gpus"] if g["name"] == "GPU0")["address"] == "0000:07:00.0"
    (finding,) = [f for f in node["findings"] if f["kind"] == "duplicate-gpu"]
    assert "0000:99:00.0" in finding["message"] and "the one sysfs shows" in finding["message"]


def test_numa_nodes_nvml_and_sysfs_disagree_on_are_a_finding_and_sysfs_wins(tmp_path):
    root = make_root(tmp_path)

    def elsewhere(gpus: list[dict]) -> None:
        assert gpus[0]["numa_node"] == 3
        gpus[0]["numa_node"] = 0

    edit_nvml(root, elsewhere)
    node = discover_json(root)
    assert next(g for g in node["gpus"] if g["name"] == "GPU0")["numa_node"] == 3
    (finding,) = [f for f in node["findings"] if f["kind"] == "numa-disagreement"]
    assert finding["severity"] == "warning" and finding["subject"] == "GPU0"
    assert "NUMA node 0 but sysfs says 3" in finding["message"]
