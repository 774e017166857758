"""Recordings an attacker shaped: a collector tripped into a bug, a symlink thousands of
components deep, a FIFO where a sysfs file should be, GPUs listed twice.

Each is built here from the DGX A100 fixture and run through the real CLI in a child with
a timeout, so a hang fails the test instead of hanging the suite: discovery must finish,
say what was wrong, and never hand out one GPU twice.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from service_helpers import DGX_A100, make_root

from topoagent.collectors.base import NoData, run_collector
from topoagent.collectors.lldp import LldpParseError, parse_lldpctl_json
from topoagent.discovery import COLLECTORS, Collector, run_collectors, run_collectors_sync
from topoagent.findings import collector_findings
from topoagent.host import Host
from topoagent.vocabulary import Severity, Status

CLI_TIMEOUT_S = 60
LLDP_RECORDING = "commands/lldpctl_-f_json.out"
UNHASHABLE_LLDP = {"lldp": {"interface": {"enp225s0f0": {
    "chassis": {"sw1": {"id": {"type": "mac", "value": "aa:bb"}, "capability": [{"type": ["Bridge"], "enabled": True}]}},
    "port": {"id": {"type": "ifname", "value": "p1"}},
}}}}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-P", "-m", "topoagent", *args], capture_output=True, text=True,
                          timeout=CLI_TIMEOUT_S)


def discover_json(root: Path | str) -> dict[str, Any]:
    result = run_cli("discover", "--json", "--root", str(root))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    document: dict[str, Any] = json.loads(result.stdout)
    return document


# --- a collector's bug stays that collector's failure ----------------------------------------


def test_an_lldp_capability_that_is_not_text_is_a_parse_error():
    with pytest.raises(LldpParseError, match="capability type: expected text, found list"):
        parse_lldpctl_json(json.dumps(UNHASHABLE_LLDP))


def test_a_bad_lldpctl_answer_is_a_warning_and_discovery_goes_on(tmp_path):
    root = make_root(tmp_path)
    (root / LLDP_RECORDING).write_text(json.dumps(UNHASHABLE_LLDP))
    node = discover_json(root)
    assert node["collectors"]["lldp"]["status"] == "error"
    assert "capability type" in node["collectors"]["lldp"]["message"]
    assert [f["severity"] for f in node["findings"] if f["subject"] == "lldp"] == ["warning"]
    assert len(node["gpus"]) == 8 and node["collectors"]["pci"]["status"] == "ok"


async def _raises_type_error(host: Host) -> Any:
    async def read() -> tuple[Any, tuple[str, ...]]:
        raise TypeError("unhashable type: 'list'")

    return await run_collector("lldp", read, optional=True)


async def _raises_outside_the_runner(host: Host) -> Any:
    raise TypeError("a bug before run_collector was reached")


async def _no_data(host: Host) -> Any:
    async def read() -> tuple[Any, tuple[str, ...]]:
        raise NoData("absent")

    return await run_collector("quiet", read)


@pytest.mark.parametrize("driver", ["sync", "async"])
def test_a_collector_that_raises_a_type_error_gets_an_error_status(driver):
    table = (
        *[c for c in COLLECTORS if c.name in ("numa", "pci")],
        Collector("lldp", _raises_type_error, optional=True),
        Collector("pci_again", _raises_outside_the_runner),
        Collector("quiet", _no_data),
    )
    with Host(DGX_A100) as host:
        results = run_collectors_sync(host, table) if driver == "sync" else asyncio.run(run_collectors(host, table))
    assert results["numa"].status == Status.OK and results["pci"].status == Status.OK
    assert results["quiet"].status == Status.NO_DATA
    lldp, bug = results["lldp"], results["pci_again"]
    assert lldp.status == Status.ERROR and bug.status == Status.ERROR
    assert "TypeError: unhashable type: 'list'" in (lldp.message or "") and "topoagent bug" in (lldp.message or "")
    assert "TypeError: a bug before run_collector" in (bug.message or "")
    severity = {f.subject: f.severity for f in collector_findings(results.values())}
    assert severity == {"lldp": Severity.WARNING, "pci_again": Severity.CRITICAL}
