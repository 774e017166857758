"""`topoagent device-plugin`: offer the node's GPUs to kubelet, placed by the local agent."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from topoagent.commands.token import read_client_token
from topoagent.documents.lease import TTL_MAX_S
from topoagent.errors import UsageError
from topoagent.vocabulary import GPU_RESOURCE

if TYPE_CHECKING:
    from topoagent.cluster.deviceplugin.node import NodeReporter
    from topoagent.cluster.deviceplugin.pods import PodSource
    from topoagent.cluster.extender.kube import Kube

# Kept here, not imported from the plugin: registering the subcommand must not import
# grpc (an optional extra) for `topoagent --help` or any other command.
DEFAULT_PLUGIN_DIR = "/var/lib/kubelet/device-plugins"
DEFAULT_RESOURCE = GPU_RESOURCE
DEFAULT_AGENT_URL = "http://127.0.0.1:9477"


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "device-plugin",
        help="kubelet device plugin: GPUs by UUID, health from findings, allocations placed by the agent",
        description=(
            "Register with kubelet (device plugin API v1beta1) and offer this node's GPUs, "
            "asking the local agent (`topoagent serve`) for health and placement. Registers "
            "again when kubelet restarts. Needs the `kubernetes` extra (grpcio). SIGTERM stops it."
        ),
    )
    parser.add_argument("--plugin-dir", metavar="DIR", default=DEFAULT_PLUGIN_DIR, help=f"kubelet's device-plugins directory, holding kubelet.sock (default {DEFAULT_PLUGIN_DIR})")
    parser.add_argument("--resource-name", default=DEFAULT_RESOURCE, help=f"extended resource to offer (default {DEFAULT_RESOURCE}, replacing NVIDIA's plugin)")
    parser.add_argument("--socket-name", default="topoagent.sock", help="this plugin's socket in --plugin-dir (default topoagent.sock)")
    parser.add_argument("--agent-url", default=os.environ.get("TOPOAGENT_URL", DEFAULT_AGENT_URL), help=f"the local agent (default $TOPOAGENT_URL or {DEFAULT_AGENT_URL})")
    parser.add_argument("--agent-token-file", metavar="FILE", help="bearer token for the agent, when it guards reads")
    parser.add_argument("--poll-interval", type=float, default=5.0, metavar="SECONDS", help="how often to ask the agent for health (default 5; unchanged answers cost a 304)")
    parser.add_argument(
        "--kube-api", metavar="URL|off",
        help="API server to read the extender's topoagent.io/gpus pod annotation from "
        "(default: in-cluster, from KUBERNETES_SERVICE_HOST; off outside a cluster)",
    )
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME"), help="this node's name, for the pod annotation look-up (default $NODE_NAME)")
    parser.add_argument(
        "--lease-ttl", type=float, default=float(TTL_MAX_S), metavar="SECONDS",
        help="with --agent-token-file and a Kubernetes API: lease what kubelet allocates, for the pod it is for, this long "
             f"at most (default {TTL_MAX_S}, a week); the lease is released when the pod ends or is deleted",
    )
    parser.add_argument(
        "--pod-resync", type=float, default=60.0, metavar="SECONDS",
        help="how often the pod watch lists this node's pods again and releases leases whose pod is gone "
             "(default 60; 0: no watch and no leases at Allocate)",
    )
    parser.add_argument(
        "--node-condition", action="store_true",
        help="set this node's TopoagentHealthy condition (False while the agent reports a critical finding, "
             "True when none, Unknown when the agent cannot be reached); needs a Kubernetes API, --node-name, "
             "and RBAC get nodes, patch nodes/status",
    )
    parser.add_argument(
        "--taint-on-critical", metavar="KEY=VALUE:EFFECT",
        help="with --node-condition: also taint the node so while a critical finding stands "
             "(e.g. topoagent.io/unhealthy=true:NoSchedule; needs RBAC patch nodes); off by default",
    )
    parser.set_defaults(run=run)


def _api_endpoint(args: argparse.Namespace) -> tuple[str, Path | None, Path | None] | None:
    """(URL, token file, CA file) of the Kubernetes API, or None without one."""
    from topoagent.cluster.deviceplugin.pods import SERVICE_ACCOUNT

    url = args.kube_api
    token_file = ca_file = None
    if url is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            return None
        url = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"
        token_file, ca_file = SERVICE_ACCOUNT / "token", SERVICE_ACCOUNT / "ca.crt"
    if url == "off":
        return None
    return url, token_file, ca_file


def _pod_source(args: argparse.Namespace) -> PodSource | None:
    from topoagent.cluster.deviceplugin.pods import PodSource

    endpoint = _api_endpoint(args)
    if endpoint is None:
        return None
    if not args.node_name:
        raise UsageError("--node-name (or $NODE_NAME) is needed to read pod annotations; or pass --kube-api off")
    url, token_file, ca_file = endpoint
    return PodSource(url, args.node_name, token_file=token_file, ca_file=ca_file)


def _node_reporter(args: argparse.Namespace) -> NodeReporter | None:
    from topoagent.cluster.deviceplugin.node import NodeApi, NodeReporter, parse_taint

    if args.taint_on_critical is not None and not args.node_condition:
        raise UsageError("--taint-on-critical needs --node-condition")
    if not args.node_condition:
        return None
    try:
        taint = parse_taint(args.taint_on_critical) if args.taint_on_critical is not None else None
    except ValueError as exc:
        raise UsageError(f"--taint-on-critical {exc}") from None
    endpoint = _api_endpoint(args)
    if endpoint is None:
        raise UsageError("--node-condition needs a Kubernetes API: run in a cluster, or give --kube-api URL")
    if not args.node_name:
        raise UsageError("--node-condition needs --node-name (or $NODE_NAME)")
    url, token_file, ca_file = endpoint
    return NodeReporter(NodeApi(url, args.node_name, token_file=token_file, ca_file=ca_file), taint)


def _pod_watch_api(args: argparse.Namespace) -> Kube:
    """The API server the pod watch lists and watches, as the extender reaches it."""
    from topoagent.cluster.extender.kube import Kube

    try:
        return Kube(args.kube_api)  # None: in-cluster, the pod's service account
    except Exception as exc:  # the client's config loaders raise their own types
        raise UsageError(f"no Kubernetes API to watch pods through: {exc} (give --kube-api, or --kube-api off)") from None


def run(args: argparse.Namespace) -> int:
    try:
        from topoagent.cluster.deviceplugin.plugin import DevicePlugin, Settings
    except ImportError as exc:
        raise UsageError(f"needs the kubernetes extra (pip install 'topoagent[kubernetes]'): {exc}") from exc
    if args.poll_interval <= 0:
        raise UsageError("--poll-interval must be above 0")
    from topoagent.documents.lease import TTL_MAX_S, TTL_MIN_S, ttl_problem

    if ttl_problem(args.lease_ttl):  # the agent's own rule: it would refuse every lease
        raise UsageError(f"--lease-ttl must be from {TTL_MIN_S} s to a week ({TTL_MAX_S})")
    if not (args.pod_resync == 0 or 1 <= args.pod_resync <= 24 * 3600):
        raise UsageError("--pod-resync must be 0 (no pod watch) or between 1 and 86400 seconds")
    token = read_client_token("--agent-token-file", args.agent_token_file) if args.agent_token_file else None
    settings = Settings(
        plugin_dir=Path(args.plugin_dir),
        resource_name=args.resource_name,
        socket_name=args.socket_name,
        agent_url=args.agent_url,
        agent_token=token,
        poll_interval_s=args.poll_interval,
        lease_ttl_s=args.lease_ttl,
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    reporter = _node_reporter(args)
    pods = _pod_source(args)
    kube = _pod_watch_api(args) if pods is not None and token is not None and args.pod_resync > 0 else None
    if kube is None:
        from topoagent.log import log_event

        why = ("no Kubernetes API (--kube-api off)" if pods is None else "no --agent-token-file" if token is None else "--pod-resync 0")
        log_event("allocations_not_leased", reason=why)
    plugin = DevicePlugin(settings, pods=pods, kube=kube, node=args.node_name, pod_resync_s=args.pod_resync,
                          reporter=reporter)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plugin.stopping.set)
        await plugin.run()

    asyncio.run(main())
    return 0
