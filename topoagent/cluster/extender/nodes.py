"""Asking the candidate nodes' agents, and ranking the nodes that fit.

For each node: ``GET /capacity`` (with ``If-None-Match``: an unchanged node answers 304
and costs nothing), then, when enough GPUs are free, a dry-run ``POST /place`` with the
pod's request.  The answer is kept with the capacity ETag it was given under: while the
node's ETag stays the same (same snapshot, same leased and busy GPUs) the same request
gets the same answer, so filter and prioritize of one pod, and pods alike, ask once.

Only nodes the API server knows are asked (``NodeTable``: their names and addresses come
from the Node objects, never from the caller's body); the token goes only with the calls
that need it (reserve, release), unless the agents guard their reads too.

At most ``concurrency`` agents are asked at once for a scheduling call's verdicts, and as
many again by the background sweeps (``Agents.each``: the pod watch's lease sweep, the
requeue watch, the holds keeper), which so never hold up a scheduling call; each node has
``timeout_s`` for its answers, and a whole call ``budget_s``: a node not answered by then is
marked so, and the call answers with what it has.  A node whose agent does not answer in
time, refuses the connection or answers something that is not its document is *unanswered*: the caller
treats it as configured (``Unanswered``), never as a failed scheduling cycle; it is not
asked again for ``quiet_s``, so a dead agent costs one timeout, not one per scheduling cycle.

Ranking (the extender's score, 0..10): first, a pod that does not fill a *whole* node
(every GPU free and healthy) whose GPUs all share local links (the agent's ring through
all of them has ``satisfaction`` 1: NVLink, NVSwitch or one PCIe switch) goes elsewhere
when another node takes it: such a node is what the largest pods need, and a pod that
breaks it for less sends the next 8-GPU pod to wait, or to a PCIe node across sockets.
Then the pod's own placement, the best ring bandwidth the agent delivers for it, then
the least NUMA distance.  Then what placing it breaks for the pods after it.  A node the
pod fills exactly breaks nothing: it comes first.  A 1-GPU pod gets no ring, so it goes
where the best pair of free GPUs is worth least (the ring bandwidth the agent would give
a 2-GPU pod there): a PCIe node before an NVLink one.  Then, every pod, the node whose
largest free block shrinks least: the most GPUs, a power of two, it can still give one
pod (``largest_block``; pods ask for 1, 2, 4 or 8), so a 1-GPU pod takes a node with 7,
6 or 5 free (its block of 4 stays) before an idle one (8 becomes 4).  Then the node with
the fewest free GPUs (best fit), so the larger free blocks elsewhere stay whole for the
larger pods after it.  Nodes still equal score alike (the scheduler picks among them).
Within the node the agent has already chosen the GPUs that break its own free zones
least; its damage figure is on each node's own scale, not comparable across kinds of
node, so it does not rank nodes.  The best key scores 10, each next distinct key one
less, down to 1; an unanswered node passed on scores 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import aiohttp

from topoagent.cluster.extender.nodetable import NodeTable
from topoagent.cluster.extender.wire import MAX_EXTENDER_PRIORITY, NODE_NAME, Candidate
from topoagent.documents.lease import LEASE_ID
from topoagent.text import cut
from topoagent.vocabulary import NOT_READY_FOR_PLACEMENT

_T = TypeVar("_T")

MAX_RESPONSE_BYTES = 4 * 1024 * 1024  # a 1024-GPU node's /capacity is well below this
REMEMBERED_NODES = 20_000  # node addresses and cached answers kept, least recently used out
ANSWERS_PER_NODE = 32


class Unreachable(Exception):
    """The node's agent did not answer (in time, or with its document)."""


class Unknown(Unreachable):
    """The node is not in the API server's table (or has no address there): nothing was sent."""


class Refused(Exception):
    """The agent answered, and the answer is no (409 no fit, 4xx): ``reason`` says why."""

    def __init__(self, reason: str, status: int) -> None:
        super().__init__(reason)
        self.reason, self.status = reason, status


def _refuse_if_blocked(status: int, doc: Any) -> None:
    """Refused when the agent answered 503 ``not_ready_for_placement`` (its fabric down, its
    GPU stack missing): an answer, and a no, not a silence that ``--unanswered pass`` keeps."""
    if status == 503 and isinstance(doc, dict) and doc.get("error") == NOT_READY_FOR_PLACEMENT and isinstance(doc.get("detail"), str):
        raise Refused(cut(f"not ready for placement: {doc['detail']}", 300), status)


@dataclass(frozen=True, slots=True)
class Verdict:
    """One node, for one pod."""

    node: str
    fits: bool
    reason: str = ""  # why not, when it does not fit or did not answer
    answered: bool = True
    resolvable: bool = True  # False: no change on the node can make it fit (too few GPUs)
    answer: dict[str, Any] | None = None  # the figures of the agent's dry-run placement that rank it (ranked())
    asked: bool = True  # False: not asked, its agent was silent a moment ago
    pair_value: float = 0.0  # for a 1-GPU pod: ring GB/s of the best pair of the node's free GPUs (0: one free, or not asked)
    free: int = 0  # the node's free GPUs
    wanted: int = 0  # the pod's GPUs
    breaks_whole: bool = False  # the pod would break a whole node whose GPUs all share local links

    def key(self) -> tuple[bool, float, float, bool, float, int, int]:
        """Smaller is better (the module docstring says why each term)."""
        answer = self.answer or {}
        objective = answer.get("objective") or {}
        block_lost = largest_block(self.free) - largest_block(self.free - self.wanted)
        return (self.breaks_whole, -_number(answer.get("bandwidth_gbps")), _number(objective.get("numa_distance")),
                self.free != self.wanted, self.pair_value, block_lost, self.free)


def largest_block(free: int) -> int:
    """The most GPUs, a power of two, a node with ``free`` GPUs can still give one pod (0 for
    none): pods ask for powers of two (ranks per node, tensor- and data-parallel degrees)."""
    return 1 << (free.bit_length() - 1) if free > 0 else 0


def by_count(name: str, wanted: int, free: int, total: int) -> Verdict | None:
    """The verdict the node's GPU counts alone give (None: ask its agent)."""
    if wanted > total:
        return Verdict(name, False, f"the node has {total} GPUs; the pod needs {wanted}", resolvable=False)
    if wanted > free:
        return Verdict(name, False, f"{free} of {total} GPUs free; the pod needs {wanted}")
    return None


def follow_ups(wanted: int, free: int, total: int) -> tuple[dict[str, int] | None, dict[str, int] | None]:
    """The dry runs a verdict needs beside the pod's own: the whole node, when the pod would
    break an idle one (``breaks_whole``); a pair, for a 1-GPU pod (``pair_value``: what the
    next 2-GPU pod would get there)."""
    return ({"gpus": total} if wanted < free == total else None), ({"gpus": 2} if wanted == 1 and free >= 2 else None)


def ranked(answer: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a /place answer that Verdict reads: all the cache keeps of it.  A
    whole answer is kilobytes; kept for up to ANSWERS_PER_NODE requests on each of
    REMEMBERED_NODES nodes, whole answers would outgrow any memory limit."""
    objective = answer.get("objective")
    objective = objective if isinstance(objective, dict) else {}
    return {"bandwidth_gbps": answer.get("bandwidth_gbps"), "objective": {"numa_distance": objective.get("numa_distance")},
            "satisfaction": answer.get("satisfaction")}


def all_local(answer: Mapping[str, Any]) -> bool:
    """Whether every link of the answer's ring is local (``satisfaction`` 1)."""
    return _number(answer.get("satisfaction")) >= 1.0


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def scores(verdicts: Iterable[Verdict]) -> dict[str, int]:
    """Every node's score: 10 for the best key among those that fit, one less for each
    next distinct key (at least 1); 0 for nodes that do not fit or did not answer."""
    verdicts = list(verdicts)
    keys = sorted({v.key() for v in verdicts if v.fits})
    rank = {key: n for n, key in enumerate(keys)}
    return {v.node: max(1, MAX_EXTENDER_PRIORITY - rank[v.key()]) if v.fits else 0 for v in verdicts}


class _Remembered(OrderedDict[str, Any]):
    def remember(self, key: str, value: Any) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > REMEMBERED_NODES:
            self.popitem(last=False)


class Agents:
    """The agents of the cluster's nodes, reached by ``url_template`` (``{node}``: the node's
    name; ``{address}``: its address), for the nodes ``table`` (the API server's) knows."""

    def __init__(self, url_template: str, table: NodeTable, *, timeout_s: float = 2.0, concurrency: int = 32, token: str | None = None,
                 quiet_s: float = 10.0, token_on_reads: bool = False) -> None:
        self.url_template = url_template
        self.table = table
        self.timeout_s = timeout_s
        self.quiet_s = quiet_s
        # Reserve and release need the token; reads only when the agents guard them too
        # (require_token_for_reads): a token sent where it is not needed is one more copy to leak.
        self._auth = {"Authorization": f"Bearer {token}"} if token else {}
        self._read_auth = self._auth if token_on_reads else {}
        self._gate = asyncio.Semaphore(concurrency)  # a scheduling call's verdicts
        self._sweep_gate = asyncio.Semaphore(concurrency)  # the background sweeps (``each``)
        self._session: aiohttp.ClientSession | None = None
        self._capacity = _Remembered()  # node -> (etag, capacity document)
        self._answers = _Remembered()  # node -> (etag, {request key: answer or Refused})
        self._silent = _Remembered()  # node -> (monotonic time, reason) of its agent's last silence
        # For /metrics: how often each agent endpoint was asked, and how often the cache answered.
        self.asked = {"capacity_changed": 0, "capacity_not_modified": 0, "dry_run_agent": 0, "dry_run_cache": 0, "unanswered": 0,
                      "unknown": 0, "out_of_time": 0}

    async def each(self, nodes: Iterable[str], ask: Callable[[str], Awaitable[_T]]) -> list[_T]:
        """``ask(node)`` for every node, at most ``concurrency`` at once: the bound of every
        background sweep over the agents.  ``ask`` must not call ``each`` itself."""

        async def one(node: str) -> _T:
            async with self._sweep_gate:
                return await ask(node)

        return list(await asyncio.gather(*(one(node) for node in nodes)))

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            # The per-node deadline is the caller's (asyncio.timeout); connections are pooled.
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None),
                                                  connector=aiohttp.TCPConnector(limit=0, limit_per_host=4))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def url(self, node: str) -> str:
        """The node's agent, or Unknown naming what is missing."""
        if not NODE_NAME.fullmatch(node) or node not in self.table:
            raise Unknown(f"node {cut(json.dumps(node), 60)} is not among the API server's Node objects; its agent was not asked")
        url = self.url_template.replace("{node}", node)
        if "{address}" in url:
            address = self.table.address(node)
            if address is None:
                raise Unknown("the node's Node object has no usable address (InternalIP, ExternalIP or Hostname); its agent was not asked")
            url = url.replace("{address}", f"[{address}]" if ":" in address else address)
        return url.rstrip("/")

    async def _get_json(self, url: str, method: str = "GET", body: Any = None, headers: Mapping[str, str] | None = None) -> tuple[int, Mapping[str, str], Any]:
        try:
            async with self._http().request(method, url, json=body, headers=dict(headers or {})) as resp:
                raw = await _read_bounded(resp.content, MAX_RESPONSE_BYTES)
                if raw is None:
                    raise Unreachable(f"{method} {url}: answer larger than {MAX_RESPONSE_BYTES} bytes")
                doc = json.loads(raw) if raw else None
                return resp.status, resp.headers, doc
        except (aiohttp.ClientError, OSError) as exc:
            raise Unreachable(f"{method} {url}: {cut(str(exc) or type(exc).__name__, 160)}") from None
        except (ValueError, RecursionError):
            raise Unreachable(f"{method} {url}: the answer is not JSON") from None

    async def capacity(self, node: str, counted: bool = True) -> tuple[str, dict[str, Any]]:
        """(ETag, the GPU counts of the node's /capacity: ``gpus``, ``free_gpus``), from the
        cache when the agent says 304; ``counted``: in /metrics' figures for scheduling calls."""
        url = self.url(node) + "/capacity"
        cached = self._capacity.get(node)
        headers = {"If-None-Match": cached[0]} if cached else {}
        status, resp_headers, doc = await self._get_json(url, headers={**self._read_auth, **headers})
        if status == 304 and cached:
            self.asked["capacity_not_modified"] += counted
            self._capacity.move_to_end(node)
            return cached[0], cached[1]
        _refuse_if_blocked(status, doc)
        if status != 200 or not isinstance(doc, dict) or not _is_count(doc.get("free_gpus")) or not _is_count(doc.get("gpus")):
            raise Unreachable(f"GET {url}: HTTP {status}, not a capacity document")
        etag = resp_headers.get("ETag", "")
        self.asked["capacity_changed"] += counted
        counts = {"gpus": doc["gpus"], "free_gpus": doc["free_gpus"]}  # the rest (zones, GPUs) is not read
        self._capacity.remember(node, (etag, counts))
        return etag, counts

    def cached_etag(self, node: str) -> str | None:
        """The capacity ETag last answered by the node's agent, if any."""
        cached = self._capacity.get(node)
        return cached[0] if cached else None

    async def dry_run(self, node: str, etag: str, request: Mapping[str, Any]) -> dict[str, Any]:
        """The ranking figures (``ranked``) of the agent's placement for ``request`` (no lease),
        or Refused with its reason."""
        key = json.dumps(request, sort_keys=True)
        known = self._answers.get(node)
        if known is None or known[0] != etag or not etag:
            known = (etag, dict[str, Any]())
            self._answers.remember(node, known)
        if key in known[1]:
            self.asked["dry_run_cache"] += 1
            got = known[1][key]
            if isinstance(got, Refused):
                raise got
            return dict(got)
        self.asked["dry_run_agent"] += 1
        try:
            answer = ranked(await self._place(node, dict(request)))
        except Refused as refused:
            _keep(known[1], key, refused)
            raise
        _keep(known[1], key, answer)
        return answer

    async def _place(self, node: str, body: dict[str, Any]) -> dict[str, Any]:
        url = self.url(node) + "/place"
        # A dry run is a read; a reservation needs the token.
        status, _, doc = await self._get_json(url, "POST", body, self._auth if "reserve" in body else self._read_auth)
        if status == 200 and isinstance(doc, dict) and isinstance(doc.get("gpus"), list):
            return doc
        if 400 <= status < 500 and isinstance(doc, dict) and isinstance(doc.get("detail"), str):
            raise Refused(cut(doc["detail"], 300), status)
        _refuse_if_blocked(status, doc)
        raise Unreachable(f"POST {url}: HTTP {status}, not a placement")

    async def verdict(self, candidate: Candidate, request: Mapping[str, Any]) -> Verdict:
        name = candidate.name
        try:
            self.url(name)
        except Unknown as exc:
            self.asked["unknown"] += 1
            return Verdict(name, False, str(exc), answered=False, asked=False)
        silent = self._silent.get(name)
        if silent is not None and time.monotonic() - silent[0] < self.quiet_s:
            # Asked again only after quiet_s: a dead agent must not cost every cycle its timeout.
            self.asked["unanswered"] += 1
            ago = time.monotonic() - silent[0]
            return Verdict(name, False, f"{silent[1]} ({ago:.0f} s ago; asked again after {self.quiet_s:g} s)", answered=False, asked=False)
        verdict = await self._ask(name, request)
        if verdict.answered:
            self._silent.pop(name, None)
        else:
            self._silent.remember(name, (time.monotonic(), verdict.reason))
        return verdict

    async def _ask(self, name: str, request: Mapping[str, Any]) -> Verdict:
        async with self._gate:
            try:
                async with asyncio.timeout(self.timeout_s):
                    etag, capacity = await self.capacity(name)
                    wanted, free, total = request["gpus"], capacity["free_gpus"], capacity["gpus"]
                    refused_by_count = by_count(name, wanted, free, total)
                    if refused_by_count is not None:
                        return refused_by_count
                    answer = await self.dry_run(name, etag, request)
                    whole, pair = follow_ups(wanted, free, total)  # each cached with the ETag like any dry run
                    breaks_whole = False
                    if whole is not None:
                        with contextlib.suppress(Refused):
                            breaks_whole = all_local(await self.dry_run(name, etag, whole))
                    pair_value = 0.0
                    if pair is not None:
                        with contextlib.suppress(Refused):
                            pair_value = _number((await self.dry_run(name, etag, pair)).get("bandwidth_gbps"))
            except TimeoutError:
                self.asked["unanswered"] += 1
                return Verdict(name, False, f"the node's agent did not answer within {self.timeout_s:g} s", answered=False)
            except Unreachable as exc:
                self.asked["unanswered"] += 1
                return Verdict(name, False, f"the node's agent did not answer: {exc}", answered=False)
            except Refused as refused:
                return Verdict(name, False, refused.reason, resolvable=refused.status == 409)
        return Verdict(name, True, answer=answer, pair_value=pair_value, free=free, wanted=wanted, breaks_whole=breaks_whole)

    async def verdicts(self, candidates: Iterable[Candidate], request: Mapping[str, Any], budget_s: float = float("inf")) -> list[Verdict]:
        """Every candidate's verdict within ``budget_s``: those not answered by then are
        marked (not answered, not asked), and their questions are dropped."""
        candidates = list(candidates)
        started = time.monotonic()
        unknown = [c.name for c in candidates if c.name not in self.table]
        if unknown:
            try:  # a node that joined a moment ago: its watch event, or one list now (at most two a second)
                async with asyncio.timeout(budget_s * 0.75 if budget_s != float("inf") else None):
                    await self.table.refresh(unknown)
            except TimeoutError:
                pass
        if not candidates:
            return []
        tasks = [asyncio.ensure_future(self.verdict(c, request)) for c in candidates]
        left = budget_s - (time.monotonic() - started)
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, left) if left != float("inf") else None)
        for task in pending:
            task.cancel()
        out = []
        for c, task in zip(candidates, tasks, strict=True):
            if task in pending:
                self.asked["out_of_time"] += 1
                out.append(Verdict(c.name, False, "not answered before the call's deadline (--call-timeout); asked again at the next call",
                                   answered=False, asked=False))
            else:
                out.append(task.result())
        return out

    # -- bind: reserve and release -------------------------------------------------------

    async def reserve(self, node: str, request: Mapping[str, Any], owner: str, ttl_s: float) -> dict[str, Any]:
        """The agent's placement with its ``lease``; Refused (no fit, no token) or Unreachable."""
        body = {**request, "reserve": {"owner": owner, "ttl_s": ttl_s}}
        try:
            async with asyncio.timeout(self.timeout_s):
                answer = await self._place(node, body)
        except TimeoutError:
            raise Unreachable(f"the node's agent did not answer within {self.timeout_s:g} s") from None
        lease = answer.get("lease")
        if not isinstance(lease, dict) or not isinstance(lease.get("id"), str):
            raise Unreachable("the agent's answer holds no lease")
        return answer

    async def release(self, node: str, lease_id: str) -> bool:
        """Whether the lease is gone now (released, or already ended)."""
        if not LEASE_ID.fullmatch(lease_id):
            return False  # not an id the agent hands out: never put into a URL
        try:
            async with asyncio.timeout(self.timeout_s):
                status, _, _ = await self._get_json(f"{self.url(node)}/leases/{lease_id}", "DELETE", headers=self._auth)
        except (TimeoutError, Unreachable):
            return False
        return status in (200, 404)

    async def leases(self, node: str) -> list[dict[str, Any]] | None:
        """The leases the node's agent holds (``GET /leases``), or None when it did not answer."""
        try:
            async with asyncio.timeout(self.timeout_s):
                status, _, doc = await self._get_json(f"{self.url(node)}/leases", headers=self._read_auth)
        except (TimeoutError, Unreachable):
            return None
        held = doc.get("leases") if status == 200 and isinstance(doc, dict) else None
        return [x for x in held if isinstance(x, dict)] if isinstance(held, list) else None


async def _read_bounded(content: aiohttp.StreamReader, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes.  (``content.read(n)`` is no
    bound read: it returns what has arrived, one chunk of a larger answer.)"""
    chunks, size = [], 0
    async for chunk in content.iter_any():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _keep(answers: dict[str, Any], key: str, value: Any) -> None:
    answers[key] = value
    while len(answers) > ANSWERS_PER_NODE:
        answers.pop(next(iter(answers)))
