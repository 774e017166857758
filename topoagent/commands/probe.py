"""`topoagent probe`: run one round of link measurements and print the figures.

The measuring happens in a child process (``topoagent.probes.worker``, the only one that
imports torch); this command builds the plan, shows progress on stderr, overlays the
figures on the matrix and reports findings.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import TextIO

from topoagent.commands.sources import matrix_from_nvidia_smi, matrix_from_root
from topoagent.documents import print_document
from topoagent.documents.agent import ProbedGpu, ProbedNode, ProbePairView, probe_round_document
from topoagent.errors import UsageError
from topoagent.node.matrix import DistanceMatrix
from topoagent.node.model import Finding
from topoagent.probes.figures import ProbeFigure, ProbeKind, ProbeSkip
from topoagent.probes.overlay import findings_for, overlay
from topoagent.probes.plan import PlanError, build_round_plan, expected_result_count, numa_nodes_with_cpus
from topoagent.probes.runner import ProbeRound, run_probe_round, torch_missing

CPU_STAND_INS = 2  # devices the CPU backend measures when no topology names any
# The largest --gpus accepted.  The biggest single hosts ship 16 GPUs (DGX-2, HGX-2; an
# NVL72 rack is 4 GPUs per host), so 64 is 4x headroom; a full round over 64 GPUs is
# 14 000 measurements, while a typo such as 5000 would ask for 87 million.
MAX_GPUS = 64


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "probe",
        help="measure GPU links (P2P, latency, host per NUMA node) in a child process",
        description=(
            "Run one round of bandwidth probes in a child process and print each figure "
            "(median and spread, GB/s per direction), the matrix with measurements "
            "overlaid, and findings (degraded links, levels the figures contradict). "
            "The cpu backend runs the same plan on host memory, for testing without a GPU; "
            f"with no --root, --from-nvidia-smi or --gpus it measures {CPU_STAND_INS} stand-in devices "
            "(devices 0 and 1, buffers in host memory). Needs torch: pip install '.[probes]'."
        ),
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--root", metavar="DIR", help="discover the node at DIR ('/' = this node)")
    source.add_argument(
        "--from-nvidia-smi",
        metavar="FILE",
        help="take GPUs and declared levels from `nvidia-smi topo -m` output (- for stdin)",
    )
    source.add_argument("--gpus", type=int, metavar="N", help=f"probe GPUs 0..N-1 with no declared topology (N <= {MAX_GPUS})")
    parser.add_argument(
        "--backend", choices=("cuda", "cpu"), default="cuda",
        help=f"default: cuda; cpu copies host memory, and with no target probes {CPU_STAND_INS} stand-in GPUs",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help=(
            "limit for the whole round, counted from the start of the command: planning, "
            "worker start-up (importing torch) and every measurement; the worker is killed "
            "when it runs out and the figures so far are printed (default: 600)"
        ),
    )
    parser.add_argument("--json", action="store_true", help="print JSON")
    progress = parser.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None, help="always show progress")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="never show progress")
    parser.set_defaults(run=run)


def choose_devices(args: argparse.Namespace) -> tuple[DistanceMatrix | None, list[int]]:
    if args.root:
        matrix = matrix_from_root(args.root)
        return matrix, [g.index for g in matrix.gpus]
    if args.from_nvidia_smi:
        matrix = matrix_from_nvidia_smi(args.from_nvidia_smi)
        if not matrix.gpus:
            raise UsageError(f"{args.from_nvidia_smi}: no GPUs in the matrix")
        return matrix, [g.index for g in matrix.gpus]
    if args.gpus is not None:
        if args.gpus < 1:
            raise UsageError("--gpus needs at least 1")
        if args.gpus > MAX_GPUS:
            raise UsageError(f"--gpus {args.gpus}: at most {MAX_GPUS} (the largest nodes hold 16 GPUs)")
        return None, list(range(args.gpus))
    if args.backend == "cpu":
        return None, list(range(CPU_STAND_INS))
    raise UsageError("say which GPUs to probe: --root DIR, --from-nvidia-smi FILE or --gpus N")


class ProgressBar:
    """Text progress on stderr: redrawn in place on a terminal, one line each otherwise."""

    WIDTH = 24

    def __init__(self, total: int, stream: TextIO, enabled: bool):
        self.total = max(total, 1)
        self.done = 0
        self.stream = stream
        self.enabled = enabled
        self.inline = enabled and stream.isatty()

    def update(self, record: ProbeFigure | ProbeSkip) -> None:
        skipped = isinstance(record, ProbeSkip)
        self.done += 2 if skipped and record.kind is ProbeKind.P2P_BIDIR else 1
        if not self.enabled:
            return
        filled = min(self.WIDTH, self.WIDTH * self.done // self.total)
        if isinstance(record, ProbeSkip):
            what = f"{record.kind} (skipped)"
        else:
            what = f"{record.kind} {record.direction or ''}".strip()
            if record.size_bytes:
                what += f" {human_size(record.size_bytes)}"
        line = f"probe [{'#' * filled}{'.' * (self.WIDTH - filled)}] {min(self.done, self.total)}/{self.total} {what}"
        if self.inline:
            self.stream.write("\r\033[K" + line)
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.inline:
            self.stream.write("\n")
            self.stream.flush()


def human_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def pair_rows(matrix: DistanceMatrix) -> list[ProbePairView]:
    rows = []
    for a_pos in range(matrix.size):
        for b_pos in range(a_pos + 1, matrix.size):
            m = matrix.measured.get((a_pos, b_pos))
            rows.append(ProbePairView(
                matrix.gpus[a_pos].name, matrix.gpus[b_pos].name, matrix.level(a_pos, b_pos),
                matrix.gpu_expected_gbps[a_pos][b_pos], m.gbps if m else None, matrix.bandwidth(a_pos, b_pos),
            ))
    return rows


def render_text(probe_round: ProbeRound, matrix: DistanceMatrix | None, findings: list[Finding], out: TextIO) -> None:
    worker = probe_round.worker or {}
    out.write(
        f"backend {probe_round.backend} (torch {worker.get('torch', '?')}): "
        f"{len(probe_round.results)} results in {probe_round.duration_s:.1f} s\n\n"
    )
    out.write(f"{'measurement':<12} {'direction':<14} {'size':>9} {'median':>10} {'p10..p90':>19} {'reps':>5}\n")
    for r in probe_round.results:
        if r.median is None:
            continue
        spread = f"{r.p10:.2f}..{r.p90:.2f}" if r.p10 is not None and r.p90 is not None else "-"
        size = human_size(r.size_bytes) if r.size_bytes is not None else "-"
        reps = r.repetitions if r.repetitions is not None else "-"
        out.write(
            f"{r.kind:<12} {r.direction or '':<14} {size:>9} "
            f"{r.median:>10.2f} {spread:>19} {reps:>5} {r.unit or ''}\n"
        )
    peers = [r for r in probe_round.results if r.kind is ProbeKind.PEER_ACCESS]
    if peers:
        out.write("\npeer access: " + ", ".join(f"{r.src}->{r.dst} {'yes' if r.available else 'no'}" for r in peers) + "\n")
    for s in probe_round.skipped:
        out.write(f"skipped {s.kind} #{s.measurement_id}: {s.reason}\n")
    if matrix is not None:
        out.write(f"\n{'pair':<14} {'level':<6} {'expected':>9} {'measured':>9}  GB/s per direction\n")
        for row in pair_rows(matrix):
            measured = "-" if row.measured_gbps is None else f"{row.measured_gbps:.2f}"
            expected = "-" if row.expected_gbps is None else f"{row.expected_gbps:.2f}"
            out.write(f"{row.a + '-' + row.b:<14} {row.level!s:<6} {expected:>9} {measured:>9}\n")
    if findings:
        out.write("\nfindings:\n")
        for f in findings:
            out.write(f"  {f.severity:<8} {f.kind}: {f.message}\n")


def probed_node(args: argparse.Namespace, matrix: DistanceMatrix | None, probe_round: ProbeRound) -> ProbedNode:
    """The node the figures are of: the target's GPUs (as discovered, or as the text names
    them), or with no target the worker's devices here (the cpu backend's stand-ins are
    no GPU); its name from the recording, else this host's when the target is this host."""
    if matrix is not None:
        gpus = tuple(ProbedGpu(g.index, g.uuid, g.pci_address) for g in matrix.gpus)
    elif args.backend == "cuda":
        devices = (probe_round.worker or {}).get("devices") or []
        gpus = tuple(
            ProbedGpu(d["index"], None, d.get("pci_address"))
            for d in devices if isinstance(d, dict) and isinstance(d.get("index"), int)
        )
    else:
        gpus = ()
    hostname = matrix.host.hostname if matrix is not None and matrix.host is not None else None
    if hostname is None and (args.root in (None, "/")) and (args.from_nvidia_smi is None or args.backend == "cuda"):
        from topoagent.node.host import Host

        hostname = Host("/").hostname()
    return ProbedNode(hostname, gpus)


def run(args: argparse.Namespace) -> int:
    started = time.monotonic()  # --timeout covers the whole round, planning included
    if args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    matrix, gpus = choose_devices(args)
    if (missing := torch_missing()) is not None:
        # Before any output: a round without torch would print a table of '-' rows first.
        print(f"topoagent probe: unavailable: {missing}", file=sys.stderr)
        return 1
    try:
        plan = build_round_plan(args.backend, gpus, numa_nodes_with_cpus())
    except PlanError as exc:
        raise UsageError(str(exc)) from None
    show = sys.stderr.isatty() if args.progress is None else args.progress
    bar = ProgressBar(expected_result_count(plan), sys.stderr, show)
    try:
        probe_round = asyncio.run(run_probe_round(plan, timeout_s=args.timeout, on_record=bar.update, since=started))
    finally:
        bar.close()
    figures = probe_round.figures()
    findings: list[Finding] = []
    if matrix is not None:
        matrix = overlay(matrix, figures)
        findings = findings_for(matrix, figures)
        if args.backend == "cpu":
            print(
                "note: the cpu backend copies host memory in place of GPUs: its figures are shown, "
                "never judged against the GPU links' rates (no link finding, no measured bandwidth)",
                file=sys.stderr,
            )
    if args.json:
        node = probed_node(args, matrix, probe_round)
        doc = probe_round_document(probe_round, pair_rows(matrix) if matrix is not None else None, findings, node)
        print_document(doc)
    else:
        render_text(probe_round, matrix, findings, sys.stdout)
    if probe_round.failure is not None:
        print(f"topoagent probe: {probe_round.failure.kind}: {probe_round.failure.message}", file=sys.stderr)
        return 1
    return 0
