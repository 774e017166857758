"""Start the real `topoagent serve` as a child process on a free loopback port."""

from __future__ import annotations

import http.client
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from conftest import FIXTURES

DGX_A100 = FIXTURES / "snapshots" / "dgx-a100"
TOPO_RECORDING = "commands/nvidia-smi_topo_-m.out"


# An agent started with this environment reads through tests/wedge_hook: a file that
# holds WEDGE never returns from its read.  (A FIFO did that once; the Host now refuses
# FIFOs, as a one-shot command must not hang on one.)
WEDGE_HOOK = Path(__file__).resolve().parent / "wedge_hook"
WEDGE = b"topoagent-test: this read never returns\n"


def wedge_env(seen: Path | None = None) -> dict[str, str]:
    """The environment for a child agent whose wedged files (see wedge) hang their reads;
    each hung read's node path is appended to ``seen`` (Agent.wedged_reads) as it hangs."""
    path = os.pathsep.join(filter(None, [str(WEDGE_HOOK), os.environ.get("PYTHONPATH")]))
    return {"PYTHONPATH": path, "TOPOAGENT_TEST_WEDGE": "1", **({"TOPOAGENT_TEST_WEDGE_SEEN": str(seen)} if seen else {})}


def wedge(root: Path, path: Path | None = None) -> Path:
    """Make a file of the recorded node (a sysfs file by default) block forever when an
    agent started with wedge_env() reads it, like a hung device."""
    path = path or root / "sys" / "devices" / "system" / "node" / "node0" / "cpulist"
    path.unlink(missing_ok=True)
    path.write_bytes(WEDGE)
    return path


def make_root(base: Path) -> Path:
    """A private copy of the recorded DGX A100 that a test may break."""
    root = base / "root"
    shutil.copytree(DGX_A100, root, symlinks=True)
    return root


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self):
        return json.loads(self.body)


@dataclass
class Agent:
    proc: subprocess.Popen
    host: str
    port: int
    token: str | None
    root: Path
    state_dir: Path
    log_path: Path
    token_file: Path | None = None
    wedged_path: Path | None = None

    def request(self, method: str, path: str, body=None, *, token: str | None = None, headers: dict | None = None, raw: bytes | None = None,
                timeout: float = 30) -> Reply:
        """``timeout``: how long the answer may take (a socket timeout fails the test)."""
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        hdrs = dict(headers or {})
        if token is not None:
            hdrs["Authorization"] = f"Bearer {token}"
        payload = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        if payload is not None:
            hdrs.setdefault("Content-Type", "application/json")
        conn.request(method, path, body=payload, headers=hdrs)
        resp = conn.getresponse()
        reply = Reply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
        conn.close()
        return reply

    def get(self, path: str, **kw) -> Reply:
        return self.request("GET", path, **kw)

    def post(self, path: str, body=None, **kw) -> Reply:
        return self.request("POST", path, body, **kw)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text()

    def wedged_reads(self) -> list[str]:
        """The node paths whose reads have hung on a wedged file (see wedge), in order."""
        if self.wedged_path is None or not self.wedged_path.exists():
            return []
        return self.wedged_path.read_text().splitlines()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            # Never leave a server behind a failed test; the test still fails.
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"topoagent serve ignored signal {sig} for {timeout} s:\n{self.log()[-2000:]}") from None


def start_agent(tmp: Path, *, root: Path | None = None, token: bool = True, config: str | None = None, state_dir: Path | None = None, token_value: str | None = None, extra: list[str] | None = None, env: dict[str, str] | None = None, nofile: int | None = None, ready_timeout: float | None = 20, wrapper: list[str] | None = None) -> Agent:
    """`nofile`: the child's open-file limit, soft and hard (as a unit's LimitNOFILE sets it);
    `ready_timeout`: how long its first discovery may take (a generated 128-GPU node's takes
    13-50 s on a loaded 2-core machine); None: return once it listens, ready or not;
    `wrapper`: a command that runs the agent's command line (a mount namespace of its own)."""
    root = root or DGX_A100  # read only; a test that breaks the node passes make_root()
    state_dir = state_dir or tmp / "state"
    args = [*(wrapper or []), sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", "127.0.0.1:0",
            "--state-dir", str(state_dir)]
    token_text = token_file = None
    if token:
        token_text = token_value or secrets.token_urlsafe(24)
        token_file = tmp / "token"
        token_file.write_text(token_text + "\n")
        token_file.chmod(0o600)  # as the README makes it: a test agent's log stays free of the readable-token warning
        args += ["--token-file", str(token_file)]
    if config is not None:
        cfg = tmp / "topoagent.toml"
        cfg.write_text(config)
        args += ["--config", str(cfg)]
    args += extra or []
    log_path = tmp / f"agent-{time.monotonic_ns()}.log"
    wedged_path = log_path.with_suffix(".wedged")
    env = {**{k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "CREDENTIALS_DIRECTORY")}, **wedge_env(wedged_path), **(env or {})}
    # The child keeps its own copy of the descriptor; ours is closed once it is handed over.
    with open(log_path, "w") as log:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env, preexec_fn=None if nofile is None else lambda: _limit_files(nofile))
    # Bounded: an agent that hangs before it listens (a FIFO in its state directory) fails the test.
    ready, _, _ = select.select([proc.stdout], [], [], 120)
    line = proc.stdout.readline() if ready else "(no line: it hung before listening)"
    match = re.search(r"on http://([\d.]+):(\d+)", line)
    if not match:
        proc.kill()
        proc.wait()
        raise AssertionError(f"agent did not start: {line!r}\n{log_path.read_text()}")
    agent = Agent(proc, match.group(1), int(match.group(2)), token_text, root, state_dir, log_path, token_file, wedged_path)
    if ready_timeout is not None:
        wait_ready(agent, ready_timeout)
    return agent


def without_leases(agent: Agent) -> Agent:
    """A module's shared agent as a fresh one starts for the next test: still running, and
    not one lease held (each released through the API, as a job's end releases it)."""
    assert agent.proc.poll() is None, f"the shared agent exited {agent.proc.returncode}:\n{agent.log()[-2000:]}"
    for lease in agent.get("/leases", token=agent.token).json()["leases"]:
        released = agent.request("DELETE", f"/leases/{lease['id']}", token=agent.token)
        assert released.status == 200, released.body
    assert agent.get("/leases", token=agent.token).json()["leases"] == []
    return agent


def _limit_files(n: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_NOFILE, (n, n))


def wait_ready(agent: Agent, timeout: float = 20) -> None:
    """Until a topology is loaded: /readyz 200, or 503 naming its snapshot (loaded, but not
    ready for placement: a recording whose GPUs no witness sees)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = agent.get("/readyz")
        if ready.status == 200 or (ready.status == 503 and "snapshot_version" in ready.json()):
            return
        time.sleep(0.05)
    raise AssertionError("agent never became ready:\n" + agent.log())


# What promtool says of each GPU family under [metrics] dcgm_labels = true (dcgm-exporter's
# modelName, an opt-in); the default page lints clean.
DCGM_LABELS_LINT = "{family} label names should be written in 'snake_case' not 'camelCase'"


# Probes on the CPU backend with small copies and few repetitions: a target takes about as
# long as the worker's start.
CPU_PROBES = """
[probes]
enabled = true
backend = "cpu"
startup_delay_s = 0.1
sizes_bytes = [65536]
repetitions = 3
timeout_s = 60
"""


def wait_for(what: str, check, agent: Agent | None = None, timeout: float = 20.0, interval: float = 0.05, log=None):
    """``check()``'s first true value, polled until ``timeout``; else fail naming ``what``
    with the end of the agent's log (or of ``log()``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    tail = log() if log is not None else agent.log() if agent is not None else ""
    raise AssertionError(f"never saw {what} within {timeout} s:\n{tail[-3000:]}")


def promtool_complaints(text: bytes) -> list[str]:
    """What `promtool check metrics` says about a page; [] is clean (and exit 0)."""
    promtool = shutil.which("promtool")
    if promtool is None:
        raise AssertionError("promtool not found: install the Debian package 'prometheus' (scripts/test does)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    said = [line for line in (done.stdout + done.stderr).decode().splitlines() if line.strip()]
    complaints = list(said)
    if done.returncode != 0:  # 3: lint findings; anything else failed to parse
        complaints.append(f"promtool exited {done.returncode}")
    return complaints


def metric_value(text: str, name: str, labels: dict[str, str] | None = None) -> float | None:
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        series, _, value = line.rpartition(" ")
        if series.split("{")[0] != name:
            continue
        if labels and not all(f'{k}="{v}"' in series for k, v in labels.items()):
            continue
        return float(value)
    return None


def wait_counters_read(agent: Agent, timeout: float = 120) -> None:
    """Wait until the agent's counter sources have reported once (their findings and series
    are then served): /metrics names collectors that discovery (/topology) does not."""
    deadline = time.monotonic() + timeout
    discovery: set[str] | None = None
    while time.monotonic() < deadline:
        if discovery is None:
            topology = agent.get("/topology")
            discovery = set(topology.json()["collectors"]) if topology.status == 200 else None
        else:
            page = agent.get("/metrics").body.decode()
            if set(re.findall(r'^topoagent_collector_success\{collector="([^"]+)"\}', page, re.M)) - discovery:
                return
        time.sleep(0.05)
    raise AssertionError("the agent's counters were never read: " + agent.log()[-2000:])
