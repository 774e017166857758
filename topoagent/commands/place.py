"""`topoagent place`: the best k GPUs of this node (or a recorded one) for a job."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from topoagent.commands.sources import matrix_and_left_out, matrix_from_root
from topoagent.errors import UsageError
from topoagent.matrix import DistanceMatrix
from topoagent.placement import PATTERNS, NoFit, Placement, Request, RequestError, place


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "place",
        help="choose the best GPUs of this node for a job: rank order, CPUs, NICs, env",
        description=(
            "Answer 'which k GPUs should my job get?' from a discovered node (--root) or an "
            "`nvidia-smi topo -m` output (--from-nvidia-smi).  With --batch, read one JSON "
            'request per line on stdin ({"gpus": 4, "busy": [0, 3], "pattern": "allreduce"}) '
            "and print one JSON answer per line, in order; blank lines are skipped."
        ),
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--root", metavar="DIR", help="a recorded node (snapshot) or / (default)")
    source.add_argument("--from-nvidia-smi", metavar="FILE", help="`nvidia-smi topo -m` output, - for stdin")
    parser.add_argument("--gpus", type=int, metavar="K", help="how many GPUs")
    parser.add_argument("--busy", default="", metavar="LIST", help="busy GPU indices, e.g. 0,3")
    parser.add_argument("--pattern", choices=PATTERNS, default="allreduce")
    parser.add_argument("--min-level", metavar="LEVEL", help="every pair at least this close (NV, NV2, PIX, ...)")
    parser.add_argument("--single-numa", action="store_true", help="all GPUs on one NUMA node")
    parser.add_argument("--include", default="", metavar="LIST", help="GPUs that must be part of the answer")
    parser.add_argument("--exclude", default="", metavar="LIST", help="GPUs that must not be")
    parser.add_argument("--nics", type=int, default=0, metavar="N", help="NICs wanted close to the GPUs")
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument("--batch", action="store_true", help="JSON requests on stdin, JSON answers on stdout")
    parser.set_defaults(run=run)


def index_list(option: str, text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option}: expected GPU indices like 0,3, got {text!r}") from None


def load_matrix(args: argparse.Namespace) -> tuple[DistanceMatrix, tuple[int, ...]]:
    """The node's matrix, and GPUs left out of it because their levels are unknown."""
    if args.from_nvidia_smi:
        if args.batch and args.from_nvidia_smi == "-":
            raise UsageError("--batch reads requests from stdin; give the matrix as a file")
        return matrix_and_left_out(args.from_nvidia_smi)
    return matrix_from_root(args.root or "/"), ()


def run(args: argparse.Namespace) -> int:
    if args.batch:
        if args.gpus is not None:
            raise UsageError("--batch takes requests from stdin; drop --gpus")
        return run_batch(load_matrix(args)[0])
    if args.gpus is None:
        raise UsageError("--gpus K is required (or --batch)")
    include = index_list("--include", args.include)
    exclude = index_list("--exclude", args.exclude)
    busy = index_list("--busy", args.busy)
    matrix, left_out = load_matrix(args)
    if unusable := sorted(set(include) & set(left_out)):
        raise UsageError(f"--include: GPU {unusable[0]} was left out: its levels to other GPUs are unknown")
    # Left-out GPUs are not candidates anyway; excluding them or calling them busy is fine.
    exclude = [i for i in exclude if i not in left_out]
    busy = [i for i in busy if i not in left_out]
    try:
        request = Request(
            gpus=args.gpus,
            pattern=args.pattern,
            min_level=args.min_level,
            single_numa=args.single_numa,
            include=tuple(include),
            exclude=tuple(exclude),
            nics=args.nics,
        )
        answer = place(matrix, request, busy)
    except RequestError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc.message}") from None
    if args.json:
        json.dump(answer.to_json(), sys.stdout, indent=1)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(render(answer))
    if isinstance(answer, NoFit):
        print(f"topoagent place: no fit: {answer.reason}", file=sys.stderr)
        return 1
    return 0


def answer_line(matrix: DistanceMatrix, line_no: int, line: str) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return {"error": {"line": line_no, "field": None, "message": f"not JSON: {exc.msg}"}}
    try:
        if not isinstance(obj, dict):
            raise RequestError("request", "expected a JSON object")
        obj = dict(obj)
        busy = obj.pop("busy", [])
        if not isinstance(busy, list):
            raise RequestError("busy", "expected a list of GPU indices")
        return place(matrix, Request.from_json(obj), busy).to_json()
    except RequestError as exc:
        return {"error": {"line": line_no, "field": exc.field, "message": exc.message}}
    except TypeError as exc:  # e.g. a field given twice by a bad client library
        return {"error": {"line": line_no, "field": None, "message": str(exc)}}


def run_batch(matrix: DistanceMatrix) -> int:
    for line_no, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        sys.stdout.write(json.dumps(answer_line(matrix, line_no, line), separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return 0


def render(answer: Placement | NoFit) -> str:
    if isinstance(answer, NoFit):
        lines = [f"no fit ({answer.constraint}): {answer.reason}"]
        lines.append("free GPUs: " + (" ".join(str(i) for i in answer.free) or "none"))
        if answer.best_available is not None:
            lines.append("best available instead:")
            lines += ["  " + line for line in render(answer.best_available).splitlines()]
        return "\n".join(lines) + "\n"
    lines = ["GPUs in rank order: " + " ".join(str(i) for i in answer.indices)]
    if answer.bandwidth_gbps is not None:
        lines.append(f"{answer.request.pattern}: {answer.bandwidth_gbps:g} GB/s, worst link {answer.worst_level}")
    lines.append("NUMA nodes: " + ", ".join(str(n) for n in answer.numa_nodes) + f"   CPUs: {answer.cpus or 'unknown'}")
    for g in answer.gpus:
        nics = ",".join(g.nearest_nics) or "-"
        lines.append(f"  rank {g.rank}: GPU{g.index}  nearest NIC {nics} ({g.nic_level or '-'})")
    env = " ".join(f"{k}={v}" for k, v in answer.env.items())
    lines.append(f"launch: {env} {' '.join(answer.numactl)} <command>".replace("  ", " "))
    lines.append(f"score: {answer.score:g}")
    lines += [f"- {reason}" for reason in answer.explain]
    return "\n".join(lines) + "\n"
