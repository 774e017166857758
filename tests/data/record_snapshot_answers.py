"""Writes placement_answers_snapshots.json: place() on every fixtures/snapshots node, random
busy sets, every k, pattern and 0 or 2 NICs.  Run at the commit whose answers are to be
kept:  python tests/data/record_snapshot_answers.py > tests/data/placement_answers_snapshots.json

It records this checkout's code: the checkout goes first on sys.path, ahead of any
topoagent installed in the interpreter (a script's own folder, not the root, is what
Python puts there).
"""

import json
import random
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

from topoagent.commands.discover import discover_root  # noqa: E402  (after the path above)
from topoagent.placement import Placement, Request, place  # noqa: E402

root = CHECKOUT / "fixtures" / "snapshots"
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True).stdout.strip()
out: dict = {"commit": commit, "answers": {}}
for path in sorted(root.iterdir()):
    m = discover_root(str(path)).distance_matrix()
    n = m.size
    rng = random.Random(path.name)
    rows = []
    for _ in range(12):
        busy = sorted(rng.sample([g.index for g in m.gpus], rng.randint(0, n - 1)))
        for k in range(1, n - len(busy) + 1):
            for pattern in ("allreduce", "alltoall", "pipeline"):
                for nics in sorted({0, min(2, len(m.nics))}):
                    a = place(m, Request(gpus=k, pattern=pattern, nics=nics), busy)
                    rows.append([busy, pattern, k, nics, list(a.indices) if isinstance(a, Placement) else None])
    out["answers"][path.name] = rows
json.dump(out, sys.stdout, separators=(",", ":"))
