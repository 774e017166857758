"""The API server calls of a bind, through the ``kubernetes`` client (an optional extra).

Read the pod (the bind arguments name it only), read a node's address when the agent URL
needs it, write the chosen GPUs on the pod (a merge patch of two annotations) and create
the Binding (``POST .../pods/{name}/binding``, with the pod's UID as precondition, as
kube-scheduler's own binder does).  The client is synchronous: each call runs in a
thread.  Bodies are read as plain JSON, the API server's published form.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from topoagent.text import cut


class KubeError(Exception):
    """The API server refused or could not be reached; the message says which call."""


class Kube:
    def __init__(self, api_url: str | None = None, kubeconfig: str | None = None, timeout_s: float = 5.0) -> None:
        """``api_url``: talk to this URL as is (a proxy such as `kubectl proxy`, or a test
        server); else ``kubeconfig``; else the pod's service account (in-cluster)."""
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
        self.timeout_s = timeout_s

    async def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        def call() -> Any:
            try:
                resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
                return json.loads(resp.data) if resp.data else None
            except self._exception as exc:
                raise KubeError(f"{what}: HTTP {exc.status}: {cut(_message(exc.body), 200)}") from None
            except (OSError, ValueError) as exc:  # urllib3's errors derive from these
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

    async def annotate(self, namespace: str, name: str, annotations: dict[str, str]) -> None:
        body = {"metadata": {"annotations": annotations}}
        await self._call(f"annotate pod {namespace}/{name}", self._core.patch_namespaced_pod, name, namespace, body,
                         _content_type="application/merge-patch+json")

    async def bind(self, namespace: str, name: str, uid: str, node: str) -> None:
        c = self._client
        binding = c.V1Binding(
            api_version="v1", kind="Binding",
            metadata=c.V1ObjectMeta(name=name, namespace=namespace, uid=uid),
            target=c.V1ObjectReference(api_version="v1", kind="Node", name=node),
        )
        await self._call(f"bind pod {namespace}/{name} to {node}", self._core.create_namespaced_pod_binding, name, namespace, binding)


def _message(body: Any) -> str:
    """The API server's Status message, else the body as it came."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        status = json.loads(text)
    except ValueError:
        return text
    return str(status.get("message", text)) if isinstance(status, dict) else text
