"""Benchmark `topoagent serve` on loopback: throughput and p99 of the read endpoints
(wrk), of POST /place (a concurrent aiohttp client), and the agent's idle RSS and CPU%.

    python bench/service.py [--root DIR] [--seconds 10] [--idle-seconds 60]

Uses fixtures/snapshots/dgx-a100 when it exists, else a recorded node built from the
8xH20 `nvidia-smi topo -m` fixture.  Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import asyncio
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


def wrk(url: str, seconds: int) -> str:
    if shutil.which("wrk") is None:
        return "wrk not installed (Debian package 'wrk')"
    out = subprocess.run(["wrk", "-t2", "-c32", f"-d{seconds}s", "--latency", url], capture_output=True, text=True).stdout
    rps = re.search(r"Requests/sec:\s+([\d.]+)", out)
    p50 = re.search(r"^\s+50%\s+(\S+)", out, re.M)
    p99 = re.search(r"^\s+99%\s+(\S+)", out, re.M)
    errors = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return f"{float(rps.group(1)):9.0f} req/s  p50 {p50.group(1):>8}  p99 {p99.group(1):>8}" + (f"  non-2xx {errors.group(1)}" if errors else "")


async def place_load(url: str, token: str, seconds: int, clients: int) -> str:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    deadline = time.monotonic() + seconds

    async def client(n: int) -> None:
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < deadline:
                body = {"gpus": 1 + n % 4, "pattern": "allreduce"}
                t0 = time.perf_counter()
                async with session.post(f"{url}/place", json=body) as resp:
                    await resp.read()
                latencies.append(time.perf_counter() - t0)
                statuses[resp.status] = statuses.get(resp.status, 0) + 1

    t0 = time.monotonic()
    await asyncio.gather(*(client(n) for n in range(clients)))
    elapsed = time.monotonic() - t0
    q = statistics.quantiles(latencies, n=100)
    return (f"{len(latencies) / elapsed:9.0f} req/s  p50 {q[49] * 1e3:6.2f}ms  p99 {q[98] * 1e3:6.2f}ms  "
            f"({clients} clients, statuses {statuses})")


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
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        root = Path(args.root) if args.root else default_root(tmp)
        proc, url, token = start(root, tmp)
        try:
            print(f"topoagent serve --root {root}  ({url}, {psutil.cpu_count()} CPUs)")
            print(f"idle          {idle(proc.pid, args.idle_seconds)}")
            print(f"GET /topology {wrk(url + '/topology', args.seconds)}")
            print(f"GET /metrics  {wrk(url + '/metrics', args.seconds)}")
            print(f"POST /place   {asyncio.run(place_load(url, token, args.seconds, args.clients))}")
            print(f"after load    RSS {psutil.Process(proc.pid).memory_info().rss / 2**20:.1f} MiB")
        finally:
            proc.terminate()
            proc.wait(timeout=30)


if __name__ == "__main__":
    main()
