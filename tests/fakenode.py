"""Build small recorded nodes (docs/snapshot-format.md) in a temp dir, with real symlinks."""

from __future__ import annotations

import json
import os
from pathlib import Path


class FakeNode:
    def __init__(self, root: Path, numa: dict[int, str] | None = None) -> None:
        self.root = root
        numa = numa or {0: "0-3"}
        node_dir = root / "sys/devices/system/node"
        ids = sorted(numa)
        for i in ids:
            d = node_dir / f"node{i}"
            d.mkdir(parents=True)
            (d / "cpulist").write_text(numa[i] + "\n")
            (d / "meminfo").write_text(f"Node {i} MemTotal:       1048576 kB\n")
            (d / "distance").write_text(" ".join("10" if j == i else "21" for j in ids) + "\n")
        (root / "sys/bus/pci/devices").mkdir(parents=True)

    def pci(self, path: str, cls: int, vendor: int = 0x10DE, device: int = 0x20B0,
            numa: int = 0, width: tuple[int, int] = (16, 16), speed: tuple[str, str] = ("16.0 GT/s PCIe",) * 2,
            driver: str | None = None) -> str:
        """``path`` like ``pci0000:00/0000:00:01.0/0000:01:00.0``; returns the address."""
        d = self.root / "sys/devices" / path
        d.mkdir(parents=True, exist_ok=True)
        files = {"class": f"0x{cls:06x}", "vendor": f"0x{vendor:04x}", "device": f"0x{device:04x}",
                 "subsystem_vendor": "0x0000", "subsystem_device": "0x0000", "numa_node": str(numa),
                 "current_link_width": str(width[0]), "max_link_width": str(width[1]),
                 "current_link_speed": speed[0], "max_link_speed": speed[1]}
        for name, value in files.items():
            (d / name).write_text(value + "\n")
        if driver:
            drivers = self.root / "sys/bus/pci/drivers" / driver
            drivers.mkdir(parents=True, exist_ok=True)
            os.symlink(os.path.relpath(drivers, d), d / "driver")
        address = path.rsplit("/", 1)[-1]
        os.symlink(f"../../../devices/{path}", self.root / "sys/bus/pci/devices" / address)
        return address

    def bridge(self, path: str, numa: int = 0, **kw: object) -> str:
        return self.pci(path, 0x060400, vendor=0x10B5, device=0x9797, numa=numa, **kw)  # type: ignore[arg-type]

    def hca(self, name: str, pci_path: str, state: str = "4: ACTIVE", rate: str = "200 Gb/sec (4X HDR)",
            netdev: str | None = None) -> None:
        dev = self.root / "sys/devices" / pci_path
        port = dev / "infiniband" / name / "ports" / "1"
        (port / "gids").mkdir(parents=True)
        (port / "state").write_text(state + "\n")
        (port / "phys_state").write_text(("5: LinkUp" if "ACTIVE" in state else "3: Disabled") + "\n")
        (port / "rate").write_text(rate + "\n")
        (port / "link_layer").write_text("InfiniBand\n")
        (port / "lid").write_text("0x1a\n")
        (port / "gids" / "0").write_text("fe80:0000:0000:0000:0015:5dff:fd34:11eb\n")
        os.symlink(os.path.relpath(dev, dev / "infiniband" / name), dev / "infiniband" / name / "device")
        cls = self.root / "sys/class/infiniband"
        cls.mkdir(parents=True, exist_ok=True)
        os.symlink(f"../../devices/{pci_path}/infiniband/{name}", cls / name)
        if netdev:
            (dev / "net" / netdev).mkdir(parents=True)
            net = self.root / "sys/class/net"
            net.mkdir(parents=True, exist_ok=True)
            os.symlink(f"../../devices/{pci_path}/net/{netdev}", net / netdev)

    def nvml(self, gpus: list[dict]) -> None:
        (self.root / "nvml.json").write_text(json.dumps({"driver_version": "535.0", "gpus": gpus}))

    def command(self, stem: str, out: str, rc: int = 0) -> None:
        d = self.root / "commands"
        d.mkdir(exist_ok=True)
        (d / f"{stem}.out").write_text(out)
        if rc:
            (d / f"{stem}.rc").write_text(str(rc))


def nvml_gpu(index: int, address: str, links: list[tuple[bool, str, str]], name: str = "NVIDIA A100-SXM4-80GB") -> dict:
    return {"index": index, "uuid": f"GPU-{index:08d}", "name": name, "pci_bus_id": address,
            "memory_total_bytes": 85899345920, "numa_node": None, "cpu_affinity": None,
            "nvlinks": [{"link": k, "active": a, "version": 3, "remote_pci_bus_id": r, "remote_type": t}
                        for k, (a, r, t) in enumerate(links)],
            "p2p": {}, "health": {"temperature_c": 30}}
