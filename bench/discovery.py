"""Discovery time: in-process, as a whole command, and against hwloc's lstopo, side by side.

    python bench/discovery.py [--runs N] [--root SNAPSHOT]

Prints medians.  The in-process figure runs on --root (default: fixtures/snapshots/dgx-a100
when present, else an hwloc recording) and on the live machine; the command comparison
alternates `topoagent discover --json` and `lstopo-no-graphics --of xml` on the live
machine so both see the same load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from topoagent.discovery import discover  # noqa: E402
from topoagent.host import Host  # noqa: E402

# What `topoagent discover` imports (the CLI registers only the command it runs).
DISCOVER_IMPORTS = "import topoagent.cli; topoagent.cli.build_parser('discover'); import topoagent.discovery"


def default_root() -> Path:
    fixture = REPO / "fixtures/snapshots/dgx-a100"
    if fixture.is_dir():
        return fixture
    return REPO.parent / "shared/hwloc/linux/32intel64-2p8co2t+8ve.tar.bz2"


def in_process(root: str | Path, runs: int) -> float:
    times = []
    with Host(root) as host:
        for _ in range(runs):
            start = time.perf_counter()
            asyncio.run(discover(host))
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# An installed agent runs from compiled bytecode; a shell with PYTHONDONTWRITEBYTECODE
# would make every run compile every module again and time the compiler instead.
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}


def command(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, env=CHILD_ENV)
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--root", default=None)
    args = parser.parse_args()
    root = args.root or default_root()
    print(f"in-process discover, {root}: {in_process(root, args.runs) * 1e3:.1f} ms (median of {args.runs})")
    print(f"in-process discover, live /: {in_process('/', args.runs) * 1e3:.1f} ms (median of {args.runs})")
    topoagent = [sys.executable, "-P", "-m", "topoagent", "discover", "--json"]
    replay = command(topoagent + ["--root", str(root)])  # also writes the bytecode caches
    ours_replay = statistics.median([command(topoagent + ["--root", str(root)]) for _ in range(args.runs)])
    print(f"whole command `topoagent discover --json --root {Path(root).name}`: {ours_replay * 1e3:.1f} ms"
          f" (first run {replay * 1e3:.1f} ms)")
    # Where a one-shot command's time goes before it reads anything.
    bare = statistics.median([command([sys.executable, "-P", "-c", "pass"]) for _ in range(args.runs)])
    imports = statistics.median([command([sys.executable, "-P", "-c", DISCOVER_IMPORTS]) for _ in range(args.runs)])
    print(f"  of which: interpreter start {bare * 1e3:.1f} ms, + discover's imports {(imports - bare) * 1e3:.1f} ms"
          f" (median of {args.runs})")
    lstopo = shutil.which("lstopo-no-graphics")
    if lstopo is None:
        print("lstopo-no-graphics not installed: no side-by-side comparison")
        return 0
    ours, theirs = [], []
    for _ in range(args.runs):  # alternate so both see the same machine state
        ours.append(command(topoagent))
        theirs.append(command([lstopo, "--whole-io", "--of", "xml", "-"]))
    a, b = statistics.median(ours), statistics.median(theirs)
    print(f"live: topoagent discover --json {a * 1e3:.1f} ms | lstopo-no-graphics --of xml {b * 1e3:.1f} ms"
          f" | ratio {a / b:.2f} (median of {args.runs}, alternated)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
