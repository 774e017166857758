"""The shipped unit verifies with systemd's own tools and scores as hardened."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

UNIT = REPO / "systemd" / "topoagent.service"


def systemd_analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:
        pytest.fail("systemd-analyze not found: install the Debian package 'systemd'")
    return tool


def installed_copy(tmp_path: Path) -> Path:
    """The unit as installed here: ExecStart pointing at this environment's topoagent."""
    script = Path(sys.executable).with_name("topoagent")
    text = UNIT.read_text().replace("/opt/topoagent/bin/topoagent", str(script))
    unit = tmp_path / "topoagent.service"
    unit.write_text(text)
    return unit


def test_unit_verifies(tmp_path):
    result = subprocess.run([systemd_analyze(), "verify", str(installed_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "topoagent.service" not in result.stderr, result.stderr


def test_exposure_score_is_at_most_2(tmp_path):
    result = subprocess.run(
        [systemd_analyze(), "security", "--offline=true", "--no-pager", str(installed_copy(tmp_path))],
        capture_output=True, text=True, timeout=60,
    )
    match = re.search(r"Overall exposure level for topoagent\.service: ([\d.]+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match.group(1)) <= 2.0, result.stdout


def test_unit_runs_what_the_issue_asks():
    text = UNIT.read_text()
    for line in (
        "Restart=on-failure", "DynamicUser=yes", "StateDirectory=topoagent", "DevicePolicy=closed",
        "NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=\n",
        "RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK", "SystemCallFilter=@system-service",
        "ExecReload=/bin/kill -HUP $MAINPID", "LoadCredential=token:/etc/topoagent/token",
    ):
        assert line in text, line
