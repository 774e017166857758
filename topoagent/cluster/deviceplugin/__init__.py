"""`topoagent device-plugin`: the kubelet device plugin API (v1beta1) answered by the agent.

``api.proto`` is kubelet's published API, vendored unchanged (see ``PROVENANCE.md``);
``api_pb2*.py`` are generated from it by ``scripts/gen-deviceplugin-proto``.  Importing
this package needs the ``kubernetes`` extra (grpcio, protobuf).
"""
