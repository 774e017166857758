"""A Kubernetes API server on loopback, speaking the published JSON for the calls our
cluster pieces make, and no more:

- ``GET /api/v1/pods`` (the device plugin: Pending pods bound to its node; every pod is
  listed, the query is recorded);
- ``GET /api/v1/namespaces/{ns}/pods/{name}``, ``GET /api/v1/nodes/{name}``;
- ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` with a JSON merge patch (RFC 7386, what
  the extender sends) or a strategic merge patch of plain maps (the same for annotations);
- ``POST /api/v1/namespaces/{ns}/pods/{name}/binding``: a ``Binding`` whose UID must be
  the pod's and whose pod is not bound yet (else 409, as the real one answers); it sets
  ``spec.nodeName``.

Errors are ``Status`` objects.  ``fail_binding`` names pods whose binding fails (500).
"""

from __future__ import annotations

import copy
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

POD = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)")
BINDING = re.compile(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/binding")
NODE = re.compile(r"/api/v1/nodes/([^/]+)")


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


class FakeApiServer:
    def __init__(self, pods: list[dict] | None = None, nodes: list[dict] | None = None) -> None:
        self.lock = threading.Lock()
        self.pods: dict[tuple[str, str], dict] = {}
        for pod in pods or []:
            self.add_pod(pod)
        self.nodes = {n["metadata"]["name"]: n for n in nodes or []}
        self.queries: list[dict] = []
        self.bindings: list[dict] = []
        self.patches: list[tuple[str, str, str]] = []  # (namespace/name, content type, body)
        self.fail_binding: set[str] = set()
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
                with outer.lock:
                    if url.path == "/api/v1/pods":
                        outer.queries.append({"path": url.path, **parse_qs(url.query)})
                        return self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": {}, "items": list(outer.pods.values())})
                    if m := POD.fullmatch(url.path):
                        pod = outer.pods.get((m.group(1), m.group(2)))
                        return self._send(200, pod) if pod else self._send(404, status(404, "NotFound", f'pods "{m.group(2)}" not found'))
                    if m := NODE.fullmatch(url.path):
                        node = outer.nodes.get(m.group(1))
                        return self._send(200, node) if node else self._send(404, status(404, "NotFound", f'nodes "{m.group(1)}" not found'))
                self._send(404, status(404, "NotFound", "the server could not find the requested resource"))

            def do_PATCH(self) -> None:
                url = urlparse(self.path)
                kind = self.headers.get("Content-Type", "")
                body = self._read()
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
                    self._send(200, updated)

            def do_POST(self) -> None:
                url = urlparse(self.path)
                body = self._read()
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
                    if name in outer.fail_binding:
                        return self._send(500, status(500, "InternalError", "etcdserver: request timed out"))
                    if (pod.get("spec") or {}).get("nodeName"):
                        return self._send(409, status(409, "Conflict", f"pod {name} is already assigned to node {pod['spec']['nodeName']!r}"))
                    node = body["target"]["name"]
                    pod.setdefault("spec", {})["nodeName"] = node
                    outer.bindings.append({"namespace": ns, "name": name, "uid": uid, "node": node})
                    self._send(201, {**status(201, "", ""), "status": "Success"})

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def add_pod(self, pod: dict) -> None:
        meta = pod.setdefault("metadata", {})
        meta.setdefault("namespace", "default")
        with self.lock:
            self.pods[(meta["namespace"], meta["name"])] = pod

    def pod(self, name: str, namespace: str = "default") -> dict:
        with self.lock:
            return copy.deepcopy(self.pods[(namespace, name)])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
