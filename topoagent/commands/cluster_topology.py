"""`topoagent cluster-topology`: read every agent's /topology and write the cluster's
topology for Slurm (topology.conf, topology.yaml) and Kueue (a Topology object)."""

from __future__ import annotations

import argparse
import json
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from topoagent.commands.token import read_client_token
from topoagent.errors import UsageError

FORMATS = {
    "topology.conf": "Slurm topology.conf for TopologyPlugin=topology/tree",
    "topology.yaml": "Slurm topology.yaml (Slurm 24.05+): the tree, and NVLink domains as blocks",
    "kueue": "a Kueue Topology object (kueue.x-k8s.io/v1beta2) over topoagent's node labels",
}
FILE_NAMES = {"topology.conf": "topology.conf", "topology.yaml": "topology.yaml", "kueue": "kueue-topology.yaml"}
MAX_DOCUMENT_BYTES = 64 << 20  # a /topology of a 16-GPU node is ~200 KB
EXIT_AGENTS_FAILED = 1


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "cluster-topology",
        help="write Slurm topology.conf/topology.yaml and a Kueue Topology from every agent's /topology",
        description=(
            "Read /topology from every agent (or saved `topoagent discover --json` files) and write "
            "the cluster's topology: Slurm topology.conf (tree), topology.yaml (tree, and NVLink "
            "domains as blocks) and a Kueue Topology. Each node is filed under the leaf switch its "
            "ports reach (fabric.leaf), or under its set of rail leaves. An agent that cannot be read "
            "is an error naming it; --partial writes what the others said."
        ),
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--agents", nargs="+", metavar="URL", help="agent base URLs, e.g. http://gpu001:9477")
    source.add_argument("--agents-file", metavar="FILE", help="a file of agent base URLs, one a line (# comments)")
    source.add_argument("--topology-files", nargs="+", metavar="FILE", help="saved /topology or `discover --json` documents")
    parser.add_argument("--format", choices=list(FORMATS), default="topology.conf",
                        help="what to print on standard output (default: topology.conf)")
    parser.add_argument("--write", metavar="DIR",
                        help="write all three files into DIR (topology.conf, topology.yaml, kueue-topology.yaml) instead")
    parser.add_argument("--partial", action="store_true",
                        help="when some agents cannot be read, still write what the others said (their errors are printed)")
    parser.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS", help="how long each agent may take to answer, in all (default: 10)")
    parser.add_argument("--token-file", metavar="FILE", help="bearer token for agents that guard reads (require_token_for_reads)")
    parser.add_argument("--prefix", default="topoagent.io", help="the label namespace of the NFD labels (default: topoagent.io)")
    parser.add_argument("--topograph-labels", action="store_true",
                        help="the Kueue levels name topograph's labels (network.topology.nvidia.com/leaf, /accelerator)")
    parser.add_argument("--kueue-name", default="topoagent", metavar="NAME", help="the Kueue Topology's name (default: topoagent)")
    parser.set_defaults(run=run)


def _agent_urls(args: argparse.Namespace) -> list[str]:
    if args.agents:
        return list(args.agents)
    try:
        text = Path(args.agents_file).read_text()
    except OSError as exc:
        raise UsageError(f"{args.agents_file}: {exc.strerror}") from None
    urls = [line.split("#", 1)[0].strip() for line in text.splitlines()]
    urls = [u for u in urls if u]
    if not urls:
        raise UsageError(f"{args.agents_file}: no agent URLs in it")
    return urls


def fetch_topology(url: str, timeout: float, token: str | None = None) -> Any:
    """GET <url>/topology as JSON, within ``timeout`` seconds in all; errors say what went
    wrong in words (OSError)."""
    import http.client
    import time
    from urllib.error import HTTPError, URLError
    from urllib.request import Request, urlopen

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise OSError("not an http:// or https:// URL")
    target = base if base.endswith("/topology") else f"{base}/topology"
    deadline = time.monotonic() + timeout
    try:
        request = Request(target, headers={"Authorization": f"Bearer {token}"} if token else {})
        with urlopen(request, timeout=timeout) as response:
            # read1: one receive at a time, so an agent that trickles its answer meets the
            # deadline (the socket timeout alone bounds each receive, not the answer).
            chunks, size = [], 0
            while chunk := response.read1(1 << 16):
                size += len(chunk)
                if size > MAX_DOCUMENT_BYTES:
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunks.append(chunk)
    except HTTPError as exc:
        raise OSError(f"HTTP {exc.code} {exc.reason}") from None
    except URLError as exc:
        raise OSError(str(exc.reason)) from None
    except TimeoutError:
        raise OSError(f"no answer within {timeout:g} s") from None
    except (http.client.HTTPException, ValueError) as exc:  # a bad URL or port; not HTTP's answer
        raise OSError(f"{type(exc).__name__}: {' '.join(str(exc).split())[:120]}") from None  # one line
    return _json_document(b"".join(chunks) if size <= MAX_DOCUMENT_BYTES else None, "answer is ")


def _json_document(body: bytes | None, what: str) -> Any:
    """``body`` as JSON; None: it passed MAX_DOCUMENT_BYTES."""
    if body is None or len(body) > MAX_DOCUMENT_BYTES:
        raise OSError(f"{what}larger than {MAX_DOCUMENT_BYTES >> 20} MiB")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise OSError(f"{what}not JSON: {str(exc)[:120]}") from None


def _read_file(path: str) -> Any:
    try:
        with open(path, "rb") as handle:
            body = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise OSError(exc.strerror or str(exc)) from None
    return _json_document(body, "")


def run(args: argparse.Namespace) -> int:
    from topoagent.exporters.cluster_topology import (
        ClusterNode,
        ClusterTopologyError,
        kueue_topology,
        node_of,
        slurm_topology_conf,
        slurm_topology_yaml,
        unplaced,
    )
    from topoagent.exporters.nfd import LabelError

    if not 0 < args.timeout < float("inf"):
        raise UsageError("--timeout must be a positive number of seconds")
    timeout = args.timeout
    sources = list(args.topology_files) if args.topology_files else _agent_urls(args)
    token = read_client_token("--token-file", args.token_file) if args.token_file else None

    def read(source: str) -> Any:
        return _read_file(source) if args.topology_files else fetch_topology(source, timeout, token)

    nodes: list[ClusterNode] = []
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=min(16, len(sources))) as pool:
        for source, outcome in zip(sources, pool.map(_attempt(read), sources)):
            if isinstance(outcome, str):
                failures.append(f"{source}: {outcome}")
                continue
            try:
                nodes.append(node_of(outcome, source))
            except ClusterTopologyError as exc:
                failures.append(str(exc))
    for line in failures:
        print(f"topoagent cluster-topology: {line}", file=sys.stderr)
    if failures and not args.partial:
        print(f"topoagent cluster-topology: {len(failures)} of {len(sources)} agents failed; nothing written "
              "(--partial writes what the others said)", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    if not nodes:
        print("topoagent cluster-topology: no agent answered; nothing written", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    for name in unplaced(nodes):
        print(f"topoagent cluster-topology: {name}: its agent knows no neighbour switch; left out of the tree", file=sys.stderr)
    try:
        texts = {
            "topology.conf": slurm_topology_conf(nodes),
            "topology.yaml": slurm_topology_yaml(nodes),
        }
    except ClusterTopologyError as exc:
        raise UsageError(str(exc)) from None
    try:
        texts["kueue"] = kueue_topology(nodes, args.kueue_name, args.prefix, args.topograph_labels)
    except ClusterTopologyError as exc:
        raise UsageError(f"--kueue-name: {exc}") from None
    except LabelError as exc:
        raise UsageError(f"--prefix: {exc}") from None
    if args.write is None:
        sys.stdout.write(texts[args.format])
        return 0
    from topoagent.commands.export import _write

    directory = Path(args.write)
    if not directory.is_dir():
        raise UsageError(f"{directory}: no such directory")
    for key, text in texts.items():
        _write(text, str(directory / FILE_NAMES[key]))
    return 0


def _attempt(read: Any) -> Any:
    def attempt(source: str) -> Any:
        try:
            return read(source)
        except OSError as exc:
            return str(exc) or type(exc).__name__
    return attempt
