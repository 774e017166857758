"""`topoagent snapshot OUT`: record this node so it can be replayed with --root OUT."""

from __future__ import annotations

import argparse
import sys

from topoagent.errors import UsageError
from topoagent.node.host import Host, HostError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "snapshot",
        help="record the files, commands and NVML answers discovery reads",
        description=(
            "Record exactly what `topoagent discover` reads on this node (sysfs/procfs "
            "files, `nvidia-smi topo -m`, NVML answers) into a directory or .tar.gz that "
            "`topoagent discover --root OUT` replays."
        ),
    )
    parser.add_argument("out", metavar="OUT", help="new directory, or a path ending in .tar.gz or .tgz")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing OUT archive, or an existing directory holding an earlier snapshot")
    parser.add_argument("--root", metavar="DIR|TARBALL", default="/",
                        help="re-record a recorded node (keeps only what discovery reads); "
                             "default: this node")
    parser.add_argument("--counter-interval", metavar="SECONDS", type=float, default=1.0,
                        help="pause between the two counter samples recorded (telemetry.json), "
                             "so a replay has rates; default: 1")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from topoagent.node.discovery import discover_sync
    from topoagent.node.recording import check_snapshot_target, record_counters, write_snapshot

    try:
        check_snapshot_target(args.out, force=args.force)  # before minutes of discovery
        host = Host(args.root, record=True)
    except HostError as exc:
        raise UsageError(str(exc)) from None
    if not host.live and not (host.root / "sys").is_dir():
        host.close()
        raise UsageError(f"not a recorded node: no sys/ under {args.root}")
    with host:
        node = discover_sync(host)
        record_counters(host, node, pause_s=max(0.0, args.counter_interval))
        try:
            path = write_snapshot(host, args.out, force=args.force)
        except HostError as exc:  # names the path itself
            raise UsageError(str(exc)) from None
        except OSError as exc:
            raise UsageError(f"{exc.filename or args.out}: {exc.strerror or exc}") from None
    what = "this node" if host.live else args.root
    print(f"recorded {what} into {path}", file=sys.stderr)
    return 0
