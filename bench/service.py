"""Benchmark `topoagent serve` on loopback: throughput and p50/p99 of the read endpoints
(wrk), of POST /place (concurrent aiohttp clients), and the agent's idle RSS and CPU%.

    python bench/service.py [--root DIR] [--seconds 10] [--idle-seconds 60] [--markdown]

wrk is the Debian/Ubuntu package 'wrk' (apt-get install wrk); without it the read
endpoints are loaded by the same Python clients as /place, and the table says so.

Uses fixtures/snapshots/dgx-a100 when it exists, else a recorded node built from the
8xH20 `nvidia-smi topo -m` fixture.  Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import psutil

REPO = Path(__file__).resolve().parents[1]


def default_root(tmp: Path) -> Path:
    dgx = REPO / "fixtures" / "snapshots" / "dgx-a100"
    if dgx.is_dir():
        return dgx
    root = tmp / "root"
    (root / "commands").mkdir(parents=True)
    shutil.copy(REPO / "fixtures" / "nvidia-smi" / "hgx-h20-8gpu-8nic.txt", root / "commands" / "nvidia-smi_topo_-m.out")
    return root


def start(root: Path, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    token = secrets.token_urlsafe(24)
    (tmp / "token").write_text(token)
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", "127.0.0.1:0",
         "--state-dir", str(tmp / "state"), "--token-file", str(tmp / "token")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        # -P keeps the cwd off sys.path: without this the agent timed is whatever
        # topoagent the interpreter has installed, not this checkout's.
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    url = re.search(r"(http://[\d.]+:\d+)", proc.stdout.readline()).group(1)
    for _ in range(200):
        try:
            import urllib.request

            if urllib.request.urlopen(f"{url}/readyz").status == 200:
                break
        except OSError:
            time.sleep(0.05)
    return proc, url, token


WRK = ["wrk", "-t2", "-c32"]  # two threads, 32 connections


def _ms(text: str) -> float:
    """wrk's latency ('812.00us', '1.20ms', '2.01s') in milliseconds."""
    value, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()
    return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]


def wrk(url: str, seconds: int) -> dict | None:
    """GET load from wrk; None when wrk is not installed (Debian package 'wrk')."""
    if shutil.which("wrk") is None:
        return None
    out = subprocess.run([*WRK, f"-d{seconds}s", "--latency", url], capture_output=True, text=True).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {"rps": float(rps.group(1)), "p50": _ms(p50.group(1)), "p99": _ms(p99.group(1)),
            "failed": int(errors.group(1)) if errors else 0, "by": f"wrk {' '.join(WRK[1:])}"}


async def http_load(url: str, seconds: int, clients: int, body: dict | None = None) -> dict:
    """``clients`` concurrent aiohttp clients, each asking as fast as answered (POST with
    ``body``, else GET); the fallback for GETs when wrk is missing, and the load for /place."""
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                if body is None:
                    request = session.get(url)
                else:
                    request = session.post(url, json={**body, "gpus": 1 + n % 4})
                async with request as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - t0)
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.monotonic() - t0
    q = statistics.quantiles(latencies, n=100)
    return {"rps": len(latencies) / elapsed, "p50": q[49] * 1e3, "p99": q[98] * 1e3,
            "failed": sum(c for status, c in statuses.items() if status >= 300),
            "by": f"{clients} concurrent Python (aiohttp) clients"}


def get_load(url: str, seconds: int, clients: int) -> dict:
    return wrk(url, seconds) or asyncio.run(http_load(url, seconds, clients))


def line(figures: dict) -> str:
    f = figures
    return (f"{f['rps']:9.0f} req/s  p50 {f['p50']:7.2f} ms  p99 {f['p99']:7.2f} ms  non-2xx {f['failed']}  ({f['by']})")


def idle(pid: int, seconds: int) -> str:
    proc = psutil.Process(pid)
    proc.cpu_percent(None)
    cpu0 = proc.cpu_times()
    time.sleep(seconds)
    cpu1 = proc.cpu_times()
    used = (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system)
    rss = proc.memory_info().rss / 2**20
    return f"RSS {rss:.1f} MiB, CPU {100 * used / seconds:.3f}% over {seconds} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--idle-seconds", type=int, default=60)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--markdown", action="store_true", help="print its block in the docs (bench/report.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        root = Path(args.root) if args.root else default_root(tmp)
        proc, url, _token = start(root, tmp)
        try:
            quiet = idle(proc.pid, args.idle_seconds)
            rows = [
                ("GET /topology", get_load(url + "/topology", args.seconds, args.clients)),
                ("GET /metrics", get_load(url + "/metrics", args.seconds, args.clients)),
                ("POST /place", asyncio.run(http_load(url + "/place", args.seconds, args.clients, {"pattern": "allreduce"}))),
            ]
            after = psutil.Process(proc.pid).memory_info().rss / 2**20
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    if not args.markdown:
        print(f"topoagent serve --root {root}  ({url}, {psutil.cpu_count()} CPUs)")
        print(f"idle          {quiet}")
        for name, figures in rows:
            print(f"{name:13} {line(figures)}")
        print(f"after load    RSS {after:.1f} MiB")
        return
    print(f"`topoagent serve --root {root.name}` on loopback, the load generator on the same machine;"
          f" each endpoint loaded for {args.seconds} s (POST /place asks for 1 to 4 GPUs, allreduce).\n")
    print("| endpoint | req/s | p50 | p99 | non-2xx | load |")
    print("|---|---:|---:|---:|---:|---|")
    for name, f in rows:
        print(f"| `{name}` | {f['rps']:.0f} | {f['p50']:.2f} ms | {f['p99']:.2f} ms | {f['failed']} | {f['by']} |")
    print(f"\nIdle: {quiet}; after the load: RSS {after:.1f} MiB.")


if __name__ == "__main__":
    main()
