"""The /metrics series budget at 128 GPUs: series and bytes a scrape serves, and /topology's
size plain and gzipped, by default and with the [metrics] opt-ins.

    python -m bench.series [--markdown]

The node is tests/big_node.py's (16 hgx-h100 blocks: 128 GPUs, 128 ConnectX-7, 18 NVLinks
a GPU), served by a real agent over loopback; a scrape is counted once the NVML counters'
first read and the capacity figures are in it.  tests/test_series_budget.py asserts the budget; this prints figures.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.big_node import write_big_node  # noqa: E402
from topoagent.vocabulary import MetricsDetail  # noqa: E402

EVERY_DETAIL = "detail = [" + ", ".join(f'"{d}"' for d in MetricsDetail) + "]\n"
MODES = (("default", ""), ("detail (every one)", EVERY_DETAIL), ("pairwise", "pairwise = true\n"),
         ("pairwise + per_link", "pairwise = true\nper_link = true\n"),
         ("pairwise + per_link + detail", "pairwise = true\nper_link = true\n" + EVERY_DETAIL))


def _get(url: str, gzip: bool = False) -> bytes:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip else {})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return reply.read()


def measure(root: Path, tmp: Path, name: str, keys: str) -> tuple[Counter[str], int, int, int]:
    config = tmp / f"{name.replace(' ', '')}.toml"
    config.write_text("[telemetry]\ninterval_s = 0.5\n[metrics]\n" + keys)
    proc = subprocess.Popen([sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", "127.0.0.1:0",
                             "--state-dir", str(tmp / f"state-{len(keys)}"), "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        base = "http://" + line.split("http://", 1)[1].split()[0].rstrip("/")
        deadline = time.monotonic() + 120
        while True:  # poll until the counters and the capacity figures are served, never a fixed wait
            try:
                page = _get(base + "/metrics").decode()
            except urllib.error.HTTPError:
                page = ""
            if 'collector="nvml_counters"' in page and "\ntopoagent_capacity_free_gpus " in page:
                break
            if time.monotonic() > deadline:
                raise SystemExit(f"{name}: the counters were never served")
            time.sleep(0.2)
        count = Counter(s.split("{")[0].split(" ")[0] for s in page.splitlines() if s and not s.startswith("#"))
        return count, len(page.encode()), len(_get(base + "/topology")), len(_get(base + "/topology", gzip=True))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true", help="print its table in the docs (bench/report.py)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        root = write_big_node(tmp / "hgx-h100-x16")
        rows = [(mode, *measure(root, tmp, mode, keys)) for mode, keys in MODES]
    if args.markdown:
        print("| `[metrics]` | series a scrape | of them the largest family | page | `/topology` | gzipped |")
        print("|---|---:|---|---:|---:|---:|")
    for mode, count, page, topology, zipped in rows:
        (top, n), = count.most_common(1)
        if args.markdown:
            print(f"| {mode} | {sum(count.values()):,} | `{top.removeprefix('topoagent_')}` {n:,} | {page / 1e6:.2f} MB | "
                  f"{topology / 1e6:.2f} MB | {zipped / 1e6:.2f} MB |")
        else:
            print(f"{mode}: {sum(count.values())} series ({top} {n}), {page} bytes; /topology {topology} bytes, {zipped} gzipped")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
