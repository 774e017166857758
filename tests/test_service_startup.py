"""The agent starts right wherever it runs (issue #35 item 5): from a source checkout whose
topoagent only the cwd provides, and through a start-up discovery that fails before it works.

Both through a real `topoagent serve`.  The checkout case runs under a bare venv that has the
dependencies and no topoagent at all: the suite's own venv has an editable install (and
PYTHONPATH names the checkout), which would let the discovery child find topoagent anyway and
hide the bug the real H200 met."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from conftest import REPO
from service_helpers import DGX_A100, Agent, make_root, metric_value, start_agent, wait_for, wait_ready, wedge

WEDGED = Path("sys/devices/system/node/node0/cpulist")  # what wedge() hangs by default


def readyz_as_declared(reply) -> dict:
    """GET /readyz's body, held to the schema /openapi.json declares for its status."""
    import jsonschema
    from schema_check import OPENAPI

    schema = OPENAPI["paths"]["/readyz"]["get"]["responses"][str(reply.status)]["content"]["application/json"]["schema"]
    body = reply.json()
    jsonschema.Draft202012Validator({**schema, "components": OPENAPI["components"]}).validate(body)
    return body


def bare_python(tmp: Path) -> Path:
    """A venv's python that reaches this suite's dependencies and no topoagent: not the
    editable install's finder, not its .pth, not PYTHONPATH."""
    deps = tmp / "deps"
    deps.mkdir()
    paths = sysconfig.get_paths()
    for lib in dict.fromkeys(Path(paths[k]) for k in ("purelib", "platlib")):
        for entry in lib.iterdir():
            hidden = entry.name.startswith(("topoagent", "__editable__", "_distutils_hack")) or entry.suffix == ".pth"
            if not hidden and not (deps / entry.name).exists():
                (deps / entry.name).symlink_to(entry)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next(venv.glob("lib/python*/site-packages"))
    (site / "deps.pth").write_text(f"{deps}\n")  # a path line: deps' own .pth files are not run
    return venv / "bin" / "python"


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONSAFEPATH", "JOURNAL_STREAM", "TOPOAGENT_TEST_WEDGE")}


def test_serve_from_a_checkout_found_only_through_the_cwd_becomes_ready(tmp_path):
    python = bare_python(tmp_path)
    # The premise: outside the checkout this interpreter has the dependencies and no topoagent.
    probe = subprocess.run([python, "-c", "import aiohttp, prometheus_client\nimport topoagent"], cwd=tmp_path, env=plain_env(),
                           capture_output=True, text=True, timeout=60)
    assert "No module named 'topoagent'" in probe.stderr, probe.stderr
    log_path = tmp_path / "agent.log"
    args = [python, "-m", "topoagent", "serve", "--root", "fixtures/snapshots/dgx-a100", "--listen", "127.0.0.1:0",
            "--state-dir", str(tmp_path / "state")]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, cwd=REPO, env=plain_env(), stdout=subprocess.PIPE, stderr=log, text=True)
    line = proc.stdout.readline()
    match = re.search(r"on http://([\d.]+):(\d+)", line)
    agent = Agent(proc, match.group(1) if match else "", int(match.group(2)) if match else 0, None, DGX_A100,
                  tmp_path / "state", log_path)
    try:
        assert match, f"agent did not start: {line!r}\n{agent.log()}"
        wait_ready(agent, 60)
        ready = agent.get("/readyz")
        assert ready.status == 200, ready.body
        assert len(agent.get("/topology").json()["gpus"]) == 8
        assert "discovery_failed" not in agent.log()
    finally:
        assert agent.stop() == 0
    # The probe worker, the other child, finds it too (the CPU backend: no GPU here).
    probe = subprocess.run([python, "-m", "topoagent", "probe", "--backend", "cpu", "--json", "--no-progress"], cwd=REPO,
                           env=plain_env(), capture_output=True, text=True, timeout=300)
    assert probe.returncode == 0, probe.stderr
    round_ = json.loads(probe.stdout)
    assert round_["worker"]["type"] == "hello" and round_["figures"], probe.stdout[:2000]


def test_a_failed_start_up_discovery_is_retried_with_back_off_and_readyz_says_why(tmp_path):
    root = make_root(tmp_path)
    healthy = (root / WEDGED).read_bytes()
    wedge(root)  # the start-up discovery hangs on a read and is killed at its timeout
    agent = start_agent(tmp_path, root=root, config="[discovery]\ntimeout_s = 1\n", ready_timeout=None)
    try:
        def failing(at_least: int):
            reply = agent.get("/readyz")
            body = readyz_as_declared(reply)
            retry = body.get("discovery")
            return (reply.status, body) if retry and retry["failures"] >= at_least else None

        status, first = wait_for("a failed discovery on /readyz", lambda: failing(1), agent)
        assert status == 503 and first["error"] == "not_ready"
        retry = first["discovery"]
        assert "timed out after 1s" in retry["error"] and retry["error"] in first["detail"]
        assert 0 < retry["retry_at"] - retry["failed_at"] <= 5  # the first retry comes within 5 s
        assert 0 <= retry["retry_in_s"] <= 5
        # Not given up: it runs again, each time a little later.
        _, second = wait_for("a second failed discovery", lambda: failing(2), agent)
        later = second["discovery"]
        assert later["retry_at"] - later["failed_at"] > retry["retry_at"] - retry["failed_at"]
        # The node comes back: a retry (the timer's next run is 300 s away) makes it ready.
        (root / WEDGED).unlink()
        (root / WEDGED).write_bytes(healthy)
        wait_for("ready after the cause went away", lambda: agent.get("/readyz").status == 200, agent, timeout=60)
        ready = readyz_as_declared(agent.get("/readyz"))
        assert "discovery" not in ready and ready["stale"] is False  # the retries stopped
        page = agent.get("/metrics").body.decode()
        assert metric_value(page, "topoagent_discovery_runs_total", {"outcome": "failure"}) >= 2
        assert metric_value(page, "topoagent_discovery_runs_total", {"outcome": "success"}) == 1
        assert "reason=retry" in agent.log()
    finally:
        agent.stop()


def test_a_discovery_that_fails_after_a_good_one_is_retried_while_readyz_stays_ready(tmp_path):
    """The last good facts stay served (stale), ready; /readyz says the runs fail and when the next comes."""
    root = make_root(tmp_path)
    agent = start_agent(tmp_path, root=root, config="[discovery]\ntimeout_s = 1\n")
    try:
        healthy = (root / WEDGED).read_bytes()
        wedge(root)
        assert agent.post("/refresh", token=agent.token).json()["stale"] is True
        ready = agent.get("/readyz")
        assert ready.status == 200 and readyz_as_declared(ready)["stale"] is True
        retry = ready.json()["discovery"]
        assert retry["failures"] == 1 and "timed out" in retry["error"] and retry["retry_at"] - retry["failed_at"] <= 5
        (root / WEDGED).unlink()
        (root / WEDGED).write_bytes(healthy)
        wait_for("fresh facts again, without a request", lambda: agent.get("/readyz").json().get("stale") is False, agent, timeout=60)
        assert "discovery" not in agent.get("/readyz").json()
    finally:
        agent.stop()


def test_a_child_that_imported_another_topoagent_says_so_and_runs_nothing(tmp_path):
    """The child (discovery, the probe worker) checks that the topoagent it imported is the agent's own."""
    from topoagent.child import PACKAGE_DIR, module_command

    elsewhere = str(tmp_path / "other" / "topoagent")
    command = module_command("topoagent.node.discovery_process", str(DGX_A100), package_dir=elsewhere)
    done = subprocess.run(command, capture_output=True, timeout=60)
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.decode().strip() == (
        f"ImportError: this child process imported topoagent from {PACKAGE_DIR}, not the agent's own {elsewhere}")


def test_the_child_runs_its_module_as_python_m_would(tmp_path):
    """Its argv and exit status are the module's: discovery pickles the recorded node on stdout."""
    import pickle

    from topoagent.child import module_command

    done = subprocess.run(module_command("topoagent.node.discovery_process", str(DGX_A100)), capture_output=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert len(pickle.loads(done.stdout).gpus) == 8
    bad = subprocess.run(module_command("topoagent.node.discovery_process", str(tmp_path / "nothing")), capture_output=True, timeout=60)
    assert bad.returncode == 1 and bad.stdout == b"" and len(bad.stderr.decode().strip().splitlines()) == 1
