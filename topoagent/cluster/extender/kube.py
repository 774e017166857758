"""The API server calls of a bind, through the ``kubernetes`` client (an optional extra).

Read the pod (the bind arguments name it only), read a node's address when the agent URL
needs it, and create the Binding (``POST .../pods/{name}/binding``) carrying the chosen
GPUs as annotations, with the pod's UID and the resourceVersion it was read at as
preconditions: the API server sets the node and the annotations in one update, or
neither, so a bind that lost a race never leaves its (released) lease written on the pod.
The pod watch (``topoagent.cluster.podwatch``) lists and watches pods through here too.
The client is synchronous: each call runs in a thread.  Bodies are read as plain JSON,
the API server's published form.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from typing import Any

from topoagent.text import cut


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

    def watch_pods(self, resource_version: str, timeout_s: int, max_event_bytes: int, opened: list[Any],
                   field_selector: str | None = None) -> Iterator[dict[str, Any]]:
        """The watch events (``{"type", "object"}``) after ``resource_version``, until the
        server ends the stream (at ``timeout_s`` at the latest).  ``opened`` receives the
        response, so another thread can close it to stop the watch.  An event larger than
        ``max_event_bytes`` ends the watch with KubeError: memory stays bounded."""
        what = "watch pods"
        try:
            resp: Any = self._core.list_pod_for_all_namespaces(
                watch=True, resource_version=resource_version, timeout_seconds=timeout_s, allow_watch_bookmarks=True,
                field_selector=field_selector, _preload_content=False, _request_timeout=(self.timeout_s, timeout_s + self.timeout_s))
        except self._exception as exc:
            raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}") from None
        except self._transport_errors as exc:
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None
        opened.append(resp)
        for line in self._lines(what, resp, max_event_bytes, tail_is_cut=False):
            yield _event(line)

    # -- the node table's watch: blocking, run in the table's own thread --------------------

    def open_node_watch(self, resource_version: str, timeout_s: int) -> Any:
        """The open stream of Node watch events after ``resource_version`` (the server ends it
        at ``timeout_s``), for ``watch_lines``; KubeError when it cannot be opened."""
        what = "watch nodes"
        try:
            return self._core.list_node(watch=True, resource_version=resource_version, timeout_seconds=timeout_s, allow_watch_bookmarks=True,
                                        _preload_content=False, _request_timeout=(self.timeout_s, timeout_s + self.timeout_s))
        except self._exception as exc:  # 410 Gone: the version is older than the server keeps
            raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}", exc.status) from None
        except self._transport_errors as exc:
            raise KubeError(f"{what}: {cut(str(exc) or type(exc).__name__, 200)}") from None

    def watch_lines(self, resp: Any, max_event_bytes: int) -> Iterator[bytes | None]:
        """Each event line of an open node watch, as it arrives; None for a line longer than
        ``max_event_bytes`` (skipped unread: memory stays bounded, the stream goes on).
        KubeError when the stream breaks, a line cut off by the end included."""
        return self._lines("watch nodes", resp, max_event_bytes, tail_is_cut=True, skip_long=True)

    def _lines(self, what: str, resp: Any, max_event_bytes: int, *, tail_is_cut: bool, skip_long: bool = False) -> Iterator[Any]:
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
            resp.release_conn()


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
