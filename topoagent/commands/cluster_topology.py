"""`topoagent cluster-topology`: read every agent's /topology and write the cluster's
topology for Slurm (topology.conf, topology.yaml) and Kueue (a Topology object)."""

from __future__ import annotations

import argparse
import json
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from topoagent.commands.token import read_client_token
from topoagent.errors import UsageError
from topoagent.text import cut, printable_line

FORMATS = {
    "topology.conf": "Slurm topology.conf for TopologyPlugin=topology/tree",
    "topology.yaml": "Slurm topology.yaml (Slurm 24.05+): the tree, and NVLink domains as blocks",
    "kueue": "a Kueue Topology object (kueue.x-k8s.io/v1beta2) over topoagent's node labels",
}
FILE_NAMES = {"topology.conf": "topology.conf", "topology.yaml": "topology.yaml", "kueue": "kueue-topology.yaml"}
# A served /topology grows with the square of the node's GPUs and NICs (one pair each):
# 155 KB for a 16-GPU, 10-NIC node, 6.8 MB for 256 GPUs (measured), so a 128-GPU node with
# 128 NICs fits in 8 MiB.  Parsed, a document takes up to ~25 times its size; one at a time.
MAX_DOCUMENT_BYTES = 8 << 20
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


def fetch_topology(url: str, timeout: float, token: str | None = None) -> bytes | bytearray:
    """The body of GET <url>/topology, within ``timeout`` seconds in all: connecting, the
    answer's head and its body; errors say what went wrong in words (OSError).

    Redirects are not followed: an agent's /topology never redirects, and a followed
    redirect would carry the bearer token to whatever host the answer names."""
    import http.client
    import time
    from urllib.parse import urlsplit

    from topoagent.commands.agent_connection import AgentConnection

    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise OSError("not an http:// or https:// URL")
    target = urlsplit(base if base.endswith("/topology") else f"{base}/topology")
    if "@" in target.netloc:
        raise OSError("a user name or password in the URL is never sent; give the token with --token-file")
    path = target.path + (f"?{target.query}" if target.query else "")
    headers = {"Accept": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    deadline = time.monotonic() + timeout
    try:
        connection = AgentConnection(target.netloc, deadline, tls=target.scheme == "https")
        try:
            connection.request("GET", path, headers=headers)
            response = connection.getresponse()
            if 300 <= response.status < 400:
                raise OSError(f"HTTP {response.status} redirect to {response.getheader('Location') or 'nowhere'}; not followed")
            if response.status != 200:
                raise OSError(f"HTTP {response.status} {response.reason}")
            body = bytearray()
            while chunk := response.read1(1 << 16):
                body += chunk
                if len(body) > MAX_DOCUMENT_BYTES:
                    raise OSError(f"answer is larger than {MAX_DOCUMENT_BYTES >> 20} MiB")
        finally:
            connection.close()
    except TimeoutError:
        raise OSError(f"no answer within {timeout:g} s") from None
    except (http.client.HTTPException, ValueError) as exc:  # a bad URL or port; not HTTP's answer
        raise OSError(f"{type(exc).__name__}: {exc}") from None
    return body


def _json_document(body: bytes | bytearray, what: str) -> Any:
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise OSError(f"{what}not JSON: {str(exc)[:120]}") from None


def _read_file(path: str) -> bytes:
    try:
        with open(path, "rb") as handle:
            body = handle.read(MAX_DOCUMENT_BYTES + 1)
    except OSError as exc:
        raise OSError(exc.strerror or str(exc)) from None
    if len(body) > MAX_DOCUMENT_BYTES:
        raise OSError(f"larger than {MAX_DOCUMENT_BYTES >> 20} MiB")
    return body


def one_line(text: str, limit: int = 300) -> str:
    """An error as one line: text from an agent (a reason, a Location) may hold line breaks."""
    return cut(printable_line(text), limit)


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

    # Only one document is parsed and held at a time, and only what the cluster files need
    # is kept of it (node_of): a parsed document takes ~25 times its JSON's size, so
    # documents held together would grow with the agents asked at once.
    parsing = threading.Lock()

    def read(source: str) -> ClusterNode | str:
        try:
            body = _read_file(source) if args.topology_files else fetch_topology(source, timeout, token)
            with parsing:
                return node_of(_json_document(body, "" if args.topology_files else "answer is "), source)
        except OSError as exc:
            return one_line(f"{source}: {str(exc) or type(exc).__name__}")
        except ClusterTopologyError as exc:
            return one_line(str(exc))

    nodes: list[ClusterNode] = []
    failures: list[str] = []
    with ThreadPoolExecutor(max_workers=min(16, len(sources))) as pool:
        for outcome in pool.map(read, sources):
            if isinstance(outcome, str):
                failures.append(outcome)
            else:
                nodes.append(outcome)
    for line in failures:
        print(f"topoagent cluster-topology: {line}", file=sys.stderr)
    if failures and not args.partial:
        print(f"topoagent cluster-topology: {len(failures)} of {len(sources)} agents failed; nothing written "
              "(--partial writes what the others said)", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    if not nodes:
        print("topoagent cluster-topology: no agent answered; nothing written", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    left_out = unplaced(nodes)
    for name in left_out:
        print(f"topoagent cluster-topology: {name}: its agent knows no neighbour switch; left out of the tree", file=sys.stderr)
    # A tree without a node in it, or one missing nodes nobody asked to leave out, would be
    # written as a success and scheduled by: refuse it, as an agent that failed is refused.
    if len(left_out) == len(nodes):
        print(f"topoagent cluster-topology: none of the {len(nodes)} nodes reported a switch; nothing written", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    if left_out and not args.partial:
        print(f"topoagent cluster-topology: {len(left_out)} of {len(nodes)} nodes left out of the tree; nothing written "
              "(--partial writes the others)", file=sys.stderr)
        return EXIT_AGENTS_FAILED
    if left_out or failures:
        missing = len(left_out) + len(failures)
        print(f"topoagent cluster-topology: --partial: {len(sources) - missing} of {len(sources)} nodes written, "
              f"{missing} left out", file=sys.stderr)
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

