"""The node's place in the cluster fabric: each port's neighbour, the rails they make, and
the one leaf (or group of leaves) a cluster scheduler files the node under.

A *rail* is a leaf switch the node reaches: ports of one node that reach different leaves
are different rails (a rail-optimised node has eight: NIC k of every node meets NIC k of
its peers on leaf k); ports that reach the same leaf share a rail.  Rails are numbered in
the order of the node's NICs (then its plain Ethernet interfaces), so rail 0 is NIC0's.
Each GPU uses the rails of its closest NICs, as placement binds them.  Where any RDMA NIC
has a known leaf, only RDMA NICs make rails: a plain Ethernet port's switch (the management
network's, heard over LLDP) is listed among the neighbours but is no rail.  A node with no
RDMA NIC on a known leaf (GPU traffic over plain Ethernet) takes its rails from its plain
interfaces.

Pure: built from the neighbour facts and the node's NICs, interfaces and levels.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from topoagent.node.facts import PortNeighbour
from topoagent.node.levels import LinkLevel
from topoagent.vocabulary import PeerKind

RAIL_GROUP_PREFIX = "rails-"


@dataclass(frozen=True, slots=True)
class Rail:
    """A leaf switch the node reaches, with the NICs, interfaces and GPUs on it."""

    index: int  # 0 is the rail of the node's first NIC with a known leaf
    leaf: str  # the leaf switch's id: an InfiniBand node GUID or an LLDP chassis id
    leaf_name: str | None  # its description / system name (not unique: many say "SwitchIB Mellanox Technologies")
    nics: tuple[str, ...]  # the RDMA NICs on it ("NIC0")
    interfaces: tuple[str, ...]  # the plain Ethernet interfaces on it (LLDP, no RDMA device)
    gpus: tuple[str, ...]  # the GPUs whose closest NICs are on it


@dataclass(frozen=True, slots=True)
class Fabric:
    """The node's place in the cluster fabric: its ports' neighbours, grouped into rails."""

    neighbours: tuple[PortNeighbour, ...] = ()
    rails: tuple[Rail, ...] = ()

    @property
    def leaf(self) -> str | None:
        """Where a cluster scheduler files this node: its one leaf, or for several rails a
        name for the set of leaves (nodes with the same set share it: a rail-optimised
        scalable unit); None when no neighbour is known."""
        return leaf_group([r.leaf for r in self.rails])

    def rail_of_nic(self, nic: str) -> int | None:
        for rail in self.rails:
            if nic in rail.nics:
                return rail.index
        return None


def leaf_group(leaves: Sequence[str]) -> str | None:
    unique = sorted(set(leaves))
    if not unique:
        return None
    if len(unique) == 1:
        return unique[0]
    import hashlib  # only nodes with several rails need it; kept off discover's start-up

    digest = hashlib.sha256("\n".join(unique).encode()).hexdigest()[:12]
    return f"{RAIL_GROUP_PREFIX}{digest}"


def build_fabric(
    neighbours: tuple[PortNeighbour, ...],
    nics: Sequence[tuple[str, str | None, tuple[str, ...]]],  # (NIC name, RDMA device, netdevs), in NIC order
    gpus: Sequence[str],
    level: Callable[[str, str], LinkLevel | None],
) -> Fabric:
    """Rails from the neighbours that are switches; ``level(gpu, nic)`` finds each GPU's closest NICs."""
    nic_of_device = {device: name for name, device, _ in nics if device}
    nic_of_netdev = {netdev: name for name, _, netdevs in nics for netdev in netdevs}
    order = {name: k for k, (name, _, _) in enumerate(nics)}
    # leaf id -> (its name, NICs, plain interfaces)
    leaves: dict[str, tuple[str | None, list[str], list[str]]] = {}
    for n in neighbours:
        if n.switch_kind != PeerKind.SWITCH:
            continue
        nic = nic_of_device.get(n.device or "") or nic_of_netdev.get(n.interface or "")
        _, on_nics, on_interfaces = leaves.setdefault(n.switch_id, (n.switch_name, [], []))
        if nic is not None:
            if nic not in on_nics:
                on_nics.append(nic)
        elif n.interface and n.interface not in on_interfaces:
            on_interfaces.append(n.interface)

    def rank(item: tuple[str, tuple[str | None, list[str], list[str]]]) -> tuple[int, int, str, str]:
        leaf, (_, on_nics, on_interfaces) = item
        if on_nics:
            return (0, min(order[n] for n in on_nics), "", leaf)
        return (1, 0, min(on_interfaces, default=""), leaf)

    if any(on_nics for _, on_nics, _ in leaves.values()):
        leaves = {leaf: (name, on_nics, []) for leaf, (name, on_nics, _) in leaves.items() if on_nics}
    ranked = sorted(leaves.items(), key=rank)
    rail_nics = {nic: k for k, (_, (_, on_nics, _)) in enumerate(ranked) for nic in on_nics}
    gpus_on: dict[int, list[str]] = {}
    for gpu in gpus:
        known = [(lvl, nic) for nic in rail_nics if (lvl := level(gpu, nic)) is not None]
        if not known:
            continue
        best = min(lvl for lvl, _ in known)
        for k in sorted({rail_nics[nic] for lvl, nic in known if lvl == best}):
            gpus_on.setdefault(k, []).append(gpu)
    rails = tuple(
        Rail(k, leaf, name, tuple(sorted(on_nics, key=order.__getitem__)), tuple(on_interfaces), tuple(gpus_on.get(k, ())))
        for k, (leaf, (name, on_nics, on_interfaces)) in enumerate(ranked)
    )
    return Fabric(neighbours, rails)


__all__ = ["RAIL_GROUP_PREFIX", "Fabric", "Rail", "build_fabric", "leaf_group"]
