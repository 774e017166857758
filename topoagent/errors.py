"""The project's exceptions: one base, so a caller can catch everything topoagent raises
on purpose (and nothing it did not mean to raise).

Each module keeps its own typed errors beside the code that raises them (LevelError in
levels.py, HostError in host.py, ...); they all derive from ``TopoagentError``.
"""

from __future__ import annotations


class TopoagentError(Exception):
    """Anything topoagent raises on purpose: bad input, a source it cannot read, ..."""


class UsageError(TopoagentError):
    """Bad input a user of a command can fix: printed as one line, exit code 2."""
