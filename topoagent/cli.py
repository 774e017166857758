"""The `topoagent` command line: one subcommand per module under topoagent/commands/."""

from __future__ import annotations

import argparse
import importlib
import sys

from topoagent import __version__
from topoagent.errors import UsageError

# Subcommand name -> module under topoagent.commands.  Each module defines
# `register(subparsers)` and a `run(args) -> int` it sets as the parser's default.
COMMANDS = {
    "matrix": "topoagent.commands.matrix",
    "discover": "topoagent.commands.discover",
    "snapshot": "topoagent.commands.snapshot",
    "probe": "topoagent.commands.probe",
    "place": "topoagent.commands.place",
    "export": "topoagent.commands.export",
    "serve": "topoagent.commands.serve",
    "device-plugin": "topoagent.commands.device_plugin",
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand, or with ``only`` that one.

    Registering a subcommand imports its module, and some pull in heavy code (placement,
    probes); a one-shot `topoagent discover` should pay for its own imports only.
    """
    parser = argparse.ArgumentParser(
        prog="topoagent",
        description="GPU topology discovery, link measurement and placement for one node.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, module_name in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module_name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    # The command comes first: build only its parser (top-level help still lists all).
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"topoagent {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `topoagent ... | head`: the reader left; not an error worth a traceback.
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
