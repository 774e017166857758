"""Cost of the telemetry loop: CPU per read of an 8-GPU, 10-HCA node's sysfs counters,
and /metrics latency with [telemetry] on and off.

    python bench/telemetry.py [--reads 200] [--scrapes 300]

The node is fixtures/snapshots/dgx-a100 (8 A100, 10 mlx5 HCAs) with its recorded counter
sample written back into the sysfs tree (counters/, hw_counters/, aer_dev_*), so the
read goes through Host's bounded file reads as it does live.  NVML's share cannot be
measured without a GPU (it is printed as such).  Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from topoagent.node.discovery import COUNTER_SOURCES, discover_sync  # noqa: E402
from topoagent.node.host import Host  # noqa: E402
from topoagent.service.telemetry import Context, History, read_live, served  # noqa: E402

DGX = REPO / "fixtures" / "snapshots" / "dgx-a100"


def counters_in_sysfs(tmp: Path) -> Path:
    """dgx-a100 with its last recorded sample as sysfs files, and no telemetry.json."""
    root = tmp / "dgx-a100"
    shutil.copytree(DGX, root, symlinks=True)
    sample = json.loads((root / "telemetry.json").read_text())["samples"][-1]["sources"]
    (root / "telemetry.json").unlink()
    for key, text in sample["infiniband_counters"].items():
        device, port, folder, name = key.split("/")
        path = (root / "sys/class/infiniband" / device).resolve() / "ports" / port / folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    for key, text in sample["pcie_aer"].items():
        address, name = key.split("/")
        (root / "sys/bus/pci/devices" / address).resolve().joinpath(name).write_text(text)
    return root


def cpu_per_read(root: Path, reads: int) -> None:
    with Host(root) as host:
        node = discover_sync(host)
        context = Context(host, node, None)  # type: ignore[arg-type]  # NVML is not read here
        sysfs = [s for s in COUNTER_SOURCES if s.name != "nvml_counters"]
        history = History()
        per_source: dict[str, list[float]] = {s.name: [] for s in sysfs}
        whole: list[float] = []
        for _ in range(reads):
            started = time.process_time()
            for source in sysfs:
                t = time.process_time()
                sample = read_live(source, context)
                history.add(sample, source.parse)
                per_source[source.name].append(time.process_time() - t)
            telemetry = served(history, {}, node)
            whole.append(time.process_time() - started)
        series = len(telemetry.readings)
    print(f"node: {len(node.gpus)} GPUs, {len(node.nics)} HCAs; {series} series from sysfs")
    for name, times in per_source.items():
        print(f"  {name:20s} CPU per read: median {statistics.median(times) * 1e3:.2f} ms")
    print(f"  read + parse + rates + findings: median {statistics.median(whole) * 1e3:.2f} ms CPU "
          f"({statistics.median(whole) / 10 * 100:.3f}% of one core at interval_s = 10)")
    print("  nvml_counters: not measured (no GPU on this machine)")


def scrape_latency(root: Path, telemetry: bool, scrapes: int, tmp: Path) -> None:
    config = tmp / f"t-{telemetry}.toml"
    config.write_text(f"[telemetry]\nenabled = {'true' if telemetry else 'false'}\ninterval_s = 1\n")
    proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", "127.0.0.1:0",
                             "--state-dir", str(tmp / f"state-{telemetry}"), "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        url = "http://" + line.split("http://", 1)[1].split()[0].rstrip("/") + "/metrics"
        time.sleep(3.0)  # the first discovery and two telemetry reads
        times, size = [], 0
        for _ in range(scrapes):
            started = time.perf_counter()
            with urllib.request.urlopen(url) as reply:
                size = len(reply.read())
            times.append(time.perf_counter() - started)
        times.sort()
        print(f"/metrics telemetry {'on ' if telemetry else 'off'}: {size} bytes, median {statistics.median(times) * 1e3:.2f} ms, "
              f"p99 {times[int(len(times) * 0.99) - 1] * 1e3:.2f} ms over {scrapes} scrapes")
    finally:
        proc.terminate()
        proc.wait(timeout=20)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=200)
    parser.add_argument("--scrapes", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="topoagent-bench-") as tmp:
        root = counters_in_sysfs(Path(tmp))
        cpu_per_read(root, args.reads)
        for on in (False, True):
            scrape_latency(root, on, args.scrapes, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
