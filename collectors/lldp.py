"""The switch and port at the other end of every Ethernet / RoCE interface, from LLDP.

Switches announce themselves on each port (LLDP); lldpd on the node keeps what it heard,
and ``lldpctl -f json`` prints it.  That JSON changes shape with the count: ``interface``
is an object keyed by interface name for one neighbour and a list of such one-key objects
for several; ``chassis`` is keyed by the system name when the switch sent one and holds
the fields directly when it did not.  Both shapes are read here.  Optional: no lldpd
installed is quiet; a daemon that is not running or a socket we may not open is a
warning, never a failed discovery.
"""

from __future__ import annotations

from typing import Any

from topoagent.collectors.base import CollectorResult, SourceError, command_failed, command_missing, run_collector
from topoagent.node.facts import PortNeighbour
from topoagent.node.host import CommandNotFound, Host
from topoagent.text import machine_json
from topoagent.vocabulary import FabricSource, PeerKind

NAME = "lldp"
LLDPCTL = ["lldpctl", "-f", "json"]
COMMAND_TIMEOUT_S = 5.0
MAX_NEIGHBOURS = 4096  # a node has tens of ports; more is not lldpd's answer
_MAX_TEXT = 256  # one name, id or description


class LldpParseError(SourceError):
    """lldpctl's JSON is not the neighbour list it should be."""


def _text(value: Any, what: str) -> str | None:
    """A string field, or the ``value`` of a ``{"type": ..., "value": ...}`` object."""
    if isinstance(value, dict):
        value = value.get("value")
    if value is None:
        return None
    if not isinstance(value, str | int):
        raise LldpParseError(f"{what}: expected text, found {type(value).__name__}")
    return str(value).strip()[:_MAX_TEXT] or None


def _entries(interfaces: Any) -> list[tuple[str, dict]]:
    """(interface name, its neighbour) for both shapes of ``interface``."""
    items = interfaces if isinstance(interfaces, list) else [interfaces]
    out: list[tuple[str, dict]] = []
    for item in items:
        if not isinstance(item, dict):
            raise LldpParseError(f"interface entry is {type(item).__name__}, not an object")
        for name, entry in item.items():
            if not isinstance(entry, dict):
                raise LldpParseError(f"interface {name[:40]!r}: not an object")
            out.append((name, entry))
    return out


def _chassis(chassis: Any, interface: str) -> tuple[str | None, dict]:
    """(system name or None, the chassis' fields)."""
    if not isinstance(chassis, dict):
        raise LldpParseError(f"interface {interface[:40]!r}: chassis is not an object")
    only = next(iter(chassis.values())) if len(chassis) == 1 else None
    named_id = isinstance(only, dict) and "id" in only  # a switch whose system name is "id"
    if "id" in chassis and not named_id:  # no system name: the fields sit here
        return None, chassis
    if len(chassis) != 1:
        raise LldpParseError(f"interface {interface[:40]!r}: chassis holds {len(chassis)} systems")
    ((name, fields),) = chassis.items()
    if not isinstance(fields, dict):
        raise LldpParseError(f"interface {interface[:40]!r}: chassis {name[:40]!r} is not an object")
    return name.strip()[:_MAX_TEXT] or None, fields


def _kind(capabilities: Any, interface: str) -> PeerKind:
    """A peer that bridges or routes is a switch; one that says it does neither (a host's
    lldpd, a station) is not a leaf.  A peer that sends no capabilities counts as a switch."""
    if isinstance(capabilities, dict):
        capabilities = [capabilities]
    if not isinstance(capabilities, list) or not capabilities:
        return PeerKind.SWITCH
    enabled: set[str] = set()
    for c in capabilities:
        if isinstance(c, dict) and c.get("enabled") is True:
            kind = c.get("type")
            if not isinstance(kind, str):  # lldpd names a capability in text, never [...] or {...}
                raise LldpParseError(f"{interface[:40]}: capability type: expected text, found {type(kind).__name__}")
            enabled.add(kind)
    return PeerKind.SWITCH if enabled & {"Bridge", "Router"} else PeerKind.HOST


def parse_lldpctl_json(text: str) -> tuple[PortNeighbour, ...]:
    """``lldpctl -f json`` -> one PortNeighbour per (interface, neighbour) heard."""
    try:
        document = machine_json(text)  # JSON's escapes reach past the Host's text guard
    except (ValueError, RecursionError) as exc:
        raise LldpParseError(f"not JSON: {str(exc)[:120]}") from None
    if not isinstance(document, dict) or not isinstance(document.get("lldp"), dict | list):
        raise LldpParseError('no "lldp" object at the top')
    lldp = document["lldp"]
    if isinstance(lldp, list):  # no neighbour at all prints {"lldp": []} on some versions
        if lldp:
            raise LldpParseError('"lldp" is a list: that is -f json0, not -f json')
        return ()
    interfaces = lldp.get("interface")
    if interfaces is None:
        return ()
    found: list[PortNeighbour] = []
    for interface, entry in _entries(interfaces):
        if len(found) >= MAX_NEIGHBOURS:
            raise LldpParseError(f"more than {MAX_NEIGHBOURS} neighbours")
        name, chassis = _chassis(entry.get("chassis", {}), interface)
        chassis_id = _text(chassis.get("id"), f"{interface[:40]}: chassis id")
        if chassis_id is None:
            raise LldpParseError(f"interface {interface[:40]!r}: the neighbour sent no chassis id")
        port = entry.get("port", {})
        if not isinstance(port, dict):
            raise LldpParseError(f"interface {interface[:40]!r}: port is not an object")
        port_id = port.get("id")
        port_type = port_id.get("type") if isinstance(port_id, dict) else None
        port_text = _text(port_id, f"{interface[:40]}: port id")
        description = _text(port.get("descr"), f"{interface[:40]}: port descr")
        # A switch names its port by ifname ("Ethernet1/5", "swp12"); a port known only
        # by its MAC is better told by its description.
        switch_port = port_text if port_type in ("ifname", "local", None) else (description or port_text)
        found.append(PortNeighbour(FabricSource.LLDP, chassis_id.lower(), name, switch_port, interface=interface[:_MAX_TEXT],
                                   switch_kind=_kind(chassis.get("capability"), interface)))
    return tuple(found)


async def collect(host: Host) -> CollectorResult[tuple[PortNeighbour, ...]]:
    async def read() -> tuple[tuple[PortNeighbour, ...], tuple[str, ...]]:
        try:
            result = await host.run(LLDPCTL, timeout=COMMAND_TIMEOUT_S)
        except CommandNotFound as exc:
            raise command_missing(exc.on_node, "lldpctl", "install lldpd to learn each Ethernet port's switch") from None
        if result.returncode != 0:
            raise command_failed(LLDPCTL, result.returncode, result.stdout, result.stderr, "is lldpd running, and may this user open its socket?")
        try:
            neighbours = parse_lldpctl_json(result.stdout)
        except LldpParseError as exc:
            raise SourceError(f"{' '.join(LLDPCTL)}: {exc}") from None
        return neighbours, ()

    return await run_collector(NAME, read, optional=True)


__all__ = ["LLDPCTL", "NAME", "LldpParseError", "collect", "parse_lldpctl_json"]
