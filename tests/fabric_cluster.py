"""A cluster of recorded nodes cabled as a recorded fabric, for the fabric tests.

``parse_ibnetdiscover`` reads an ibnetdiscover dump (fixtures/fabric/*.txt) into its
switches and the host ports cabled to them.  ``build_node`` copies a recorded node
(fixtures/snapshots/<name>) and adds what its ``smpquery`` would answer on that fabric:
for each of its HCA ports, the nodeinfo and nodedesc of the switch at the other end, in
smpquery's real output format (fixtures/fabric/smpquery-*.txt).  Discovery then replays
those answers exactly as it replays nvidia-smi's.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from topoagent.collectors.ib_neighbours import smpquery
from topoagent.node.host import command_file_stem

REPO = Path(__file__).resolve().parents[1]
FABRIC = REPO / "fixtures" / "fabric"
SNAPSHOTS = REPO / "fixtures" / "snapshots"

_SWITCH = re.compile(r'^Switch\s+(\d+)\s+"S-([0-9a-f]+)"\s+#\s+"([^"]*)"')
_PORT = re.compile(r'^\[(\d+)\]\s+"([SH])-([0-9a-f]+)"\[(\d+)\](?:\([0-9a-f]+\))?\s+#\s+"([^"]*)"')


@dataclass
class IbSwitch:
    guid: str  # "0xec0d9a0300ec8240"
    description: str
    ports: int
    devid: str
    # port -> (peer kind "S"/"H", peer GUID, peer port, peer description)
    links: dict[int, tuple[str, str, int, str]] = field(default_factory=dict)

    @property
    def hosts(self) -> dict[int, str]:
        return {port: desc for port, (kind, _, _, desc) in self.links.items() if kind == "H"}

    @property
    def uplinks(self) -> set[str]:
        return {guid for kind, guid, _, _ in self.links.values() if kind == "S"}


def parse_ibnetdiscover(text: str) -> dict[str, IbSwitch]:
    switches: dict[str, IbSwitch] = {}
    current: IbSwitch | None = None
    devid = ""
    for line in text.splitlines():
        if line.startswith("devid="):
            devid = line.split("=", 1)[1]
        elif (m := _SWITCH.match(line)) is not None:
            current = IbSwitch(f"0x{m.group(2)}", m.group(3), int(m.group(1)), devid)
            switches[current.guid] = current
        elif line.startswith(("Ca", "vendid")):
            current = None if line.startswith("Ca") else current
        elif current is not None and (m := _PORT.match(line)) is not None:
            current.links[int(m.group(1))] = (m.group(2), f"0x{m.group(3)}", int(m.group(4)), m.group(5))
    return switches


def leaves(switches: dict[str, IbSwitch]) -> dict[str, IbSwitch]:
    return {guid: s for guid, s in switches.items() if s.hosts}


def host_port(switches: dict[str, IbSwitch], description: str) -> tuple[IbSwitch, int]:
    """The leaf and its port that the HCA described as ``description`` is cabled to."""
    for switch in switches.values():
        for port, desc in switch.hosts.items():
            if desc == description:
                return switch, port
    raise KeyError(description)


def nodeinfo_answer(switch: IbSwitch, local_port: int, route: str) -> str:
    """smpquery -D nodeinfo of ``switch`` reached through its port ``local_port``."""
    return (
        f"# Node info: DR path slid 0; dlid 0; {route}\n"
        "BaseVers:........................1\n"
        "ClassVers:.......................1\n"
        "NodeType:........................Switch\n"
        f"NumPorts:........................{switch.ports}\n"
        f"SystemGuid:......................{switch.guid}\n"
        f"Guid:............................{switch.guid}\n"
        f"PortGuid:........................{switch.guid}\n"
        "PartCap:.........................8\n"
        f"DevId:...........................0x{int(switch.devid, 16):04x}\n"
        "Revision:........................0x000000a0\n"
        f"LocalPort:.......................{local_port}\n"
        "VendorId:........................0x0002c9\n"
    )


def nodedesc_answer(switch: IbSwitch, route: str) -> str:
    return f"# Node Description: DR path slid 0; dlid 0; {route}\nNode Description:.................{switch.description}\n"


def write_command(root: Path, argv: list[str], stdout: str, *, stderr: str = "", rc: int = 0) -> None:
    commands = root / "commands"
    commands.mkdir(exist_ok=True)
    stem = command_file_stem(argv)
    (commands / f"{stem}.out").write_text(stdout)
    if stderr:
        (commands / f"{stem}.err").write_text(stderr)
    if rc:
        (commands / f"{stem}.rc").write_text(f"{rc}\n")


def build_node(base: str, dest: Path, hostname: str, cabling: dict[str, tuple[IbSwitch, int]]) -> Path:
    """A copy of recorded node ``base`` named ``hostname`` whose HCA ``device`` (port 1) is
    cabled to ``cabling[device]`` = (leaf, its port)."""
    shutil.copytree(SNAPSHOTS / base, dest, symlinks=True, ignore=shutil.ignore_patterns("telemetry.json"))
    (dest / "proc" / "sys" / "kernel").mkdir(parents=True, exist_ok=True)
    (dest / "proc" / "sys" / "kernel" / "hostname").write_text(hostname + "\n")
    meta = json.loads((dest / "snapshot.json").read_text())
    meta["hostname"] = hostname
    meta["recorded_by"] += "; smpquery answers composed by tests/fabric_cluster.py from a recorded fabric"
    (dest / "snapshot.json").write_text(json.dumps(meta, indent=2) + "\n")
    for device, (switch, port) in cabling.items():
        route = "0,1"
        write_command(dest, smpquery(device, 1, "nodeinfo"), nodeinfo_answer(switch, port, route))
        write_command(dest, smpquery(device, 1, "nodedesc"), nodedesc_answer(switch, route))
    return dest
