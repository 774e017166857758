"""`topoagent completion bash|zsh`: a shell completion script, generated from the parser."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "completion",
        help="print a bash or zsh completion script",
        description="Print a completion script for every command and flag. "
                    "bash: source <(topoagent completion bash); zsh: save it as _topoagent on $fpath.",
    )
    parser.add_argument("shell", choices=("bash", "zsh"), help="the shell to complete in")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from topoagent.cli import build_parser
    from topoagent.clidoc import bash_completion, zsh_completion

    render = bash_completion if args.shell == "bash" else zsh_completion
    sys.stdout.write(render(build_parser()))
    return 0
