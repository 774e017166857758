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
from topoagent.errors import UsageError
from topoagent.vocabulary import GPU_RESOURCE

if TYPE_CHECKING:
    from topoagent.cluster.deviceplugin.pods import PodSource

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
    parser.set_defaults(run=run)


def _pod_source(args: argparse.Namespace) -> PodSource | None:
    from topoagent.cluster.deviceplugin.pods import SERVICE_ACCOUNT, PodSource

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
    if not args.node_name:
        raise UsageError("--node-name (or $NODE_NAME) is needed to read pod annotations; or pass --kube-api off")
    return PodSource(url, args.node_name, token_file=token_file, ca_file=ca_file)


def run(args: argparse.Namespace) -> int:
    try:
        from topoagent.cluster.deviceplugin.plugin import DevicePlugin, Settings
    except ImportError as exc:
        raise UsageError(f"needs the kubernetes extra (pip install 'topoagent[kubernetes]'): {exc}") from exc
    if args.poll_interval <= 0:
        raise UsageError("--poll-interval must be above 0")
    token = read_client_token("--agent-token-file", args.agent_token_file) if args.agent_token_file else None
    settings = Settings(
        plugin_dir=Path(args.plugin_dir),
        resource_name=args.resource_name,
        socket_name=args.socket_name,
        agent_url=args.agent_url,
        agent_token=token,
        poll_interval_s=args.poll_interval,
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    plugin = DevicePlugin(settings, pods=_pod_source(args))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, plugin.stopping.set)
        await plugin.run()

    asyncio.run(main())
    return 0
