"""Writes placement_answers_snapshots.json: place() on every fixtures/snapshots node, random
busy sets, every k, pattern and 0 or 2 NICs.  Run from the checkout root at the commit
whose answers are to be kept:  python tests/data/record_snapshot_answers.py > tests/data/placement_answers_snapshots.json
"""

import json
import random
import subprocess
import sys
from pathlib import Path

from topoagent.commands.discover import discover_root
from topoagent.placement import Placement, Request, place

root = Path("fixtures/snapshots")
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
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
