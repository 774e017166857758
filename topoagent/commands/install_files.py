"""`topoagent install-files DIR`: write the deployment files the wheel carries.

The systemd unit, the example config, the Grafana dashboard and its alert rules travel inside the package
(topoagent/data, the repository's systemd/ folder), so `pip install topoagent` is all a
node needs; this writes them out where the operator wants them.
"""

from __future__ import annotations

import argparse
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from topoagent.errors import UsageError


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "install-files",
        help="write the systemd unit, config, Grafana dashboard and alert rules into a directory",
        description="Write the deployment files shipped with topoagent (systemd unit, example "
                    "config, Grafana dashboard, Prometheus alert rules) into DIR and name each one written. Existing files "
                    "are left alone unless --force.",
    )
    parser.add_argument("directory", metavar="DIR", help="where to write them (created if missing)")
    parser.add_argument("--force", action="store_true", help="overwrite files that already exist")
    parser.set_defaults(run=run)


def shipped_files() -> list[Traversable]:
    data = files("topoagent") / "data"
    return sorted((f for f in data.iterdir() if f.is_file() and not f.name.startswith(".")), key=lambda f: f.name)


def run(args: argparse.Namespace) -> int:
    target = Path(args.directory)
    shipped = shipped_files()
    if not shipped:
        raise UsageError("this installation carries no deployment files (topoagent/data is empty)")
    existing = [target / f.name for f in shipped if (target / f.name).exists()]
    if existing and not args.force:
        # Nothing written: half a set of files is worse than none.
        raise UsageError(f"{', '.join(map(str, existing))}: already there; --force overwrites")
    try:
        target.mkdir(parents=True, exist_ok=True)
        for source in shipped:
            (target / source.name).write_bytes(source.read_bytes())
            print(target / source.name)
    except OSError as exc:
        raise UsageError(f"{exc.filename or target}: {exc.strerror}") from None
    return 0
