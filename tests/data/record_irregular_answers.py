"""Writes placement_answers_irregular.json: place() by branch and bound (no table of k-sets)
on small irregular NVLink meshes, rings and paths of 3-6 GPUs on seeded busy sets.  Run at
the commit whose answers are to be kept:
    python tests/data/record_irregular_answers.py > tests/data/placement_answers_irregular.json

It records this checkout's code: the checkout goes first on sys.path, ahead of any
topoagent installed in the interpreter.
"""

import json
import random
import subprocess
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(CHECKOUT))

import topoagent.placement.ksets as ksets  # noqa: E402  (after the path above)
from topoagent.placement import Placement, Request, place  # noqa: E402
from topoagent.placement.synthetic import irregular_mesh  # noqa: E402

# (GPUs, seed, p, socket size): 2 or 3 sockets, sparse to dense, small enough for brute force.
MESHES = ((10, 1, 0.3, 5), (12, 3, 0.3, 6), (12, 5, 0.35, 4), (12, 8, 0.45, 6), (14, 2, 0.3, 7))
REQUESTS_PER_MESH = 10

ksets.SMALL_TABLE_SETS = 0  # every answer by the branch and bound
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=CHECKOUT, capture_output=True, text=True).stdout.strip()
out: dict = {"commit": commit, "meshes": []}
for n, seed, p, socket_size in MESHES:
    m = irregular_mesh(n, seed=seed, p=p, socket_size=socket_size)
    rng = random.Random(f"{n}/{seed}")
    rows = []
    for _ in range(REQUESTS_PER_MESH):
        k = rng.randint(3, 6)
        pattern = rng.choice(("allreduce", "allreduce", "pipeline"))
        busy = sorted(rng.sample(range(n), rng.randint(0, n - k)))
        a = place(m, Request(gpus=k, pattern=pattern), busy)
        rows.append([busy, pattern, k, list(a.indices) if isinstance(a, Placement) else None])
    out["meshes"].append({"gpus": n, "seed": seed, "p": p, "socket_size": socket_size, "answers": rows})
lines = [f'{{"commit": {json.dumps(out["commit"])}, "meshes": [']
for i, mesh in enumerate(out["meshes"]):
    head = json.dumps({key: value for key, value in mesh.items() if key != "answers"})[:-1]
    rows = ",\n   ".join(json.dumps(row) for row in mesh["answers"])
    lines.append(f' {head}, "answers": [\n   {rows}]}}' + ("," if i < len(out["meshes"]) - 1 else ""))
lines.append("]}")
print("\n".join(lines))
