"""Every JSON document we print holds to its schema in the OpenAPI document, and the
schema is strict: a field written by a door but not declared (or the reverse) fails here."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from conftest import FIXTURES

from topoagent.cli import main
from topoagent.discovery import discover
from topoagent.exporters.openapi import openapi_document
from topoagent.host import Host
from topoagent.schema import DOCUMENTS, SCHEMA_VERSION, node_document

SNAPSHOTS = sorted(p for p in (FIXTURES / "snapshots").iterdir() if p.is_dir())
OPENAPI = openapi_document()


def validate(document: Any, name: str) -> None:
    schema = {"$ref": f"#/components/schemas/{name}", "components": OPENAPI["components"]}
    jsonschema.Draft202012Validator(schema).validate(document)


def test_every_component_is_strict() -> None:
    for document in DOCUMENTS:
        schema = document.json_schema()
        assert schema["additionalProperties"] is False
        assert set(schema["required"]) == set(schema["properties"]), document.name


@pytest.mark.parametrize("root", SNAPSHOTS, ids=lambda p: p.name)
def test_discover_json_holds_to_the_node_schema(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["discover", "--json", "--root", str(root)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["schema_version"] == SCHEMA_VERSION
    validate(out, "Node")
    # The schema is strict: a stray field is refused, so the check above can fail.
    with pytest.raises(jsonschema.ValidationError):
        validate({**out, "extra": 1}, "Node")


def test_matrix_json_holds_to_its_schema(corpus: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for text in sorted((corpus / "nvidia-smi-topo").glob("*.txt")):
        if main(["matrix", "--json", "--from-nvidia-smi", str(text)]) != 0:
            capsys.readouterr()
            continue  # an unreadable capture: the parser's tests cover its error
        out = json.loads(capsys.readouterr().out)
        assert out["schema_version"] == SCHEMA_VERSION
        validate(out, "TopoMatrix")


def test_a_finding_of_every_kind_and_severity_is_describable() -> None:
    with Host(str(FIXTURES / "snapshots" / "degraded")) as host:
        doc = node_document(asyncio.run(discover(host)))
    validate(doc, "Node")
    assert {f["severity"] for f in doc["findings"]} <= {"info", "warning", "critical"}
