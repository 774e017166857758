"""How the agent starts a Python child process (discovery, the probe worker) that runs the
agent's own topoagent, wherever that came from.

``python -P -m MODULE`` alone loses a source checkout: the agent found topoagent through its
cwd (``python3 -m topoagent serve`` in the checkout), and -P drops the cwd, so the child
could not import it (on a real H200 the agent never became ready).  Without -P a file in
the cwd named like a module would run in the child.  So the child keeps -P and is told
where the agent's topoagent lies: the directory that holds it goes first on its import path
(left where it is when the path has it already, as where topoagent is installed: no
site-packages ahead of the standard library), and it checks that what it imported is that
one before it runs MODULE as ``-m`` would.
"""

from __future__ import annotations

import os
import sys

import topoagent

# The agent's topoagent package directory.
PACKAGE_DIR = os.path.dirname(os.path.abspath(topoagent.__file__))

# python -P -c BOOT HOME PACKAGE_DIR MODULE ARGS...: MODULE runs with sys.argv [its file, ARGS...].
BOOT = """\
import os, runpy, sys
home, package, module = sys.argv[1:4]
if home not in sys.path:
    sys.path.insert(0, home)
import topoagent
found = os.path.dirname(os.path.abspath(topoagent.__file__))
if found != package:
    print(f"ImportError: this child process imported topoagent from {found}, not the agent's own {package}", file=sys.stderr)
    sys.exit(1)
del sys.argv[1:4]
runpy.run_module(module, run_name="__main__", alter_sys=True)
"""


def module_command(module: str, *args: str, package_dir: str = PACKAGE_DIR) -> list[str]:
    """The command that runs ``module`` (of topoagent) as ``python -P -m module args``
    would, on this interpreter and with the agent's own topoagent."""
    return [sys.executable, "-P", "-c", BOOT, os.path.dirname(package_dir), package_dir, module, *args]
