"""The one table of sources: each counter source owns the metric families its parser emits
and the thresholds on them; /metrics and the findings are built from those declarations."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import importlib.util
import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, REPO
from prometheus_client.parser import text_string_to_metric_families
from service_helpers import metric_value, promtool_complaints

from topoagent.collectors import aer
from topoagent.collectors.counters import COUNTER, GAUGE, CounterSource, Family, Threshold, label_is
from topoagent.collectors.registry import COUNTER_SOURCES, FAMILIES, SOURCES, THRESHOLDS, by_subsystem, check_declarations
from topoagent.config import Config
from topoagent.exporters.prometheus import MetricsPage
from topoagent.service.agent import Agent
from topoagent.service.telemetry import History, Sample, served
from topoagent.vocabulary import FindingKind, MetricsDetail, Severity

SNAPSHOTS = FIXTURES / "snapshots"
RECORDED = sorted(p.name for p in SNAPSHOTS.iterdir() if (p / "telemetry.json").is_file())


@pytest.mark.parametrize("name", RECORDED)
def test_every_series_a_parser_emits_is_of_a_family_its_own_source_declares(name):
    """A family no source declares would not reach /metrics: this is where it fails loudly."""
    samples = json.loads((SNAPSHOTS / name / "telemetry.json").read_text())["samples"]
    for source in COUNTER_SOURCES:
        declared = {f.name: f.labels for f in source.families}
        for sample in samples:
            raw = (sample.get("sources") or {}).get(source.name)
            if raw is None:
                continue
            for metric, labels, _ in source.parse(raw):
                assert metric in declared, f"{source.name} emits {metric}, a family it does not declare"
                assert tuple(k for k, _ in labels) == declared[metric], f"{source.name}: {metric} with labels {labels}"


def test_the_recordings_exercise_every_declared_family():
    emitted: set[str] = set()
    for name in RECORDED:
        for sample in json.loads((SNAPSHOTS / name / "telemetry.json").read_text())["samples"]:
            for source in COUNTER_SOURCES:
                raw = (sample.get("sources") or {}).get(source.name)
                if raw is not None:
                    emitted.update(m for m, _, _ in source.parse(raw))
    assert emitted == {f.name for f in FAMILIES}


def test_one_table_lists_every_source_once_and_the_declarations_follow_from_it():
    names = [s.name for s in SOURCES]
    assert len(names) == len(set(names))
    assert {"numa", "pci", "nvml", "infiniband_counters", "pcie_aer", "nvml_counters"} <= set(names)
    assert {t.key for t in THRESHOLDS} == {t.key for s in COUNTER_SOURCES for t in s.thresholds}
    assert aer.ERRORS in FAMILIES and all(rule in THRESHOLDS for rule in aer.THRESHOLDS)
    # /metrics keeps a subsystem's families together, whichever source declares them.
    subsystems = [f.subsystem for f in FAMILIES]
    assert subsystems == sorted(subsystems, key=subsystems.index)
    a, b, c = (Family(n, "", GAUGE, ()) for n in ("gpu_a", "pcie_b", "gpu_c"))
    assert by_subsystem([a, b, c]) == (a, c, b)


def _source(families: tuple[Family, ...], thresholds: tuple[Threshold, ...] = (), name: str = "x") -> CounterSource:
    return CounterSource(name, lambda context: {}, lambda raw: [], families, thresholds)


def test_the_table_refuses_declarations_that_would_mislead():
    mine = Family("x_events_total", "Events.", COUNTER, ("device",))
    with pytest.raises(ValueError, match="declared by x and y"):
        check_declarations([_source((mine,)), _source((mine,), name="y")])
    with pytest.raises(ValueError, match="ends in _total"):
        check_declarations([_source((Family("x_events", "Events.", COUNTER, ("device",)),))])
    with pytest.raises(ValueError, match="ends in _total"):
        check_declarations([_source((Family("x_temperature_total", "Degrees.", GAUGE, ("device",)),))])
    with pytest.raises(ValueError, match="does not carry its unit"):
        check_declarations([_source((Family("x_sent_total", "Sent.", COUNTER, ("device",), "bytes"),))])
    foreign = Threshold("x_per_s", aer.ERRORS, label_is("severity", "fatal"), 0.0, FindingKind.PCIE_AER_ERRORS, Severity.CRITICAL, "x")
    with pytest.raises(ValueError, match="a family x does not declare"):
        check_declarations([_source((mine,), (foreign,))])
    # What the agent judges reaches the default page: a threshold on a family served only with
    # a detail names the default family that sums the same events, else it is refused.
    detailed = Family("x_errors_total", "Errors, one series per code.", COUNTER, ("device", "code"), detail=MetricsDetail.XID)
    summed = Family("x_error_events_total", "Errors by class.", COUNTER, ("device", "class"))
    judged = Threshold("x_errors_per_s", detailed, {}, 0.0, FindingKind.GPU_XID, Severity.CRITICAL, "errors")
    with pytest.raises(ValueError, match="names no family of its source served by default that sums it"):
        check_declarations([_source((detailed, summed), (judged,))])
    check_declarations([_source((detailed, summed), (dataclasses.replace(judged, summed_in=summed),))])


def test_each_metric_name_is_written_once_in_the_source_that_owns_it():
    code = [p for folder in ("topoagent", "collectors", "exporters", "probes")
            for p in (REPO / folder).rglob("*.py") if p.relative_to(REPO).parts[1] not in ("collectors", "exporters", "probes")]
    for source in COUNTER_SOURCES:
        owner = Path(sys.modules[source.parse.__module__].__file__ or "").resolve()
        for family in source.families:
            writers = {p.resolve() for p in code if f'"{family.name}"' in p.read_text()}
            assert writers == {owner}, f"{family.name} is written in {sorted(str(w) for w in writers)}"


def _imports(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):  # every level: function-level imports too
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_discovery_and_telemetry_never_import_each_other_and_nothing_registers_through_getattr():
    discovery, telemetry, registry = (Path(importlib.util.find_spec(name).origin or "") for name in
                                      ("topoagent.node.discovery", "topoagent.service.telemetry", "topoagent.collectors.registry"))
    assert "topoagent.service.telemetry" not in _imports(discovery)
    assert "topoagent.node.discovery" not in _imports(telemetry)
    for path in (discovery, telemetry, registry):
        tree = ast.parse(path.read_text())
        assert "__getattr__" not in {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}, path.name
    # Importing one loads not the other: the registry they share imports only the sources.
    for first, other in (("topoagent.service.telemetry", "topoagent.node.discovery"), ("topoagent.node.discovery", "topoagent.service.telemetry")):
        done = subprocess.run([sys.executable, "-P", "-c", f"import sys, {first}; print({other!r} in sys.modules)"],
                              capture_output=True, text=True, check=True, cwd=REPO)
        assert done.stdout.strip() == "False", f"importing {first} loaded {other}"


def test_a_series_no_source_declares_is_logged_and_counted_and_metrics_still_answer(tmp_path, caplog):
    def broken(raw):  # a parser with a bug: one family nobody declares, one with a label too many
        return [("gpu_temperature_celsius", (("gpu", "0"),), 40.0),
                ("gpu_fan_speed_percent", (("gpu", "0"),), 55.0),
                ("pcie_aer_errors_total", (("device", "0000:07:00.0"), ("severity", "fatal"), ("extra", "1")), 1.0)]

    async def render() -> str:
        agent = Agent(Config(root=str(SNAPSHOTS / "dgx-a100"), state_dir=str(tmp_path / "state"), udev=False))
        await agent.start()
        try:
            await agent.request_refresh("test")
            history = History()
            history.add(Sample("nvml_counters", 1.0, {}), broken)
            snapshot = agent.snapshot
            agent.snapshot = snapshot.with_telemetry(snapshot.version + 1, served(history, {}, snapshot.node))
            return MetricsPage(agent).render().decode()
        finally:
            await agent.stop()

    logger = logging.getLogger("topoagent")
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.ERROR, logger="topoagent"):
            text = asyncio.run(render())
    finally:
        logger.removeHandler(caplog.handler)
    assert metric_value(text, "topoagent_gpu_temperature_celsius", {"gpu": "0"}) == 40.0  # the declared one is served
    assert metric_value(text, "topoagent_telemetry_undeclared_series", {"metric": "gpu_fan_speed_percent"}) == 1
    assert metric_value(text, "topoagent_telemetry_undeclared_series", {"metric": "pcie_aer_errors_total"}) == 1
    assert "topoagent_gpu_fan_speed_percent" not in text
    assert "event=metric_family_undeclared metric=gpu_fan_speed_percent series=1" in caplog.text
    assert "topoagent_ready" in {f.name for f in text_string_to_metric_families(text)}  # the rest of the page is there
    assert promtool_complaints(text.encode()) == []
