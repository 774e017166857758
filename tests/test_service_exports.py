"""[exports]: a running `topoagent serve` keeps NFD's feature file, gres.conf and the NCCL
topology file current, rewriting each only when its text changes."""

from __future__ import annotations

import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from service_helpers import Agent, make_root, start_agent, wait_for

from topoagent.config import ConfigError, config_from_toml

IB_STATE = "sys/class/infiniband/mlx5_0/ports/1/state"


def export(fmt: str, root: Path, *extra: str) -> str:
    done = subprocess.run([sys.executable, "-P", "-m", "topoagent", "export", fmt, "--root", str(root), *extra],
                          capture_output=True, text=True, timeout=60, check=True)
    return done.stdout



def identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


@pytest.fixture
def exporting(tmp_path) -> Agent:
    out = tmp_path / "out"
    out.mkdir()
    config = f"""
[exports]
nfd_path = "{out / 'topoagent.features'}"
nfd_expiry_s = 7200
gres_path = "{out / 'gres.conf'}"
gres_node_name = "gpu[01-02]"
nccl_path = "{out / 'nccl-topo.xml'}"
"""
    agent = start_agent(tmp_path, root=make_root(tmp_path), config=config)
    yield agent
    assert agent.stop() == 0


def test_exports_are_the_export_commands_text_and_follow_findings(exporting):
    out = exporting.root.parent / "out"
    nfd, gres, nccl = out / "topoagent.features", out / "gres.conf", out / "nccl-topo.xml"
    wait_for("the three files written", lambda: all(p.exists() for p in (nfd, gres, nccl)), exporting)
    root = exporting.root
    assert gres.read_text() == export("gres", root, "--node-name", "gpu[01-02]")
    assert all(line.startswith("NodeName=gpu[01-02] Name=gpu ") for line in gres.read_text().splitlines() if not line.startswith("#"))
    assert nccl.read_text() == export("nccl-xml", root)
    directive, _, labels = nfd.read_text().partition("\n")
    assert labels == export("nfd", root)
    assert "topoagent.io/findings=0\n" in labels
    expires = datetime.fromisoformat(directive.removeprefix("# +expiry-time="))
    assert directive.startswith("# +expiry-time=") and directive.endswith("Z")
    assert 7000 < expires.timestamp() - nfd.stat().st_mtime <= 7200
    before = {p: identity(p) for p in (nfd, gres, nccl)}

    # Nothing changed: a new snapshot, the same files (not rewritten).
    assert exporting.post("/refresh", token=exporting.token).status == 200
    # An InfiniBand port goes down: a finding appears and the NFD labels follow.
    (root / IB_STATE).write_text("1: DOWN\n")
    assert exporting.post("/refresh", token=exporting.token).json()["stale"] is False
    wait_for("the NFD file rewritten", lambda: identity(nfd) != before[nfd], exporting)
    labels = nfd.read_text().partition("\n")[2]
    assert labels == export("nfd", root)
    assert "topoagent.io/findings.warnings=1\n" in labels
    assert identity(gres) == before[gres]  # its text did not change: left alone
    # The port comes back: the finding clears, and the labels with it.
    (root / IB_STATE).write_text("4: ACTIVE\n")
    assert exporting.post("/refresh", token=exporting.token).status == 200
    wait_for("the finding cleared", lambda: "topoagent.io/findings.warnings=0\n" in nfd.read_text(), exporting)
    assert identity(gres) == before[gres]
    assert "event=export_written" in exporting.log()


def test_a_file_that_cannot_be_written_is_retried_and_the_agent_keeps_serving(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    blocked = out / "missing-dir" / "gres.conf"  # its directory does not exist yet
    agent = start_agent(tmp_path, config=f'[exports]\ngres_path = "{blocked}"\nnccl_path = "{out / "nccl.xml"}"\n')
    try:
        wait_for("the writable file written", lambda: (out / "nccl.xml").exists(), agent)
        wait_for("the failure logged", lambda: "event=loop_failed loop=exports" in agent.log(), agent)
        assert agent.get("/readyz").status == 200
        blocked.parent.mkdir()
        wait_for("the file written once its directory exists", blocked.exists, agent)
        assert agent.log().count("event=loop_failed loop=exports") == 1  # once, not per try
    finally:
        assert agent.stop() == 0


@pytest.mark.parametrize(("text", "says"), [
    ('nfd_path = "relative/file"', "exports.nfd_path: expected an absolute path"),
    ('gres_node_name = "gpu 01"', "exports.gres_node_name: node name 'gpu 01'"),
    ('nfd_prefix = "Bad_Prefix!"', "exports.nfd_prefix: 'Bad_Prefix!' is not a valid label namespace"),
])
def test_bad_exports_keys_are_named(text, says):
    with pytest.raises(ConfigError, match="^" + says.replace("[", r"\[").replace("(", r"\(")):
        config_from_toml(f"[exports]\n{text}\n")
