"""The extender's HTTP service (aiohttp): ``{prefix}/filter``, ``{prefix}/prioritize``,
``{prefix}/bind`` (with a Kubernetes API to bind through), ``/holds`` (see ``holds``), ``/metrics``,
``/healthz`` and ``/readyz``.

With client certificates required (``--client-ca-file``, see ``tls``) a caller without one
never completes the handshake; the middleware refusing one (403) is a second guard.  The
probes have an app of their own (``make_probe_app``, ``--probe-listen``).  Candidate nodes
are resolved through the API server's table (``nodetable``) only.

kube-scheduler calls filter, then prioritize, for each pod it is configured to send (a
pod requesting a ``managedResources`` entry), then bind for the node it chose when
``bindVerb`` is set.  A body that is not the extender API's document is 400 with
``{"error", "detail"}``; everything about a pod or a node is answered inside the API's own
documents (``FailedNodes``, ``Score`` 0, ``Error`` of a bind), so one slow or broken agent
never fails a scheduling cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from topoagent.cluster.deviceplugin.pods import ANNOTATION as GPUS_ANNOTATION
from topoagent.cluster.extender import HOLD_AFTER_S, HOLD_GUARD_S, HOLD_MIN_GPUS, HOLD_TTL_S
from topoagent.cluster.extender.holds import Holds, NodeLoad, keep
from topoagent.cluster.extender.kube import Kube, KubeError
from topoagent.cluster.extender.metrics import ExtenderCollector, render
from topoagent.cluster.extender.nodes import Agents, Refused, Unreachable, Verdict, scores
from topoagent.cluster.extender.requeue import Requeue
from topoagent.cluster.extender.tls import peer_subject
from topoagent.cluster.extender.wire import (
    DEFAULT_RESOURCE,
    LEASE_ANNOTATION,
    ExtenderArgs,
    PodError,
    PodRef,
    WireError,
    filter_result,
    host_priorities,
    parse_binding_args,
    parse_extender_args,
    pod_ref,
    pod_request,
)
from topoagent.cluster.podwatch import PodWatch
from topoagent.connections import ConnectionGuard
from topoagent.documents.lease import OWNER_MAX_LEN
from topoagent.log import log_event
from topoagent.text import cut
from topoagent.vocabulary import Unanswered

MAX_BODY_BYTES = 64 * 1024 * 1024  # a NodeList of a few thousand full Node objects
PARSE_IN_THREAD_BYTES = 256 * 1024  # a larger body is parsed off the event loop: /healthz stays answered


@dataclass(frozen=True, slots=True)
class Settings:
    resource: str = DEFAULT_RESOURCE
    unanswered: Unanswered = Unanswered.FILTER
    lease_ttl_s: float = 600.0
    prefix: str = "/scheduler"
    max_body_bytes: int = MAX_BODY_BYTES
    # The listener asks for client certificates (--client-ca-file): refuse callers without one.
    require_client_certificate: bool = False
    # With a Kubernetes API: how often the pod watch lists again (0: no watch, leases end by TTL only).
    pod_resync_s: float = 60.0
    # kube-scheduler sends the nodes that passed its own filters: at most the cluster's nodes.
    max_nodes: int = 5000
    # A filter or prioritize answers within this (below kube-scheduler's httpTimeout, 5 s as shipped).
    call_timeout_s: float = 4.0
    # A request body must arrive within this of its head.
    body_timeout_s: float = 10.0
    # Holds and guards (see ``holds``; with the pod watch only): a pod asking for this many GPUs or
    # more that fit no node keeps each node that can fit it now from pods that waited less, for
    # hold_guard_s at most (0: no guards); after hold_after_s it holds the node it may drain for
    # hold_ttl_s at most (0: no holds).
    hold_min_gpus: int = HOLD_MIN_GPUS
    hold_after_s: float = HOLD_AFTER_S
    hold_ttl_s: float = HOLD_TTL_S
    hold_guard_s: float = HOLD_GUARD_S


SETTINGS = web.AppKey("settings", Settings)
VERBS: web.AppKey[dict[str, int]] = web.AppKey("verbs")  # verb -> calls, for /metrics
BINDS: web.AppKey[dict[str, int]] = web.AppKey("binds")  # result -> binds
AGENTS = web.AppKey("agents", Agents)
KUBE = web.AppKey("kube", Kube)
WATCH = web.AppKey("pod_watch", PodWatch)
REQUEUE = web.AppKey("requeue", Requeue)
HOLDS = web.AppKey("holds", Holds)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, error: str, detail: str) -> web.Response:
    return web.json_response({"error": error, "detail": detail}, status=status)


class BodyTimeout(Exception):
    """The body did not arrive in time: 408, and the connection closed."""


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except WireError as exc:
        return _error(400, "bad_request", str(exc))
    except BodyTimeout as exc:
        resp = _error(408, "request_timeout", str(exc))
        resp.force_close()  # the unread rest must not be taken for the next request
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(exc.status, "http_error", exc.text or exc.reason)
    except ConnectionResetError:
        raise
    except Exception as exc:  # a bug: say so plainly, keep serving
        log_event("extender_handler_crashed", logging.ERROR, path=request.path, error=f"{type(exc).__name__}: {exc}")
        return _error(500, "internal", "internal error; see the extender's log")


def _peercert(request: web.Request) -> dict[str, Any] | None:
    """The caller's certificate as TLS verified it; None over plain HTTP or without one."""
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    return cert if isinstance(cert, dict) and cert else None


@web.middleware
async def client_certificates(request: web.Request, handler: Handler) -> web.StreamResponse:
    # By the route matched, not the path as written: no spelling of a path reaches a verb.
    if request.match_info.handler in PROBES or _peercert(request) is not None:
        return await handler(request)
    return _error(403, "client_certificate_required",
                  "this extender answers only callers with a client certificate from its --client-ca-file (kube-scheduler's "
                  "tlsConfig certFile/keyFile); /healthz and /readyz answer without one")


async def _body(request: web.Request) -> Any:
    timeout_s = request.app[SETTINGS].body_timeout_s
    try:
        async with asyncio.timeout(timeout_s):  # a body sent a byte a minute holds a connection
            raw = await request.read()  # 413 past client_max_size
    except TimeoutError:
        raise BodyTimeout(f"the request body did not arrive within {timeout_s:g} s") from None
    except RuntimeError as exc:  # aiohttp's "Connection closed.": the client left mid-body, nothing to answer
        raise ConnectionResetError(str(exc)) from None
    try:
        return await asyncio.to_thread(json.loads, raw) if len(raw) > PARSE_IN_THREAD_BYTES else json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise WireError(f"body: not valid JSON: {cut(str(exc), 120)}") from None


def _args(settings: Settings, doc: Any) -> ExtenderArgs:
    return parse_extender_args(doc, settings.max_nodes)


def _log_unanswered(settings: Settings, verdicts: list[Verdict]) -> None:
    """One line per call, however many nodes fell silent in it (each once per silence)."""
    silent = [v for v in verdicts if not v.answered and v.asked]
    if silent:
        names = ",".join(v.node for v in silent[:5]) + (f",+{len(silent) - 5} more" if len(silent) > 5 else "")
        log_event("agent_unanswered", logging.WARNING, node=names, nodes=len(silent), reason=silent[0].reason, treated_as=settings.unanswered)


def _wanted(settings: Settings, args: ExtenderArgs) -> tuple[dict[str, Any] | None, str | None]:
    """(request, None), or (None, why) when the pod asks for something no node can give."""
    try:
        return pod_request(args.pod, settings.resource), None
    except PodError as exc:
        return None, str(exc)


async def filter_nodes(request: web.Request) -> web.Response:
    settings, agents = request.app[SETTINGS], request.app[AGENTS]
    request.app[VERBS]["filter"] += 1
    deadline = time.monotonic() + settings.call_timeout_s
    args = _args(settings, await _body(request))
    wanted, problem = _wanted(settings, args)
    names = [c.name for c in args.candidates]
    if problem is not None:
        return web.json_response(filter_result(args, [], {}, {name: problem for name in names}))
    if wanted is None:  # no GPU asked: nothing for us to say against any node
        return web.json_response(filter_result(args, names, {}, {}))
    passed, failed, unresolvable = [], {}, {}
    verdicts = await agents.verdicts(args.candidates, wanted, deadline - time.monotonic())
    for verdict in verdicts:
        if verdict.fits or (not verdict.answered and settings.unanswered is Unanswered.PASS and verdict.node in agents.table):
            passed.append(verdict.node)
        elif verdict.resolvable:
            failed[verdict.node] = verdict.reason
        else:
            unresolvable[verdict.node] = verdict.reason
    _log_unanswered(settings, verdicts)
    holds = request.app.get(HOLDS)
    if holds is not None:
        holds.honour(pod_ref(args.pod), wanted["gpus"], passed, unresolvable, {v.node: v.free for v in verdicts if v.fits})
    requeue = request.app.get(REQUEUE)
    if requeue is not None:
        for verdict in verdicts:  # a change on these nodes may let the pod in: watch them for one
            if not verdict.fits and verdict.node in agents.table and (verdict.resolvable or not verdict.answered):
                requeue.rejected(verdict.node)
    return web.json_response(filter_result(args, passed, failed, unresolvable))


async def prioritize(request: web.Request) -> web.Response:
    settings, agents = request.app[SETTINGS], request.app[AGENTS]
    request.app[VERBS]["prioritize"] += 1
    deadline = time.monotonic() + settings.call_timeout_s
    args = _args(settings, await _body(request))
    wanted, _ = _wanted(settings, args)
    if wanted is None:
        return web.json_response(host_priorities({c.name: 0 for c in args.candidates}))
    return web.json_response(host_priorities(scores(await agents.verdicts(args.candidates, wanted, deadline - time.monotonic()))))


async def bind(request: web.Request) -> web.Response:
    settings, agents = request.app[SETTINGS], request.app[AGENTS]
    kube = request.app.get(KUBE)
    if kube is None:
        raise web.HTTPNotFound(text="bind is off: start the extender with --bind (and a Kubernetes API to bind through)")
    request.app[VERBS]["bind"] += 1
    args = parse_binding_args(await _body(request))
    # Who asked, before anything is leased or bound: the audit trail of every bind.
    log_event("bind_asked", pod=f"{args.pod_namespace}/{args.pod_name}", node=args.node, caller=peer_subject(_peercert(request)))

    def _bind_result(error: str = "") -> web.Response:
        request.app[BINDS]["failed" if error else "bound"] += 1
        holds = request.app.get(HOLDS)
        if holds is not None and not error:
            holds.forget(args.pod_uid, "bound")
        return web.json_response({"Error": error})

    pod_name = f"{args.pod_namespace}/{args.pod_name}"
    try:
        pod = await kube.pod(args.pod_namespace, args.pod_name)
        ref = pod_ref(pod)
        meta = pod.get("metadata")
        version = meta.get("resourceVersion") if isinstance(meta, dict) else None
        version = version if isinstance(version, str) else None
        if ref.uid != args.pod_uid:
            return _bind_result(f"pod {pod_name} has UID {ref.uid}, not {args.pod_uid}: it was replaced")
        spec = pod.get("spec")
        bound_to = spec.get("nodeName") if isinstance(spec, dict) else None
        if bound_to:  # a retried bind that went through: lease nothing more
            return _bind_result(f"pod {pod_name} is already bound to node {bound_to}")
        try:
            wanted = pod_request(pod, settings.resource)
        except PodError as exc:
            return _bind_result(f"pod {pod_name}: {exc}")
        if wanted is not None and args.node not in agents.table:
            await agents.table.refresh([args.node])  # a node that joined a moment ago
        if wanted is None:
            await kube.bind(args.pod_namespace, args.pod_name, args.pod_uid, args.node, resource_version=version)
            return _bind_result()
        return _bind_result(await _reserve_and_bind(request.app, ref, version, args.node, wanted))
    except KubeError as exc:
        log_event("bind_failed", logging.WARNING, pod=pod_name, node=args.node, error=str(exc))
        return _bind_result(str(exc))


async def _reserve_and_bind(app: web.Application, ref: PodRef, version: str | None, node: str, wanted: dict[str, Any]) -> str:
    """Lease the GPUs, bind the pod with them written on it; '' or what went wrong (the
    lease released again when anything after it failed).

    The annotations travel in the Binding, which the API server applies only to the pod
    as it was read (UID and resourceVersion): of two binds of one pod at once, one binds
    with its lease on the pod, the other fails and releases its own."""
    settings, agents, kube = app[SETTINGS], app[AGENTS], app[KUBE]
    try:
        answer = await agents.reserve(node, wanted, ref.owner(OWNER_MAX_LEN), settings.lease_ttl_s)
    except Refused as refused:
        return f"node {node} cannot take pod {ref}: {refused.reason}"
    except Unreachable as exc:
        if settings.unanswered is Unanswered.PASS:
            # As configured: the node passes without its agent, so it binds without GPUs
            # chosen (the device plugin then asks the node's agent itself).
            log_event("bound_without_agent", logging.WARNING, pod=str(ref), node=node, reason=str(exc))
            await kube.bind(ref.namespace, ref.name, ref.uid, node, resource_version=version)
            return ""
        return f"node {node}: {exc}"
    lease_id = answer["lease"]["id"]
    uuids = [g["uuid"] for g in answer["gpus"] if isinstance(g, dict) and isinstance(g.get("uuid"), str) and g["uuid"]]
    try:
        if len(uuids) != wanted["gpus"] or len(uuids) != len(answer["gpus"]):
            raise KubeError(f"node {node}'s agent does not name every GPU by UUID; the device plugin could not be told")
        watch = app.get(WATCH)
        if watch is not None:
            watch.note_node(node)  # its agent is swept for leases whose pod is gone
        await kube.bind(ref.namespace, ref.name, ref.uid, node, {GPUS_ANNOTATION: ",".join(uuids), LEASE_ANNOTATION: lease_id}, version)
    except KubeError as exc:
        released = await agents.release(node, lease_id)
        log_event("bind_failed", logging.WARNING, pod=str(ref), node=node, error=str(exc), lease=lease_id, released=released)
        return str(exc) if released else f"{exc} (and lease {lease_id} could not be released; it ends in {settings.lease_ttl_s:g} s)"
    log_event("bound", pod=str(ref), node=node, gpus=",".join(uuids), lease=lease_id)
    return ""


async def metrics(request: web.Request) -> web.Response:
    page = render(ExtenderCollector(request.app[AGENTS], request.app[VERBS], request.app[BINDS], request.app.get(REQUEUE),
                                    request.app.get(HOLDS)))
    return web.Response(body=page, headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})


async def list_holds(request: web.Request) -> web.Response:
    holds = request.app.get(HOLDS)
    if holds is None:
        raise web.HTTPNotFound(text="holds are off: they need --bind (its pod watch) and --hold-after or --hold-guard above 0")
    return web.json_response(holds.document())


async def node_loads(agents: Agents) -> dict[str, NodeLoad]:
    """The GPU counts and leases of every node whose agent answers now (``Agents.each``):
    only while a large pod is due a hold."""

    async def one(node: str) -> tuple[str, NodeLoad] | None:
        try:
            async with asyncio.timeout(agents.timeout_s):
                _, counts = await agents.capacity(node, counted=False)
        except (TimeoutError, Unreachable, Refused):  # silent or not ready: not a node to hold
            return None
        leases = await agents.leases(node) if counts["free_gpus"] < counts["gpus"] else []
        held = tuple((lease["created_at"], len(lease["gpus"])) for lease in leases or []
                     if isinstance(lease.get("created_at"), (int, float)) and isinstance(lease.get("gpus"), list))
        return node, NodeLoad(counts["gpus"], counts["free_gpus"], held)

    answers = await agents.each(agents.table.names(), one)
    return dict(a for a in answers if a is not None)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


async def readyz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ready"})


PROBES = (healthz, readyz)  # kubelet's probes: no client certificate to present


def make_probe_app() -> web.Application:
    """/healthz and /readyz alone (--probe-listen, plain HTTP): kubelet's probes present no
    client certificate, which the main listener requires with --client-ca-file."""
    app = web.Application(client_max_size=1024)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


def while_serving(loop: Callable[[], Awaitable[None]]) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup context that runs ``loop`` as a task while the app serves, and cancels it
    (and waits for it to end) when the app stops."""

    async def lifetime(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.ensure_future(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return lifetime


def make_app(agents: Agents, settings: Settings, kube: Kube | None = None, guard: ConnectionGuard | None = None,
             requeue: Requeue | None = None) -> web.Application:
    """The app; ``guard`` (the listener's) is told where each request starts and ends, to
    time idle connections."""
    middlewares: list[Any] = [client_certificates, json_errors] if settings.require_client_certificate else [json_errors]
    if guard is not None:
        middlewares.insert(0, guard.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=settings.max_body_bytes)
    app[SETTINGS] = settings
    app[AGENTS] = agents
    app[VERBS] = {"filter": 0, "prioritize": 0, "bind": 0}
    app[BINDS] = {"bound": 0, "failed": 0}
    if kube is not None:
        app[KUBE] = kube

    async def session_lifetime(app: web.Application) -> AsyncIterator[None]:
        yield
        await agents.close()

    app.cleanup_ctx.append(session_lifetime)
    if requeue is not None:
        app[REQUEUE] = requeue
        app.cleanup_ctx.append(while_serving(requeue.run))
    if agents.table.api is not None:
        table = agents.table

        async def node_table_lifetime(app: web.Application) -> AsyncIterator[None]:
            # The first list before the first call: nodes are known from the start; the watch goes on from it.
            version = await table.list_now()
            async for _ in while_serving(lambda: table.run(version))(app):
                yield

        app.cleanup_ctx.append(node_table_lifetime)
    if kube is not None and settings.pod_resync_s > 0:
        holds = None
        if settings.hold_after_s > 0 or settings.hold_guard_s > 0:  # the pod watch tells when a holder binds, ends or is deleted
            app[HOLDS] = holds = Holds(min_gpus=settings.hold_min_gpus, after_s=settings.hold_after_s, ttl_s=settings.hold_ttl_s,
                                       guard_s=settings.hold_guard_s, resource=settings.resource)
            app.cleanup_ctx.append(while_serving(lambda: keep(holds, lambda: node_loads(agents))))
        app[WATCH] = watch = PodWatch(kube, agents, resync_s=settings.pod_resync_s, cluster_nodes=agents.table.names,
                                      on_event=holds.observe if holds is not None else None)
        # After the agents' session: cleanup runs in reverse, so the watch stops before it closes.
        app.cleanup_ctx.append(while_serving(watch.run))
    prefix = settings.prefix.rstrip("/")
    app.router.add_post(f"{prefix}/filter", filter_nodes)
    app.router.add_post(f"{prefix}/prioritize", prioritize)
    app.router.add_post(f"{prefix}/bind", bind)
    app.router.add_get("/holds", list_holds)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app
