"""Hold a JSON document to its schema in the agent's OpenAPI document."""

from __future__ import annotations

from typing import Any

import jsonschema

from topoagent.exporters.openapi import openapi_document

OPENAPI = openapi_document()


def validate(document: Any, name: str) -> None:
    """Raise jsonschema.ValidationError unless ``document`` is a valid ``name``."""
    schema = {"$ref": f"#/components/schemas/{name}", "components": OPENAPI["components"]}
    jsonschema.Draft202012Validator(schema).validate(document)
