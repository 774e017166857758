"""A recorded 128-GPU node for the series budget: 16 copies of the hgx-h100 fixture's block
(8 H100 with 18 NVLinks each to their own 4 NVSwitches, one ConnectX-7 per GPU), each copy in
its own PCI domain (0000-000f), written by fixtures/build_snapshots.py's own writer, so
discovery replays it as it replays every recorded node: 128 GPUs, 128 NICs, 2,304 NVLinks.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "fixtures"))
import build_snapshots as bs  # noqa: E402

BLOCKS = 16


def _in_domain(addr: str | None, domain: int) -> str | None:
    return None if addr is None else f"{domain:04x}{addr[4:]}"


def _move(dev: bs.Pci, domain: int, nic_base: int) -> None:
    dev.addr = _in_domain(dev.addr, domain) or dev.addr
    if dev.hca is not None:  # mlx5_k / ibk stay unique across the copies
        k = int(dev.hca.name.removeprefix("mlx5_")) + nic_base
        ports = tuple(replace(p, lid=f"0x{k + 1:x}") for p in dev.hca.ports)
        dev.hca = replace(dev.hca, name=f"mlx5_{k}", ports=ports, netdev=f"ib{k}" if dev.hca.netdev else None)
    for child in dev.children:
        _move(child, domain, nic_base)


def hgx_h100_x16(name: str = "hgx-h100-x16") -> bs.Machine:
    block = bs.hgx_h100(name)
    per_block = len(block.gpus)
    roots, gpus = [], []
    for b in range(BLOCKS):
        copy_of = copy.deepcopy(block)
        for root in copy_of.roots:
            root.domain_bus = f"{b:04x}{root.domain_bus[4:]}"
            for dev in root.devices:
                _move(dev, b, b * per_block)
            roots.append(root)
        for gpu in copy_of.gpus:
            gpu.addr = _in_domain(gpu.addr, b) or gpu.addr
            for link in gpu.nvlinks:
                link.remote = _in_domain(link.remote, b)
            gpus.append(gpu)
    block.roots, block.gpus = roots, gpus
    block.recorded_by = "tests/big_node.py: 16 copies of the hgx-h100 fixture's block in PCI domains 0000-000f (synthetic)"
    return block


def write_big_node(out: Path) -> Path:
    bs.write_machine(hgx_h100_x16(), out)
    return out
