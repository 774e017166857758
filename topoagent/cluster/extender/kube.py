"""The API server calls of a bind, through the ``kubernetes`` client (an optional extra).

Read the pod (the bind arguments name it only), read a node's address when the agent URL
needs it, and create the Binding (``POST .../pods/{name}/binding``) carrying the chosen
GPUs as annotations, with the pod's UID and the resourceVersion it was read at as
preconditions: the API server sets the node and the annotations in one update, or
neither, so a bind that lost a race never leaves its (released) lease written on the pod.
The pod watch (``topoagent.cluster.podwatch``) lists and watches pods through here too.
The client is synchronous: each call runs in a thread.  Bodies are read as plain JSON,
the API server's published form.

A watch runs in a thread of its own, blocked in a read for as long as the API server
holds the stream (or its head).  Such a thread must end before the interpreter does: a
thread that wakes in the client while Python finalizes is ended by ``pthread_exit``, whose
unwinding aborts the process (SIGABRT) at the compiled frames of the client's argument
checks (pydantic_core, under ``validate_call``).  So each watch is
a ``WatchCall`` that the loop can cut at whichever step it has reached, and the watches
use a client of their own, whose connections carry nothing else.  ``WatchThread`` runs a
watch's stream in that thread and hands its items to the loop: the Node table and the pod
watch both read their watches through it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

from topoagent.log import log_event
from topoagent.text import cut

_T = TypeVar("_T")


class KubeError(Exception):
    """The API server refused or could not be reached; the message says which call, ``status``
    the HTTP status of a refusal (None: no answer)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class Kube:
    def __init__(self, api_url: str | None = None, kubeconfig: str | None = None, timeout_s: float = 5.0) -> None:
        """``api_url``: talk to this URL as is (a proxy such as `kubectl proxy`, or a test
        server); else ``kubeconfig``; else the pod's service account (in-cluster)."""
        import urllib3
        from kubernetes import client, config

        configuration = client.Configuration()
        if api_url:
            configuration.host = api_url.rstrip("/")
        elif kubeconfig:
            config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
        else:
            config.load_incluster_config(client_configuration=configuration)
        self._client = client
        self._core = client.CoreV1Api(client.ApiClient(configuration))
        watching = copy.deepcopy(configuration)
        watching.retries = False  # a cut watch ends at once, not after urllib3's retries: its loop opens the next
        self._watches = client.CoreV1Api(_cuttable(client.ApiClient(watching)))
        self._exception = client.ApiException
        # urllib3's own errors (MaxRetryError: nothing listening) derive from neither OSError nor ValueError.
        self._transport_errors: tuple[type[Exception], ...] = (OSError, ValueError, urllib3.exceptions.HTTPError)
        # Each call's failure is one KubeError line naming the call; urllib3's warning per retry
        # would repeat it three times a try while the API server is away.
        logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)
        self.timeout_s = timeout_s

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            try:
                resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
                return json.loads(resp.data) if resp.data else None
            except self._exception as exc:
                raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}") from None
            except self._transport_errors as exc:
                raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None

        return await asyncio.to_thread(call)

    async def pod(self, namespace: str, name: str) -> dict[str, Any]:
        pod = await self._call(f"get pod {namespace}/{name}", self._core.read_namespaced_pod, name, namespace)
        if not isinstance(pod, dict):
            raise KubeError(f"get pod {namespace}/{name}: not a Pod")
        return pod

    async def node(self, name: str) -> dict[str, Any]:
        node = await self._call(f"get node {name}", self._core.read_node, name)
        if not isinstance(node, dict):
            raise KubeError(f"get node {name}: not a Node")
        return node

    async def bind(self, namespace: str, name: str, uid: str, node: str, annotations: dict[str, str] | None = None,
                   resource_version: str | None = None) -> None:
        """Bind the pod, writing ``annotations`` on it in the same update; refused (409) when
        the pod is no longer the one with ``uid`` at ``resource_version``, or is bound."""
        c = self._client
        binding = c.V1Binding(
            api_version="v1", kind="Binding",
            metadata=c.V1ObjectMeta(name=name, namespace=namespace, uid=uid, annotations=annotations or None,
                                    resource_version=resource_version or None),
            target=c.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        await self._call(f"bind pod {namespace}/{name} to {node}", self._core.create_namespaced_pod_binding, name, namespace, binding)

    async def annotate_node(self, name: str, annotations: dict[str, str]) -> None:
        """Set ``annotations`` on the Node (a JSON merge patch: the others stay)."""
        await self._call(f"annotate node {name}", self._core.patch_node, name, {"metadata": {"annotations": annotations}},
                         _content_type="application/merge-patch+json")

    def list_nodes_page(self, limit: int, token: str | None) -> dict[str, Any]:
        """One page of the Node objects (a NodeList document), for the node table; blocking."""
        return self._list_page("list nodes", "NodeList", self._core.list_node, limit=limit, _continue=token or None)

    def _list_page(self, what: str, kind: str, call: Any, **query: Any) -> dict[str, Any]:
        """One page of a list call, read as JSON and checked to be a ``kind``; blocking."""
        try:
            resp: Any = call(**query, _preload_content=False, _request_timeout=self.timeout_s * 6)
            doc = json.loads(resp.data)
        except self._exception as exc:
            raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}") from None
        except self._transport_errors as exc:
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
            raise KubeError(f"{what}: not a {kind}")
        return doc

    # -- the pod watch's calls: blocking, run in the watch's own thread ------------------------

    def list_pods_page(self, limit: int, token: str | None, field_selector: str | None = None) -> dict[str, Any]:
        """One page of a consistent pod list (a PodList document; ``metadata.continue`` says
        whether more follow)."""
        return self._list_page("list pods", "PodList", self._core.list_pod_for_all_namespaces,
                               limit=limit, _continue=token or None, field_selector=field_selector)

    def watch_pods(self, resource_version: str, timeout_s: int, max_event_bytes: int, call: WatchCall,
                   field_selector: str | None = None) -> Iterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``) after ``resource_version``, until the
        server ends the stream (at ``timeout_s`` at the latest), or another thread cuts
        ``call``.  An event larger than ``max_event_bytes`` ends the watch with KubeError:
        memory stays bounded."""
        what = "watch pods"
        try:
            with call.opening():
                resp: Any = self._watches.list_pod_for_all_namespaces(
                    watch=True, resource_version=resource_version, timeout_seconds=timeout_s, allow_watch_bookmarks=True,
                    field_selector=field_selector, _preload_content=False, _request_timeout=(self.timeout_s, timeout_s + self.timeout_s))
        except self._exception as exc:
            raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}") from None
        except self._transport_errors as exc:
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None
        for line in self._lines(what, resp, call, max_event_bytes, tail_is_cut=False):
            yield _event(line)

    # -- the node table's watch: blocking, run in the table's own thread --------------------

    def open_node_watch(self, resource_version: str, timeout_s: int, call: WatchCall) -> Any:
        """The open stream of Node watch events after ``resource_version`` (the server ends it
        at ``timeout_s``), for ``watch_lines``; KubeError when it cannot be opened.  Cut
        ``call`` meanwhile, it fails, or its stream ends at once."""
        what = "watch nodes"
        try:
            with call.opening():
                return self._watches.list_node(watch=True, resource_version=resource_version, timeout_seconds=timeout_s,
                                               allow_watch_bookmarks=True, _preload_content=False,
                                               _request_timeout=(self.timeout_s, timeout_s + self.timeout_s))
        except self._exception as exc:  # 410 Gone: the version is older than the server keeps
            raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}", exc.status) from None
        except self._transport_errors as exc:
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None

    def watch_lines(self, resp: Any, call: WatchCall, max_event_bytes: int) -> Iterator[bytes | None]:
        """Each event line of an open node watch (opened for ``call``), as it arrives; None
        for a line longer than ``max_event_bytes`` (skipped unread: memory stays bounded, the
        stream goes on).  KubeError when the stream breaks, a line cut off by the end included."""
        return self._lines("watch nodes", resp, call, max_event_bytes, tail_is_cut=True, skip_long=True)

    def _lines(self, what: str, resp: Any, call: WatchCall, max_event_bytes: int, *, tail_is_cut: bool,
               skip_long: bool = False) -> Iterator[Any]:
        buffer = b""
        skipping = False  # inside a line past max_event_bytes: dropped up to its newline
        try:
            # read1: whatever has arrived, never waiting for a full buffer (an event would
            # wait for the next ones); chunked or not.
            while chunk := resp.read1(64 * 1024):
                buffer += chunk
                while (end := buffer.find(b"\n")) >= 0:
                    line, buffer = buffer[:end], buffer[end + 1:]
                    if skipping:
                        skipping = False
                    elif line.strip():
                        yield line
                if len(buffer) > max_event_bytes:
                    if not skip_long:
                        raise KubeError(f"{what}: an event larger than {max_event_bytes} bytes")
                    if not skipping:
                        yield None
                    buffer, skipping = b"", True
            if buffer.strip() and not skipping:
                if tail_is_cut:  # a complete event ends with its newline: this one was cut off
                    raise KubeError(f"{what}: the stream broke off inside an event")
                yield buffer
        except self._transport_errors as exc:  # the stream cut, or shut to stop the watch
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None
        finally:
            call.let_go()  # back in the pool, the connection may carry the next watch: never cut it later
            resp.release_conn()


# A connect under way cannot be cut (its socket is not the connection's yet): it ends
# within the client's connect timeout (Kube's timeout_s, 5 s).
STOP_WITHIN_S = 10.0
_opening = threading.local()  # .call: the WatchCall this thread is opening, if any


class WatchCall:
    """One watch request and the thread that makes it.  ``stop`` ends both, at whichever step
    the request has reached (connecting, waiting for the response's head, reading the
    stream): its socket is shut down under the blocked call, which returns at once (closing
    the response would wait for that read, and until the head comes there is no response),
    and the thread is waited for.  The thread is not a daemon: whatever happens, the
    interpreter waits for it rather than kill it in the client."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[socket.socket] = []  # the sockets that carried it (a retry takes another connection)
        self._running: concurrent.futures.Future[None] | None = None
        self._name = ""
        self.cut_off = False

    def start(self, pump: Callable[[], None], name: str) -> concurrent.futures.Future[None]:
        """Run ``pump`` (which makes the request, through ``opening``) in the watch's thread,
        named ``name``; its outcome: None, or what ``pump`` raised, as it is (the executor
        holds it: nothing of ours catches it on the way)."""
        runner = concurrent.futures.ThreadPoolExecutor(max_workers=1, initializer=_named, initargs=(name,))
        self._running, self._name = runner.submit(pump), name
        runner.shutdown(wait=False)  # its one thread ends with pump
        return self._running

    async def stop(self) -> None:
        """Cut the request, and wait (``STOP_WITHIN_S`` at most) for the thread to end."""
        self.cut()
        running = self._running
        if running is None:
            return
        done, _ = await asyncio.to_thread(concurrent.futures.wait, [running], STOP_WITHIN_S)
        if not done:  # a bug: nothing the thread does should outlast its cut socket this long
            log_event("watch_thread_not_stopped", logging.ERROR, thread=self._name, within=f"{STOP_WITHIN_S:g} s",
                      then="exit waits for it")

    @contextlib.contextmanager
    def opening(self) -> Iterator[None]:
        """On the watch's thread, while it makes the request: the socket of each connection
        the request uses is held, to be cut."""
        _opening.call = self
        opened = False
        try:
            yield
            opened = True
        finally:
            _opening.call = None
            if not opened:
                self.let_go()  # no stream: the connection went back to the pool, or is closed

    def hold(self, sock: socket.socket) -> None:
        with self._lock:
            if not self.cut_off:
                if sock not in self._held:
                    self._held.append(sock)
                return
        _shut(sock)  # cut already: the request fails at once

    def cut(self) -> None:
        with self._lock:  # shut under the lock: let go of, a socket may carry the other watch next
            self.cut_off = True
            for sock in self._held:
                _shut(sock)
            self._held = []

    def let_go(self) -> None:
        with self._lock:
            self._held.clear()


class WatchThread(Generic[_T]):
    """``stream(call)`` run in a watch's own thread, its items handed to the loop in order::

        async with WatchThread(stream, "pod-watch") as items:
            async for item in items: ...

    The iteration ends where the stream does; where the stream raises, its exception is
    raised in the loop as it is (a KubeError: the API server's; anything else: a bug of ours).
    Leaving the block, however (cancelled included), cuts the call and waits for the thread.
    Each watch has a WatchCall of its own: a late thread never feeds the next watch."""

    QUEUED = 64  # items between the thread and the loop: bounded, the thread waits for the loop

    def __init__(self, stream: Callable[[WatchCall], Iterable[_T]], name: str) -> None:
        self._stream, self._name = stream, name
        self._call = WatchCall()
        self._queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue(maxsize=self.QUEUED)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running: concurrent.futures.Future[None] | None = None

    async def __aenter__(self) -> WatchThread[_T]:
        self._loop = asyncio.get_running_loop()
        self._running = self._call.start(self._pump, self._name)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self._call.stop()

    def __aiter__(self) -> WatchThread[_T]:
        return self

    async def __anext__(self) -> _T:
        what, item = await self._queue.get()
        if what == "end":
            # How the stream ended: what it raised comes as it is (a KubeError: the API
            # server's; anything else: a bug of ours).
            assert self._running is not None
            await asyncio.wrap_future(self._running)
            raise StopAsyncIteration
        return item

    def _pump(self) -> None:
        try:
            # Once cut, items are dropped, never the stream: its socket is shut, so it ends at
            # once, and read to its end it hands its connection back.
            for item in self._stream(self._call):
                self._put(("item", item))
        finally:
            self._put(("end", None))  # however it ended: its outcome says how

    def _put(self, item: tuple[str, Any]) -> None:
        """Onto the queue, in the thread; never once cut: nobody reads, and the loop may be closing."""
        if self._call.cut_off:
            return
        assert self._loop is not None
        done = asyncio.run_coroutine_threadsafe(self._queue.put(item), self._loop)
        while not self._call.cut_off:  # waits while the queue is full; gives up when cut
            with contextlib.suppress(TimeoutError):
                done.result(timeout=1.0)
                return
        done.cancel()


def _named(name: str) -> None:
    """A watch's thread goes by the watch's name (an executor's would be ``name_0``)."""
    threading.current_thread().name = name


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):  # closed meanwhile
        sock.shutdown(socket.SHUT_RDWR)


class _Held:
    """A connection whose socket the WatchCall its thread is opening, if any, holds: from the
    moment it connects, and each time it carries a request (a kept-alive one carries
    several).  The socket, not the connection: a response that ends with its connection
    (HTTP/1.0, ``Connection: close``) takes the socket from it."""

    sock: socket.socket | None

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        self._hold()

    def request(self, *args: Any, **kwargs: Any) -> None:
        self._hold()  # a kept-alive connection; a new one is held as it connects
        super().request(*args, **kwargs)  # type: ignore[misc]

    def _hold(self) -> None:
        call = getattr(_opening, "call", None)
        if call is not None and self.sock is not None:
            call.hold(self.sock)


def _cuttable(api_client: Any) -> Any:
    """``api_client`` with connections a WatchCall can cut: each pool class of its pool
    manager (plain, TLS, through a proxy) makes its connections with ``_Held`` mixed in."""
    manager = api_client.rest_client.pool_manager
    manager.pool_classes_by_scheme = {
        scheme: type(f"Held{pool.__name__}", (pool,), {"ConnectionCls": type(f"Held{pool.ConnectionCls.__name__}", (_Held, pool.ConnectionCls), {})})
        for scheme, pool in manager.pool_classes_by_scheme.items()
    }
    return api_client


def _event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except (ValueError, RecursionError):
        raise KubeError("watch pods: an event that is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("type"), str) or not isinstance(event.get("object"), dict):
        raise KubeError("watch pods: an event without type and object")
    return event


def _message(body: Any) -> str:
    """The API server's Status message, else the body as it came."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        status = json.loads(text)
    except ValueError:
        return text
    return str(status.get("message", text)) if isinstance(status, dict) else text
