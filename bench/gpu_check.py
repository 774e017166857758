"""The Python side of bench/gpu_check.sh: the parts of the GPU check a shell does badly.

    python bench/gpu_check.py load SECONDS STARTED_FILE     a bf16 matmul loop on every GPU (torch)
    python bench/gpu_check.py wait-ready SERVE_OUT SECONDS   the URL serve printed, once /readyz has a topology
    python bench/gpu_check.py save URL FILE                  GET URL into FILE
    python bench/gpu_check.py sample URL DIR COUNT EVERY_S   /metrics' GPU series beside nvidia-smi --query-gpu
    python bench/gpu_check.py parity DIR                     the samples side by side; exit 1 if no GPU counter
    python bench/gpu_check.py http-costs URL OUT_JSON        GET /metrics and POST /place, timed
    python bench/gpu_check.py nvml-costs OUT_JSON            NVML calls and the agent's reads, timed

Standard library and topoagent only, but for ``load`` (torch) and ``nvml-costs`` (the NVML
binding the agent reads through).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.stats import percentile  # the nearest-rank p99 docs/benchmarks.md uses

# nvidia-smi's names beside the agent's families, and the factor from nvidia-smi's unit
# (with nounits) to the agent's.
QUERY = (
    ("utilization.gpu", "topoagent_gpu_utilization_ratio", 0.01),
    ("utilization.memory", "topoagent_gpu_memory_utilization_ratio", 0.01),
    ("memory.used", "topoagent_gpu_memory_used_bytes", 2**20),
    ("memory.reserved", "topoagent_gpu_memory_reserved_bytes", 2**20),
    ("memory.free", "topoagent_gpu_memory_free_bytes", 2**20),
    ("power.draw", "topoagent_gpu_power_watts", 1.0),
    ("enforced.power.limit", "topoagent_gpu_power_limit_watts", 1.0),
    ("temperature.gpu", "topoagent_gpu_temperature_celsius", 1.0),
    ("temperature.memory", "topoagent_gpu_memory_temperature_celsius", 1.0),
    ("clocks.sm", "topoagent_gpu_sm_clock_hertz", 1e6),
    ("clocks.mem", "topoagent_gpu_memory_clock_hertz", 1e6),
    ("clocks_event_reasons.active", "topoagent_gpu_clock_throttle_reasons", None),  # a hex mask
    ("pcie.link.gen.current", None, None),
)
GPU_FAMILY = re.compile(r"^(topoagent_(?:gpu|pcie|nvlink)_[a-z_]+)(\{[^}]*\})? (\S+)$")
NOT_COUNTERS = {"topoagent_gpu_info", "topoagent_gpu_busy"}  # from discovery and the leases, not the counters


def get(url: str, body: bytes | None = None, timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"} if body else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def load(seconds: float, started: Path) -> int:
    """Keep every GPU busy with bf16 matmuls for ``seconds``: the load the samples read."""
    import torch

    if not torch.cuda.is_available():
        print("load: torch sees no CUDA device", file=sys.stderr)
        return 1
    devices = [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    mats = [torch.randn(8192, 8192, device=d, dtype=torch.bfloat16) for d in devices]
    started.write_text(f"{len(devices)}\n")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for m in mats:
            for _ in range(8):
                torch.matmul(m, m)  # the work is the point
        for d in devices:
            torch.cuda.synchronize(d)
    return 0


def wait_ready(serve_out: Path, seconds: float) -> int:
    """Print the agent's URL (from the line ``topoagent serve`` prints) once GET /readyz
    says a topology is loaded: 200, or 503 naming its snapshot."""
    deadline = time.monotonic() + seconds
    said, base = "no answer", None
    while time.monotonic() < deadline:
        if base is None:
            found = re.search(r"on (http://[\d.]+:\d+)", serve_out.read_text() if serve_out.exists() else "")
            base = found.group(1) if found else None
        if base is not None:
            try:
                status, body = get(base + "/readyz", timeout=2)
            except OSError as exc:
                said = str(exc)
            else:
                said = f"{status} {body[:500].decode(errors='replace')}"
                if status == 200 or (status == 503 and b"snapshot_version" in body):
                    print(f"readyz: {said}", file=sys.stderr)
                    print(base)
                    return 0
        time.sleep(0.2)
    print(f"gpu_check: the agent did not load a topology within {seconds:g} s; /readyz said: {said}", file=sys.stderr)
    return 1


def save(url: str, out: Path) -> int:
    status, body = get(url)
    out.write_bytes(body)
    return 0 if status in (200, 503) else 1


def known_fields() -> list[str]:
    """The QUERY fields this driver's nvidia-smi answers: one it does not know (an older
    driver's `clocks_throttle_reasons`) fails the whole query, so each is asked alone once."""
    known = []
    for name, _family, _factor in QUERY:
        done = subprocess.run(["nvidia-smi", f"--query-gpu={name}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30)
        if done.returncode == 0:
            known.append(name)
    return known


def sample(base: str, out: Path, count: int, every: float) -> int:
    out.mkdir(parents=True, exist_ok=True)
    fields = ",".join(known_fields())
    with open(out / "nvidia-smi-query.csv", "w") as smi, open(out / "agent-metrics-samples.txt", "w") as agent:
        smi.write("index," + fields + "\n")
        for n in range(1, count + 1):
            done = subprocess.run(["nvidia-smi", f"--query-gpu=index,{fields}", "--format=csv,noheader,nounits"],
                                  capture_output=True, text=True, timeout=30)
            smi.write(done.stdout if done.returncode == 0 else f"# nvidia-smi exited {done.returncode}: {done.stderr.strip()}\n")
            status, page = get(base + "/metrics")
            agent.write(f"# sample {n} {time.time():.3f} status {status}\n")
            agent.writelines(line + "\n" for line in page.decode(errors="replace").splitlines()
                             if GPU_FAMILY.match(line) or line.startswith("topoagent_collector_success"))
            (out / "last-metrics.prom").write_bytes(page)
            if n < count:
                time.sleep(every)
    return 0


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    low, high = min(values), max(values)
    return f"{low:.6g}" if low == high else f"{low:.6g}..{high:.6g}"


def parity(out: Path) -> int:
    """Each GPU family the agent served, per GPU, beside nvidia-smi's reading of the same."""
    agent: dict[tuple[str, str], list[float]] = {}
    for line in (out / "agent-metrics-samples.txt").read_text().splitlines():
        match = GPU_FAMILY.match(line)
        if match:
            labels = match.group(2) or ""
            pairs = re.findall(r'(\w+)="([^"]*)"', labels)
            gpu = next((v for k, v in pairs if k == "gpu"), "-")
            # gpu_info's labels are its value; the others' are what tells series apart.
            rest = [f'{k}="{v}"' for k, v in pairs if k != "gpu" and match.group(1) != "topoagent_gpu_info"]
            family = match.group(1) + ("{" + ",".join(rest) + "}" if rest else "")
            agent.setdefault((family, gpu), []).append(float(match.group(3)))
    smi: dict[tuple[str, str], list[float]] = {}
    rows = (out / "nvidia-smi-query.csv").read_text().splitlines()
    names = rows[0].split(",")
    for row in rows[1:]:
        if row.startswith("#"):
            continue
        cells = [c.strip() for c in row.split(",")]
        for name, cell in zip(names[1:], cells[1:], strict=False):
            with contextlib.suppress(ValueError):  # [N/A], [Not Supported]
                smi.setdefault((name, cells[0]), []).append(int(cell, 16) if cell.startswith("0x") else float(cell))
    print(f"{'family (agent)':<58} {'gpu':>3}  {'agent':>24}  {'nvidia-smi':>24}  nvidia-smi field")
    shown = set()
    for field_name, family, factor in QUERY:
        gpus = sorted({g for (n, g) in smi if n == field_name} | {g for (n, g) in agent if n == family})
        for gpu in gpus:
            raw = smi.get((field_name, gpu), [])
            theirs = [v * factor for v in raw] if factor else raw
            ours = agent.get((family, gpu), []) if family else []
            shown.add((family, gpu))
            print(f"{family or '(not served)':<58} {gpu:>3}  {_spread(ours):>24}  {_spread(theirs):>24}  {field_name}")
    for (family, gpu), ours in sorted(agent.items()):
        if (family, gpu) not in shown:
            print(f"{family:<58} {gpu:>3}  {_spread(ours):>24}  {'':>24}  -")
    counters = {family.split("{")[0] for family, _ in agent} - NOT_COUNTERS
    if not counters:
        print("gpu_check: FAILED: /metrics carried no GPU counter family (NVML counters dead?); "
              "see topoagent_collector_success in agent-metrics-samples.txt", file=sys.stderr)
        return 1
    print(f"{len(counters)} GPU counter families served")
    return 0


def _timed(fn: Callable[[], Any], n: int) -> dict[str, Any]:
    times, error = [], None
    for _ in range(n):
        started = time.perf_counter()
        try:
            fn()
        except Exception as exc:  # recorded beside the figure: the check reports, it does not judge
            error = f"{type(exc).__name__}: {exc}"
        times.append((time.perf_counter() - started) * 1000)
    times.sort()
    figure: dict[str, Any] = {"n": n, "median_ms": round(statistics.median(times), 3),
                              "p99_ms": round(percentile(times, 0.99), 3), "max_ms": round(times[-1], 3)}
    if error:
        figure["error"] = error
    return figure


def http_costs(base: str, out: Path) -> int:
    def answered(url: str, body: bytes | None = None) -> None:
        status, text = get(url, body)
        # 409: it does not fit now (a GPU still counted busy): an answer all the same.  Any
        # other refusal is timed too, and said beside the figure.
        if status not in (200, 409):
            raise RuntimeError(f"{status} {text[:200].decode(errors='replace')}")

    figures = {
        "GET /metrics": _timed(lambda: answered(base + "/metrics"), 50),
        "POST /place gpus=1": _timed(lambda: answered(base + "/place", b'{"gpus": 1}'), 50),
    }
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 1 if any("error" in f for f in figures.values()) else 0


def nvml_costs(out: Path) -> int:
    """What NVML costs here: the binding's own calls, and the agent's reads through it."""
    import pynvml

    from topoagent.collectors.nvml import COUNTERS, LiveCounterReader
    from topoagent.node.discovery import discover
    from topoagent.node.host import Host
    from topoagent.service.telemetry import Context, read_live

    figures: dict[str, Any] = {}
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        figures["nvmlDeviceGetCount"] = _timed(pynvml.nvmlDeviceGetCount, 100)
        figures["nvmlDeviceGetPowerUsage"] = _timed(lambda: pynvml.nvmlDeviceGetPowerUsage(handle), 100)
        figures["nvmlDeviceGetUtilizationRates"] = _timed(lambda: pynvml.nvmlDeviceGetUtilizationRates(handle), 100)
        figures["nvmlDeviceGetMemoryInfo"] = _timed(lambda: pynvml.nvmlDeviceGetMemoryInfo(handle), 100)
        figures["nvmlDeviceGetTemperature"] = _timed(lambda: pynvml.nvmlDeviceGetTemperature(handle, pynvml.NVML_TEMPERATURE_GPU), 100)
        figures["nvmlDeviceGetClockInfo(SM)"] = _timed(lambda: pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM), 100)
    finally:
        pynvml.nvmlShutdown()
    with Host("/") as host:
        figures["discover (whole node, in process)"] = _timed(lambda: asyncio.run(discover(host)), 5)
        node = asyncio.run(discover(host))
        reader = LiveCounterReader()
        try:
            context = Context(host, node, reader)
            errors = []

            def counters() -> None:
                got = read_live(COUNTERS, context)
                if got.error:
                    errors.append(got.error)

            figures["agent counter read (nvml_counters)"] = _timed(counters, 100)
            if errors:
                figures["agent counter read (nvml_counters)"]["error"] = f"{len(errors)} of 100 failed; last: {errors[-1]}"
        finally:
            reader.close()
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 1 if any("error" in f for f in figures.values()) else 0


def main(argv: list[str]) -> int:
    match argv:
        case ["load", seconds, started]:
            return load(float(seconds), Path(started))
        case ["wait-ready", serve_out, seconds]:
            return wait_ready(Path(serve_out), float(seconds))
        case ["save", url, out]:
            return save(url, Path(out))
        case ["sample", url, out, count, every]:
            return sample(url, Path(out), int(count), float(every))
        case ["parity", out]:
            return parity(Path(out))
        case ["http-costs", url, out]:
            return http_costs(url, Path(out))
        case ["nvml-costs", out]:
            return nvml_costs(Path(out))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
