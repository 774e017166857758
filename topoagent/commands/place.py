"""`topoagent place`: the best k GPUs of this node (or a recorded one) for a job."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from dataclasses import replace
from typing import Any, BinaryIO

from topoagent.commands.sources import matrix_and_left_out
from topoagent.documents import print_document
from topoagent.documents.agent import answer_document, batch_error_document
from topoagent.errors import TopoagentError, UsageError
from topoagent.node.matrix import DistanceMatrix
from topoagent.placement import Door, Live, NoFit, Placement, RequestError, parse_request, place
from topoagent.placement.live import NO_LIVE
from topoagent.placement.request import SERVICE_DEADLINE_MS, parse_gpu_indices
from topoagent.text import cut
from topoagent.vocabulary import DETAIL_ALL, Affinity, Detail, EstimateModel, Pattern


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "place",
        help="choose the best GPUs of this node for a job: rank order, CPUs, NICs, env",
        # Wrapped here: RawDescriptionHelpFormatter (for the examples) keeps lines as written.
        description=(
            "Answer 'which k GPUs should my job get?' from a discovered node (--root) or an\n"
            "`nvidia-smi topo -m` output (--from-nvidia-smi).\n"
            "\n"
            "With --batch, read one JSON request per line on stdin and print one JSON answer\n"
            "per line, in order; blank lines are skipped. A line takes POST /place's fields\n"
            f"(gpus, pattern, ...; deadline_ms defaults to {SERVICE_DEADLINE_MS} ms, as in the service) and\n"
            '"busy", the GPUs in use, as --busy gives them. Request flags (--gpus, --busy,\n'
            "--pattern, ...) are refused with --batch: each line says its own. --root,\n"
            "--from-nvidia-smi and --measured (the node) apply to every line. POST /place\n"
            "takes no busy: the agent knows which GPUs are busy (leases, processes)."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--root", metavar="DIR", help="a recorded node (snapshot) or / (default)")
    source.add_argument("--from-nvidia-smi", metavar="FILE", help="`nvidia-smi topo -m` output, - for stdin")
    # Request flags are read as text and parsed by the same code as JSON requests
    # (topoagent.placement.request), so every door says the same about the same input.
    # None, not "": --batch must tell a flag given from one left out.
    parser.add_argument("--gpus", metavar="K", help="how many GPUs")
    parser.add_argument("--busy", metavar="LIST", help="GPUs in use by others, e.g. 0,3 (default: none)")
    parser.add_argument("--pattern", choices=[p.value for p in Pattern], help="default: allreduce")
    parser.add_argument("--min-level", metavar="LEVEL", help="every pair at least this close (NV, NV2, PIX, ...; default: none)")
    parser.add_argument("--single-numa", action="store_true", help="all GPUs on one NUMA node")
    parser.add_argument("--include", metavar="LIST", help="GPUs that must be part of the answer (default: none)")
    parser.add_argument("--exclude", metavar="LIST", help="GPUs that must not be (default: none)")
    parser.add_argument("--nics", metavar="N", help="NICs wanted close to the GPUs (default 0)")
    parser.add_argument("--affinity", choices=[a.value for a in Affinity], help="tier the answer must meet: best, better, any (default)")
    parser.add_argument("--fallback", action="store_true", help="settle for the best lower tier instead of no fit")
    parser.add_argument("--message-bytes", metavar="BYTES", help="allreduce: the all-reduce size its estimate models (default 256 MiB); alltoall, pipeline: one message's size, their links and estimate are timed by (default 1 MiB)")
    parser.add_argument(
        "--measured", metavar="FILE",
        help="measurements to place by: the output of `topoagent probe --json` (what-if: your own figures)",
    )
    parser.add_argument(
        "--deadline-ms", metavar="MS",
        help=f"answer by then with the best set found so far, saying whether it is proven optimal (default {CLI_DEADLINE_MS})",
    )
    parser.add_argument(
        "--detail", metavar="LIST",
        help=f"--json: the answer's sections beyond the lean one, as POST /place's detail: {', '.join([*Detail, DETAIL_ALL])} "
        "(default: none; the text output always shows them)",
    )
    parser.add_argument("--json", action="store_true", help="print the answer as JSON")
    parser.add_argument(
        "--batch", action="store_true",
        help="JSON requests on stdin, JSON answers on stdout; exit 2 if any line was bad input, else 3 if any never fits, "
        "else 1 if any did not fit now, else 0",
    )
    parser.set_defaults(run=run)


EPILOG = """\
examples:
  topoagent place --gpus 4                  # this node, no GPU busy
  topoagent place --gpus 2 --busy 0,3 --pattern alltoall --root RECORDED_NODE
  nvidia-smi topo -m > topo.txt
  topoagent place --gpus 4 --from-nvidia-smi topo.txt --json
  topoagent place --gpus 4 --json --detail bindings,launch   # with each rank's CPUs, NICs, srun options
  printf '%s\\n' '{"gpus": 2, "busy": [0, 1]}' '{"gpus": 4, "nics": 1}' |
    topoagent place --batch

exit status: 0 placed; 1 no fit now (busy GPUs: it fits once they are given
back); 3 never fits this node (not even with every GPU free: retrying will not
help); the reason on stderr; 2 bad input (one line on stderr). With --batch
every line is answered on stdout and the exit status is the worst line's: 2 if
any line was bad input, else 3 if any never fits, else 1 if any did not fit
now, else 0.
"""

# Request fields that --batch lines carry, by flag: given with --batch they are refused.
BATCH_LINE_FLAGS = {
    "gpus": "--gpus", "busy": "--busy", "pattern": "--pattern", "min_level": "--min-level",
    "single_numa": "--single-numa", "include": "--include", "exclude": "--exclude", "nics": "--nics",
    "affinity": "--affinity", "fallback": "--fallback", "message_bytes": "--message-bytes",
    "deadline_ms": "--deadline-ms", "detail": "--detail",
}


# A person at a terminal can wait longer than a scheduler's request: a second.
CLI_DEADLINE_MS = 1000
# A probe of a 256-GPU node (every ordered pair, both directions) is about 30 MB of JSON.
MAX_MEASURED_BYTES = 64 * 1024 * 1024


def flag_value(text: str) -> Any:
    """A flag's text as the JSON value it spells (4, 4.0, true), else the text itself:
    the request parser then judges it as it would judge that value in a JSON request."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def flag_list(text: str) -> list[Any]:
    return [flag_value(part.strip()) for part in text.split(",") if part.strip()]


def request_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The request the flags spell, as a JSON-like object: only the flags given."""
    fields: dict[str, Any] = {"gpus": flag_value(args.gpus)}  # run() saw it given
    if args.pattern is not None:
        fields["pattern"] = args.pattern
    if args.min_level is not None:
        fields["min_level"] = args.min_level
    if args.single_numa:
        fields["single_numa"] = True
    if args.include is not None:
        fields["include"] = flag_list(args.include)
    if args.exclude is not None:
        fields["exclude"] = flag_list(args.exclude)
    if args.nics is not None:
        fields["nics"] = flag_value(args.nics)
    if args.affinity is not None:
        fields["affinity"] = args.affinity
    if args.fallback:
        fields["fallback"] = True
    if args.message_bytes is not None:
        fields["message_bytes"] = flag_value(args.message_bytes)
    fields["deadline_ms"] = flag_value(args.deadline_ms) if args.deadline_ms is not None else CLI_DEADLINE_MS
    if args.detail is not None:
        fields["detail"] = flag_list(args.detail)
    return fields


def recorded_live(args: argparse.Namespace) -> Live:
    """On a recorded node, the NIC traffic its counter samples give, as the service that
    replays them weighs it (placement.live); nothing on a live node, where one read has no
    rate, or on nvidia-smi text."""
    if args.from_nvidia_smi or not args.root:
        return Live()
    from topoagent.node.host import Host, HostError
    from topoagent.service.telemetry import nic_traffic, replayed

    try:
        return Live(nic_traffic=nic_traffic(replayed(Host(args.root), None)))
    except HostError as exc:  # the recording's counters, not its topology: place without them
        print(f"topoagent place: warning: {exc}; placing without NIC traffic", file=sys.stderr)
        return Live()


def load_matrix(args: argparse.Namespace) -> tuple[DistanceMatrix, tuple[int, ...]]:
    """The node's matrix (with --measured's figures overlaid), and GPUs left out of it
    because their levels are unknown."""
    if args.from_nvidia_smi:
        if args.batch and args.from_nvidia_smi == "-":
            raise UsageError("--batch reads requests from stdin; give the matrix as a file")
        matrix, left_out = matrix_and_left_out(args.from_nvidia_smi)
    else:
        matrix, left_out = ready_matrix(args.root or "/"), ()
    if args.measured:
        matrix = with_measured(matrix, args.measured)
    return matrix, left_out


class NotReadyForPlacement(TopoagentError):
    """The node shows a finding that leaves every answer untrustworthy (GET /readyz's 503)."""


def ready_matrix(root: str) -> DistanceMatrix:
    """The node's matrix, or NotReadyForPlacement naming what it cannot see (GPUs a stack
    that does not answer leaves unknown): an answer would be a guess."""
    from topoagent.commands.discover import discover_root
    from topoagent.node.findings import placement_refusals

    node = discover_root(root)
    blockers = placement_refusals(node.findings)
    if blockers:
        raise NotReadyForPlacement("; ".join(f"{f.kind} ({f.subject}): {f.message}" for f in blockers))
    return node.distance_matrix()


def with_measured(matrix: DistanceMatrix, path: str) -> DistanceMatrix:
    """The matrix with the figures of a `topoagent probe --json` document overlaid, judged
    as the service judges its own (levels.measured_gbps)."""
    from topoagent.probes.figures import MalformedRecord, parse_figure
    from topoagent.probes.overlay import overlay
    from topoagent.smallfile import read_small_file

    try:
        raw, _ = read_small_file(path, MAX_MEASURED_BYTES)
    except OSError as exc:
        raise UsageError(f"--measured: cannot read {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_MEASURED_BYTES:
        raise UsageError(f"--measured: {path} is larger than {MAX_MEASURED_BYTES >> 20} MiB; "
                         "a probe of a 256-GPU node is about 30 MB")
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise UsageError(f"--measured: {path} is not JSON: {cut(str(exc), 120)}") from None
    except RecursionError:
        raise UsageError(f"--measured: {path} is nested too deep to be a probe document") from None
    records = doc.get("figures") if isinstance(doc, dict) else None
    if not isinstance(records, list):
        raise UsageError(f"--measured: {path} has no 'figures' list (expected `topoagent probe --json` output)")
    if (why := not_this_node(matrix, doc.get("node"), path)) is not None:
        raise UsageError(why)
    try:
        figures = [parse_figure(r) for r in records if isinstance(r, dict)]
    except MalformedRecord as exc:
        raise UsageError(f"--measured: {path}: {exc}") from None
    return overlay(matrix, figures)


def node_words(hostname: str | None, ids: list[str]) -> str:
    shown = ", ".join(ids[:2]) + (", ..." if len(ids) > 2 else "")
    name = f"node {hostname}" if hostname else "an unnamed node"
    return f"{name} (GPUs {shown})" if ids else name


def not_this_node(matrix: DistanceMatrix, node: Any, path: str) -> str | None:
    """Why a probe document's figures are not this node's (None: they are, or cannot be
    told apart -- then a warning on stderr).  GPU UUIDs decide where both sides know them
    (a renamed host keeps its GPUs); else a PCI address or a hostname that differs refuses,
    since twin nodes share PCI addresses and only their names tell them apart."""
    if not isinstance(node, dict):
        print(
            f"topoagent place: warning: --measured: {path} does not say which node it was taken on "
            "(written before probes recorded it); its figures are laid over this node's GPUs by index",
            file=sys.stderr,
        )
        return None
    gpus = [g for g in node.get("gpus") or () if isinstance(g, dict)]
    probe_host = node.get("hostname") if isinstance(node.get("hostname"), str) else None
    here_host = matrix.host.hostname if matrix.host is not None else None
    probe_uuids = [g["uuid"] for g in gpus if isinstance(g.get("uuid"), str)]
    probe_pcis = [g["pci_address"] for g in gpus if isinstance(g.get("pci_address"), str)]
    here_uuids = {g.uuid for g in matrix.gpus if g.uuid}
    here_pcis = {g.pci_address for g in matrix.gpus if g.pci_address}
    if probe_uuids and here_uuids:
        differs = any(u not in here_uuids for u in probe_uuids)
        theirs, ours = probe_uuids, sorted(here_uuids)
    else:
        pci_differs = bool(probe_pcis and here_pcis) and any(p not in here_pcis for p in probe_pcis)
        host_differs = bool(probe_host and here_host) and probe_host != here_host
        if not (probe_pcis and here_pcis) and not (probe_host and here_host):
            print(
                f"topoagent place: warning: --measured: cannot tell whether {path} was taken on this node "
                "(neither GPU ids nor hostnames to compare); its figures are laid over this node's GPUs by index",
                file=sys.stderr,
            )
            return None
        differs = pci_differs or host_differs
        theirs, ours = (probe_pcis, sorted(here_pcis)) if pci_differs else ([], [])
    if not differs:
        return None
    return (
        f"--measured: {path} was taken on {node_words(probe_host, theirs)}, not on this {node_words(here_host, ours)}; "
        "probe this node (topoagent probe --json) for figures to place by"
    )


def request_flags_given(args: argparse.Namespace) -> list[str]:
    """The request flags on the command line (a store_true flag counts when set)."""
    return [flag for name, flag in BATCH_LINE_FLAGS.items() if getattr(args, name) not in (None, False)]


def left_out_rules(
    fields: dict[str, Any], busy: Any, on_node: set[int], left_out: tuple[int, ...]
) -> tuple[dict[str, Any], tuple[int, ...]]:
    """A request's fields and busy GPUs where nvidia-smi's text left some GPUs out (their
    levels unknown): such a GPU may be named busy or excluded -- it is no candidate anyway
    -- but not included.  The same rules for the flags and for each line of --batch."""
    def left(i: Any) -> bool:
        return type(i) is int and i in left_out

    include = fields.get("include")
    if isinstance(include, list) and (named := [i for i in include if left(i)]):
        raise RequestError("include", f"GPU {named[0]} was left out: its levels to other GPUs are unknown")
    exclude = fields.get("exclude")
    if isinstance(exclude, list) and any(left(i) for i in exclude):
        fields = {**fields, "exclude": [i for i in exclude if not left(i)]}
    parsed = parse_gpu_indices("busy", busy, on_node | set(left_out))
    return fields, tuple(i for i in parsed if i not in left_out)


def run(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except NotReadyForPlacement as exc:
        print(f"topoagent place: not ready for placement: {exc}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    if args.batch:
        # Each line is a whole request, busy included; a flag beside them would be
        # silently ignored or silently merged, and neither is what a line said.
        if given := request_flags_given(args):
            fields = ", ".join(f'"{name}"' for name, flag in BATCH_LINE_FLAGS.items() if flag in given)
            raise UsageError(f"--batch takes requests from stdin; drop {', '.join(given)} (give each line its {fields})")
        matrix, left_out = load_matrix(args)
        return run_batch(matrix, recorded_live(args), left_out)
    if args.gpus is None:
        raise UsageError("--gpus K is required (or --batch)")
    if args.detail is not None and not args.json:
        # The text output shows every section already: a --detail there would say nothing.
        raise UsageError("--detail chooses the sections of the --json answer; add --json (the text output shows them all)")
    matrix, left_out = load_matrix(args)
    on_node = {g.index for g in matrix.gpus}
    try:
        # The batch lines' own rules (each index once, on the node), so the doors agree.
        asked, busy = left_out_rules(request_fields(args), flag_list(args.busy or ""), on_node, left_out)
        request = parse_request(asked, gpu_indices=on_node)
        answer = place(matrix, request, busy, live=recorded_live(args))
    except RequestError as exc:
        raise UsageError(f"--{exc.field.replace('_', '-')}: {exc.message}") from None
    if args.json:
        print_document(answer_document(answer))
    else:
        sys.stdout.write(render(answer))
    if isinstance(answer, NoFit):
        said = "never fits this node" if answer.never_fits else "no fit"
        print(f"topoagent place: {said}: {answer.why.render(Door.CLI)}", file=sys.stderr)
        return EXIT_NEVER_FITS if answer.never_fits else EXIT_NO_FIT
    return 0


# Distinct, so that a script retrying on "busy now" (1) stops on what waiting cannot change (3).
EXIT_NO_FIT = 1
EXIT_NEVER_FITS = 3
# --batch exits with its worst line's status, worst first: bad input, never fits, no fit now.
BATCH_SEVERITY = (2, EXIT_NEVER_FITS, EXIT_NO_FIT, 0)


# A request is a short JSON object; a longer line is refused (and skipped) unread.
MAX_BATCH_LINE_BYTES = 64 * 1024


def answer_line(
    matrix: DistanceMatrix, line_no: int, line: str, live: Live = NO_LIVE, left_out: tuple[int, ...] = ()
) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        return batch_error_document(line_no, None, f"not JSON: {exc.msg}")
    except RecursionError:
        return batch_error_document(line_no, None, "not JSON we read: nested too deeply")
    except ValueError as exc:  # a number past Python's int digit limit
        return batch_error_document(line_no, None, f"not JSON we read: {str(exc).split(';')[0]}")
    try:
        if not isinstance(obj, dict):
            raise RequestError("request", "expected a JSON object")
        fields = dict(obj)
        busy_named = fields.pop("busy", [])
        gpu_indices = {g.index for g in matrix.gpus}
        fields, busy = left_out_rules(fields, busy_named, gpu_indices, left_out)
        request = parse_request(fields, gpu_indices=gpu_indices)
        if request.deadline_ms is None:  # a scheduler's door, like HTTP: the service's default
            request = replace(request, deadline_ms=SERVICE_DEADLINE_MS)
        return answer_document(place(matrix, request, busy, live=live))
    except RequestError as exc:
        return batch_error_document(line_no, exc.location, exc.message)


def batch_lines(stream: BinaryIO) -> Iterator[tuple[int, str | None]]:
    """(line number, text) per line of ``stream``; text None for a line over the bound.

    Bytes, not text: a byte that is not UTF-8 spoils its own line (read as U+FFFD, so
    that line is not JSON), not the whole batch.
    """
    line_no = 0
    while chunk := stream.readline(MAX_BATCH_LINE_BYTES + 1):
        line_no += 1
        if len(chunk) <= MAX_BATCH_LINE_BYTES or chunk.endswith(b"\n"):
            yield line_no, chunk.decode("utf-8", errors="replace")
            continue
        while chunk and not chunk.endswith(b"\n"):  # skip the rest of the long line
            chunk = stream.readline(MAX_BATCH_LINE_BYTES)
        yield line_no, None


def run_batch(matrix: DistanceMatrix, live: Live = NO_LIVE, left_out: tuple[int, ...] = ()) -> int:
    """Answer every line; exit as a single request would for the worst line's answer:
    2 if any line was bad input, else 3 if any never fits, else 1 if any did not fit
    now, else 0 (none: 0)."""
    status = 0
    for line_no, line in batch_lines(sys.stdin.buffer):
        if line is None:
            answer = batch_error_document(line_no, None, f"line longer than {MAX_BATCH_LINE_BYTES} bytes")
        elif not line.strip():
            continue
        else:
            answer = answer_line(matrix, line_no, line, live, left_out)
        line_status = 2 if "error" in answer else 0 if answer["fit"] else EXIT_NEVER_FITS if answer["never_fits"] else EXIT_NO_FIT
        status = min(status, line_status, key=BATCH_SEVERITY.index)
        sys.stdout.write(json.dumps(answer, separators=(",", ":")) + "\n")
        sys.stdout.flush()
    return status


ESTIMATE_WORDS = {
    EstimateModel.RING_ALLREDUCE: "ring all-reduce of {size} bytes",
    EstimateModel.ALLTOALL: "all-to-all, one message of {size} bytes to each peer",
    EstimateModel.PIPELINE_P2P: "pipeline point-to-point, one message of {size} bytes per stage",
}


def render(answer: Placement | NoFit) -> str:
    if isinstance(answer, NoFit):
        constraint = "--" + answer.constraint.replace("_", "-")
        said = "never fits this node" if answer.never_fits else "no fit"
        lines = [f"{said} ({constraint}): {answer.why.render(Door.CLI)}"]
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
        lines.append(
            f"  rank {g.rank}: GPU{g.index}  CPUs {g.cpus or 'unknown'}  memory node {'-' if g.memory_node is None else g.memory_node}"
            f"  NIC {g.nic or '-'} ({g.nic_level or '-'})" + ("" if g.rail is None else f" rail {g.rail}")
        )
    env = " ".join(f"{k}={v}" for k, v in answer.env.items())
    lines.append(f"launch: {env} {' '.join(answer.numactl)} <command>".replace("  ", " "))
    if answer.launch is not None:
        lines.append("srun: " + " ".join(answer.launch.srun))
    lines.append(f"affinity: {answer.affinity}   topology satisfaction: {answer.satisfaction:.0%} of links local")
    if answer.estimate is not None:
        e = answer.estimate
        what = ESTIMATE_WORDS[e.model].format(size=e.message_bytes)
        lines.append(f"estimate: {what}: {e.time_us / 1000:.3g} ms, bus bandwidth {e.bus_bandwidth_gbps:g} GB/s")
    lines.append(f"score: {answer.score:g}")
    lines += [f"- {reason.render(Door.CLI)}" for reason in answer.reasons]
    return "\n".join(lines) + "\n"
