"""The one table of collectors, the typed errors they report, and exporters that read the
model only (what the host holds reaches them through discovery, and snapshots record it)."""

from __future__ import annotations

import ast
import asyncio
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
from conftest import FIXTURES

from topoagent.cli import main
from topoagent.collectors.base import CollectorResult, SourceError, run_collector
from topoagent.commands.discover import discover_root
from topoagent.errors import TopoagentError
from topoagent.exporters.gres import render_gres
from topoagent.node.discovery import COLLECTORS, Collector, check_order, run_collectors
from topoagent.node.host import Host
from topoagent.vocabulary import Status

SNAPSHOTS = FIXTURES / "snapshots"
EXPORTERS = Path(__file__).resolve().parents[1] / "exporters"


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


@pytest.mark.parametrize("path", sorted(EXPORTERS.glob("*.py")), ids=lambda p: p.name)
def test_exporters_import_no_collector_and_no_host(path: Path) -> None:
    banned = [m for m in imported_modules(path)
              if m.startswith(("topoagent.collectors", "topoagent.node.host"))]
    assert banned == []


def test_every_collector_needs_only_collectors_listed_before_it() -> None:
    check_order(COLLECTORS)
    names = [c.name for c in COLLECTORS]
    assert names.index("infiniband") < names.index("ib_neighbours")  # the ports it asks about
    later = (Collector("pci", COLLECTORS[0].collect, needs=("numa",)), COLLECTORS[0])
    with pytest.raises(ValueError, match="pci needs numa"):
        check_order(later)


def test_collectors_run_concurrently_and_get_what_they_need() -> None:
    both_started = asyncio.Event()
    started: list[str] = []

    async def independent(host: Host) -> CollectorResult[Any]:
        started.append("b")
        if len(started) == 2:
            both_started.set()
        await both_started.wait()  # would never return if the collectors ran one by one
        return CollectorResult("b", Status.OK, "b-data")

    async def first(host: Host) -> CollectorResult[Any]:
        started.append("a")
        if len(started) == 2:
            both_started.set()
        await both_started.wait()
        return CollectorResult("a", Status.OK, "a-data")

    async def after_a(host: Host, a: CollectorResult[Any]) -> CollectorResult[Any]:
        return CollectorResult("c", Status.OK, f"saw {a.data}")

    table = (Collector("a", first), Collector("b", independent), Collector("c", after_a, needs=("a",)))

    async def go() -> dict[str, CollectorResult[Any]]:
        return await asyncio.wait_for(run_collectors(Host("/"), table), 5)

    results = asyncio.run(go())
    assert list(results) == ["a", "b", "c"]
    assert results["c"].data == "saw a-data"


def test_a_collector_reports_its_typed_errors_and_names_its_bugs_as_bugs(caplog) -> None:
    """A bug met on odd input stops only its own collector, but is never passed off as a
    damaged file: its message names the exception and says it is a bug, and the
    traceback is in the debug log."""
    async def damaged() -> tuple[Any, tuple[str, ...]]:
        raise SourceError("/sys/x: 'abc' is not a number")

    async def bug() -> tuple[Any, tuple[str, ...]]:
        return int("abc"), ()  # a ValueError no parser meant to raise

    result = asyncio.run(run_collector("x", damaged))
    assert (result.status, result.message) == (Status.ERROR, "/sys/x: 'abc' is not a number")
    logger = logging.getLogger("topoagent")  # a CLI test may have stopped it propagating
    logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.DEBUG, logger="topoagent"):
            crashed = asyncio.run(run_collector("x", bug))
    finally:
        logger.removeHandler(caplog.handler)
    assert crashed.status == Status.ERROR
    assert crashed.message is not None and crashed.message.startswith("collector crashed (ValueError: invalid literal")
    assert "topoagent bug" in crashed.message
    assert "event=collector_crashed collector=x error=ValueError" in caplog.text and "int(\\\"abc\\\")" in caplog.text
    assert issubclass(SourceError, TopoagentError)


def with_driver_minors(tmp_path: Path, name: str) -> tuple[Path, dict[str, int]]:
    """A copy of a fixture whose driver numbers /dev/nvidiaN in reverse bus order."""
    root = tmp_path / name
    shutil.copytree(SNAPSHOTS / name, root, symlinks=True)
    gpus = sorted(g.pci_address for g in discover_root(str(root)).gpus if g.pci_address)
    minors = {address: len(gpus) - 1 - k for k, address in enumerate(gpus)}
    for address, minor in minors.items():
        info = root / "proc/driver/nvidia/gpus" / address / "information"
        info.parent.mkdir(parents=True)
        info.write_text(f"Model: \t\t NVIDIA A100-SXM4-40GB\nIRQ:   \t\t 100\nDevice Minor: \t {minor}\n")
    (root / "proc/cpuinfo").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\n"
                                      "model\t\t: 49\nmodel name\t: AMD EPYC 7742 64-Core Processor\n\n")
    return root, minors


def test_discovery_reads_the_driver_minors_and_gres_names_them(tmp_path: Path) -> None:
    root, minors = with_driver_minors(tmp_path, "dgx-a100")
    topology = discover_root(str(root))
    assert {g.pci_address: g.device_minor for g in topology.gpus} == minors
    assert topology.cpu is not None and topology.cpu.model is not None
    assert topology.cpu.model.family == 23
    text = render_gres(topology)
    files = [field for line in text.splitlines() if not line.startswith("#")
             for field in line.split() if field.startswith("File=")]
    assert files == [f"File=/dev/nvidia{7 - k}" for k in range(8)]  # bus order, reversed minors
    assert "assumes /dev/nvidia minor numbers" not in text


def test_a_snapshot_records_what_the_exports_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root, minors = with_driver_minors(tmp_path, "dgx-a100")
    out = tmp_path / "again"
    assert main(["snapshot", "--root", str(root), str(out)]) == 0
    assert (out / "proc/cpuinfo").is_file()
    for address in minors:
        assert (out / "proc/driver/nvidia/gpus" / address / "information").is_file()
    capsys.readouterr()
    for fmt in ("gres", "nccl-xml"):
        assert main(["export", fmt, "--root", str(root)]) == 0
        original = capsys.readouterr().out
        assert main(["export", fmt, "--root", str(out)]) == 0
        assert capsys.readouterr().out == original


def test_a_driver_file_without_a_minor_is_a_warning_naming_it(tmp_path: Path) -> None:
    root, minors = with_driver_minors(tmp_path, "vm-1gpu")
    address = next(iter(minors))
    info = root / "proc/driver/nvidia/gpus" / address / "information"
    info.write_text("Model: \t\t NVIDIA A100\n")
    topology = discover_root(str(root))
    status = {c.name: c for c in topology.collectors}["nvidia_driver"]
    assert status.status == Status.OK
    assert status.warnings == (f"/proc/driver/nvidia/gpus/{address}/information: no 'Device Minor' line; "
                               "minor number unknown",)
    assert topology.gpus[0].device_minor is None



def test_a_critical_finding_is_drawn_in_the_picture(tmp_path: Path) -> None:
    from test_discovery import nvswitch_node

    from topoagent.exporters.svg import COLORS, render_svg

    nvswitch_node(tmp_path, gpu3_links_up=4, gpu2_in_fabric=False)
    topology = discover_root(str(tmp_path))
    assert [(f.kind, f.severity) for f in topology.findings if f.subject == "GPU2"] == [
        ("nvlink-down", "critical"), ("gpu-outside-fabric", "critical")]
    assert f'stroke="{COLORS["critical"]}"' in render_svg(topology)
