"""`topoagent extender`: the kube-scheduler extender, run once per cluster."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import sys
from typing import TYPE_CHECKING

# The package alone, for its defaults: --help imports neither aiohttp nor the extender's modules.
from topoagent.cluster.extender import HOLD_AFTER_S, HOLD_GUARD_S, HOLD_MIN_GPUS, HOLD_TTL_S
from topoagent.commands.token import read_client_token
from topoagent.documents.lease import TTL_MAX_S
from topoagent.errors import UsageError
from topoagent.vocabulary import GPU_RESOURCE

if TYPE_CHECKING:  # registering the command imports neither aiohttp nor the kubernetes client
    import ssl

    from topoagent.cluster.extender.app import Settings
    from topoagent.cluster.extender.kube import Kube
    from topoagent.config import Listen

DEFAULT_LISTEN = "127.0.0.1:9480"
DEFAULT_AGENT_URL = "http://{node}:9477"
DEFAULT_RESOURCE = GPU_RESOURCE  # vocabulary is light: --help imports neither aiohttp nor the extender

EPILOG = """\
kube-scheduler's KubeSchedulerConfiguration (deploy/kubernetes/kube-scheduler-config.yaml):

  extenders:
    - urlPrefix: https://topoagent-extender.topoagent.svc:9480/scheduler
      filterVerb: filter
      prioritizeVerb: prioritize
      bindVerb: bind            # only with --bind
      weight: 5
      enableHTTPS: true         # --tls-cert-file, --tls-key-file
      tlsConfig:                # its client certificate, from --client-ca-file's CA
        certFile: /etc/kubernetes/topoagent-extender/client.crt
        keyFile: /etc/kubernetes/topoagent-extender/client.key
        caFile: /etc/kubernetes/topoagent-extender/ca.crt   # the CA of the extender's certificate
      nodeCacheCapable: false   # names or Node objects alike: addresses come from the API server
      ignorable: false          # with the extender down, GPU pods wait (run two replicas)
      managedResources: [{name: nvidia.com/gpu, ignoredByScheduler: false}]

With --client-ca-file only a caller with a certificate from that CA completes the TLS
handshake (none, or a bad one, fails it); kubelet's probes, which present none, reach
/healthz and /readyz on --probe-listen (plain HTTP, nothing else served there). --bind on
an address other than loopback needs --client-ca-file: whoever can call bind can bind any
pending pod to any node and lease GPUs away.

Nodes and agents: a node's agent is asked only when the API server's Node objects name the
node; its address ({address}) is the Node's, never one from a filter body. The Node objects
are listed once, then watched (RBAC: nodes list, watch): a node added, deleted or given
another address counts at once; while no watch is open, a name not seen yet is listed for.
Dry runs and reads carry no token.

Pod annotations (the agent's own words, as POST /place takes them):
  topoagent.io/pattern: allreduce|alltoall|pipeline|independent
  topoagent.io/affinity: best|better|any     topoagent.io/min-level: NV2, PIX, ...
  topoagent.io/single-numa: "true"
With --bind the chosen GPUs are written on the pod as topoagent.io/gpus (UUIDs in rank
order, read by `topoagent device-plugin`) and the agent's lease as topoagent.io/lease,
both in the pod's Binding; the lease is released when the pod ends or is deleted
(a pod watch; RBAC: pods get, list, watch).

Holds (with --bind): a pod asking for --hold-min-gpus or more that fits no node (its filter
failed on every node, or kube-scheduler marked it Unschedulable) waits. At once, a guard keeps
every node that can fit it now from pods that waited less and would leave it too few GPUs
(for --hold-guard at most); after --hold-after it holds one node, which drains. Pods kept off
a node are filtered off that node only (FailedAndUnresolvableNodes, naming the waiting pod)
until it binds, is deleted, ends, or --hold-for passes. GET /holds lists them; /metrics
counts them.
"""


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "extender",
        help="kube-scheduler extender: filter and score nodes by their agents' answers, bind with the GPUs chosen",
        # Wrapped here: RawDescriptionHelpFormatter (for the epilog's YAML) keeps lines as written.
        description=(
            "Serve the kube-scheduler extender API (filter, prioritize and, with --bind, bind)\n"
            "under --path-prefix. For each GPU pod it asks every candidate node's agent\n"
            "(/capacity, dry-run /place), at most --concurrency at once, --agent-timeout each;\n"
            "it filters out nodes that cannot fit (the reason per node) and scores the rest\n"
            "1-10: best ring bandwidth, then least NUMA distance, then least broken for later\n"
            "pods (a node the pod fills first; a 1-GPU pod where a free pair is worth least;\n"
            "the node with the most free GPUs last); 0: a node passed without its agent's\n"
            "answer. With --tls-cert-file and --tls-key-file it serves HTTPS; with\n"
            "--client-ca-file it answers only callers presenting a certificate from that CA\n"
            "(kube-scheduler's tlsConfig). SIGTERM stops it."
        ),
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--listen", metavar="HOST:PORT", default=DEFAULT_LISTEN, help=f"address to serve on (default {DEFAULT_LISTEN})")
    parser.add_argument("--path-prefix", metavar="PATH", default="/scheduler", help="the urlPrefix's path: verbs are served under it (default /scheduler)")
    parser.add_argument(
        "--agent-url", metavar="TEMPLATE", default=DEFAULT_AGENT_URL,
        help=f"each node's agent: {{node}} is the node's name, {{address}} its InternalIP from the Node object (default {DEFAULT_AGENT_URL})",
    )
    parser.add_argument("--agent-token-file", metavar="FILE", help="the agents' bearer token (needed by --bind to reserve GPUs)")
    parser.add_argument("--agent-timeout", type=float, default=2.0, metavar="SECONDS", help="how long each node's agent may take to answer (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, metavar="N", help="agents asked at once by the scheduling calls, and again by the background sweeps (default 32)")
    parser.add_argument("--call-timeout", type=float, default=4.0, metavar="SECONDS",
                        help="a filter or prioritize answers within this, nodes not answered by then marked so (default 4: "
                             "below kube-scheduler's httpTimeout, 5 s as shipped)")
    parser.add_argument("--max-nodes", type=int, default=5000, metavar="N",
                        help="candidate nodes in one call at most; more is 400 (default 5000, Kubernetes' largest cluster)")
    parser.add_argument("--node-resync", type=float, default=30.0, metavar="SECONDS",
                        help="how long each watch of the Node objects (names and addresses) runs before it is renewed from "
                             "where it left off, without a list (default 30)")
    parser.add_argument("--requeue-interval", type=float, default=1.0, metavar="SECONDS",
                        help="how often the agents of nodes that rejected a pod are asked whether their capacity changed; "
                             "a change is written on the Node (topoagent.io/capacity), so kube-scheduler retries the pod "
                             "(default 1; 0: off)")
    parser.add_argument("--agent-reads-need-token", action="store_true",
                        help="send the token with reads and dry runs too (agents with http.require_token_for_reads)")
    parser.add_argument(
        "--unanswered", choices=("filter", "pass"), default="filter",
        help="a node whose agent does not answer: filter it out (reason in FailedNodes), or pass it with score 0 (default filter)",
    )
    parser.add_argument("--resource-name", default=DEFAULT_RESOURCE, metavar="NAME", help=f"the extended resource a pod's GPU count is read from (default {DEFAULT_RESOURCE})")
    parser.add_argument("--bind", action="store_true", help="serve the bind verb: lease the GPUs on the node's agent, annotate the pod, create its Binding")
    parser.add_argument("--lease-ttl", type=float, default=float(TTL_MAX_S), metavar="SECONDS",
                        help=f"how long a bind's lease holds the GPUs at most (default {TTL_MAX_S}, a week: the pod watch "
                             "releases it when the pod ends, so a running job never loses its GPUs to the TTL)")
    parser.add_argument(
        "--pod-resync", type=float, default=60.0, metavar="SECONDS",
        help="with --bind: watch the pods and release a pod's lease when it ends or is deleted; list them again and sweep "
             "the agents for leases whose pod is gone this often (default 60; 0: no watch, leases end at --lease-ttl only)",
    )
    holds = parser.add_argument_group("holds (with --bind: big pods do not starve; GET /holds lists them)")
    holds.add_argument("--hold-min-gpus", type=int, default=HOLD_MIN_GPUS, metavar="N",
                       help=f"a pod asking for this many GPUs or more may hold a node (default {HOLD_MIN_GPUS}: the whole NVLink domain of an "
                            "8-GPU NVSwitch node, the largest block pods ask for)")
    holds.add_argument("--hold-after", type=float, default=HOLD_AFTER_S, metavar="SECONDS",
                       help="once such a pod has fit no node this long it holds, among the nodes that can ever take it, the "
                            "one that would free up soonest (by its leases' ages): smaller pods are filtered off that node "
                            f"until the pod binds, is deleted or ends (default {HOLD_AFTER_S:g}; 0: no holds; holds need --pod-resync above 0)")
    holds.add_argument("--hold-guard", type=float, default=HOLD_GUARD_S, metavar="SECONDS",
                       help="from the moment such a pod fits a node again, pods that waited less and would leave that node too "
                            f"few GPUs for it are filtered off it, for this long at most (default {HOLD_GUARD_S:g}: twice kube-scheduler's "
                            "longest backoff; 0: no guards; with --hold-after 0, guards alone)")
    holds.add_argument("--hold-for", type=float, default=HOLD_TTL_S, metavar="SECONDS",
                       help=f"a hold ends after this, its pod still unbound; that pod holds no node again (default {HOLD_TTL_S:g})")
    parser.add_argument("--kube-api", metavar="URL", help="API server (Node objects; binds), as is (e.g. `kubectl proxy`); default: --kubeconfig, else in-cluster")
    parser.add_argument("--kubeconfig", metavar="FILE", help="kubeconfig for the API server (default: in-cluster service account)")
    guard = parser.add_argument_group("connections (as the agent's [http] settings)")
    guard.add_argument("--max-connections", type=int, default=512, metavar="N",
                       help="connections held at most; past it the longest-idle one is closed (default 512)")
    guard.add_argument("--header-timeout", type=float, default=10.0, metavar="SECONDS",
                       help="from connecting (TLS handshake included) to a whole request head, and for a body (default 10)")
    guard.add_argument("--keepalive-timeout", type=float, default=30.0, metavar="SECONDS", help="an idle kept-alive connection is closed after this (default 30)")
    guard.add_argument("--probe-listen", metavar="HOST:PORT",
                       help="also serve /healthz and /readyz alone, over plain HTTP, here: kubelet's probes present no client certificate")
    tls = parser.add_argument_group("TLS (kube-scheduler's enableHTTPS and tlsConfig)")
    tls.add_argument("--tls-cert-file", metavar="FILE", help="serve HTTPS with this PEM certificate (its chain after it), with --tls-key-file")
    tls.add_argument("--tls-key-file", metavar="FILE", help="the certificate's PEM private key, unencrypted")
    tls.add_argument(
        "--client-ca-file", metavar="FILE",
        help="require of every caller a client certificate signed by this PEM CA (kube-scheduler's tlsConfig "
             "certFile/keyFile); kubelet's probes use --probe-listen. Use a CA of its own, "
             "not the cluster's: every certificate the CA signed may call bind",
    )
    tls.add_argument(
        "--insecure-bind-without-client-auth", action="store_true",
        help="let --bind serve on an address other than loopback without --client-ca-file: anyone reaching it can "
             "bind any pending pod to any node and lease GPUs. Only behind another guard that authenticates callers",
    )
    parser.set_defaults(run=run)


def _loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def _tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The listener's TLS from the flags, or None for plain HTTP; UsageError, one line
    naming the flag and the file, for a combination or a file it cannot serve with."""
    if bool(args.tls_cert_file) != bool(args.tls_key_file):
        given, missing = ("--tls-cert-file", "--tls-key-file") if args.tls_cert_file else ("--tls-key-file", "--tls-cert-file")
        raise UsageError(f"{given} needs {missing} too: HTTPS needs the certificate and its key")
    if args.client_ca_file and not args.tls_cert_file:
        raise UsageError("--client-ca-file needs --tls-cert-file and --tls-key-file: client certificates are checked over HTTPS only")
    if not args.tls_cert_file:
        return None
    from topoagent.cluster.extender.tls import TLSFileError, server_context

    try:
        return server_context(args.tls_cert_file, args.tls_key_file, args.client_ca_file)
    except TLSFileError as exc:
        raise UsageError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    from topoagent.config import ConfigError, parse_listen
    from topoagent.documents.lease import TTL_MAX_S, TTL_MIN_S, ttl_problem

    try:
        listen = parse_listen("--listen", args.listen)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    template = args.agent_url
    if not template.startswith(("http://", "https://")) or ("{node}" not in template and "{address}" not in template):
        raise UsageError("--agent-url: expected an http:// or https:// URL with {node} or {address} in it")
    if not args.agent_timeout > 0:
        raise UsageError("--agent-timeout must be above 0")
    if args.concurrency < 1:
        raise UsageError("--concurrency must be at least 1")
    if not 0 < args.call_timeout <= 600:
        raise UsageError("--call-timeout must be above 0 and at most 600 seconds (below kube-scheduler's httpTimeout)")
    if not 1 <= args.max_nodes <= 1_000_000:
        raise UsageError("--max-nodes must be from 1 to 1000000")
    if not (args.requeue_interval == 0 or 0.1 <= args.requeue_interval <= 3600):
        raise UsageError("--requeue-interval must be 0 (off) or between 0.1 and 3600 seconds")
    if not 1 <= args.node_resync <= 24 * 3600:
        raise UsageError("--node-resync must be between 1 and 86400 seconds")
    if not 1 <= args.max_connections <= 1_000_000:
        raise UsageError("--max-connections must be from 1 to 1000000")
    if not (0 < args.header_timeout <= 3600 and 0 < args.keepalive_timeout <= 3600):
        raise UsageError("--header-timeout and --keepalive-timeout must be above 0 and at most 3600 seconds")
    probe_listen = None
    if args.probe_listen:
        try:
            probe_listen = parse_listen("--probe-listen", args.probe_listen)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    if ttl_problem(args.lease_ttl):  # the agents' own rule: they would refuse every bind's lease
        raise UsageError(f"--lease-ttl must be from {TTL_MIN_S} s to a week ({TTL_MAX_S})")
    if not (args.pod_resync == 0 or 1 <= args.pod_resync <= 24 * 3600):
        raise UsageError("--pod-resync must be 0 (no pod watch) or between 1 and 86400 seconds")
    if not 1 <= args.hold_min_gpus <= 4096:
        raise UsageError("--hold-min-gpus must be from 1 to 4096")
    if not (args.hold_after == 0 or 0.1 <= args.hold_after <= 24 * 3600):
        raise UsageError("--hold-after must be 0 (no holds) or between 0.1 and 86400 seconds")
    if not (args.hold_guard == 0 or 0.1 <= args.hold_guard <= 24 * 3600):
        raise UsageError("--hold-guard must be 0 (no guards) or between 0.1 and 86400 seconds")
    if not 1 <= args.hold_for <= 7 * 24 * 3600:
        raise UsageError("--hold-for must be between 1 second and a week")
    if not args.path_prefix.startswith("/"):
        raise UsageError("--path-prefix must start with /")
    tls = _tls_context(args)
    exposed = not _loopback(listen.host)
    if args.bind and exposed and not args.client_ca_file and not args.insecure_bind_without_client_auth:
        raise UsageError(
            f"--bind on {args.listen} (not loopback) without --client-ca-file lets anyone who reaches it bind any pending pod "
            "to any node: give --client-ca-file (with --tls-cert-file, --tls-key-file), or --insecure-bind-without-client-auth"
        )
    token = read_client_token("--agent-token-file", args.agent_token_file) if args.agent_token_file else None
    if args.bind and token is None:
        raise UsageError("--bind reserves GPUs on the agents: give --agent-token-file")

    from topoagent.cluster.extender.app import Settings
    from topoagent.vocabulary import Unanswered

    # Always: the Node objects say which nodes exist and where their agents are.
    try:
        from topoagent.cluster.extender.kube import Kube

        kube = Kube(args.kube_api, args.kubeconfig)
    except ImportError as exc:
        raise UsageError(f"the extender needs the kubernetes extra (pip install 'topoagent[kubernetes]'): {exc}") from None
    except Exception as exc:  # the client's config loaders raise their own types
        raise UsageError(f"no Kubernetes API to read the Node objects from: {exc} (give --kube-api or --kubeconfig)") from None
    settings = Settings(resource=args.resource_name, unanswered=Unanswered(args.unanswered), lease_ttl_s=args.lease_ttl,
                        prefix=args.path_prefix, require_client_certificate=bool(args.client_ca_file), pod_resync_s=args.pod_resync,
                        max_nodes=args.max_nodes, call_timeout_s=args.call_timeout, body_timeout_s=args.header_timeout,
                        hold_min_gpus=args.hold_min_gpus, hold_after_s=args.hold_after, hold_ttl_s=args.hold_for,
                        hold_guard_s=args.hold_guard)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    if exposed and not args.client_ca_file:
        from topoagent.log import log_event

        # Loud on purpose: every start says so, in the log an operator reads.
        log_event("unauthenticated_callers", logging.WARNING, listen=args.listen,
                  answers="filter, prioritize" + (", bind (--insecure-bind-without-client-auth)" if args.bind else ""),
                  fix="--client-ca-file")
    return asyncio.run(_serve(listen.host, listen.port, settings, template, args, token, kube, tls, probe_listen))


class _OncePerMinute(logging.Filter):
    """One line a minute per kind of connection error (a flood of clients that hang up is
    one line, with how many were held back), where aiohttp would log one per connection."""

    def __init__(self) -> None:
        super().__init__()
        from topoagent.connections import LOG_INTERVAL_S

        self.interval_s = LOG_INTERVAL_S
        self._last: dict[str, tuple[float, int]] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        import time

        key = str(record.msg).split(" error=", 1)[-1].split(":", 1)[0][:80]
        now = time.monotonic()
        last, held = self._last.get(key, (float("-inf"), 0))
        if now - last < self.interval_s:
            self._last[key] = (last, held + 1)
            return False
        if len(self._last) > 64:
            self._last.clear()
        self._last[key] = (now, 0)
        if held:
            record.msg = f"{record.msg} suppressed={held}"
        return True


async def _serve(host: str, port: int, settings: Settings, template: str, args: argparse.Namespace, token: str | None, kube: Kube,
                 tls: ssl.SSLContext | None, probe_listen: Listen | None) -> int:
    from aiohttp import web

    from topoagent.cluster.extender.app import make_app, make_probe_app
    from topoagent.cluster.extender.nodes import Agents
    from topoagent.cluster.extender.nodetable import NodeTable
    from topoagent.connections import ConnectionGuard, OneLineProtocolErrors, Throttled, loop_exception_handler, raise_open_file_limit

    loop = asyncio.get_running_loop()
    # The agent's defences: resource errors once a minute, bounded and timed connections,
    # a parser's complaint one line.
    loop.set_exception_handler(loop_exception_handler(Throttled()))
    server_log = logging.getLogger("topoagent.cluster.extender.http")
    server_log.addFilter(OneLineProtocolErrors())
    server_log.addFilter(_OncePerMinute())
    guard = ConnectionGuard(max_connections=args.max_connections, header_timeout_s=args.header_timeout,
                            keepalive_timeout_s=args.keepalive_timeout, open_files=raise_open_file_limit())
    table = NodeTable(kube, resync_s=args.node_resync)
    agents = Agents(template, table, timeout_s=args.agent_timeout, concurrency=args.concurrency, token=token,
                    token_on_reads=args.agent_reads_need_token)
    from topoagent.cluster.extender.requeue import Requeue

    requeue = Requeue(agents, kube, interval_s=args.requeue_interval) if args.requeue_interval > 0 else None
    runner = web.AppRunner(make_app(agents, settings, kube if args.bind else None, guard, requeue), access_log=None, logger=server_log,
                           keepalive_timeout=args.keepalive_timeout, lingering_time=min(10.0, args.header_timeout))
    await runner.setup()
    assert runner.server is not None
    probes: web.AppRunner | None = None
    try:
        listener = await guard.listen(runner.server, host, port, ssl=tls)
        if probe_listen is not None:
            probe_guard = ConnectionGuard(max_connections=64, header_timeout_s=args.header_timeout, keepalive_timeout_s=args.keepalive_timeout)
            probes = web.AppRunner(make_probe_app(), access_log=None, logger=server_log)
            await probes.setup()
            assert probes.server is not None
            await probe_guard.listen(probes.server, probe_listen.host, probe_listen.port)
    except OSError as exc:
        await runner.cleanup()
        if probes is not None:
            await probes.cleanup()
        raise UsageError(f"cannot listen: {exc.strerror or exc}") from None
    bound = listener.sockets[0].getsockname()[1] if listener.sockets else port
    shown = f"[{host}]" if ":" in host else host
    verbs = "filter, prioritize" + (", bind" if kube is not None else "")
    scheme = "https" if tls is not None else "http"
    callers = f"; callers need a certificate from {args.client_ca_file}" if args.client_ca_file else ""
    print(f"topoagent extender on {scheme}://{shown}:{bound}{settings.prefix.rstrip('/')} ({verbs}{callers}); agents at {template}", flush=True)
    if probe_listen is not None:
        print(f"  probes (/healthz, /readyz) on http://{args.probe_listen}", flush=True)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    await stopping.wait()
    listener.close()
    await runner.cleanup()
    if probes is not None:
        await probes.cleanup()
    return 0
