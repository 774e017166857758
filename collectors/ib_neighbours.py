"""The switch at the other end of every active InfiniBand port, asked of the fabric itself.

For each active InfiniBand port the collector sends two directed-route SMPs out of that
port (``smpquery -C mlx5_0 -P 1 -D nodeinfo 0,1`` and ``... nodedesc 0,1``): the node one
hop away answers with its node GUID, its type and the number of its port the SMP came in
by, and with its description.  Directed routes need no subnet manager and no LIDs, so a
port whose SM is down still learns its leaf; they do need the port's management device
(``/dev/infiniband/umadN``), which is root's unless udev says otherwise (see the systemd
unit).  Optional: no infiniband-diags is quiet; no permission is a warning, never a failed
discovery.  RoCE ports are LLDP's (collectors/lldp.py).
"""

from __future__ import annotations

import re

from topoagent.collectors.base import CollectorResult, NoData, SourceError, command_failed, command_missing, run_collector
from topoagent.collectors.infiniband import Hca
from topoagent.node.facts import PortNeighbour
from topoagent.node.host import CommandNotFound, CommandTimeout, Host, HostError
from topoagent.vocabulary import FabricSource, PeerKind

NAME = "ib_neighbours"
# One SMP round trip is milliseconds; smpquery's own timeout and retries stay well under this.
COMMAND_TIMEOUT_S = 5.0
_FIELD = re.compile(r"^([A-Za-z][A-Za-z0-9 ]*?):\.*(.*)$")
_GUID = re.compile(r"0x[0-9a-fA-F]{1,16}")
_MAX_LINES = 200  # nodeinfo is 13 lines; anything longer is not smpquery's answer
# smpquery's NodeType words (and ibtool's numbers) -> the kinds a neighbour is.
_NODE_TYPES = {"switch": PeerKind.SWITCH, "2": PeerKind.SWITCH, "channel adapter": PeerKind.HOST, "1": PeerKind.HOST,
               "router": PeerKind.ROUTER, "3": PeerKind.ROUTER}


class SmpParseError(SourceError):
    """smpquery's output is not the attribute it was asked for."""


def smp_fields(text: str) -> dict[str, str]:
    """``Key:.....value`` lines -> {key: value}; ``#`` lines (the route) are skipped."""
    fields: dict[str, str] = {}
    for line in text.splitlines()[:_MAX_LINES]:
        if line.startswith("#") or not line.strip():
            continue
        match = _FIELD.match(line.strip())
        if match:
            fields.setdefault(match.group(1), match.group(2).strip())
    return fields


def parse_nodeinfo(text: str) -> tuple[str, PeerKind, int]:
    """``smpquery nodeinfo`` -> (node GUID "0x...", kind, the port the query came in by)."""
    fields = smp_fields(text)
    guid = fields.get("Guid") or fields.get("SystemGuid")
    if not guid or not _GUID.fullmatch(guid):
        raise SmpParseError(f"no node GUID in nodeinfo (Guid: {str(guid)[:40]!r})")
    kind = _NODE_TYPES.get(fields.get("NodeType", "").lower())
    if kind is None:
        raise SmpParseError(f"unknown NodeType {fields.get('NodeType', '')[:40]!r} in nodeinfo")
    local = fields.get("LocalPort", "")
    if not (local.isascii() and local.isdigit() and len(local) <= 3):
        raise SmpParseError(f"LocalPort {local[:40]!r} in nodeinfo is not a port number")
    return f"0x{int(guid, 16):016x}", kind, int(local)


def parse_nodedesc(text: str) -> str | None:
    """``smpquery nodedesc`` -> the node's description (None when empty)."""
    description = smp_fields(text).get("Node Description")
    if description is None:
        raise SmpParseError("no 'Node Description' in nodedesc")
    return description[:128] or None


def smpquery(device: str, port: int, attribute: str) -> list[str]:
    """The directed-route query of ``attribute`` on the node one hop out of ``device`` ``port``."""
    return ["smpquery", "-C", device, "-P", str(port), "-D", attribute, f"0,{port}"]


async def ask(host: Host, argv: list[str]) -> str:
    result = await host.run(argv, timeout=COMMAND_TIMEOUT_S)
    if result.returncode != 0:
        raise command_failed(argv, result.returncode, result.stdout, result.stderr)
    return result.stdout


async def neighbour(host: Host, device: str, port: int) -> PortNeighbour:
    argv = smpquery(device, port, "nodeinfo")
    try:
        guid, kind, remote_port = parse_nodeinfo(await ask(host, argv))
    except SmpParseError as exc:
        raise SourceError(f"{' '.join(argv)}: {exc}") from None
    argv = smpquery(device, port, "nodedesc")
    try:
        name = parse_nodedesc(await ask(host, argv))
    except SmpParseError as exc:
        raise SourceError(f"{' '.join(argv)}: {exc}") from None
    return PortNeighbour(FabricSource.INFINIBAND, guid, name, str(remote_port), device=device, port=port, switch_kind=kind)


def active_ib_ports(hcas: tuple[Hca, ...]) -> list[tuple[str, int]]:
    return [(h.name, p.number) for h in hcas for p in h.ports if p.active and not p.roce]


async def collect(host: Host, infiniband: CollectorResult[tuple[Hca, ...]]) -> CollectorResult[tuple[PortNeighbour, ...]]:
    async def read() -> tuple[tuple[PortNeighbour, ...], tuple[str, ...]]:
        ports = active_ib_ports(infiniband.data or ())
        if not ports:
            raise NoData("no active InfiniBand port")
        found: list[PortNeighbour] = []
        failed: list[str] = []
        for device, port in ports:
            try:
                found.append(await neighbour(host, device, port))
            except CommandNotFound as exc:
                raise command_missing(exc.on_node, "smpquery", "install infiniband-diags to learn each port's switch") from None
            except CommandTimeout as exc:
                raise SourceError(str(exc)) from None  # one hung query would hang the rest too
            except (SourceError, HostError) as exc:
                failed.append(f"{device} port {port}: {exc}")
        if not found:
            raise SourceError(f"no port's neighbour could be asked ({failed[0]})")
        return tuple(found), tuple(failed)

    return await run_collector(NAME, read, optional=True)


__all__ = ["NAME", "SmpParseError", "collect", "parse_nodedesc", "parse_nodeinfo", "smp_fields", "smpquery"]
