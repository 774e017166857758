"""The documents: the one JSON form (and JSON Schema) of every document topoagent emits."""

import json
import sys
from typing import Any


def print_document(document: Any) -> None:
    """A document on stdout as every command prints one: indented, in one write (json.dump
    would hand stdout thousands of pieces, one call each: a third of `discover --json` on a
    128-GPU node)."""
    sys.stdout.write(json.dumps(document, indent=1) + "\n")
