"""After the README's plain `pip install .` (no `probes` extra), probes say at once that
torch is missing and how to install it, instead of a table of '-' rows and, in the
service, a failure half a minute later.  A real interpreter without torch on its path:
the suite's site-packages minus torch, run without site (-S)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DGX_A100 = REPO / "fixtures" / "snapshots" / "dgx-a100"
LEFT_OUT = ("torch", "functorch", "nvidia", "triton", "topoagent")  # torch and what ships with it; a stale copy of us


@pytest.fixture(scope="module")
def no_torch_env(tmp_path_factory) -> dict[str, str]:
    farm = tmp_path_factory.mktemp("site-without-torch")
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not entry.name.startswith(LEFT_OUT) and entry.suffix != ".pth":
            (farm / entry.name).symlink_to(entry)
    return {"PYTHONPATH": f"{farm}:{REPO}", "PATH": "/usr/bin:/bin"}


def test_probe_says_torch_is_missing_before_any_table(no_torch_env):
    out = subprocess.run(
        [sys.executable, "-S", "-m", "topoagent", "probe", "--root", str(DGX_A100), "--backend", "cpu"],
        capture_output=True, text=True, timeout=60, env=no_torch_env, cwd="/",
    )
    assert out.returncode == 1
    assert out.stdout == ""  # no table of '-' rows
    assert out.stderr.count("\n") == 1
    assert "topoagent probe: unavailable: torch is not installed" in out.stderr
    assert "pip install '.[probes]'" in out.stderr


def test_serve_with_probes_warns_at_start_up_and_in_topology(no_torch_env, tmp_path):
    log = tmp_path / "agent.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-S", "-m", "topoagent", "serve", "--root", str(DGX_A100), "--listen", "127.0.0.1:0",
             "--state-dir", str(tmp_path / "state"), "--probes", "cpu"],
            stdout=subprocess.PIPE, stderr=err, text=True, env=no_torch_env, cwd="/",
        )
    try:
        match = re.search(r"on (http://[\d.]+:\d+)", proc.stdout.readline())
        assert match, log.read_text()
        deadline = time.monotonic() + 20
        findings: list[dict] = []
        while time.monotonic() < deadline and not findings:
            try:
                with urllib.request.urlopen(match.group(1) + "/topology", timeout=5) as reply:
                    findings = [f for f in json.load(reply)["findings"] if f["kind"] == "probes_unavailable"]
            except OSError:
                pass
            time.sleep(0.1)
        assert findings and findings[0]["severity"] == "warning"
        assert "pip install '.[probes]'" in findings[0]["message"]
        warned = [line for line in log.read_text().splitlines() if "event=probes_unavailable" in line]
        assert len(warned) == 1 and "WARNING" in warned[0] and "torch is not installed" in warned[0]
    finally:
        proc.terminate()
        proc.wait(timeout=20)
