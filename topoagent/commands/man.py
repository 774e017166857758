"""`topoagent man`: the manual page (roff), generated from the parser."""

from __future__ import annotations

import argparse
import sys


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "man",
        help="print the manual page (roff)",
        description="Print topoagent(1) in roff: every command and flag, from the parser itself. "
                    "Read it with: topoagent man | man -l -",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from topoagent.cli import build_parser
    from topoagent.clidoc import man_page

    sys.stdout.write(man_page(build_parser()))
    return 0
