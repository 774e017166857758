"""The probe worker: the one process of topoagent that imports torch.

Run as ``python -m topoagent.probes.worker``.  It reads one JSON plan on stdin (see
``topoagent.probes.plan``), measures, and writes one JSON line per result on stdout
(result, skipped and failure lines are ``topoagent.probes.figures``' types, written with
their ``to_record()``, which the runner parses back):

    {"type": "hello", "backend": ..., "torch": ..., "devices": [...]}      first
    {"type": "result", "id": 3, "kind": "p2p", "src": 0, "dst": 1, "size_bytes": ...,
     "repetitions": 15, "warmup": 3, "loop": 8, "unit": "GB/s",
     "median": ..., "p10": ..., "p90": ..., "min": ..., "max": ..., "duration_s": ...}
    {"type": "skipped", "id": 4, "reason": "..."}       a measurement this node cannot do
    {"type": "failure", "failure": "oom" | "cuda_error" | "unavailable" | "plan_error"
     | "crash", "message": "..."}                       last line of a failed run
    {"type": "done", "results": N}                      last line of a good run

Exit codes: 0 done, 1 crash, 2 plan error, 3 out of memory, 4 CUDA error, 5 backend
unavailable (no torch, no CUDA).  The agent kills the worker when it overruns its timeout;
nothing here needs to be interruptible.

Method (compared with NVIDIA's tools; ideas, not code):

- **Copies, not kernels.**  Like nvbandwidth's ``*_memcpy_ce`` tests and
  p2pBandwidthLatencyTest, every figure times copies issued with ``Tensor.copy_`` (a
  ``cudaMemcpyPeerAsync``/``cudaMemcpyAsync`` on a copy engine).  Torch enables peer
  access between two GPUs when the driver allows it, so a pair without P2P falls back to
  a copy staged through host memory exactly as the NVIDIA tools' "P2P=Disabled" rows do;
  the ``peer_access`` result says which case a pair is in.
- **Hold the stream, then time with CUDA events.**  nvbandwidth blocks the stream with a
  spin kernel so that all copies of a sample are queued before the start event fires, and
  p2pBandwidthLatencyTest does the same with a delay kernel; we use
  ``torch.cuda._sleep`` for that, then record a start event, queue ``loop`` back-to-back
  copies, record an end event.  One such timed batch is one sample.
- **Warm-up and repetitions, reported as a median with its spread.**  ``warmup`` batches
  are run and thrown away (first-touch, peer mapping, clocks); ``repetitions`` samples
  are kept; we report the median (as nvbandwidth does across its samples) and p10/p90
  and min/max, so a noisy link shows as a wide spread rather than a wrong number.
- **Several sizes.**  Small copies show fixed costs, large ones the plateau; the agent
  takes the largest size as the link's figure.  Sizes default to 4, 64 and 256 MiB
  (nvbandwidth: 512 MiB; p2pBandwidthLatencyTest: 40 MB).
- **Both directions at once.**  ``p2p_bidir`` runs a→b on a's stream and b→a on b's
  stream together (p2pBandwidthLatencyTest's bidirectional matrix) and reports each
  direction separately.  All figures are **GB/s (10^9 B/s) per direction**.
- **Latency.**  ``latency_loop`` copies of ``latency_bytes`` (4 bytes, one int, like
  p2pBandwidthLatencyTest) behind a held stream; the figure is microseconds per copy.
- **Host↔device per NUMA node.**  Before allocating the host buffer the worker binds every
  one of its threads to that node's CPUs (``os.sched_setaffinity``), so Linux' first-touch
  policy places the pages on that node; the buffer is then page-locked
  (``cudaHostRegister``) — pinned memory as bandwidthTest/nvbandwidth use, and the only
  memory that gives copy-engine rates.  The affinity is restored afterwards.
- **On-device copy** (``local_copy``): copy rate of one GPU's memory onto itself, a
  health figure; the memory moves twice the bytes reported (read + write).
- **Memory is given back** after each measurement (``torch.cuda.empty_cache``), so a
  probe never keeps GPU memory a training job could need.

CPU backend: the same plan with CPU tensors.  Every device number maps to its own host
buffer; copies are real ``Tensor.copy_`` calls timed with ``time.perf_counter_ns``;
``p2p_bidir`` runs its two directions on two threads at once (torch drops the GIL inside
a copy); host buffers are bound per NUMA node exactly as on CUDA but not pinned.  Torch
runs one intra-op thread, so a copy is one stream of work like one copy engine.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Set
from pathlib import Path
from typing import Any, TypedDict

from topoagent.node.cpulist import parse_cpulist
from topoagent.probes.figures import (
    FailureKind,
    ProbeFigure,
    ProbeKind,
    ProbeSkip,
    RecordType,
    Unit,
    WorkerFailure,
)
from topoagent.probes.plan import PlanError, validate_plan

EXIT_OK, EXIT_CRASH, EXIT_PLAN, EXIT_OOM, EXIT_CUDA, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4, 5
# Spin long enough (GPU clock cycles, ~1-2 ms) for a batch of copies to be queued.
HOLD_CYCLES = 2_000_000
NODE_SYSFS = Path("/sys/devices/system/node")


class Skip(Exception):
    """A measurement this node cannot do (no such device, NUMA node without CPUs)."""


class BackendUnavailable(Exception):
    pass


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def node_cpus(node: int, sysfs: Path = NODE_SYSFS) -> frozenset[int]:
    try:
        text = (sysfs / f"node{node}" / "cpulist").read_text()
    except OSError:
        raise Skip(f"NUMA node {node} does not exist on this machine") from None
    cpus = parse_cpulist(text)
    if not cpus:
        raise Skip(f"NUMA node {node} has no CPUs (memory-only node)")
    return cpus


def set_process_affinity(cpus: Set[int]) -> None:
    """Bind every thread of this process, not just the caller (torch keeps a pool)."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):  # the thread ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def set_process_affinity_quietly(cpus: Set[int]) -> None:
    with contextlib.suppress(PermissionError):
        set_process_affinity(cpus)


class bound_to_node:
    def __init__(self, node: int):
        self.cpus = node_cpus(node)
        self.saved: set[int] = set()

    def __enter__(self) -> None:
        self.saved = os.sched_getaffinity(0)
        allowed = self.cpus & self.saved
        if not allowed:
            raise Skip("this worker may not run on that NUMA node's CPUs (its cpuset excludes them)")
        try:
            set_process_affinity(allowed)
        except PermissionError:  # a seccomp filter (systemd's @resources) or a locked cpuset
            set_process_affinity_quietly(self.saved)
            raise Skip("binding to that NUMA node's CPUs is not permitted here (sched_setaffinity refused)") from None

    def __exit__(self, *exc: object) -> None:
        set_process_affinity(self.saved)


class Spread(TypedDict):
    """A figure's median and spread, by ProbeFigure's field names."""

    median: float
    p10: float
    p90: float
    minimum: float
    maximum: float


def summarize(samples: list[float]) -> Spread:
    ordered = sorted(samples)
    if len(ordered) >= 2:
        deciles = statistics.quantiles(ordered, n=10, method="inclusive")
        p10, p90 = deciles[0], deciles[-1]
    else:
        p10 = p90 = ordered[0]
    return {
        "median": round(statistics.median(ordered), 4),
        "p10": round(p10, 4),
        "p90": round(p90, 4),
        "minimum": round(ordered[0], 4),
        "maximum": round(ordered[-1], 4),
    }


class Backend:
    """What differs between CUDA and CPU: where buffers live and how a batch is timed."""

    name = ""

    def __init__(self, torch: Any):
        self.torch = torch

    def describe(self) -> list[dict[str, Any]]:
        raise NotImplementedError

    def check_device(self, device: int) -> None:
        raise NotImplementedError

    def buffer(self, device: int, nbytes: int) -> Any:
        raise NotImplementedError

    def host_buffer(self, nbytes: int) -> Any:
        raise NotImplementedError

    def release_host(self, tensor: Any) -> None:
        pass

    def peer_access(self, src: int, dst: int) -> bool:
        raise NotImplementedError

    def time_batches(self, batches: list[tuple[int, Callable[[], None], int]]) -> list[float]:
        """Run each (device, copy, count) batch concurrently; seconds each took."""
        raise NotImplementedError

    def release(self) -> None:
        pass


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, torch: Any):
        super().__init__(torch)
        if not torch.cuda.is_available():
            raise BackendUnavailable("torch sees no CUDA device (driver missing or CPU build)")
        self.count = torch.cuda.device_count()

    def describe(self) -> list[dict[str, Any]]:
        out = []
        for i in range(self.count):
            props = self.torch.cuda.get_device_properties(i)
            bus = getattr(props, "pci_bus_id", None)
            domain = getattr(props, "pci_domain_id", 0)
            dev = getattr(props, "pci_device_id", 0)
            out.append(
                {
                    "index": i,
                    "name": props.name,
                    "memory_bytes": props.total_memory,
                    "pci_address": f"{domain:04x}:{bus:02x}:{dev:02x}.0" if bus is not None else None,
                }
            )
        return out

    def check_device(self, device: int) -> None:
        if device >= self.count:
            raise Skip(f"no CUDA device {device} (this node has {self.count})")

    def buffer(self, device: int, nbytes: int) -> Any:
        t = self.torch.empty(nbytes, dtype=self.torch.uint8, device=f"cuda:{device}")
        t.fill_(1)
        return t

    def host_buffer(self, nbytes: int) -> Any:
        # Allocate and touch under the NUMA binding, then page-lock in place: the pages
        # stay on the bound node (torch's pinned caching allocator could hand back a
        # block first touched while bound to another node).
        t = self.torch.empty(nbytes, dtype=self.torch.uint8)
        t.fill_(1)
        cudart = self.torch.cuda.cudart()
        rc = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"CUDA error: cudaHostRegister failed ({rc})")
        return t

    def release_host(self, tensor: Any) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.cudart().cudaHostUnregister(tensor.data_ptr())

    def peer_access(self, src: int, dst: int) -> bool:
        return bool(self.torch.cuda.can_device_access_peer(src, dst))

    def time_batches(self, batches: list[tuple[int, Callable[[], None], int]]) -> list[float]:
        torch = self.torch
        events = []
        for device, _, _ in batches:
            with torch.cuda.device(device):
                torch.cuda._sleep(HOLD_CYCLES)  # hold the stream while we queue
        for device, copy, count in batches:
            with torch.cuda.device(device):
                stream = torch.cuda.current_stream(device)
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record(stream)
                for _ in range(count):
                    copy()
                end.record(stream)
                events.append((start, end))
        out = []
        for start, end in events:
            end.synchronize()
            out.append(start.elapsed_time(end) / 1e3)
        return out

    def release(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()


class CpuBackend(Backend):
    name = "cpu"

    def __init__(self, torch: Any):
        super().__init__(torch)
        torch.set_num_threads(1)

    def describe(self) -> list[dict[str, Any]]:
        return [{"index": None, "name": "host memory buffers standing in for GPUs"}]

    def check_device(self, device: int) -> None:
        pass

    def buffer(self, device: int, nbytes: int) -> Any:
        t = self.torch.empty(nbytes, dtype=self.torch.uint8)
        t.fill_(1)
        return t

    def host_buffer(self, nbytes: int) -> Any:
        return self.buffer(-1, nbytes)

    def peer_access(self, src: int, dst: int) -> bool:
        return True  # every stand-in buffer is in the one host memory

    def time_batches(self, batches: list[tuple[int, Callable[[], None], int]]) -> list[float]:
        if len(batches) == 1:
            _, copy, count = batches[0]
            t0 = time.perf_counter_ns()
            for _ in range(count):
                copy()
            return [(time.perf_counter_ns() - t0) / 1e9]
        barrier = threading.Barrier(len(batches))
        took = [0.0] * len(batches)

        def run(slot: int, copy: Callable[[], None], count: int) -> None:
            barrier.wait()
            t0 = time.perf_counter_ns()
            for _ in range(count):
                copy()
            took[slot] = (time.perf_counter_ns() - t0) / 1e9

        threads = [
            threading.Thread(target=run, args=(slot, copy, count))
            for slot, (_, copy, count) in enumerate(batches)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return took


class Prober:
    def __init__(self, backend: Backend, plan: dict[str, Any]):
        self.backend = backend
        self.plan = plan

    def setting(self, m: dict[str, Any], key: str) -> Any:
        return m.get(key, self.plan[key])

    def sample(
        self, batches: list[tuple[int, Callable[[], None], int]], warmup: int, repetitions: int
    ) -> list[list[float]]:
        for _ in range(warmup):
            self.backend.time_batches(batches)
        per_batch: list[list[float]] = [[] for _ in batches]
        for _ in range(repetitions):
            for slot, seconds in enumerate(self.backend.time_batches(batches)):
                per_batch[slot].append(seconds)
        return per_batch

    def bandwidth_record(
        self, m: dict[str, Any], size: int, seconds: list[float], loop: int, started: float, **extra: Any
    ) -> ProbeFigure:
        gbps = [size * loop / s / 1e9 for s in seconds if s > 0]
        if not gbps:
            raise RuntimeError("timer returned zero for every sample")
        return ProbeFigure(
            measurement_id=m["id"],
            kind=ProbeKind(m["kind"]),
            **extra,
            size_bytes=size,
            repetitions=len(seconds),
            warmup=self.setting(m, "warmup"),
            loop=loop,
            unit=Unit.GBPS,
            **summarize(gbps),
            duration_s=round(time.perf_counter() - started, 6),
            backend=self.backend.name,
        )

    def run(self, m: dict[str, Any]) -> Iterator[ProbeFigure]:
        kind = ProbeKind(m["kind"])
        for key in ("src", "dst", "device"):
            if key in m:
                self.backend.check_device(m[key])
        try:
            if kind is ProbeKind.PEER_ACCESS:
                yield ProbeFigure(
                    measurement_id=m["id"],
                    kind=kind,
                    src=m["src"],
                    dst=m["dst"],
                    available=self.backend.peer_access(m["src"], m["dst"]),
                    backend=self.backend.name,
                )
            elif kind is ProbeKind.LATENCY:
                yield self.latency(m)
            elif kind.is_host:
                with bound_to_node(m["numa_node"]):
                    yield from self.host(m)
            else:
                yield from self.copies(m)
        finally:
            self.backend.release()

    def copies(self, m: dict[str, Any]) -> Iterator[ProbeFigure]:
        kind = ProbeKind(m["kind"])
        sizes = self.setting(m, "sizes_bytes")
        biggest = max(sizes)
        loop = self.setting(m, "loop")
        warmup, reps = self.setting(m, "warmup"), self.setting(m, "repetitions")
        if kind is ProbeKind.LOCAL_COPY:
            a = self.backend.buffer(m["device"], biggest)
            b = self.backend.buffer(m["device"], biggest)
        else:
            a = self.backend.buffer(m["src"], biggest)
            b = self.backend.buffer(m["dst"], biggest)
        if kind is ProbeKind.P2P_BIDIR:
            # The way back has its own pair of buffers, so the two directions never
            # read or write the same memory.
            c = self.backend.buffer(m["dst"], biggest)
            d = self.backend.buffer(m["src"], biggest)
        for size in sizes:
            started = time.perf_counter()
            sa, sb = a[:size], b[:size]
            if kind is ProbeKind.LOCAL_COPY:
                (took,) = self.sample([(m["device"], lambda: sb.copy_(sa, non_blocking=True), loop)], warmup, reps)
                yield self.bandwidth_record(m, size, took, loop, started, device=m["device"], direction=f"{m['device']}")
            elif kind is ProbeKind.P2P:
                # Torch issues a cross-device copy on the source device's stream.
                (took,) = self.sample([(m["src"], lambda: sb.copy_(sa, non_blocking=True), loop)], warmup, reps)
                yield self.bandwidth_record(
                    m, size, took, loop, started, src=m["src"], dst=m["dst"], direction=f"{m['src']}->{m['dst']}"
                )
            else:  # p2p_bidir: both directions at once, each on its source's stream
                back_src, back_dst = c[:size], d[:size]
                forward, backward = self.sample(
                    [
                        (m["src"], lambda: sb.copy_(sa, non_blocking=True), loop),
                        (m["dst"], lambda: back_dst.copy_(back_src, non_blocking=True), loop),
                    ],
                    warmup,
                    reps,
                )
                yield self.bandwidth_record(
                    m, size, forward, loop, started, src=m["src"], dst=m["dst"],
                    direction=f"{m['src']}->{m['dst']}", concurrent=True,
                )
                yield self.bandwidth_record(
                    m, size, backward, loop, started, src=m["dst"], dst=m["src"],
                    direction=f"{m['dst']}->{m['src']}", concurrent=True,
                )

    def host(self, m: dict[str, Any]) -> Iterator[ProbeFigure]:
        sizes = self.setting(m, "sizes_bytes")
        biggest = max(sizes)
        loop = self.setting(m, "loop")
        warmup, reps = self.setting(m, "warmup"), self.setting(m, "repetitions")
        device, node = m["device"], m["numa_node"]
        dev = self.backend.buffer(device, biggest)
        host = self.backend.host_buffer(biggest)
        try:
            for size in sizes:
                started = time.perf_counter()
                sd, sh = dev[:size], host[:size]
                if m["kind"] == ProbeKind.H2D:
                    copy, direction = (lambda: sd.copy_(sh, non_blocking=True)), f"node{node}->{device}"
                else:
                    copy, direction = (lambda: sh.copy_(sd, non_blocking=True)), f"{device}->node{node}"
                (took,) = self.sample([(device, copy, loop)], warmup, reps)
                yield self.bandwidth_record(
                    m, size, took, loop, started, device=device, numa_node=node, direction=direction
                )
        finally:
            self.backend.release_host(host)

    def latency(self, m: dict[str, Any]) -> ProbeFigure:
        size = self.plan["latency_bytes"]
        loop = self.plan["latency_loop"]
        a = self.backend.buffer(m["src"], size)
        b = self.backend.buffer(m["dst"], size)
        started = time.perf_counter()
        (took,) = self.sample(
            [(m["src"], lambda: b.copy_(a, non_blocking=True), loop)],
            self.setting(m, "warmup"),
            self.setting(m, "repetitions"),
        )
        micros = [s / loop * 1e6 for s in took]
        return ProbeFigure(
            measurement_id=m["id"],
            kind=ProbeKind.LATENCY,
            src=m["src"],
            dst=m["dst"],
            direction=f"{m['src']}->{m['dst']}",
            size_bytes=size,
            repetitions=len(took),
            warmup=self.setting(m, "warmup"),
            loop=loop,
            unit=Unit.MICROSECONDS,
            **summarize(micros),
            duration_s=round(time.perf_counter() - started, 6),
            backend=self.backend.name,
        )


def classify(exc: BaseException, torch: Any | None) -> tuple[FailureKind, int]:
    """Map an exception from torch to a failure kind the agent understands."""
    text = str(exc)
    oom_types = tuple(
        t for t in (getattr(torch, "OutOfMemoryError", None),) if isinstance(t, type)
    )
    if isinstance(exc, MemoryError) or (oom_types and isinstance(exc, oom_types)):
        return FailureKind.OOM, EXIT_OOM
    if "out of memory" in text or "can't allocate memory" in text:
        return FailureKind.OOM, EXIT_OOM
    accel = getattr(torch, "AcceleratorError", None)
    if (isinstance(accel, type) and isinstance(exc, accel)) or "CUDA error" in text or "CUDA driver" in text:
        return FailureKind.CUDA_ERROR, EXIT_CUDA
    return FailureKind.CRASH, EXIT_CRASH


def fail(kind: FailureKind, message: str, code: int) -> int:
    emit(WorkerFailure(kind, message[:2000]).to_record())
    return code


def load_torch(backend: str) -> Any:
    # CUDA numbers GPUs fastest-first by default; PCI order matches nvidia-smi and NVML.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    warnings.filterwarnings("ignore", message=".*NumPy.*")
    try:
        import torch
    except ImportError as exc:
        raise BackendUnavailable(f"torch is not installed in {sys.executable}: {exc}") from None
    return torch


def main() -> int:
    try:
        plan = json.loads(sys.stdin.read())
        validate_plan(plan)
    except (ValueError, PlanError) as exc:
        return fail(FailureKind.PLAN_ERROR, f"bad plan: {exc}", EXIT_PLAN)
    torch = None
    try:
        torch = load_torch(plan["backend"])
        backend: Backend = CudaBackend(torch) if plan["backend"] == "cuda" else CpuBackend(torch)
        emit(
            {
                "type": RecordType.HELLO.value,
                "backend": backend.name,
                "torch": torch.__version__,
                "pid": os.getpid(),
                "devices": backend.describe(),
            }
        )
        prober = Prober(backend, plan)
        count = 0
        for m in plan["measurements"]:
            try:
                for record in prober.run(m):
                    emit(record.to_record())
                    count += 1
            except Skip as exc:
                emit(ProbeSkip(measurement_id=m["id"], kind=ProbeKind(m["kind"]), reason=str(exc)).to_record())
        emit({"type": RecordType.DONE.value, "results": count})
        return EXIT_OK
    except BackendUnavailable as exc:
        return fail(FailureKind.UNAVAILABLE, str(exc), EXIT_UNAVAILABLE)
    except BrokenPipeError:
        return EXIT_CRASH  # the agent went away; nobody to tell
    except Exception as exc:
        kind, code = classify(exc, torch)
        detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return fail(kind, detail, code)


if __name__ == "__main__":
    sys.exit(main())
