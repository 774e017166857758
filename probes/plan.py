"""Probe plans: what the worker is asked to measure, as plain JSON-ready values.

The agent builds a plan, sends it to the worker on stdin, and reads one JSON line per
result back.  Nothing here imports torch; the worker validates the same shape with
``validate_plan`` so a bad plan fails the same way on both sides.

Plan (JSON object)::

    {"schema": 1, "backend": "cpu" | "cuda",
     "sizes_bytes": [...], "warmup": 2, "repetitions": 10, "loop": 4,
     "latency_bytes": 4, "latency_loop": 50,
     "measurements": [
        {"id": 0, "kind": "peer_access", "src": 0, "dst": 1},
        {"id": 1, "kind": "p2p", "src": 0, "dst": 1},              # one direction
        {"id": 2, "kind": "p2p_bidir", "src": 0, "dst": 1},        # both at once
        {"id": 3, "kind": "latency", "src": 0, "dst": 1},
        {"id": 4, "kind": "h2d", "device": 0, "numa_node": 0},
        {"id": 5, "kind": "d2h", "device": 0, "numa_node": 0},
        {"id": 6, "kind": "local_copy", "device": 0}]}

Any measurement may override ``sizes_bytes``, ``warmup``, ``repetitions`` and ``loop``.
Device numbers are GPU indices in PCI bus order (the worker sets
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA's numbering matches nvidia-smi's and NVML's).
On the CPU backend each device number names a separate host buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 1
BACKENDS = ("cpu", "cuda")
PAIR_KINDS = ("peer_access", "p2p", "p2p_bidir", "latency")
DEVICE_KINDS = ("local_copy",)
HOST_KINDS = ("h2d", "d2h")
KINDS = PAIR_KINDS + DEVICE_KINDS + HOST_KINDS

MiB = 1 << 20

# The most measurements one plan may hold.  A full round grows with the square of the
# GPU count (7 per unordered pair) and every measurement costs the worker copies and the
# agent a dict; 20 000 covers a full round of 64 GPUs with 8 NUMA nodes (15 200) and
# refuses a typo such as 5000 GPUs (87 million measurements, tens of GB) before any
# of it is built.
MAX_PLAN_MEASUREMENTS = 20_000


@dataclass(frozen=True, slots=True)
class PlanDefaults:
    """Sizes and counts for one backend.

    CUDA: several sizes from copy-engine ramp-up to plateau (nvbandwidth's default buffer
    is 512 MiB; p2pBandwidthLatencyTest copies 40 MB); 256 MiB at 450 GB/s still takes
    0.6 ms per copy, long enough for CUDA events (0.5 us resolution) to time precisely.
    CPU: small sizes, so a whole round on the stand-in backend takes well under a second.
    """

    sizes_bytes: tuple[int, ...]
    warmup: int
    repetitions: int
    loop: int
    latency_bytes: int = 4
    latency_loop: int = 50


DEFAULTS: dict[str, PlanDefaults] = {
    "cuda": PlanDefaults(sizes_bytes=(4 * MiB, 64 * MiB, 256 * MiB), warmup=3, repetitions=15, loop=8),
    "cpu": PlanDefaults(sizes_bytes=(256 * 1024, 4 * MiB), warmup=1, repetitions=7, loop=2),
}


class PlanError(ValueError):
    """A plan the worker cannot run (unknown kind, missing field, bad number)."""


def build_round_plan(
    backend: str,
    gpus: Iterable[int],
    numa_nodes: Iterable[int] = (),
    *,
    pairs: Iterable[tuple[int, int]] | None = None,
    per_gpu: bool = True,
    defaults: PlanDefaults | None = None,
) -> dict[str, Any]:
    """A full round: every ordered pair, both-at-once per unordered pair, and per GPU
    its on-device copy and host<->device from each NUMA node.

    ``pairs`` limits the pair measurements (unordered pairs); default: all of them.
    ``per_gpu=False`` leaves out the per-GPU measurements.
    """
    if backend not in BACKENDS:
        raise PlanError(f"backend must be one of {', '.join(BACKENDS)}, not {backend!r}")
    devices = sorted(set(gpus))
    nodes = sorted(set(numa_nodes))
    if pairs is not None:
        unordered = sorted({(min(a, b), max(a, b)) for a, b in pairs if a != b})
        pair_count = len(unordered)
    else:
        pair_count = len(devices) * (len(devices) - 1) // 2
    # Counted before anything is built: an oversized plan must not cost memory first.
    count = 7 * pair_count + (len(devices) * (1 + 2 * len(nodes)) if per_gpu else 0)
    if count > MAX_PLAN_MEASUREMENTS:
        raise PlanError(
            f"a round over {len(devices)} GPUs would hold {count} measurements, "
            f"more than the limit of {MAX_PLAN_MEASUREMENTS}"
        )
    if pairs is None:
        unordered = [(a, b) for i, a in enumerate(devices) for b in devices[i + 1 :]]
    measurements: list[dict[str, Any]] = []

    def add(kind: str, **fields: Any) -> None:
        measurements.append({"id": len(measurements), "kind": kind, **fields})

    for a, b in unordered:
        add("peer_access", src=a, dst=b)
        add("peer_access", src=b, dst=a)
        add("p2p", src=a, dst=b)
        add("p2p", src=b, dst=a)
        add("p2p_bidir", src=a, dst=b)
        add("latency", src=a, dst=b)
        add("latency", src=b, dst=a)
    for device in devices if per_gpu else ():
        add("local_copy", device=device)
        for node in nodes:
            add("h2d", device=device, numa_node=node)
            add("d2h", device=device, numa_node=node)
    return plan_with(backend, measurements, defaults)


def plan_for_target(
    gpus: tuple[int, ...], backend: str, numa_nodes: Iterable[int] = (), defaults: PlanDefaults | None = None
) -> dict[str, Any]:
    """The plan for one scheduled target: a pair (P2P both ways, latency) or one GPU."""
    if len(gpus) == 2:
        return build_round_plan(backend, gpus, pairs=[(gpus[0], gpus[1])], per_gpu=False, defaults=defaults)
    if len(gpus) == 1:
        return build_round_plan(backend, gpus, numa_nodes, pairs=[], defaults=defaults)
    raise PlanError(f"a target is one GPU or a pair, not {len(gpus)}")


def numa_nodes_with_cpus(root: Path = Path("/")) -> list[int]:
    """NUMA nodes of this machine that have CPUs (host buffers can be bound there)."""
    node_dir = root / "sys/devices/system/node"
    try:
        text = (node_dir / "has_cpu").read_text().strip()
    except OSError:
        return [0]  # no NUMA in sysfs: one node
    nodes: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-", 1)
            nodes.extend(range(int(lo), int(hi) + 1))
        elif part:
            nodes.append(int(part))
    return nodes or [0]


def plan_with(
    backend: str, measurements: list[dict[str, Any]], defaults: PlanDefaults | None = None
) -> dict[str, Any]:
    d = defaults or DEFAULTS[backend]
    plan = {
        "schema": SCHEMA,
        "backend": backend,
        "sizes_bytes": list(d.sizes_bytes),
        "warmup": d.warmup,
        "repetitions": d.repetitions,
        "loop": d.loop,
        "latency_bytes": d.latency_bytes,
        "latency_loop": d.latency_loop,
        "measurements": measurements,
    }
    validate_plan(plan)
    return plan


def _positive_int(value: Any, what: str, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlanError(f"{what} must be an integer >= {minimum}, not {value!r}")
    return value


def validate_plan(plan: Any) -> None:
    """Raise PlanError naming the first thing wrong with ``plan``."""
    if not isinstance(plan, Mapping):
        raise PlanError("a plan is a JSON object")
    if plan.get("schema") != SCHEMA:
        raise PlanError(f"plan schema must be {SCHEMA}, not {plan.get('schema')!r}")
    if plan.get("backend") not in BACKENDS:
        raise PlanError(f"backend must be one of {', '.join(BACKENDS)}, not {plan.get('backend')!r}")
    for key in ("warmup",):
        _positive_int(plan.get(key), key, minimum=0)
    for key in ("repetitions", "loop", "latency_bytes", "latency_loop"):
        _positive_int(plan.get(key), key)
    sizes = plan.get("sizes_bytes")
    if not isinstance(sizes, list) or not sizes:
        raise PlanError("sizes_bytes must be a non-empty list")
    for size in sizes:
        _positive_int(size, "each size in sizes_bytes")
    measurements = plan.get("measurements")
    if not isinstance(measurements, list):
        raise PlanError("measurements must be a list")
    if len(measurements) > MAX_PLAN_MEASUREMENTS:
        raise PlanError(f"{len(measurements)} measurements are more than the limit of {MAX_PLAN_MEASUREMENTS}")
    seen: set[int] = set()
    for n, m in enumerate(measurements):
        where = f"measurement {n}"
        if not isinstance(m, Mapping):
            raise PlanError(f"{where} is not an object")
        ident = _positive_int(m.get("id"), f"{where}: id", minimum=0)
        if ident in seen:
            raise PlanError(f"{where}: id {ident} is used twice")
        seen.add(ident)
        kind = m.get("kind")
        if kind not in KINDS:
            raise PlanError(f"{where}: kind must be one of {', '.join(KINDS)}, not {kind!r}")
        if kind in PAIR_KINDS:
            src = _positive_int(m.get("src"), f"{where}: src", minimum=0)
            dst = _positive_int(m.get("dst"), f"{where}: dst", minimum=0)
            if src == dst:
                raise PlanError(f"{where}: {kind} needs two different devices")
        else:
            _positive_int(m.get("device"), f"{where}: device", minimum=0)
        if kind in HOST_KINDS:
            _positive_int(m.get("numa_node"), f"{where}: numa_node", minimum=0)
        if "sizes_bytes" in m:
            if not isinstance(m["sizes_bytes"], list) or not m["sizes_bytes"]:
                raise PlanError(f"{where}: sizes_bytes must be a non-empty list")
            for size in m["sizes_bytes"]:
                _positive_int(size, f"{where}: each size")
        for key in ("repetitions", "loop"):
            if key in m:
                _positive_int(m[key], f"{where}: {key}")
        if "warmup" in m:
            _positive_int(m["warmup"], f"{where}: warmup", minimum=0)


def expected_result_count(plan: Mapping[str, Any]) -> int:
    """How many result lines a plan yields (for a progress bar)."""
    total = 0
    for m in plan["measurements"]:
        kind = m["kind"]
        sizes = len(m.get("sizes_bytes", plan["sizes_bytes"]))
        if kind in ("peer_access", "latency"):
            total += 1
        elif kind == "p2p_bidir":
            total += 2 * sizes  # one figure per direction per size
        else:
            total += sizes
    return total
