"""Every JSON document we print holds to its schema in the OpenAPI document, and the
schema is strict: a field written by a door but not declared (or the reverse) fails here."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import jsonschema
import pytest
from conftest import FIXTURES
from schema_check import validate

from topoagent.cli import main
from topoagent.documents.agent import DOCUMENTS as AGENT_DOCUMENTS
from topoagent.documents.agent import sections_table
from topoagent.documents.schema import DOCUMENTS, SCHEMA_VERSION, node_document
from topoagent.node.discovery import discover
from topoagent.node.host import Host

SNAPSHOTS = sorted(p for p in (FIXTURES / "snapshots").iterdir() if p.is_dir())


def test_every_component_is_strict() -> None:
    """Every field is required, but those of a placement answer's sections (`detail`):
    present only when asked, and said so."""
    for document in (*DOCUMENTS, *AGENT_DOCUMENTS):
        schema = document.json_schema()
        assert schema["additionalProperties"] is False
        on_request = {key for key, f in document.fields.items() if f.section is not None}
        assert set(schema["required"]) == set(schema["properties"]) - on_request, document.name
        assert all("Only when the request's `detail` names" in schema["properties"][key]["description"] for key in on_request)
    assert {d.name for d in AGENT_DOCUMENTS if any(f.section for f in d.fields.values())} == {"Placement", "PlacedGpu", "NoFit"}


class _Watched:
    """An answer that notes which of its attributes a dump reads."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> object:
        self.read.add(name)
        return getattr(self._inner, name)


@pytest.mark.parametrize("detail", [(), ("bindings",), ("launch",), ("explain",)])
def test_an_answer_renders_only_the_sections_asked(detail: tuple[str, ...]) -> None:
    """Launch forms and reasons in words are written when a door shows them, not for every
    answer: a lean dump never reads them, nor any other section's field."""
    from topoagent.documents.agent import answer_document
    from topoagent.placement import Placement, Request, place
    from topoagent.placement.synthetic import pcie_two_socket_8

    answer = place(pcie_two_socket_8(), Request(gpus=4, nics=1, detail=detail))
    assert isinstance(answer, Placement)
    watched = _Watched(answer)
    doc = answer_document(watched)
    validate(doc, "Placement")
    sections = {
        "bindings": {"numa_nodes", "cpus", "nics", "env", "numactl"},
        "launch": {"launch"},
        "explain": {"links", "broken_zones", "estimate", "explain", "request"},
    }
    asked = set().union(*(sections[d] for d in detail))
    unasked = set().union(*sections.values()) - asked
    assert not (watched.read & unasked) - {"request"}  # the request itself is read: its pattern, its detail
    assert asked <= set(doc) and not unasked & set(doc)
    assert asked - {"request"} <= watched.read


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


def test_place_answers_hold_to_their_schemas(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    root = str(FIXTURES / "snapshots" / "dgx-a100")
    assert main(["place", "--gpus", "4", "--nics", "2", "--json", "--root", root]) == 0
    validate(json.loads(capsys.readouterr().out), "Placement")
    # NUMA nodes of 2 GPUs never hold 3: exit 3, never fits (issue 27).
    assert main(["place", "--gpus", "3", "--busy", "0,2,4,6", "--single-numa", "--json", "--root", root]) == 3
    nofit = json.loads(capsys.readouterr().out)
    validate(nofit, "NoFit")
    assert nofit["best_available"] is not None  # the nested placement was checked too
    lines = "\n".join(['{"gpus": 2}', '{"gpus": 2, "include": [9]}', "not json"])
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(lines.encode())))
    assert main(["place", "--batch", "--root", root]) == 2  # the worst line's: bad input
    fit, bad_index, not_json = (json.loads(line) for line in capsys.readouterr().out.splitlines())
    validate(fit, "Placement")
    validate(bad_index, "BatchError")
    validate(not_json, "BatchError")
    assert bad_index["error"]["field"] == "include[0]"


def test_the_docs_table_of_detail_sections_is_what_the_answer_writes() -> None:
    """docs/placement.md's table of what each `detail` section adds is rendered from the
    answer's field list: a field that moves between sections moves there too."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "placement.md").read_text()
    table = text.split("<!-- detail-sections -->\n", 1)[1].split("<!-- /detail-sections -->", 1)[0]
    assert table == sections_table(), "docs/placement.md's sections table is out of date; paste documents/agent.py's sections_table()"
