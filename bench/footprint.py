"""The agent's idle memory beside node_exporter's, measured in one run.

    python -m bench.footprint [--idle-seconds 5] [--markdown]    (from a checkout's root)

Starts `topoagent serve --root fixtures/snapshots/dgx-a100` and Debian's node_exporter
(package prometheus-node-exporter) on loopback ports, scrapes each one's /metrics once (so
both have answered a request, as a scraped agent has), lets both sit idle for
--idle-seconds, then reads their resident memory (VmRSS, /proc/PID/status) and repeats,
the two alternating, for --rounds rounds, and with them the interpreter that has imported
aiohttp.web and nothing else (the floor under any agent built on aiohttp).  Then the agent
serving the generated 128-GPU node (tests/big_node.py), --rounds times.  Prints medians;
asserts nothing.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CHILD_ENV = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"} | {"PYTHONPATH": str(REPO)}
NODE_EXPORTER = next((p for p in map(shutil.which, ("prometheus-node-exporter", "node_exporter")) if p), None)
READY_WAIT_S = 120.0  # the 128-GPU node's first discovery takes seconds on a loaded 2-core machine


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"^VmRSS:\s+(\d+) kB", status, re.M)
    assert found, f"no VmRSS for {pid}"
    return int(found.group(1)) / 1024


def wait_for(url: str, proc: subprocess.Popen) -> None:
    """Until ``url`` answers 200 (the service is up and has discovered its node)."""
    deadline = time.monotonic() + READY_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{proc.args[0]} exited {proc.returncode} before answering {url}")
        try:
            if urllib.request.urlopen(url, timeout=5).status == 200:
                return
        except OSError:
            time.sleep(0.05)
    raise SystemExit(f"{url}: no answer within {READY_WAIT_S:.0f} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def agent(root: Path, tmp: Path) -> tuple[subprocess.Popen, str]:
    (tmp / "token").write_text("bench-footprint-token-0123456789abcdef\n")
    os.chmod(tmp / "token", 0o600)
    port = free_port()
    proc = subprocess.Popen(
        # -P: this checkout's topoagent, never the cwd's or an installed one.
        [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", f"127.0.0.1:{port}",
         "--state-dir", str(tmp / "state"), "--token-file", str(tmp / "token")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=CHILD_ENV)
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/readyz", proc)
    return proc, url


def node_exporter() -> tuple[subprocess.Popen, str]:
    assert NODE_EXPORTER
    port = free_port()
    proc = subprocess.Popen([NODE_EXPORTER, f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_for(f"{url}/metrics", proc)
    return proc, url


def idle_rss(start, idle_seconds: float) -> float:
    """Start a service, scrape it once, leave it idle, read its RSS, stop it."""
    proc, url = start()
    try:
        urllib.request.urlopen(f"{url}/metrics", timeout=30).read()
        time.sleep(idle_seconds)  # a figure at rest, not a wait for readiness (that was wait_for)
        return rss_mib(proc.pid)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


# The floor under any agent built on aiohttp (a chosen dependency): the interpreter with
# aiohttp.web imported and nothing else, its resident memory read by itself.
AIOHTTP_FLOOR = "import aiohttp.web, re; print(re.search(r'^VmRSS:\\s+(\\d+) kB', open('/proc/self/status').read(), re.M).group(1))"


def floor_rss() -> float:
    done = subprocess.run([sys.executable, "-P", "-c", AIOHTTP_FLOOR], capture_output=True, text=True, check=True, env=CHILD_ENV)
    return int(done.stdout) / 1024


def measure(rounds: int, idle_seconds: float) -> dict[str, float | str]:
    if NODE_EXPORTER is None:
        raise SystemExit("node_exporter not installed (Debian: apt-get install prometheus-node-exporter): no peer to measure beside")
    sys.path.insert(0, str(REPO / "tests"))
    from big_node import write_big_node

    with tempfile.TemporaryDirectory(prefix="bench-footprint-") as tmpdir:
        tmp = Path(tmpdir)
        dgx = REPO / "fixtures" / "snapshots" / "dgx-a100"
        ours, theirs, floor = [], [], []
        for n in range(rounds):  # alternate, so both see the same machine
            run = tmp / f"dgx-{n}"
            run.mkdir()
            ours.append(idle_rss(lambda run=run: agent(dgx, run), idle_seconds))
            theirs.append(idle_rss(node_exporter, idle_seconds))
            floor.append(floor_rss())
        big = write_big_node(tmp / "big-node")
        big_runs = []
        for n in range(rounds):  # its figure a median too: one run on a shared machine moves by MiBs
            run = tmp / f"big-{n}"
            run.mkdir()
            big_runs.append(idle_rss(lambda run=run: agent(big, run), idle_seconds))
        big_rss = statistics.median(big_runs)
    version = subprocess.run([NODE_EXPORTER, "--version"], capture_output=True, text=True)
    return {
        "ours": statistics.median(ours), "theirs": statistics.median(theirs),
        "ratio": statistics.median(a / b for a, b in zip(ours, theirs)), "big": big_rss,
        "floor": statistics.median(floor), "floor_ratio": statistics.median(a / b for a, b in zip(floor, theirs)),
        "peer": (version.stdout + version.stderr).splitlines()[0].strip(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--idle-seconds", type=float, default=5.0)
    parser.add_argument("--markdown", action="store_true", help="print its block in the docs (bench/report.py)")
    args = parser.parse_args()
    f = measure(args.rounds, args.idle_seconds)
    if not args.markdown:
        print(f"idle RSS: topoagent serve (dgx-a100) {f['ours']:.1f} MiB, node_exporter {f['theirs']:.1f} MiB, "
              f"ratio {f['ratio']:.2f}x (medians of {args.rounds}, alternated; {f['peer']})")
        print(f"python with aiohttp.web imported alone: {f['floor']:.1f} MiB, ratio {f['floor_ratio']:.2f}x")
        print(f"idle RSS serving the generated 128-GPU node: {f['big']:.1f} MiB")
        return 0
    print(f"Resident memory (VmRSS) after one `/metrics` scrape and {args.idle_seconds:g} s idle; medians of"
          f" {args.rounds} rounds, the two services alternated on loopback. Peer: {f['peer']}"
          " (Debian's prometheus-node-exporter, default collectors).\n")
    print("| service | idle RSS | ratio to node_exporter |")
    print("|---|---:|---:|")
    print(f"| `topoagent serve --root dgx-a100` | {f['ours']:.1f} MiB | {f['ratio']:.2f}× |")
    print(f"| node_exporter | {f['theirs']:.1f} MiB | 1.00× |")
    print(f"| `python -c 'import aiohttp.web'` alone: the floor under an agent on aiohttp | {f['floor']:.1f} MiB | {f['floor_ratio']:.2f}× |")
    print(f"| `topoagent serve`, generated 128-GPU node (tests/big_node.py), median of {args.rounds} | {f['big']:.1f} MiB | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
