"""A Kubernetes API server on loopback, speaking the published JSON for the calls our
cluster pieces make, and no more:

- ``GET /api/v1/pods`` (the device plugin: Pending pods bound to its node; every pod is
  listed, the query is recorded); with ``limit`` in pages (``metadata.continue``), and with
  ``watch=true`` a stream of watch events after ``resourceVersion`` (one JSON object a
  line) until ``timeoutSeconds`` or ``close_watches()``; a resourceVersion older than the
  events kept gets one ERROR event, 410 Gone, as the real one answers;
- ``GET /api/v1/namespaces/{ns}/pods/{name}``, ``GET /api/v1/nodes/{name}``, ``GET /api/v1/nodes``
  (with ``limit``, in pages; ``node_lists`` counts them); with ``watch=1`` the Node watch
  as the real one serves it (HTTP/1.1, chunked, one WatchEvent ``{"type", "object"}`` a
  line: ADDED, MODIFIED, DELETED after ``resourceVersion``; with ``allowWatchBookmarks`` a
  BOOKMARK carrying the latest resourceVersion before the stream ends at ``timeoutSeconds``;
  a resourceVersion older than the events kept gets one ERROR event, a Status 410 Expired);
  ``node_watches`` counts them, ``expire_node_watches()`` ends them as etcd's compaction
  past their resourceVersion does (their next watch gets 410), ``break_node_watches()``
  cuts the open stream (else the next) inside an event, ``node_watch_line()`` sends a
  line of its own (a malformed event);
- ``PATCH /api/v1/nodes/{name}/status`` with a strategic merge patch, whose
  ``status.conditions`` merge by ``type`` as the real one's do (anything but ``status`` is
  ignored there, as on the real subresource); ``PATCH /api/v1/nodes/{name}`` with a JSON merge
  patch, refused 409 when its ``metadata.resourceVersion`` is given and is not the node's
  (``spec.taints``, a list without a merge key, is replaced whole); each is recorded in
  ``node_patches``;
- ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` with a JSON merge patch (RFC 7386, what
  the extender sends) or a strategic merge patch of plain maps (the same for annotations);
- ``POST /api/v1/namespaces/{ns}/pods/{name}/binding``: a ``Binding`` whose UID (and
  resourceVersion, when given) must be the pod's and whose pod is not bound yet (else 409,
  as the real one answers); it sets ``spec.nodeName`` and the Binding's annotations in one
  update.

Every change gives the pod a new ``metadata.resourceVersion`` and a watch event;
``delete_pod`` and ``set_phase`` play the pod's end.

Errors are ``Status`` objects; with ``pods_unavailable`` listing and watching pods answer 503,
with ``fail_node_patches`` a Node patch answers 500, with ``node_watch_forbidden`` a Node
watch 403 (RBAC without ``watch``).  ``hold_node_lists`` (an Event) makes a Node LIST take
its snapshot, then wait for the event before it answers (a slow list); ``hold_node_watches``
makes a Node watch wait for it before it answers at all, ``hold_pod_watches`` a pods watch
(``watches`` counts them as they arrive); ``hold_pod_lists`` does so for a pods LIST.  ``fail_binding`` names pods whose binding fails (500);
``binding_delay_s`` holds each binding that long first, as a loaded API server does, so
that concurrent binds of one pod overlap.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

POD = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)")
BINDING = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/binding")
NODE = re.compile(r"/api/v1/nodes/([^/]+)")
NODE_STATUS = re.compile(r"/api/v1/nodes/([^/]+)/status")


def status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure" if code >= 400 else "Success",
            "message": message, "reason": reason, "code": code}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def merge_conditions(conditions: Any, patch: list) -> list:
    """A strategic merge of node conditions: by ``type``, each patched one's fields over the old."""
    out = [dict(c) for c in conditions or []]
    for item in patch:
        old = next((c for c in out if c.get("type") == item.get("type")), None)
        if old is None:
            out.append(dict(item))
        else:
            old.update(item)
    return out


KEPT_EVENTS = 1000


class FakeApiServer:
    def __init__(self, pods: list[dict] | None = None, nodes: list[dict] | None = None) -> None:
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.version = 100
        self.events: list[tuple[int, str, dict]] = []  # (resourceVersion, type, pod), the last KEPT_EVENTS
        self.watch_generation = 0  # close_watches() bumps it: every open watch stream ends
        self.watches = 0  # watch requests served
        self.pods: dict[tuple[str, str], dict] = {}
        for pod in pods or []:
            self.add_pod(pod)
        self.nodes = {n["metadata"]["name"]: n for n in nodes or []}
        for node in self.nodes.values():
            self.version += 1
            node["metadata"].setdefault("resourceVersion", str(self.version))
        self.node_patches: list[tuple[str, str, dict]] = []  # (path, content type, body)
        self.queries: list[dict] = []
        self.bindings: list[dict] = []
        self.patches: list[tuple[str, str, str]] = []  # (namespace/name, content type, body)
        self.fail_binding: set[str] = set()
        self.binding_delay_s = 0.0
        self.node_lists = 0  # GET /api/v1/nodes served
        self.node_patch_times: list[tuple[str, float, Any]] = []  # (node, monotonic time, patch): when each landed
        self.pods_unavailable = False  # GET /api/v1/pods (list and watch) answers 503, as an API server restarting
        self.hold_pod_lists: threading.Event | None = None  # set: a pods LIST answers only once it is set (a hung API server)
        self.hold_pod_watches: threading.Event | None = None  # set: the held pods watches answer
        self.node_events: list[tuple[int, bytes]] = []  # (resourceVersion, the event's line), the last KEPT_EVENTS
        self.node_compacted = 0  # a node watch from below this resourceVersion gets 410
        self.node_watches = 0  # node watch requests served
        self.node_watch_forbidden = False  # a Node watch answers 403, as with a ClusterRole without watch
        self.fail_node_patches = False  # PATCH /api/v1/nodes/{name} answers 500, as etcd timing out
        self.node_cuts = 0  # node streams owed a cut inside an event (break_node_watches)
        self.node_ends = 0  # expire_node_watches() bumps it: every open node stream ends, no bookmark
        self.hold_node_lists: threading.Event | None = None  # set: the held lists answer (their snapshot taken before)
        self.hold_node_watches: threading.Event | None = None  # set: the held watches answer
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _read(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length)) if length else None

            def do_GET(self) -> None:
                url = urlparse(self.path)
                query = parse_qs(url.query)
                if url.path == "/api/v1/pods" and outer.hold_pod_lists is not None and query.get("watch", [""])[0] not in ("true", "1"):
                    outer.hold_pod_lists.wait()  # a hung API server: the list answers only once set
                if url.path == "/api/v1/pods" and outer.pods_unavailable:
                    return self._send(503, status(503, "ServiceUnavailable", "the server is currently unable to handle the request"))
                if url.path == "/api/v1/pods" and query.get("watch", [""])[0] in ("true", "1"):
                    return self._watch(query)
                if url.path == "/api/v1/nodes" and query.get("watch", [""])[0] in ("true", "1"):
                    if outer.node_watch_forbidden:
                        return self._send(403, status(403, "Forbidden", 'nodes is forbidden: User "system:serviceaccount:topoagent:'
                                                      'topoagent-extender" cannot watch resource "nodes" in API group "" at the cluster scope'))
                    with outer.lock:
                        outer.node_watches += 1
                        held = outer.hold_node_watches
                    if held is not None:
                        held.wait()
                    try:
                        return self._node_watch(query)
                    except (BrokenPipeError, ConnectionResetError):  # the client went away
                        return None
                with outer.lock:
                    if url.path == "/api/v1/pods":
                        outer.queries.append({"path": url.path, **query})
                        items = list(outer.pods.values())
                        meta: dict[str, Any] = {"resourceVersion": str(outer.version)}
                        if "limit" in query:
                            start, limit = int(query.get("continue", ["0"])[0] or 0), int(query["limit"][0])
                            if start + limit < len(items):
                                meta["continue"] = str(start + limit)
                            items = items[start:start + limit]
                        return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta, "items": items})
                    if url.path == "/api/v1/nodes":
                        outer.node_lists += 1
                        nodes = list(outer.nodes.values())
                        node_meta: dict[str, Any] = {"resourceVersion": str(outer.version)}
                        if "limit" in query:
                            start, limit = int(query.get("continue", ["0"])[0] or 0), int(query["limit"][0])
                            if start + limit < len(nodes):
                                node_meta["continue"] = str(start + limit)
                            nodes = nodes[start:start + limit]
                        node_list = {"kind": "NodeList", "apiVersion": "v1", "metadata": node_meta, "items": copy.deepcopy(nodes)}
                        held = outer.hold_node_lists
                        if held is None:
                            return self._send(200, node_list)
                    if m := POD.fullmatch(url.path):
                        pod = outer.pods.get((m.group(1), m.group(2)))
                        return self._send(200, pod) if pod else self._send(404, status(404, "NotFound", f'pods "{m.group(2)}" not found'))
                    if m := NODE.fullmatch(url.path):
                        node = outer.nodes.get(m.group(1))
                        return self._send(200, node) if node else self._send(404, status(404, "NotFound", f'nodes "{m.group(1)}" not found'))
                if url.path == "/api/v1/nodes":  # a held list: the snapshot above, answered once the test lets it go
                    held.wait()
                    return self._send(200, node_list)
                self._send(404, status(404, "NotFound", "the server could not find the requested resource"))

            def _watch(self, query: dict[str, list[str]]) -> None:
                since = int(query.get("resourceVersion", ["0"])[0] or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds", ["1800"])[0])
                with outer.lock:
                    outer.watches += 1
                    held = outer.hold_pod_watches
                if held is not None:
                    held.wait()
                with outer.lock:
                    generation = outer.watch_generation
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()  # HTTP/1.0: the stream ends when the connection closes
                with outer.lock:
                    if outer.events and since < outer.events[0][0] - 1 and since < outer.version:
                        gone = status(410, "Expired", f"too old resource version: {since} ({outer.events[0][0] - 1})")
                        self.wfile.write(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                        return
                while True:
                    with outer.lock:
                        pending = [(v, t, o) for v, t, o in outer.events if v > since]
                        if not pending:
                            left = deadline - time.monotonic()
                            if left <= 0 or outer.watch_generation != generation:
                                return
                            outer.changed.wait(min(left, 0.2))
                            continue
                    for v, kind, obj in pending:
                        self.wfile.write(json.dumps({"type": kind, "object": obj}).encode() + b"\n")
                        since = v
                    self.wfile.flush()

            def _node_watch(self, query: dict[str, list[str]]) -> None:
                since = int(query.get("resourceVersion", ["0"])[0] or 0)
                deadline = time.monotonic() + float(query.get("timeoutSeconds", ["1800"])[0])
                bookmarks = query.get("allowWatchBookmarks", [""])[0] in ("true", "1")
                with outer.lock:
                    generation, ends = outer.watch_generation, outer.node_ends
                self.protocol_version = "HTTP/1.1"  # chunked, as the real one streams
                self.close_connection = True
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()

                def chunk(data: bytes) -> None:
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                    self.wfile.flush()

                with outer.lock:
                    expired = since < outer.node_compacted
                    compacted = outer.node_compacted
                if expired:
                    gone = status(410, "Expired", f"too old resource version: {since} ({compacted})")
                    chunk(json.dumps({"type": "ERROR", "object": gone}).encode() + b"\n")
                    self.wfile.write(b"0\r\n\r\n")
                    return
                while True:
                    with outer.lock:
                        if outer.node_ends != ends:
                            self.wfile.write(b"0\r\n\r\n")
                            return
                        if outer.node_cuts:
                            outer.node_cuts -= 1
                            # A chunk announced whole, half of it sent, then the connection gone.
                            self.wfile.write(b"%x\r\n" % 400 + b'{"type":"MODIFIED","object":{"kind":"Node","metad')
                            self.wfile.flush()
                            return
                        pending = [(v, line) for v, line in outer.node_events if v > since]
                        if not pending:
                            left = deadline - time.monotonic()
                            if left <= 0 or outer.watch_generation != generation:
                                version = outer.version
                                break
                            outer.changed.wait(min(left, 0.2))
                            continue
                    for v, line in pending:
                        chunk(line + b"\n")
                        since = v
                if bookmarks:
                    mark = {"kind": "Node", "apiVersion": "v1", "metadata": {"resourceVersion": str(version)}}
                    chunk(json.dumps({"type": "BOOKMARK", "object": mark}).encode() + b"\n")
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()

            def do_PATCH(self) -> None:
                url = urlparse(self.path)
                kind = self.headers.get("Content-Type", "")
                body = self._read()
                if NODE_STATUS.fullmatch(url.path) or NODE.fullmatch(url.path):
                    return self._patch_node(url.path, kind, body)
                with outer.lock:
                    m = POD.fullmatch(url.path)
                    pod = outer.pods.get((m.group(1), m.group(2))) if m else None
                    if pod is None:
                        return self._send(404, status(404, "NotFound", "pod not found"))
                    if kind not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
                        return self._send(415, status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format - accepted media types include: application/merge-patch+json; got {kind}"))
                    outer.patches.append((f"{m.group(1)}/{m.group(2)}", kind, json.dumps(body)))
                    updated = merge_patch(pod, body)
                    outer.pods[(m.group(1), m.group(2))] = updated
                    outer._changed("MODIFIED", updated)
                    self._send(200, updated)

            def _patch_node(self, path: str, kind: str, body: Any) -> None:
                status_only = NODE_STATUS.fullmatch(path)
                m = status_only or NODE.fullmatch(path)
                assert m is not None
                with outer.lock:
                    node = outer.nodes.get(m.group(1))
                    if node is None:
                        return self._send(404, status(404, "NotFound", f'nodes "{m.group(1)}" not found'))
                    if not isinstance(body, dict):
                        return self._send(400, status(400, "BadRequest", "expected a JSON object"))
                    if outer.fail_node_patches and not status_only:
                        return self._send(500, status(500, "InternalError", "etcdserver: request timed out"))
                    if status_only:
                        if kind != "application/strategic-merge-patch+json":
                            return self._send(415, status(415, "UnsupportedMediaType", f"this test server takes node status as a strategic merge patch; got {kind}"))
                        patch = body.get("status") or {}
                        updated = copy.deepcopy(node)
                        node_status = updated.setdefault("status", {})
                        if "conditions" in patch:
                            node_status["conditions"] = merge_conditions(node_status.get("conditions"), patch["conditions"])
                        for key, value in patch.items():
                            if key != "conditions":
                                node_status[key] = merge_patch(node_status.get(key), value)
                    else:
                        if kind != "application/merge-patch+json":
                            return self._send(415, status(415, "UnsupportedMediaType", f"this test server takes a node as a JSON merge patch; got {kind}"))
                        version = (body.get("metadata") or {}).get("resourceVersion")
                        if version and version != node["metadata"].get("resourceVersion"):
                            return self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on nodes "{m.group(1)}": the object has been modified; please apply your changes to the latest version and try again'))
                        # metadata merges too (annotations), all but the resourceVersion the server sets
                        metadata = {k: v for k, v in (body.get("metadata") or {}).items() if k != "resourceVersion"}
                        updated = merge_patch(node, {**body, "metadata": metadata})
                    outer.node_patches.append((path, kind, body))
                    outer.node_patch_times.append((m.group(1), time.monotonic(), copy.deepcopy(body)))
                    outer.nodes[m.group(1)] = updated
                    outer._node_changed("MODIFIED", updated)
                    self._send(200, updated)

            def do_POST(self) -> None:
                url = urlparse(self.path)
                body = self._read()
                if outer.binding_delay_s:
                    time.sleep(outer.binding_delay_s)
                with outer.lock:
                    m = BINDING.fullmatch(url.path)
                    if not m:
                        return self._send(404, status(404, "NotFound", "the server could not find the requested resource"))
                    ns, name = m.group(1), m.group(2)
                    pod = outer.pods.get((ns, name))
                    if pod is None:
                        return self._send(404, status(404, "NotFound", f'pods "{name}" not found'))
                    if not isinstance(body, dict) or body.get("kind", "Binding") != "Binding" or not (body.get("target") or {}).get("name"):
                        return self._send(400, status(400, "BadRequest", "expected a Binding with a target"))
                    uid = (body.get("metadata") or {}).get("uid")
                    if uid and uid != pod["metadata"].get("uid"):
                        return self._send(409, status(409, "Conflict", f"Precondition failed: UID in precondition: {uid}, UID in object meta: {pod['metadata'].get('uid')}"))
                    version = (body.get("metadata") or {}).get("resourceVersion")
                    if version and version != pod["metadata"].get("resourceVersion"):
                        return self._send(409, status(409, "Conflict", f'Operation cannot be fulfilled on pods "{name}": the object has been modified; please apply your changes to the latest version and try again'))
                    if name in outer.fail_binding:
                        return self._send(500, status(500, "InternalError", "etcdserver: request timed out"))
                    if (pod.get("spec") or {}).get("nodeName"):
                        return self._send(409, status(409, "Conflict", f"pod {name} is already assigned to node {pod['spec']['nodeName']!r}"))
                    node = body["target"]["name"]
                    pod.setdefault("spec", {})["nodeName"] = node
                    annotations = (body.get("metadata") or {}).get("annotations") or {}
                    if annotations:
                        pod["metadata"].setdefault("annotations", {}).update(annotations)
                    outer.bindings.append({"namespace": ns, "name": name, "uid": uid, "node": node})
                    outer._changed("MODIFIED", pod)
                    self._send(201, {**status(201, "", ""), "status": "Success"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def _changed(self, kind: str, pod: dict) -> None:
        """A new resourceVersion for ``pod`` and its watch event; the lock is held."""
        self.version += 1
        pod.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self.events.append((self.version, kind, copy.deepcopy(pod)))
        del self.events[:-KEPT_EVENTS]
        self.changed.notify_all()

    def add_pod(self, pod: dict) -> None:
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        with self.lock:
            stored = copy.deepcopy(pod)
            self.pods[(meta["namespace"], meta["name"])] = stored
            self._changed("ADDED", stored)
            meta["resourceVersion"] = stored["metadata"]["resourceVersion"]

    def _node_changed(self, kind: str, node: dict) -> None:
        """A new resourceVersion for ``node`` and its watch event; the lock is held."""
        self.version += 1
        node.setdefault("metadata", {})["resourceVersion"] = str(self.version)
        self._node_line(json.dumps({"type": kind, "object": node}).encode())

    def _node_line(self, line: bytes) -> None:
        self.node_events.append((self.version, line))
        if len(self.node_events) > KEPT_EVENTS:
            del self.node_events[:-KEPT_EVENTS]
            self.node_compacted = self.node_events[0][0] - 1
        self.changed.notify_all()

    def add_node(self, node: dict) -> None:
        with self.lock:
            stored = copy.deepcopy(node)
            kind = "MODIFIED" if stored["metadata"]["name"] in self.nodes else "ADDED"
            self.nodes[stored["metadata"]["name"]] = stored
            self._node_changed(kind, stored)

    def remove_node(self, name: str) -> None:
        with self.lock:
            node = self.nodes.pop(name, None)
            if node is not None:
                self._node_changed("DELETED", node)

    def set_node_address(self, name: str, address: str) -> None:
        """The Node's InternalIP is now ``address`` (kubelet's update after a readdressing)."""
        with self.lock:
            node = self.nodes[name]
            node.setdefault("status", {})["addresses"] = [{"type": "InternalIP", "address": address}, {"type": "Hostname", "address": name}]
            self._node_changed("MODIFIED", node)

    def label_node(self, name: str, labels: dict[str, str]) -> None:
        with self.lock:
            node = self.nodes[name]
            node["metadata"].setdefault("labels", {}).update(labels)
            self._node_changed("MODIFIED", node)

    def expire_node_watches(self) -> None:
        """Other objects change and etcd compacts past every node watch's resourceVersion,
        which ends without a bookmark: the next watch from there gets 410."""
        with self.lock:
            self.version += 1
            self.node_events.clear()
            self.node_compacted = self.version
            self.node_ends += 1
            self.changed.notify_all()

    def break_node_watches(self) -> None:
        """Cut the open node watch (or the next one) inside an event, as a dropped connection does."""
        with self.lock:
            self.node_cuts += 1
            self.changed.notify_all()

    def node_watch_line(self, line: bytes) -> None:
        """Send ``line`` to the node watches as an event of its own (one a client cannot read)."""
        with self.lock:
            self.version += 1
            self._node_line(line)

    def delete_pod(self, name: str, namespace: str = "default") -> None:
        with self.lock:
            pod = self.pods.pop((namespace, name))
            self._changed("DELETED", pod)

    def set_phase(self, name: str, phase: str, namespace: str = "default") -> None:
        with self.lock:
            pod = self.pods[(namespace, name)]
            pod.setdefault("status", {})["phase"] = phase
            self._changed("MODIFIED", pod)

    def set_node_name(self, name: str, node: str, namespace: str = "default") -> None:
        """The pod bound to ``node`` by someone else (kube-scheduler's own bind)."""
        with self.lock:
            pod = self.pods[(namespace, name)]
            pod.setdefault("spec", {})["nodeName"] = node
            self._changed("MODIFIED", pod)

    def set_pod_condition(self, name: str, condition: dict, namespace: str = "default") -> None:
        """A status condition on the pod, by type (kube-scheduler's PodScheduled after a failed try)."""
        with self.lock:
            pod = self.pods[(namespace, name)]
            status = pod.setdefault("status", {})
            status["conditions"] = [c for c in status.get("conditions") or [] if c.get("type") != condition.get("type")] + [dict(condition)]
            self._changed("MODIFIED", pod)

    def close_watches(self) -> None:
        """End every open watch stream, as an API server does at its timeout or restart."""
        with self.lock:
            self.watch_generation += 1
            self.changed.notify_all()

    def node(self, name: str) -> dict:
        with self.lock:
            return copy.deepcopy(self.nodes[name])

    def taint_node(self, name: str, taint: dict) -> None:
        """Someone else's taint (an admin's kubectl taint)."""
        with self.lock:
            node = self.nodes[name]
            node.setdefault("spec", {}).setdefault("taints", []).append(taint)
            self._node_changed("MODIFIED", node)

    def pod(self, name: str, namespace: str = "default") -> dict:
        with self.lock:
            return copy.deepcopy(self.pods[(namespace, name)])

    def close(self) -> None:
        self.close_watches()
        self.server.shutdown()
        self.server.server_close()
