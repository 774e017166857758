"""The documents: the one JSON form (and JSON Schema) of every document topoagent emits."""
