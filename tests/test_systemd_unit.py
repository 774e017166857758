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


def test_the_state_directory_is_the_agents_own_user_and_group_and_no_one_elses():
    """Issue #37: a group of its own, not nogroup; no group or other bit (the agent refuses a
    state directory others may write: topoagent.statefile.state_dir_problem)."""
    settings = dict(re.findall(r"^(User|Group|StateDirectory|StateDirectoryMode|DynamicUser)=(\S+)$", UNIT.read_text(), re.M))
    assert settings["DynamicUser"] == "yes" and settings["User"] == settings["Group"] == settings["StateDirectory"] == "topoagent"
    assert int(settings["StateDirectoryMode"], 8) & 0o077 == 0



def test_the_units_group_opens_a_group_only_node_inside_a_private_user_namespace():
    """The unit's promise under PrivateUsers=yes: systemd sets SupplementaryGroups= first,
    then makes the user namespace, and the kernel still grants the group's access to a
    0660 node of that group.  The same two steps here: setpriv sets uid and groups, unshare
    makes a namespace that maps only the uid and gid (as PrivateUsers= does)."""
    import grp
    import os
    import tempfile

    (group,) = re.findall(r"^SupplementaryGroups=(\S+)$", UNIT.read_text(), re.M)
    gid = grp.getgrnam(group).gr_gid
    for tool in ("setpriv", "unshare"):
        assert shutil.which(tool), f"{tool} not found: install Debian's util-linux"
    assert os.geteuid() == 0, "needs root to take on another uid"

    def read_as_nobody(node: Path, *groups: int) -> subprocess.CompletedProcess:
        become = ["setpriv", "--reuid=65534", "--regid=65534", f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]
        namespace = ["unshare", "--user", "--map-user=65534", "--map-group=65534"]
        return subprocess.run([*become, *namespace, "sh", "-c", f"id -G; cat {node}"], capture_output=True, text=True, timeout=60)

    # Under /tmp itself: pytest's tmp_path lies under 0700 folders the other uid cannot cross.
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        Path(folder).chmod(0o755)
        node = Path(folder) / "nvidiactl"
        node.write_text("opened\n")
        os.chown(node, 0, gid)
        node.chmod(0o660)
        inside = read_as_nobody(node, gid)
        denied = read_as_nobody(node)
    assert inside.returncode == 0 and inside.stdout.endswith("opened\n"), inside.stderr
    assert str(gid) not in inside.stdout.split("\n")[0].split()  # unmapped: it reads as nogroup there...
    assert denied.returncode != 0 and "Permission denied" in denied.stderr  # ...yet it is what opens the node
