"""The `topoagent` command line: one subcommand per module under topoagent/commands/."""

from __future__ import annotations

import argparse
import atexit
import gc
import importlib
import os
import sys

from topoagent import __version__
from topoagent.errors import UsageError

# topoagent.log's LEVELS by name, spelled here so that a command that never logs does not
# import logging (a tenth of `discover`'s start-up); a test holds the two equal.
LEVEL_NAMES = ("debug", "info", "warning", "error")
BROKEN_PIPE_EXIT = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader left

# Subcommand name -> module under topoagent.commands.  Each module defines
# `register(subparsers)` and a `run(args) -> int` it sets as the parser's default.
COMMANDS = {
    "matrix": "topoagent.commands.matrix",
    "discover": "topoagent.commands.discover",
    "snapshot": "topoagent.commands.snapshot",
    "probe": "topoagent.commands.probe",
    "place": "topoagent.commands.place",
    "export": "topoagent.commands.export",
    "cluster-topology": "topoagent.commands.cluster_topology",
    "serve": "topoagent.commands.serve",
    "device-plugin": "topoagent.commands.device_plugin",
    "extender": "topoagent.commands.extender",
    "slurm": "topoagent.commands.slurm",
    "install-files": "topoagent.commands.install_files",
    "completion": "topoagent.commands.completion",
    "man": "topoagent.commands.man",
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
    parser.add_argument("--log-level", choices=LEVEL_NAMES, help=LOG_LEVEL_HELP)
    # Not required: a bare `topoagent` is answered with this help (main), not one error line.
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(module_name).register(sub)
    _accept_log_level_everywhere(sub)
    return parser


LOG_LEVEL_HELP = "log events at this level and above to stderr (default: info for the services serve, extender and device-plugin; warning otherwise)"


def _accept_log_level_everywhere(sub: argparse._SubParsersAction) -> None:
    """`topoagent serve --log-level debug` works as well as `topoagent --log-level debug serve`.

    SUPPRESS as default: a subcommand that was not given the flag leaves the top-level value."""
    for parser in sub.choices.values():
        parser.add_argument("--log-level", choices=LEVEL_NAMES, default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _accept_log_level_everywhere(action)


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command's parser that ``args`` came from (`export nfd`'s, `place`'s)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        name = getattr(args, subs[0].dest, None) if subs and subs[0].dest != argparse.SUPPRESS else None
        if name is None or name not in subs[0].choices:
            return parser
        parser = subs[0].choices[name]


def refuse_unknown(parser: argparse.ArgumentParser, unknown: list[str]) -> None:
    """Exit 2 with the subcommand's own usage line, naming what it does not take, and the
    closest flag it does take for each mistyped one (`--patern`: did you mean --pattern?).

    argparse itself reports a subcommand's unknown arguments with the top-level usage."""
    import difflib  # only on this error path: start-up stays light

    known = [flag for action in parser._actions for flag in action.option_strings]
    hints = []  # (the mistyped flag, the closest known one)
    for word in unknown:
        flag = word.split("=", 1)[0]
        if flag.startswith("-") and (close := difflib.get_close_matches(flag, known, n=1)):
            hints.append((flag, close[0]))
    message = "unrecognized arguments: " + " ".join(unknown)
    if len(hints) == 1:
        message += f"; did you mean {hints[0][1]}?"
    elif hints:
        message += "; did you mean " + ", ".join(f"{good} (for {bad})" for bad, good in hints) + "?"
    parser.error(message)


def main(argv: list[str] | None = None) -> int:
    if argv is None:  # the process is this command (not a caller in Python, e.g. a test)
        # At exit the interpreter runs full garbage collections over every object the
        # imports made (a tenth of `discover --json`: dataclasses, enums, tables).  Freezing
        # them first, once the command is done, leaves them to plain reference counting,
        # which frees what needs freeing; only a reference cycle's finalizer would be
        # skipped, and the commands close what they open with `with`.
        atexit.register(gc.freeze)
        argv = sys.argv[1:]
    # The command comes first: build only its parser (top-level help still lists all).
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else None)
    args, unknown = parser.parse_known_args(argv)
    if args.command is None:  # `topoagent` alone: what the commands are
        parser.print_help(sys.stderr)
        return 2
    if unknown:
        refuse_unknown(chosen_parser(parser, args), unknown)  # exits 2
    if args.log_level is not None and args.command != "serve":  # serve sets up its own (journald)
        from topoagent.log import LEVELS, log_to_stderr

        log_to_stderr(LEVELS[args.log_level])
    try:
        return args.run(args)
    except UsageError as exc:
        print(f"topoagent {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `topoagent ... | head`: the reader left before the answer was whole, so the
        # command's own status is unknown: exit as a shell's command killed by SIGPIPE does
        # (128 + 13), never 0, which would call a refused request a success.  Point stdout
        # at /dev/null so the interpreter's last flush cannot fail again with a traceback.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return BROKEN_PIPE_EXIT


if __name__ == "__main__":
    sys.exit(main())
