"""`topoagent extender`: the kube-scheduler extender, once per cluster.

kube-scheduler asks it (HTTP/JSON, ``k8s.io/kube-scheduler/extender/v1``) which nodes can
take a GPU pod and how well; it asks each candidate node's agent (``/capacity``, dry-run
``/place``) and, with ``--bind``, reserves the GPUs it chose on the node's agent, writes
them on the pod (``topoagent.io/gpus``, read by the node's device plugin) and binds the pod.

- ``wire``: the extender API's documents, and a pod's GPU request read from its spec and
  annotations (through the agent's own request parser);
- ``nodes``: asking the agents (bounded fan-out, per-node timeout, ETag cache) and ranking
  the nodes that fit;
- ``nodetable``: the nodes and their addresses, from the API server's Node objects only;
- ``kube``: the API server calls (Node list, bind; the ``kubernetes`` client);
- ``holds``: a node kept for a large pod that fits no node, so smaller pods cannot starve it;
- ``tls``: HTTPS, and the client certificates (kube-scheduler's) it asks callers for;
- ``app``: the HTTP service.
"""

# The holds' defaults (``holds``), written once for the command line, ``app.Settings``, ``Holds``
# and the bench (bench/kube_queue.py); here, where `topoagent extender --help` imports nothing more.
HOLD_MIN_GPUS = 8  # a pod asking for this many GPUs or more may wait, and hold a node
HOLD_AFTER_S = 30.0  # a large pod that has fit no node this long holds one
HOLD_TTL_S = 300.0  # a hold's longest life (--hold-for)
HOLD_GUARD_S = 20.0  # a guard's longest life: twice kube-scheduler's longest backoff (10 s)
