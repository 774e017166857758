"""discover on the recorded-node fixtures: the real nvidia-smi matrices, the degraded
node's faults, NUMA for numa_node -1, the JSON shape, snapshot round trips, damage."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FABRIC_DOWN, REAL_NODES, WITHOUT_GPU_STACK

from topoagent.cli import main
from topoagent.collectors.nvidia_smi import TopoMatrix, parse_topo_matrix
from topoagent.node.discovery import discover
from topoagent.node.host import Host
from topoagent.node.model import NodeTopology

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "fixtures" / "snapshots"
ALL = sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir())
# Fixtures whose commands/nvidia-smi_topo_-m.out is (or starts with) a real capture;
# the others' matrix was rendered by the fixture generator (fixtures/SOURCES.md).
REAL_CAPTURES = ["dgx-a100", "dgx1-v100", "dgx2", "vm-1gpu", "workstation-2gpu", "h200-vm"]
WITH_GPU_STACK = [n for n in ALL if n not in WITHOUT_GPU_STACK]
# Healthy: no fault injected, no witness missing (no-gpudirect lacks GPUDirect's module), the NVLink fabric up.
HEALTHY = [n for n in WITH_GPU_STACK if n not in ("degraded", "no-gpudirect") and n not in FABRIC_DOWN]
# What a healthy fixture may still report: pcie-2socket's X722 runs at 2.5 of 8 GT/s
# behind a port that tops out at 2.5 GT/s (as recorded by hwloc): said, as information.
EXPECTED_HEALTHY_FINDINGS = {"pcie-2socket": {("pcie-slow", "info", "0000:60:00.0")}}


# Fixtures whose RDMA ports are all down or RoCE: there is no InfiniBand port to ask about.
NO_ACTIVE_IB_PORT = {"workstation-2gpu": "no active InfiniBand port"}


def discover_at(root: Path) -> NodeTopology:
    with Host(root) as host:
        return asyncio.run(discover(host))


def recorded_matrix(name: str) -> TopoMatrix:
    return parse_topo_matrix((SNAPSHOTS / name / "commands/nvidia-smi_topo_-m.out").read_text())


def copy_fixture(name: str, dest: Path, *, without_commands: bool = False) -> Path:
    ignore = shutil.ignore_patterns("commands") if without_commands else None
    shutil.copytree(SNAPSHOTS / name, dest, symlinks=True, ignore=ignore)
    return dest


def test_the_fixture_list_is_the_issue_list() -> None:
    assert sorted(["dgx-a100", "dgx1-v100", "hgx-h100", "dgx2", "pcie-2socket",
                          "workstation-2gpu", "vm-1gpu", "degraded",
                          "no-gpu-stack", "no-nvidia-driver", "no-gpus", "no-gpudirect",
                          "no-fabric-manager", "fabric-not-started", "fabric-in-progress",
                          "h200-vm"]) == ALL  # issue 35: the first real GPU node


def not_recorded(tool: str) -> str:
    return f"the recording holds no {tool} output (not recorded on its node)"


def test_a_live_node_without_the_fabric_tools_says_what_to_install(tmp_path, monkeypatch):
    """Live, a missing smpquery or lldpctl is a tool to install, named with its package."""
    import asyncio

    from topoagent.collectors import lldp
    from topoagent.collectors.base import command_missing
    from topoagent.node.host import Host

    monkeypatch.setenv("PATH", str(tmp_path))  # an empty PATH: neither tool is installed
    result = asyncio.run(lldp.collect(Host("/")))
    assert (result.status, result.message) == ("no_data", "lldpctl not found (install lldpd to learn each Ethernet port's switch)")
    said = str(command_missing(True, "smpquery", "install infiniband-diags to learn each port's switch"))
    assert said == "smpquery not found (install infiniband-diags to learn each port's switch)"


def test_a_recording_tells_a_tool_its_node_lacked_from_one_it_did_not_record(tmp_path):
    import asyncio

    from topoagent.collectors import lldp
    from topoagent.node.host import Host, command_file_stem

    (tmp_path / "commands").mkdir()
    result = asyncio.run(lldp.collect(Host(tmp_path)))
    assert (result.status, result.message) == ("no_data", not_recorded("lldpctl"))
    (tmp_path / "commands" / f"{command_file_stem(lldp.LLDPCTL)}.missing").write_text("command not found\n")
    result = asyncio.run(lldp.collect(Host(tmp_path)))
    assert (result.status, result.message) == ("no_data", "lldpctl not found (install lldpd to learn each Ethernet port's switch)")


@pytest.mark.parametrize("name", [n for n in WITH_GPU_STACK if n not in REAL_NODES])  # h200-vm: tests/test_real_h200.py
def test_every_collector_reads_every_fixture(name: str) -> None:
    topo = discover_at(SNAPSHOTS / name)
    # Every generated fixture records sysfs, NVML, RDMA devices, network interfaces and nvidia-smi: nothing is missing.
    # None records the driver's procfs (minor numbers) or a GPUDirect peer-memory module:
    # those sources are absent, quietly (no-gpudirect records the module list without one).
    assert {c.name: (c.status, c.message, c.warnings) for c in topo.collectors} == {
        **{c: ("ok", None, ()) for c in ("numa", "cpu", "pci", "infiniband", "interfaces", "nvml", "nvidia_smi")},
        "nvidia_driver": ("no_data", "/proc/driver/nvidia/gpus: no GPUs listed by the driver", ()),
        "gpudirect": ("ok", None, ()) if name == "no-gpudirect" else
        ("no_data", "no GPUDirect peer-memory module loaded (nvidia_peermem, nv_peer_mem)", ()),
        # The fabric's neighbours are recorded only in the cluster fixtures (tests/test_fabric_cluster.py).
        # A recording says it holds no such output: an install hint would send the reader
        # to fix the machine that replays it.
        "ib_neighbours": ("no_data", NO_ACTIVE_IB_PORT.get(name, not_recorded("smpquery")), ()),
        "lldp": ("no_data", not_recorded("lldpctl"), ()),
    }
    assert topo.gpus and all(g.pci_address and g.uuid for g in topo.gpus)


@pytest.mark.parametrize("name", REAL_CAPTURES)
def test_derived_matrix_equals_the_real_nvidia_smi_capture(name: str, tmp_path: Path) -> None:
    # Without the recorded nvidia-smi output, every level must come from sysfs + NUMA + NVML.
    topo = discover_at(copy_fixture(name, tmp_path / name, without_commands=True))
    assert {p.source for p in topo.pairs} <= {"derived"}  # h200-vm has one GPU: no pair
    ours, real = topo.topo_matrix(), recorded_matrix(name)
    assert not real.missing_rows, "the completed capture has every row"
    assert [d.name for d in ours.gpus] == [d.name for d in real.gpus]
    # nvidia-smi names NICs NIC<k> with a legend (new drivers) or by RDMA device (old ones).
    assert [d.device for d in ours.nics] == [d.device for d in real.nics]
    our_name = {d.device: d.name for d in ours.nics} | {d.name: d.name for d in ours.gpus}
    real_to_ours = {d.name: our_name[d.device if d.kind == "nic" else d.name] for d in real.devices}
    if any(d.name.startswith("NIC") for d in real.nics):
        assert all(k == v for k, v in real_to_ours.items())
    differences = [
        (a.name, b.name, str(level), str(topo.level(real_to_ours[a.name], real_to_ours[b.name])))
        for a, b, level in real.pairs()
        if topo.level(real_to_ours[a.name], real_to_ours[b.name]) != level
    ]
    assert differences == []
    for real_gpu, our_gpu in zip(real.gpus, ours.gpus):
        assert our_gpu.cpu_affinity == real_gpu.cpu_affinity
        if real_gpu.numa_affinity is not None:  # drivers before ~450 print no NUMA column
            assert our_gpu.numa_affinity == real_gpu.numa_affinity


@pytest.mark.parametrize("name", WITH_GPU_STACK)  # unknown levels print as "?", which no parser reads back
def test_discover_matrix_prints_what_was_derived(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--matrix", "--root", str(SNAPSHOTS / name)]) == 0
    captured = capsys.readouterr()
    printed = parse_topo_matrix(captured.out)
    topo = discover_at(SNAPSHOTS / name)
    assert [(d.name, d.device) for d in printed.devices] == [(d.name, d.device) for d in topo.topo_matrix().devices]
    assert all(level == topo.level(a.name, b.name) for a, b, level in printed.pairs())
    # Findings go to stderr, one line each, so the matrix stays parseable.
    assert len(captured.err.splitlines()) == len(topo.findings)


@pytest.mark.parametrize("name", WITH_GPU_STACK)
def test_derived_and_declared_agree_pair_for_pair(name: str) -> None:
    topo = discover_at(SNAPSHOTS / name)
    real = recorded_matrix(name)
    assert len(topo.pairs) == len(list(real.pairs()))
    assert all(p.source == "derived" and p.level == p.declared for p in topo.pairs)
    assert not [f for f in topo.findings if f.kind == "level-disagreement"]


@pytest.mark.parametrize("name", HEALTHY)
def test_healthy_fixtures_report_no_faults(name: str) -> None:
    topo = discover_at(SNAPSHOTS / name)
    found = {(f.kind, f.severity, f.subject) for f in topo.findings}
    assert found == EXPECTED_HEALTHY_FINDINGS.get(name, set())


def test_pcie_2socket_keeps_the_hidden_bridge_above_the_x722() -> None:
    topo = discover_at(SNAPSHOTS / "pcie-2socket")
    hidden = topo.pci.get("0000:5f:03.0")
    assert hidden is not None and not hidden.listed
    x722 = topo.pci.get("0000:60:00.0")
    assert x722.parent == "0000:5f:03.0" and x722.depth == 3
    assert (x722.link.current_gts, x722.link.max_gts) == (2.5, 8.0)  # '8 GT/s' old format
    finding = next(f for f in topo.findings if f.subject == "0000:60:00.0")
    assert "2.5 GT/s of 8 GT/s" in finding.message and "0000:5f:03.0" in finding.message


# --- the degraded node ----------------------------------------------------------------


def test_degraded_node_reports_exactly_its_three_faults() -> None:
    topo = discover_at(SNAPSHOTS / "degraded")
    assert sorted((f.kind, f.subject) for f in topo.findings) == [
        ("ib-port-down", "mlx5_6 port 1"),
        ("nvlink-down", "GPU5"),
        ("pcie-degraded", "GPU3"),  # once, though GPU3 and its switch port both show x8
    ]
    by_kind = {f.kind: f for f in topo.findings}
    assert "x8 of x16" in by_kind["pcie-degraded"].message
    assert "NVLink 7" in by_kind["nvlink-down"].message
    assert "DOWN" in by_kind["ib-port-down"].message
    assert all(f.severity == "warning" for f in topo.findings)


def test_each_fault_lowers_the_pairs_it_touches_and_no_other() -> None:
    healthy, degraded = discover_at(SNAPSHOTS / "hgx-h100"), discover_at(SNAPSHOTS / "degraded")
    assert [(p.a, p.b) for p in healthy.pairs] == [(p.a, p.b) for p in degraded.pairs]
    changed = {}
    for p in healthy.pairs:
        q = degraded.pair(p.a, p.b)
        if (q.level, q.expected_gbps) != (p.level, p.expected_gbps):
            changed[(p.a, p.b)] = (p, q)
    for (a, b), (p, q) in changed.items():
        assert q.expected_gbps < p.expected_gbps, (a, b)
        assert {a, b} & {"GPU3", "GPU5", "NIC6"}, f"{a}/{b} changed but touches no fault"
    # NVLink down: GPU5 reaches every peer through the fabric on 17 of 18 links.
    for k in (0, 1, 2, 3, 4, 6, 7):
        p, q = changed[tuple(sorted((f"GPU{k}", "GPU5"), key=lambda n: int(n[3:])))]
        assert (str(p.level), str(q.level)) == ("NV18", "NV17")
        assert (p.expected_gbps, q.expected_gbps) == (450.0, 425.0)  # NVLink 4: 25 GB/s a link
    # IB port down: nothing reaches the network through NIC6.
    nic6 = [key for key in changed if "NIC6" in key]
    assert len(nic6) == len(healthy.gpus) + len(healthy.nics) - 1
    assert all(changed[key][1].expected_gbps == 0.0 for key in nic6)
    # x8 link: GPU3's own NIC was capped by the 400 Gb/s port (50 GB/s); now the PCIe
    # Gen5 x8 link (31.5 GB/s) is the bottleneck. Its pairs through the other socket stay
    # at the socket link's rate, which is lower than either.
    p, q = changed[("GPU3", "NIC3")]
    assert (str(q.level), p.expected_gbps, q.expected_gbps) == ("PIX", 50.0, 31.51)
    socket1 = [f"NIC{k}" for k in (4, 5, 7)]
    assert not [n for n in socket1 if ("GPU3", n) in changed]
    assert degraded.distance_matrix().gpus[3].pcie_width == 8
    assert healthy.distance_matrix().gpus[3].pcie_width == 16


# --- NUMA of devices whose numa_node is -1 (KVM guest) ---------------------------------


def test_vm_devices_get_their_numa_node_from_local_cpulist() -> None:
    root = SNAPSHOTS / "vm-1gpu"
    gpu_dir = root / "sys/bus/pci/devices/0000:02:00.0"
    assert (gpu_dir / "numa_node").read_text().strip() == "-1"
    assert json.loads((root / "nvml.json").read_text())["gpus"][0]["numa_node"] is None
    topo = discover_at(root)
    for device in topo.pci.devices:
        assert (device.numa_node, device.numa_source) == (0, "local_cpus"), device.address
    assert topo.gpus[0].numa_node == 0 and topo.nics[0].numa_node == 0
    assert topo.topo_matrix().gpus[0].numa_affinity == "0"


# --- discover --json ----------------------------------------------------------------------


def discover_json(capsys: pytest.CaptureFixture[str], root: Path, *, timings: bool = False) -> dict:
    assert main(["discover", "--json", "--root", str(root)]) == 0
    out = json.loads(capsys.readouterr().out)
    if not timings:
        for status in out["collectors"].values():
            status.pop("seconds")
    return out


def test_discover_json_has_the_issue_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    out = discover_json(capsys, SNAPSHOTS / "dgx-a100", timings=True)
    assert out["schema_version"] == 3
    nodes = out["numa_nodes"]
    assert [n["id"] for n in nodes] == list(range(8))  # NPS4 on two sockets
    assert nodes[3]["cpus"] == "48-63,176-191"  # GPU0/1's node in the real capture
    assert all(len(n["distances"]) == 8 and n["distances"][n["id"]] == 10 for n in nodes)
    assert all(isinstance(n["memory_bytes"], int) and n["memory_bytes"] > 0 for n in nodes)
    devices = {d["address"]: d for d in out["pci_devices"]}
    gpu0 = devices["0000:07:00.0"]
    assert (gpu0["class"], gpu0["vendor"], gpu0["device"], gpu0["numa_node"]) == (
        "0x030200", "0x10de", "0x20b0", 3)
    # parent: the bridge right above, itself listed, up to a root port whose parent is null.
    chain, address = [], gpu0["address"]
    while devices[address]["parent"] is not None:
        address = devices[address]["parent"]
        chain.append(address)
    assert len(chain) == gpu0["depth"] and devices[chain[-1]]["kind"] == "bridge"
    # sysfs writes '16.0 GT/s PCIe' here and '8 GT/s' on older kernels (pcie-2socket).
    assert (SNAPSHOTS / "dgx-a100/sys/bus/pci/devices/0000:07:00.0/max_link_speed").read_text() == "16.0 GT/s PCIe\n"
    assert {k: gpu0["link"][k] for k in ("current_gts", "current_width", "max_gts", "max_width", "max_gen")} == {
        "current_gts": 16.0, "current_width": 16, "max_gts": 16.0, "max_width": 16, "max_gen": 4}
    assert [g["name"] for g in out["gpus"]] == [f"GPU{k}" for k in range(8)]
    assert out["gpus"][0]["address"] == "0000:07:00.0" and len(out["gpus"][0]["nvlinks"]) == 12
    nic0 = out["nics"][0]
    assert (nic0["name"], nic0["device"], nic0["address"]) == ("NIC0", "mlx5_0", "0000:0c:00.0")
    assert nic0["netdev"] and nic0["ports"][0]["state"] == "ACTIVE"
    assert nic0["ports"][0]["rate_gbps"] == 200.0
    pair = next(p for p in out["pairs"] if (p["a"], p["b"]) == ("GPU0", "GPU1"))
    assert (pair["level"], pair["nvlinks"], pair["source"], pair["declared"]) == ("NV12", 12, "derived", "NV12")
    assert pair["expected_gbps"] == 300.0
    gpu_nic = next(p for p in out["pairs"] if (p["a"], p["b"]) == ("GPU0", "NIC0"))
    assert (gpu_nic["level"], gpu_nic["source"]) == ("PXB", "derived")
    assert len(out["pairs"]) == (8 + 10) * (8 + 10 - 1) // 2
    assert out["findings"] == []
    assert set(out["collectors"]) == {"numa", "cpu", "pci", "infiniband", "interfaces", "gpudirect", "nvml", "nvidia_driver", "nvidia_smi", "ib_neighbours", "lldp"}
    assert out["collectors"].pop("nvidia_driver")["status"] == "no_data"  # not recorded
    assert out["collectors"].pop("gpudirect")["status"] == "no_data"  # no peer-memory module recorded
    assert out["collectors"].pop("ib_neighbours")["status"] == "no_data"  # no smpquery recorded
    assert out["collectors"].pop("lldp")["status"] == "no_data"  # no lldpctl recorded
    for status in out["collectors"].values():
        assert status["status"] == "ok" and status["message"] is None
        assert isinstance(status["seconds"], float) and status["seconds"] >= 0


# --- snapshot of a recorded node replays to the same discovery -----------------------------


@pytest.mark.parametrize("name,form", [("pcie-2socket", "dir"), ("dgx2", "dir"), ("vm-1gpu", "tar.gz")])
def test_snapshot_of_a_fixture_replays_to_the_same_discovery(
    name: str, form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / ("node" if form == "dir" else "node.tar.gz")
    assert main(["snapshot", "--root", str(SNAPSHOTS / name), str(out)]) == 0
    capsys.readouterr()
    assert discover_json(capsys, out) == discover_json(capsys, SNAPSHOTS / name)
    if form == "dir":
        # Only what discovery reads (pcie-2socket's hidden bridge comes along) and the
        # recorded counter samples, nothing else.
        kept = {p.relative_to(out).parts[0] for p in out.iterdir()}
        assert kept <= {"sys", "proc", "commands", "nvml.json", "snapshot.json", "telemetry.json"}
        assert json.loads((out / "snapshot.json").read_text())["recorded_by"].endswith(str(SNAPSHOTS / name))


# --- damage ------------------------------------------------------------------------------


def test_damaged_files_are_named_and_discovery_completes(tmp_path: Path) -> None:
    root = copy_fixture("dgx1-v100", tmp_path / "node")
    devices = root / "sys/bus/pci/devices"
    gpu0 = devices / "0000:1a:00.0"  # GPU0 (NVML index 0)
    nic = devices / "0000:3f:00.0"  # mlx5_0
    root_port = devices / "0000:17:00.0"
    (root_port.resolve() / "class").write_text("garbage\n")
    (gpu0.resolve() / "numa_node").write_text("banana\n")
    (nic.resolve() / "current_link_speed").write_text("fast\n")
    os.symlink("../../../devices/pci0000:99/0000:99:00.0", devices / "0000:99:00.0")
    os.symlink("../../devices/pci0000:98/0000:98:00.0/infiniband/mlx5_9",
               root / "sys/class/infiniband/mlx5_9")
    (root / "sys/devices/system/node/node1/distance").unlink()
    (root / "nvml.json").write_text('{"gpus": [')

    topo = discover_at(root)
    status = {c.name: c for c in topo.collectors}
    assert status["nvml"].status == "error" and "nvml.json" in status["nvml"].message
    for name in ("numa", "pci", "infiniband", "nvidia_smi"):
        assert status[name].status == "ok", name
    warned = "\n".join(w for c in topo.collectors for w in c.warnings)
    for path in ("0000:17:00.0/class", "0000:1a:00.0/numa_node", "0000:3f:00.0/current_link_speed",
                 "/sys/bus/pci/devices/0000:99:00.0: dangling", "/sys/class/infiniband/mlx5_9: dangling",
                 "node1/distance: missing"):
        assert path in warned, path
    # The damage costs only what it touches.
    assert topo.pci.get("0000:99:00.0") is None
    assert [n.device for n in topo.nics] == ["mlx5_0"]
    # A garbage numa_node falls back to the device's local CPUs, as for -1.
    gpu0_device = topo.pci.get("0000:1a:00.0")
    assert (gpu0_device.numa_node, gpu0_device.numa_source) == (0, "local_cpus")
    assert topo.numa.node(1).distances == () and topo.numa.node(0).distances == (10, 21)
    assert [f.kind for f in topo.findings] == ["collector-error", "nvlink-unknown"]
    # Without NVML the NVLink pairs are nvidia-smi's word; PCIe pairs are still derived.
    healthy = discover_at(SNAPSHOTS / "dgx1-v100")
    assert [(p.a, p.b, p.level) for p in topo.pairs] == [(p.a, p.b, p.level) for p in healthy.pairs]
    sources = {p.source for p in topo.pairs if p.level.is_nvlink}
    assert sources == {"nvidia-smi"}
    assert {p.source for p in topo.pairs if not p.level.is_nvlink} == {"derived"}


# --- what a one-shot discover loads ------------------------------------------------------


# Modules a one-shot command has no use for: the event loop and TLS (a third of start-up
# before), the HTTP stack, logging when it logs nothing, tarfile when the root is a directory;
# discover also builds no agent documents, and replaying a directory runs and unpacks nothing.
# shutil (with bz2, lzma, zlib) and locale stay: argparse imports them itself (every
# add_argument makes a help formatter, which asks shutil for the terminal's width; gettext
# asks locale), and pynvml brings shutil through ctypes.util on a node with a driver.
NEVER_ONE_SHOT = {"asyncio", "ssl", "aiohttp", "prometheus_client", "torch", "psutil", "logging", "tarfile",
                  "topoagent.probes", "topoagent.service.served", "topoagent.service.agent"}
A100 = str(SNAPSHOTS / "dgx-a100")
SMI_TEXT = str(Path(__file__).resolve().parents[1] / "fixtures/nvidia-smi/hgx-h20-8gpu-8nic.txt")


def _no_driver() -> set[str]:
    """pynvml, on a machine where NVML cannot answer (it is asked only where it can)."""
    from topoagent.collectors.nvml import nvml_library_present

    return set() if nvml_library_present() else {"pynvml"}


@pytest.mark.parametrize(("argv", "also_never", "proof"), [
    (["discover", "--json", "--root", A100], {"pynvml", "topoagent.placement", "topoagent.service.telemetry", "topoagent.documents.agent",
                                              "subprocess", "tempfile"}, "topoagent.node.model"),
    (["discover", "--json"], {"topoagent.placement", "topoagent.service.telemetry", "topoagent.documents.agent"} | _no_driver(), "topoagent.node.model"),
    (["place", "--root", A100, "--gpus", "4"], {"pynvml"}, "topoagent.placement.search"),
    (["matrix", "--from-nvidia-smi", SMI_TEXT], {"pynvml", "topoagent.placement", "topoagent.node.model"},
     "topoagent.collectors.nvidia_smi"),
    (["export", "nfd", "--root", A100], {"pynvml", "topoagent.service.telemetry"}, "topoagent.node.model"),
    (["snapshot", "recorded"], _no_driver(), "topoagent.node.recording"),
])
def test_one_shot_commands_import_only_what_they_use(
    tmp_path: Path, argv: list[str], also_never: set[str], proof: str
) -> None:
    script = (
        "import sys, json\n"
        "from topoagent.cli import main\n"
        f"rc = main({argv!r})\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
        "sys.exit(rc)\n"
    )
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, check=True)
    assert done.stdout.strip() or (tmp_path / "recorded" / "sys").is_dir()  # printed, or recorded the node
    loaded = set(json.loads(done.stderr.strip().splitlines()[-1]))
    never = NEVER_ONE_SHOT | also_never
    assert not {m for m in loaded if m in never or m.split(".")[0] in never}
    assert proof in loaded  # it did its work


def test_cli_offers_the_log_levels_the_logger_knows() -> None:
    from topoagent.cli import LEVEL_NAMES
    from topoagent.log import LEVELS

    assert tuple(LEVELS) == LEVEL_NAMES


def test_one_shot_discovery_matches_the_services() -> None:
    import asyncio

    from topoagent.documents.schema import node_document
    from topoagent.node.discovery import discover, discover_sync
    from topoagent.node.host import Host

    with Host(A100) as host:
        one_shot = node_document(discover_sync(host))
        served = node_document(asyncio.run(discover(host)))
    for document in (one_shot, served):  # how long each collector took differs, nothing else
        for collector in document["collectors"].values():
            collector.pop("seconds", None)
    assert one_shot == served
