"""The recorded-node fixtures are internally consistent and match a fresh generation.

These checks need no collectors: they read the snapshot files directly, so a broken
fixture shows up here and not as a puzzling failure in a collector test.  The real nodes
(``build_snapshots.RECORDED``) are not generated but copied from their recordings; the
same comparison checks they are kept as recorded, and the consistency checks that hold
of a real node run on them too.
"""

from __future__ import annotations

import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from topoagent.collectors.nvidia_smi import parse_topo_matrix
from topoagent.node.cpulist import parse_cpulist

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
SNAPSHOTS = REPO / "fixtures" / "snapshots"
sys.path.insert(0, str(REPO / "fixtures"))
import build_snapshots  # noqa: E402

NAMES = ["dgx-a100", "dgx1-v100", "hgx-h100", "dgx2", "pcie-2socket", "workstation-2gpu", "vm-1gpu", "degraded",
         # Nodes with a witness missing (issue 27): what the agent must say it cannot see.
         "no-gpu-stack", "no-nvidia-driver", "no-gpus", "no-gpudirect",
         # NVSwitch nodes whose NVLink fabric is down or not yet up.
         "no-fabric-manager", "fabric-not-started", "fabric-in-progress",
         # Real nodes, recorded by `topoagent snapshot` on the hardware.
         "h200-vm"]
SPECS = {m.name: m for m in build_snapshots.MACHINES()}
RECORDED = {r.name: r for r in build_snapshots.RECORDED}
GENERATED = [n for n in NAMES if n in SPECS]
# The nodes whose NVML and nvidia-smi answered: their recorded answers must agree with sysfs.
WITH_GPU_STACK = [n for n in GENERATED if SPECS[n].nvml and SPECS[n].nvidia_smi == "out"] + list(RECORDED)


def tree(root: Path) -> dict[str, tuple[str, str | bytes]]:
    out: dict[str, tuple[str, str | bytes]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = ("link", os.readlink(path))
            elif path.is_file():
                out[rel] = ("file", path.read_bytes())
    return out


def read(path: Path) -> str:
    return path.read_text().strip()


def pci_devices(root: Path) -> dict[str, Path]:
    return {p.name: p for p in (root / "sys/bus/pci/devices").iterdir()}


def mask_cpus(mask_text: str) -> frozenset[int]:
    """The CPUs of a sysfs cpumask (32-bit hex words, most significant first)."""
    mask = int(mask_text.replace(",", ""), 16)
    return frozenset(cpu for cpu in range(mask.bit_length()) if mask >> cpu & 1)


def test_every_listed_fixture_exists():
    assert sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir()) == sorted(NAMES)
    assert sorted([*SPECS, *RECORDED]) == sorted(NAMES)


def test_committed_fixtures_equal_a_fresh_generation(tmp_path):
    build_snapshots.build(tmp_path)
    for name in NAMES:
        fresh = tree(tmp_path / name)
        committed = {k: v for k, v in tree(SNAPSHOTS / name).items() if Path(k).parts[0] not in build_snapshots.KEPT}
        assert fresh.keys() == committed.keys(), f"{name}: file sets differ; rerun fixtures/build_snapshots.py"
        changed = [k for k in fresh if fresh[k] != committed[k]]
        assert not changed, f"{name}: {changed[:5]} differ; rerun fixtures/build_snapshots.py"


@pytest.mark.parametrize("name", NAMES)
def test_every_symlink_resolves_inside_the_snapshot(name):
    root = (SNAPSHOTS / name).resolve()
    links = [p for p in root.rglob("*") if p.is_symlink()]
    assert links
    for link in links:
        target = link.resolve()
        assert target.is_relative_to(root), f"{link} escapes the snapshot"
        # A recording keeps a driver link as sysfs has it; only its target's name is read,
        # and the driver's folder is not recorded.
        assert target.exists() or (name in RECORDED and link.name == "driver"), f"{link} dangles"
        assert not os.path.isabs(os.readlink(link)), f"{link} is absolute"
    for addr, dev in pci_devices(root).items():
        assert dev.is_symlink() and dev.resolve().name == addr
        assert dev.resolve().relative_to(root / "sys/devices").parts[0].startswith("pci")


@pytest.mark.parametrize("name", NAMES)
def test_snapshot_json_and_numa(name):
    root = SNAPSHOTS / name
    meta = json.loads((root / "snapshot.json").read_text())
    made_by = "topoagent snapshot" if name in RECORDED else "build_snapshots.py"
    assert meta["schema"] == 1 and meta["hostname"] and made_by in meta["recorded_by"]
    nodes = sorted((root / "sys/devices/system/node").glob("node*"))
    for node in nodes:
        distances = read(node / "distance").split()
        assert len(distances) == len(nodes) and distances[nodes.index(node)] == "10"
        assert "MemTotal" in (node / "meminfo").read_text()


@pytest.mark.parametrize("name", WITH_GPU_STACK)
def test_nvml_gpus_exist_in_sysfs_as_nvidia_gpus(name):
    root = SNAPSHOTS / name
    nvml = json.loads((root / "nvml.json").read_text())
    devices = pci_devices(root)
    sysfs_gpus = sorted(
        a for a, d in devices.items()
        if read(d / "vendor") == "0x10de" and read(d / "class")[:6] in ("0x0300", "0x0302")
    )
    assert [g["pci_bus_id"] for g in nvml["gpus"]] == sysfs_gpus
    assert [g["index"] for g in nvml["gpus"]] == list(range(len(sysfs_gpus)))
    assert len({g["uuid"] for g in nvml["gpus"]}) == len(sysfs_gpus)
    for g in nvml["gpus"]:
        numa = read(devices[g["pci_bus_id"]] / "numa_node")
        assert g["numa_node"] == (None if numa == "-1" else int(numa))
        device = devices[g["pci_bus_id"]]
        if (device / "local_cpulist").is_file():
            assert g["cpu_affinity"] == read(device / "local_cpulist")
        else:  # a recording keeps what discovery read: the mask
            assert parse_cpulist(g["cpu_affinity"]) == mask_cpus(read(device / "local_cpus"))


@pytest.mark.parametrize("name", WITH_GPU_STACK)
def test_nvlink_peers_are_symmetric_and_switches_are_in_sysfs(name):
    root = SNAPSHOTS / name
    gpus = json.loads((root / "nvml.json").read_text())["gpus"]
    devices = pci_devices(root)
    gpu_links: Counter[tuple[str, str]] = Counter()
    for g in gpus:
        for link in g["nvlinks"]:
            if not link["active"]:
                continue
            remote = link["remote_pci_bus_id"]
            assert remote in devices, f"{g['pci_bus_id']} link {link['link']} -> {remote} not in sysfs"
            if link["remote_type"] == "gpu":
                gpu_links[(g["pci_bus_id"], remote)] += 1
            else:
                assert link["remote_type"] == "switch"
                assert read(devices[remote] / "class").startswith("0x0680")
    for (a, b), count in gpu_links.items():
        assert gpu_links[(b, a)] == count, f"{a}->{b} has {count} links, {b}->{a} {gpu_links[(b, a)]}"


@pytest.mark.parametrize("name", WITH_GPU_STACK)
def test_nvidia_smi_matrix_matches_sysfs_devices(name):
    root = SNAPSHOTS / name
    matrix = parse_topo_matrix((root / "commands/nvidia-smi_topo_-m.out").read_text())
    assert not matrix.missing_rows
    nvml = json.loads((root / "nvml.json").read_text())
    assert len(matrix.gpus) == len(nvml["gpus"])
    ib_class = root / "sys/class/infiniband"
    hcas = sorted(ib_class.iterdir() if ib_class.is_dir() else [], key=lambda p: int(p.name.rsplit("_", 1)[1]))
    assert len(matrix.nics) == len(hcas)
    assert [n.device for n in matrix.nics] == [h.name for h in hcas]
    for hca in hcas:
        assert (hca / "device").resolve().name in pci_devices(root)
        assert (hca / "ports/1/state").exists()


@pytest.mark.parametrize("name", [n for n in WITH_GPU_STACK if n in SPECS])
def test_recorded_matrix_is_what_the_fixture_facts_give(name):
    # The spec's facts, read with nvidia-smi's semantics, give every cell the capture has.
    spec = SPECS[name]
    recorded = parse_topo_matrix((SNAPSHOTS / name / "commands/nvidia-smi_topo_-m.out").read_text())
    derived = parse_topo_matrix(build_snapshots.render_topo(spec, build_snapshots.derive_topo(spec)))
    assert [d.name for d in recorded.devices] == [d.name for d in derived.devices]
    assert recorded.levels == derived.levels
    assert [d.cpu_affinity for d in recorded.gpus] == [d.cpu_affinity for d in derived.gpus]


@pytest.mark.parametrize("name", [n for n in GENERATED if SPECS[n].topo_source])
def test_real_captures_are_kept_byte_exact(name):
    real = (SHARED / "corpus" / SPECS[name].topo_source).read_bytes()
    assert (SNAPSHOTS / name / "commands/nvidia-smi_topo_-m.out").read_bytes().startswith(real)


def faults(root: Path) -> dict[str, list]:
    slow = []
    for addr, dev in pci_devices(root).items():
        if not (dev / "current_link_width").exists():
            continue
        current = (read(dev / "current_link_width"), read(dev / "current_link_speed"))
        if current != (read(dev / "max_link_width"), read(dev / "max_link_speed")):
            slow.append(addr)
    down_links = [
        (g["index"], link["link"])
        for g in json.loads((root / "nvml.json").read_text())["gpus"]
        for link in g["nvlinks"]
        if not link["active"]
    ]
    down_ports = [
        (hca.name, port.name)
        for hca in (root / "sys/class/infiniband").iterdir()
        for port in (hca / "ports").iterdir()
        if read(port / "state") != "4: ACTIVE"
    ]
    return {"pcie": sorted(slow), "nvlink": down_links, "ib": down_ports}


def test_degraded_fixture_has_exactly_the_three_faults():
    root = SNAPSHOTS / "degraded"
    found = faults(root)
    gpu3 = json.loads((root / "nvml.json").read_text())["gpus"][3]["pci_bus_id"]
    gpu3_dir = pci_devices(root)[gpu3].resolve()
    # One PCIe link at x8 of x16: the GPU and the switch port above it both report it.
    assert found["pcie"] == sorted([gpu3, gpu3_dir.parent.name])
    assert read(gpu3_dir / "current_link_width") == "8" and read(gpu3_dir / "max_link_width") == "16"
    assert found["nvlink"] == [(5, 7)]
    assert found["ib"] == [("mlx5_6", "1")]
    assert read(root / "sys/class/net/ib6/operstate") == "down"


def test_the_healthy_twin_of_degraded_has_no_faults():
    assert faults(SNAPSHOTS / "hgx-h100") == {"pcie": [], "nvlink": [], "ib": []}


def test_the_nodes_without_a_gpu_stack_hold_no_answer_of_one():
    """What a pod without the NVIDIA runtime, a node without the driver and a CPU node
    record: no NVML answers; nvidia-smi absent, or failing with the driver's exit code 9."""
    for name in ("no-gpu-stack", "no-nvidia-driver", "no-gpus"):
        root = SNAPSHOTS / name
        assert not (root / "nvml.json").exists()
        telemetry = json.loads((root / "telemetry.json").read_text())
        assert all("nvml_counters" not in s["sources"] for s in telemetry["samples"])
    assert (SNAPSHOTS / "no-gpu-stack/commands/nvidia-smi_topo_-m.missing").is_file()
    assert read(SNAPSHOTS / "no-nvidia-driver/commands/nvidia-smi_topo_-m.rc") == "9"
    gpus = [p for p in pci_devices(SNAPSHOTS / "no-nvidia-driver").values() if read(p / "class") == "0x030200"]
    assert len(gpus) == 8 and not any((p / "driver").exists() for p in gpus)
    assert not [p for p in pci_devices(SNAPSHOTS / "no-gpus").values() if read(p / "vendor") == "0x10de"]
    modules = {p.name for p in (SNAPSHOTS / "no-gpudirect/sys/module").iterdir()}
    assert "nvidia" in modules and "mlx5_ib" in modules and "nvidia_peermem" not in modules
