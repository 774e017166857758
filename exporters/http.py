"""The agent's HTTP API (aiohttp): /topology, /place, /leases, /metrics, health, OpenAPI.

Built by `make_app(agent, token)`; shared state lives under typed `web.AppKey`s and the
agent's background work starts and stops with the app through `cleanup_ctx`.  The handlers
see the agent only through the `Service` interface and render from its `served()` value.  Every
error is JSON `{"error": ..., "detail": ...}`; a bad field is named in `detail`.
"""

from __future__ import annotations

import asyncio
import gzip
import hmac
import ipaddress
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any

from aiohttp import web
from aiohttp.web_urldispatcher import _default_expect_handler

from topoagent.config import Config
from topoagent.connections import ConnectionGuard
from topoagent.documents.agent import answer_document, lease_document
from topoagent.documents.lease import LEASE_ID, owner_problem, ttl_problem
from topoagent.exporters.prometheus import HttpCollector, MetricsPage
from topoagent.exporters.ratelimit import RateLimiter, client_key
from topoagent.log import log_event
from topoagent.node.findings import placement_refusals
from topoagent.placement import NoFit, Request, RequestError, parse_request
from topoagent.service.interface import ProbeRunning, ProbesOff, Service, StateUnavailable
from topoagent.service.leases import LeaseConflict, LeaseError
from topoagent.service.served import DiscoveryRetry, Served, Snapshot, etag_of
from topoagent.text import cut
from topoagent.vocabulary import NOT_READY_FOR_PLACEMENT, FindingKind

AGENT = web.AppKey("agent", Service)


class Token:
    """The bearer token; b"" = no token file, mutating endpoints off.  SIGHUP may swap it."""

    def __init__(self, value: bytes = b"") -> None:
        self.value = value


TOKEN = web.AppKey("token", Token)
METRICS = web.AppKey("metrics", MetricsPage)
# The OpenAPI document, made on the first GET /openapi.json (the agent need not hold it).
OPENAPI = web.AppKey("openapi", list)
RATE = web.AppKey("rate", RateLimiter)
REFUSED = web.AppKey("refused", dict)  # requests refused before a handler: reason -> count

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(Exception):
    def __init__(self, status: int, error: str, detail: str, extra: dict[str, Any] | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail, self.extra = status, error, detail, extra or {}
        self.headers = headers or {}


def error_response(status: int, error: str, detail: str, headers: dict[str, str] | None = None, **extra: Any) -> web.Response:
    headers = {**({"WWW-Authenticate": "Bearer"} if status == 401 else {}), **(headers or {})}
    return web.json_response({"error": error, "detail": detail, **extra}, status=status, headers=headers)


_HTTP_ERRORS = {400: "bad_request", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


@web.middleware
async def json_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ApiError as exc:
        resp = error_response(exc.status, exc.error, exc.detail, exc.headers, **exc.extra)
        if exc.status in (408, 413):
            resp.force_close()  # the unread body must not be taken for the next request
        return resp
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        detail = exc.text or exc.reason
        if exc.status == 413:
            detail = f"request body is larger than {request.app[AGENT].config.max_body_bytes} bytes"
        resp = error_response(exc.status, _HTTP_ERRORS.get(exc.status, "http_error"), detail)
        if exc.status == 405 and "Allow" in exc.headers:
            resp.headers["Allow"] = exc.headers["Allow"]
        return resp
    except ConnectionResetError:
        raise  # the client went away mid-request: nothing to answer, not a bug
    except Exception as exc:  # a bug: say so plainly, keep serving
        log_event("handler_crashed", logging.ERROR, path=request.path, error=f"{type(exc).__name__}: {exc}")
        return error_response(500, "internal", "internal error; see the agent's log")


# The longest search a caller without the token may ask for (`deadline_ms`); more is capped.
OPEN_DEADLINE_MS_MAX = 1000


def _token_ok(request: web.Request) -> bool:
    token = request.app[TOKEN].value
    header = request.headers.get("Authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not given:
        return False
    # aiohttp hands header bytes that are not UTF-8 over as surrogates ("Bearer \xe9"):
    # encode them back, byte for byte, instead of failing on them.
    return hmac.compare_digest(given.strip().encode("utf-8", "surrogateescape"), token)


def limit_rate(request: web.Request) -> None:
    """429 when this client has spent its share of changes (a token bucket per address)."""
    limiter = request.app[RATE]
    config = request.app[AGENT].config
    limiter.configure(config.rate_limit_per_s, config.rate_limit_burst)  # SIGHUP may change them
    client = client_key(request.remote)
    wait = limiter.take(client)
    if wait > 0:
        request.app[REFUSED]["rate_limited"] += 1
        retry = RateLimiter.retry_after(wait)
        raise ApiError(
            429, "too_many_requests",
            f"too many changes from {client}: {config.rate_limit_burst} at once, then {config.rate_limit_per_s:g} a second; retry in {retry} s",
            headers={"Retry-After": str(retry)},
        )


def require_token(request: web.Request) -> None:
    """The gate of every endpoint that changes something: the token, then the rate limit.

    A refusal for want of a token costs the agent nothing; what the rate bounds is the
    work a change costs (a lease written and synced, a discovery run, a probe round)."""
    if not request.app[TOKEN].value:
        raise ApiError(403, "forbidden", "mutating endpoints are off: the agent was started without --token-file")
    if not _token_ok(request):
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token> (the agent's --token-file)")
    limit_rate(request)


OPEN_PATHS = {"/healthz", "/readyz"}


class AllowedHosts:
    """The Host header values this agent answers to.

    A page that rebinds its own DNS name to this node's address makes the browser send
    that name in Host; refusing names we do not know keeps such a page from reading the
    API through a browser on the node.  An IP literal cannot be rebound, so any passes;
    names pass when they are localhost, this machine's name, or listed in
    [http] allowed_hosts ("*" there turns the check off)."""

    def __init__(self, config: Config, hostname: str | None = None) -> None:
        self.configure(config, hostname)

    def configure(self, config: Config, hostname: str | None = None) -> None:
        name = (hostname if hostname is not None else socket.gethostname()).lower().rstrip(".")
        names = {"localhost", name, name.split(".", 1)[0], config.listen.host.lower(), *config.allowed_hosts}
        self.any = "*" in names
        self.names = frozenset(n for n in names if n and n != "*")
        self._source = config.allowed_hosts, config.listen

    def refresh(self, config: Config) -> None:
        if (config.allowed_hosts, config.listen) != self._source:
            self.configure(config)

    def allows(self, header: str | None) -> bool:
        if header is None or self.any:
            return True  # no Host at all: HTTP/1.0, never a browser
        host = header.strip().lower()
        if host.startswith("["):  # [v6]:port
            literal, sep, rest = host[1:].partition("]")
            return bool(sep) and (not rest or _is_port(rest)) and _is_ip(literal)
        name, sep, port = host.rpartition(":")
        if not sep or not _is_port(sep + port):
            name = host
        name = name.rstrip(".")
        return _is_ip(name) or name in self.names


def _is_port(text: str) -> bool:
    return text.startswith(":") and text[1:].isascii() and text[1:].isdigit() and len(text) <= 6


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


HOSTS = web.AppKey("hosts", AllowedHosts)


@web.middleware
async def host_check(request: web.Request, handler: Handler) -> web.StreamResponse:
    hosts = request.app[HOSTS]
    hosts.refresh(request.app[AGENT].config)
    header = request.headers.get("Host")
    if not hosts.allows(header):
        request.app[REFUSED]["misdirected_host"] += 1
        shown = cut(json.dumps(header), 80)  # json: control characters and stray bytes escaped
        raise ApiError(421, "misdirected_request", f"Host {shown} is not a name this agent answers to; add it to [http] allowed_hosts")
    return await handler(request)


@web.middleware
async def read_auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    agent = request.app[AGENT]
    guarded = agent.config.require_token_for_reads and request.path not in OPEN_PATHS and request.app[TOKEN].value
    if guarded and not _token_ok(request):
        raise ApiError(401, "unauthorized", "this agent requires Authorization: Bearer <token> for reads too")
    return await handler(request)


def _ready_snapshot(served: Served, *, readyz: bool = False) -> Snapshot:
    """The snapshot, or 503 ``not_ready`` before the first: discovery is running, or it
    failed and is tried again (why, and when; /readyz adds it as ``discovery``)."""
    snapshot = served.snapshot
    if snapshot is None:
        retry = served.discovery_retry
        if retry is None:
            raise ApiError(503, "not_ready", "no topology loaded yet; discovery is running")
        raise ApiError(
            503, "not_ready",
            f"no topology loaded yet: discovery failed ({retry.failures} in a row): {retry.error}; "
            f"next try in {max(0.0, retry.retry_at - time.time()):.1f} s",
            {"discovery": _discovery_retry(retry)} if readyz else None,
        )
    return snapshot


def _discovery_retry(retry: DiscoveryRetry) -> dict[str, Any]:
    return {"error": retry.error, "failures": retry.failures, "failed_at": retry.failed_at, "retry_at": retry.retry_at,
            "retry_in_s": round(max(0.0, retry.retry_at - time.time()), 1)}


# -- request validation -------------------------------------------------------------------


def parse_place_request(doc: Any, known_gpus: set[int]) -> tuple[Request, dict[str, Any] | None, str | None]:
    """The typed request (by the one request parser every door uses), HTTP's own `reserve`
    part and a dry run's `lease` (``_holder_lease``), or ApiError 400 naming the field.

    Bad or self-contradictory input is 400 here, as the CLI exits 2 for it; 409 is kept
    for well-formed requests this node cannot satisfy now (busy or leased GPUs), 422 for
    those it could not satisfy with every GPU free (the CLI's exit 3)."""
    if not isinstance(doc, dict):  # the HTTP body, before its `reserve` part is split off
        raise ApiError(400, "bad_request", "body: expected a JSON object")
    fields = {key: value for key, value in doc.items() if key not in ("reserve", "lease")}
    try:
        req = parse_request(fields, gpu_indices=known_gpus)
    except RequestError as exc:
        raise ApiError(400, "bad_request", f"{exc.location}: {exc.message}") from None
    reserve = _parse_reserve(doc["reserve"]) if "reserve" in doc else None
    holder = _holder_lease(doc.get("lease"))
    if "lease" in doc and reserve is not None:
        raise ApiError(400, "bad_request", "lease: a dry run's field; a reserve takes only free GPUs")
    return req, reserve, holder


def _holder_lease(lease: Any) -> str | None:
    """A dry run's `lease`: the id of a lease whose GPUs count as free for this answer, as
    its holder asks (the device plugin, for the bindings of a pod's own GPUs); None without."""
    if lease is None:
        return None
    if not isinstance(lease, str) or not LEASE_ID.fullmatch(lease):
        raise ApiError(400, "bad_request", "lease: expected a lease id")
    return lease


def _parse_reserve(reserve: Any) -> dict[str, Any]:
    if not isinstance(reserve, dict):
        raise ApiError(400, "bad_request", 'reserve: expected {"owner": ..., "ttl_s": ...}')
    unknown = sorted(set(reserve) - {"owner", "ttl_s"})
    if unknown:
        raise ApiError(400, "bad_request", f"reserve: unknown field(s): {', '.join(unknown)}")
    # The lease store's own rules: it grants nothing it would refuse to load.
    owner, ttl = reserve.get("owner"), reserve.get("ttl_s")
    for name, problem in (("owner", owner_problem(owner)), ("ttl_s", ttl_problem(ttl))):
        if problem:
            raise ApiError(400, "bad_request", f"reserve.{name}: {problem}")
    assert isinstance(ttl, (int, float))  # ttl_problem said so
    return {"owner": owner, "ttl_s": float(ttl)}


def _state_unavailable(exc: StateUnavailable) -> ApiError:
    """A state directory that fails under a change (read-only, full, gone): 503 naming it,
    and no log line per request (a caller in a retry loop would flood the log); the lease
    sweeper logs a directory it cannot read, once a minute at most."""
    return ApiError(503, "state_unavailable", str(exc), headers={"Retry-After": "5"})


def _too_large(request: web.Request) -> ApiError | None:
    """413 from the Content-Length header alone, before a byte of the body is read."""
    limit = request.app[AGENT].config.max_body_bytes
    if request.content_length is not None and request.content_length > limit:
        return ApiError(413, "payload_too_large", f"request body is larger than {limit} bytes (Content-Length {request.content_length})")
    return None


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """`Expect: 100-continue`: refuse an oversized body instead of inviting it."""
    error = _too_large(request)
    if error is not None:
        resp = error_response(error.status, error.error, error.detail)
        resp.force_close()
        return resp
    await _default_expect_handler(request)  # writes "100 Continue" itself
    return None


async def read_json(request: web.Request) -> Any:
    # Any Content-Type is read as JSON: `curl -d` sends form-urlencoded by default.
    error = _too_large(request)
    if error is not None:
        raise error
    timeout_s = request.app[AGENT].config.header_timeout_s
    try:
        async with asyncio.timeout(timeout_s):  # a body sent a byte a minute holds a connection
            raw = await request.read()  # raises 413 past client_max_size (chunked bodies)
    except TimeoutError:
        raise ApiError(408, "request_timeout", f"the request body did not arrive within {timeout_s:g} s") from None
    if not raw:
        raise ApiError(400, "bad_request", "body: empty; expected a JSON object")
    try:
        return json.loads(raw, parse_constant=_reject_constant, object_pairs_hook=_no_duplicate_keys)
    except DuplicateKey as exc:
        raise ApiError(400, "bad_request", f"{exc.key}: given twice") from None
    except (ValueError, RecursionError) as exc:
        raise ApiError(400, "bad_request", f"body: not valid JSON: {cut(str(exc), 120)}") from None


class DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = cut(json.dumps(key), 60)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # {"gpus": 2, "gpus": 3}: json.loads would silently keep the last one.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise DuplicateKey(key)
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# -- handlers -------------------------------------------------------------------------------

def query_parameters(request: web.Request, known: tuple[str, ...]) -> dict[str, str]:
    """The query's parameters, each known and given once, or 400 naming the one that is
    not: `?fromat=matrix` must not quietly answer JSON, as an unknown body field is refused."""
    for name in request.query:
        if name not in known:
            raise ApiError(400, "bad_request", f"{cut(name, 60)}: unknown query parameter (known: {', '.join(known)})")
        if len(request.query.getall(name)) > 1:
            raise ApiError(400, "bad_request", f"{name}: given twice")
    return dict(request.query)


# The query parameters each GET endpoint takes (the OpenAPI document lists the same).
TOPOLOGY_QUERY = ("format",)


async def topology(request: web.Request) -> web.StreamResponse:
    query = query_parameters(request, TOPOLOGY_QUERY)
    snapshot = _ready_snapshot(request.app[AGENT].served())
    fmt = query.get("format", "json")
    if fmt == "matrix":
        return web.Response(text=snapshot.matrix_text, content_type="text/plain")
    if fmt != "json":
        raise ApiError(400, "bad_request", "format: expected json or matrix")
    # The JSON and its gzip are made once per snapshot, off the event loop (a 128-GPU node's
    # document is about 7.3 MiB: a counter read's new snapshot was serialised here on the loop).
    etag = snapshot.etag if snapshot.rendered("json") else await asyncio.to_thread(lambda: snapshot.etag)
    headers = {"ETag": etag, "Cache-Control": "no-cache", "Vary": "Accept-Encoding"}
    if not accepts_gzip(request.headers.get("Accept-Encoding", "")):
        if _not_modified(request, etag):
            return web.Response(status=304, headers=headers)
        # A big node's document is held gzipped only: unpacked off the event loop.
        body = snapshot.held_body
        if body is None:
            body = await asyncio.to_thread(lambda: snapshot.body)
        return web.Response(body=body, content_type="application/json", headers=headers)
    # Gzipped once per snapshot, with the document (topoagent.service.served); its own ETag,
    # as another representation of the same document.
    headers["ETag"] = etag = etag[:-1] + '-gzip"'
    if _not_modified(request, etag):
        return web.Response(status=304, headers=headers)
    return web.Response(body=snapshot.body_gzip, content_type="application/json", headers={**headers, "Content-Encoding": "gzip"})


async def capacity(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    # A blocked node's GPUs look free (the fabric findings name no GPU): no figures, as /place.
    _ready_for_placement(_ready_snapshot(agent.served()))
    served = await agent.current_capacity()  # computed off the loop; waits a bounded time
    if served is None:  # the first figures took longer than the wait: they are still coming
        raise ApiError(503, "capacity_pending", "the capacity figures are still being computed; ask again shortly",
                       headers={"Retry-After": "1"})
    if served.stale:
        # Figures of an older state while the current ones are computed: no ETag, so a
        # client's cached copy (the extender's dry runs) is never confirmed by a 304 that
        # would stand for a node whose busy GPUs may have changed since.
        return web.Response(body=served.body, content_type="application/json", headers={"Cache-Control": "no-store"})
    headers = {"ETag": served.etag, "Cache-Control": "no-cache"}
    if _not_modified(request, served.etag):
        return web.Response(status=304, headers=headers)
    return web.Response(body=served.body, content_type="application/json", headers=headers)


async def place(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    doc = await read_json(request)
    if isinstance(doc, dict) and "reserve" in doc:
        if doc["reserve"] is None:
            raise ApiError(400, "bad_request", 'reserve: null; leave it out for a dry run or give {"owner": ..., "ttl_s": ...}')
        require_token(request)  # before anything is said about the request
    snapshot = _ready_snapshot(agent.served())
    _ready_for_placement(snapshot)
    try:
        req, reserve, holder = parse_place_request(doc, {g.index for g in snapshot.matrix.gpus})
    except ApiError:
        agent.count_invalid_request()
        raise
    if reserve is None:
        if (req.deadline_ms or 0) > OPEN_DEADLINE_MS_MAX and not _token_ok(request):
            # A dry run needs no token; a long search is CPU anyone could spend without one.
            req = replace(req, deadline_ms=OPEN_DEADLINE_MS_MAX)
        answer = await agent.place(req, holder)
        lease = None
    else:
        try:
            answer, lease = await agent.reserve(req, reserve["owner"], reserve["ttl_s"])
        except LeaseConflict as exc:  # the grant's last check refused a GPU placement saw free: a defence
            raise ApiError(409, "lease_conflict", f"reserve: {exc}") from None
        except LeaseError as exc:  # the store's last check refused what it would not load back
            raise ApiError(400, "bad_request", f"reserve: {exc}") from None
        except StateUnavailable as exc:
            raise _state_unavailable(exc) from None
    if isinstance(answer, NoFit):
        detail = f"{answer.constraint}: {answer.reason}"
        if answer.never_fits:  # not even on the idle node: no wait, lease or eviction helps
            raise ApiError(422, "never_fits", f"never fits this node: {detail}", {"nofit": answer_document(answer)})
        why = _why_busy(agent.served(), req)
        if why:
            detail += f" ({why})"
        raise ApiError(409, "no_fit", detail, {"nofit": answer_document(answer)})
    body = answer_document(answer)
    if lease is not None:
        body["lease"] = lease_document(lease)
    return web.json_response(body)


def _why_busy(served: Served, req: Request) -> str:
    """Say which wanted GPUs are leased (by whom) and which run processes."""
    leased = served.holding().holder
    running = served.running
    parts = []
    for gpu in req.include:
        if gpu in leased:
            parts.append(f"GPU {gpu} is leased to {cut(leased[gpu].owner, 40)} until lease {leased[gpu].id} ends")
        elif gpu in running:
            parts.append(f"GPU {gpu} is running processes")
    if not parts and leased:
        parts.append(f"leased: GPUs {sorted(leased)}")
    if not parts and running:
        parts.append(f"running processes: GPUs {sorted(running)}")
    return "; ".join(parts)


async def list_leases(request: web.Request) -> web.Response:
    served = request.app[AGENT].served()
    holding = served.holding()
    body: dict[str, Any] = {
        "leases": [lease_document(lease) for lease in served.active_leases()],
        # Leases one of whose GPUs left the node: they hold the ones left until released or expired.
        "orphaned": [lease.id for lease in holding.orphaned],
    }
    recovery = served.lease_recovery
    if recovery is not None:
        # Leases granted before this start may be lost: say so where schedulers look.
        body["recovered_from_corrupt_state"] = {"file": recovery.file, "moved_to": recovery.moved_to, "error": recovery.error}
    quarantine = served.lease_quarantine
    if quarantine is not None and (quarantine.entries or quarantine.unreadable):
        # Entries the store refused on loading; the GPUs they named are held (see docs/service.md, Leases).
        body["quarantined"] = {"file": quarantine.file, "entries": list(quarantine.entries)}
        if quarantine.unreadable:
            body["quarantined"]["unreadable"] = quarantine.unreadable
    return web.json_response(body)


async def delete_lease(request: web.Request) -> web.Response:
    require_token(request)
    agent = request.app[AGENT]
    try:
        lease = await agent.release(request.match_info["lease_id"])
    except StateUnavailable as exc:
        raise _state_unavailable(exc) from None
    if lease is None:
        raise ApiError(404, "not_found", "no such lease (released, expired or never granted)")
    return web.json_response(lease_document(lease))


async def refresh(request: web.Request) -> web.Response:
    require_token(request)
    if request.body_exists:  # optional; takes no fields yet, and a typo must not pass
        doc = await read_json(request)
        if not isinstance(doc, dict):
            raise ApiError(400, "bad_request", "body: expected a JSON object (or no body)")
        if doc:
            raise ApiError(400, "bad_request", f"unknown field(s): {cut(', '.join(sorted(doc)), 120)}; /refresh takes none")
    agent = request.app[AGENT]
    await agent.request_refresh("request")
    snapshot = _ready_snapshot(agent.served())
    return web.json_response({"snapshot_version": snapshot.version, "stale": snapshot.stale, "error": snapshot.error})


def accepts_gzip(accept_encoding: str) -> bool:
    """Whether an Accept-Encoding header lists gzip, and not with q=0 (RFC 9110 12.5.3)."""
    for item in accept_encoding.lower().split(","):
        coding, _, params = item.partition(";")
        if coding.strip() == "gzip":
            try:
                return float(params.replace(" ", "").removeprefix("q=") or "1") > 0
            except ValueError:
                return False
    return False


async def metrics(request: web.Request) -> web.Response:
    agent = request.app[AGENT]
    if agent.served().snapshot is not None:
        await agent.current_capacity()  # bounded: past its wait the page carries the latest figures, marked stale
    page = request.app[METRICS].render()
    headers = {"Content-Type": "text/plain; version=0.0.4; charset=utf-8", "Vary": "Accept-Encoding"}
    # Prometheus asks for gzip; a big node's page shrinks about tenfold.
    if accepts_gzip(request.headers.get("Accept-Encoding", "")):
        return web.Response(body=gzip.compress(page, compresslevel=6), headers={**headers, "Content-Encoding": "gzip"})
    return web.Response(body=page, headers=headers)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "alive"})


def _ready_for_placement(snapshot: Snapshot, *, readyz: bool = False) -> None:
    """503 ``not_ready_for_placement`` while a finding makes every answer untrustworthy
    (``placement_blockers``: GPUs no witness can see, an NVLink fabric down): which
    findings, and why.  /readyz names the snapshot too, as its 200 does; /place leaves
    ``no-gpus`` to the core's own answer (``placement_refusals``)."""
    blockers = snapshot.placement_blockers if readyz else placement_refusals(snapshot.findings)
    if blockers:
        said = {"snapshot_version": snapshot.version, "stale": snapshot.stale} if readyz else {}
        raise ApiError(
            503, NOT_READY_FOR_PLACEMENT, "; ".join(f"{f.kind} ({f.subject}): {f.message}" for f in blockers),
            {**said, "findings": [{"kind": str(f.kind), "severity": str(f.severity), "subject": f.subject, "message": f.message}
                                  for f in blockers]},
        )


def _warnings(snapshot: Snapshot) -> list[dict[str, str]]:
    """What /readyz names beside its answer without letting it decide: the sources that
    fail (``collector-error``: a counter source none of whose reads worked, a source
    discovery could not read).  No placement needs them, so they never make it 503."""
    return [{"kind": str(f.kind), "severity": str(f.severity), "subject": f.subject, "message": f.message}
            for f in snapshot.findings if f.kind is FindingKind.COLLECTOR_ERROR]


async def readyz(request: web.Request) -> web.Response:
    """Ready for placement: a topology is loaded and no finding makes its answers
    untrustworthy; /healthz alone says the process lives.  Ready or not, the body says what
    else is wrong: failing sources (``warnings``) and a failing discovery (``discovery``:
    the facts served are older, and when it is tried again)."""
    served = request.app[AGENT].served()
    snapshot = _ready_snapshot(served, readyz=True)
    retry = {"discovery": _discovery_retry(served.discovery_retry)} if served.discovery_retry else {}
    try:
        _ready_for_placement(snapshot, readyz=True)
    except ApiError as exc:
        exc.extra.update(retry, warnings=_warnings(snapshot))
        raise
    return web.json_response({"status": "ready", "snapshot_version": snapshot.version, "stale": snapshot.stale,
                              "warnings": _warnings(snapshot), **retry})


async def openapi(request: web.Request) -> web.Response:
    made = request.app[OPENAPI]
    if not made:
        from topoagent.exporters.openapi import openapi_document

        made.append(json.dumps(openapi_document(), indent=1).encode())
    return web.Response(body=made[0], content_type="application/json")


def _not_modified(request: web.Request, etag: str) -> bool:
    inm = request.headers.get("If-None-Match", "")
    return bool(inm) and (inm.strip() == "*" or etag in [t.strip() for t in inm.split(",")])


async def index(request: web.Request) -> web.Response:
    """The picture of the node as the agent knows it now (leases, busy GPUs, every
    finding), drawn here; a few lines of script poll this door with If-None-Match."""
    served = request.app[AGENT].served()
    snapshot = _ready_snapshot(served)
    leased, busy = frozenset(served.holding().holder), served.running
    key = f"page {sorted(leased)} {sorted(busy)}"  # the page shows leases and busy GPUs: they key it too
    body, etag = await asyncio.to_thread(snapshot.cached, key, lambda: _page(snapshot, leased, busy))  # off the loop
    headers = {"ETag": etag, "Cache-Control": "no-cache"}
    if _not_modified(request, etag):
        return web.Response(status=304, headers=headers)
    return web.Response(body=body, content_type="text/html", charset="utf-8", headers=headers)


def _page(snapshot: Snapshot, leased: frozenset[int], busy: frozenset[int]) -> tuple[bytes, str]:
    from topoagent.exporters.svg import ETAG_SLOT, render_page  # only once the picture is asked for

    page = render_page(snapshot.node, snapshot.matrix, findings=snapshot.findings, leased=leased, busy=busy,
                       live_ms=PAGE_POLL_MS)
    etag = etag_of(page.encode())  # of the page with its slot empty, then stamped into it
    return page.replace(ETAG_SLOT, f"data-etag='{etag}'", 1).encode(), etag


PAGE_POLL_MS = 3000


async def probe(request: web.Request) -> web.Response:
    require_token(request)
    agent = request.app[AGENT]
    _ready_snapshot(agent.served())
    try:
        scheduled = agent.request_probe_round()
    except ProbesOff as exc:
        raise ApiError(409, "probes_off", str(exc)) from None
    except ProbeRunning as exc:
        raise ApiError(409, "probe_running", str(exc)) from None
    return web.json_response(scheduled, status=202)


def make_app(agent: Service, token: bytes = b"", *, run_agent: bool = True, guard: ConnectionGuard | None = None) -> web.Application:
    """The app; with `run_agent` the agent's loop starts and stops with it.  `guard` (the
    listener's) is told where each request starts and ends, to time idle connections."""
    middlewares = [json_errors, host_check, read_auth]
    if guard is not None:
        middlewares.insert(0, guard.middleware())
    app = web.Application(middlewares=middlewares, client_max_size=agent.config.max_body_bytes)
    app[AGENT] = agent
    app[TOKEN] = Token(token)
    app[RATE] = RateLimiter(agent.config.rate_limit_per_s, agent.config.rate_limit_burst)
    app[HOSTS] = AllowedHosts(agent.config)
    app[REFUSED] = refused = {"rate_limited": 0, "misdirected_host": 0}
    app[METRICS] = MetricsPage(agent, HttpCollector(guard, refused))
    app[OPENAPI] = []

    async def agent_lifetime(app: web.Application) -> AsyncIterator[None]:
        await agent.start()
        yield
        await agent.stop()

    if run_agent:
        app.cleanup_ctx.append(agent_lifetime)
    app.router.add_get("/", index)
    app.router.add_get("/topology", topology)
    app.router.add_post("/place", place, expect_handler=expect_continue)
    app.router.add_get("/capacity", capacity)
    app.router.add_get("/leases", list_leases)
    app.router.add_delete("/leases/{lease_id}", delete_lease)
    app.router.add_post("/refresh", refresh, expect_handler=expect_continue)
    app.router.add_post("/probe", probe, expect_handler=expect_continue)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/openapi.json", openapi)
    return app
