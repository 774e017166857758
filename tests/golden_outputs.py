"""Golden outputs of every recorded node: what users see from fixtures/snapshots/<node>/.

Each node's ``expected/`` folder holds what a real ``topoagent serve --root <node>`` serves
over loopback (node_exporter's ``e2e-output.txt`` habit, hwloc's ``.output`` files):

- ``topology.json``  ``GET /topology``, the bytes as served.  (``topoagent discover --json``
  prints the same document less what the agent adds -- its ``agent`` part, each collector's
  ``last_success_at``, the recorded counters' findings: the served one is what schedulers
  read, so it is kept.)
- ``place.json``     each request of ``place_requests`` posted to ``POST /place`` (dry runs),
  with the status and answer: ``[{"name", "request", "status", "answer"}, ...]``.  The
  answers are re-indented one key a line so that a changed answer reads as a short diff;
  every value is as served.
- ``metrics.txt``    ``GET /metrics`` after those requests (the placement counters count them).

Volatile values are normalised in one place, this module (``VOLATILE_*`` below and the
``normalise_*`` functions): timings, wall-clock timestamps, the snapshot's version (the
counter loop swaps a new one in on each of its reads), whether the capacity figures were
current at the instant of the scrape, and the HTTP listener's connection figures (the
open-file limit of the machine sets the cap).  Everything else is byte-for-byte.  Nothing
of the machine running this leaks in (a test checks its hostname and the checkout's path),
and no lease is taken, so there is no lease id to hide.

Real servers rather than rendering in process: the bytes are the served ones by
construction, and this module imports nothing of ``topoagent``, whose modules are moving.
The eight agents run at once.  Their configuration (``AGENT_CONFIG``) lets every search
finish (the answers are the exact ones on a loaded machine too) and replays the recorded
counters soon after discovery.

Rewrite every node's files (run from the checkout, with the test environment's python):

    python -m tests.golden_outputs --update            # all nodes
    python -m tests.golden_outputs --update dgx2       # one

Without ``--update`` it says which files differ, as ``tests/test_golden_outputs.py`` does.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import difflib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SNAPSHOTS = REPO / "fixtures" / "snapshots"
NODES = sorted(p.name for p in SNAPSHOTS.iterdir() if p.is_dir())
FILES = ("topology.json", "place.json", "metrics.txt")
UPDATE_COMMAND = "python -m tests.golden_outputs --update"

AGENT_CONFIG = """\
[telemetry]
# A recording's counters are replayed at the loop's first read after discovery: soon.
interval_s = 0.5

[placement]
# The longest deadline a request may name: every search finishes, so the answers are the
# exact ones on a loaded machine too (the default 20 ms may stop a big search early).
deadline_ms = 60000
"""

# /metrics series whose samples are dropped (their HELP and TYPE lines stay).
VOLATILE_SERIES = frozenset({
    "topoagent_collector_duration_seconds",  # how long a read took
    "topoagent_collector_last_success_timestamp_seconds",  # wall clock
    "topoagent_snapshot_timestamp_seconds",  # wall clock
    "topoagent_snapshot_age_seconds",  # wall clock
    # 1 when the counter loop swapped a new snapshot in while the figures were computed;
    # the figures themselves depend only on the busy GPUs, and stay.
    "topoagent_capacity_stale",
    "topoagent_http_connections",  # whether the previous request's connection is closed yet
    "topoagent_http_connections_limit",  # kept below this machine's open-file limit
})
# GET /topology values replaced by NORMALISED: (path, key), "*" for every key of a mapping.
VOLATILE_TOPOLOGY = (
    (("agent",), "snapshot_version"),
    (("agent",), "built_at"),
    (("agent",), "failed_at"),
    (("collectors", "*"), "seconds"),
    (("collectors", "*"), "last_success_at"),
)
NORMALISED = "<normalised>"


def place_requests(gpus: int) -> list[tuple[str, dict[str, Any]]]:
    """The fixed list of placement requests, for a node of ``gpus`` GPUs."""
    some = min(4, gpus)  # the pattern requests: 4 GPUs, or all of a smaller node
    pair = min(2, gpus)
    return [
        ("k1", {"gpus": 1}),
        ("k2", {"gpus": 2}),
        ("k4", {"gpus": 4}),
        ("all", {"gpus": gpus}),
        ("allreduce", {"gpus": some, "pattern": "allreduce"}),
        ("alltoall", {"gpus": some, "pattern": "alltoall"}),
        ("pipeline", {"gpus": some, "pattern": "pipeline"}),
        ("single_numa", {"gpus": pair, "single_numa": True}),
        ("nics", {"gpus": pair, "nics": 2, "detail": ["bindings"]}),  # which NICs: in the bindings
        ("min_level", {"gpus": some, "min_level": "NV"}),
        ("too_many", {"gpus": gpus + 1}),  # never fits
        # Answers are lean unless asked: the full one stays under review too.
        ("detailed", {"gpus": some, "detail": ["bindings", "launch", "explain"]}),
    ]


# --- normalisation: the one place -------------------------------------------------------

def normalise_metrics(text: str) -> str:
    kept = []
    for line in text.splitlines(keepends=True):
        if not line.startswith("#") and re.split(r"[{ ]", line, maxsplit=1)[0] in VOLATILE_SERIES:
            continue
        kept.append(line)
    return "".join(kept)


def normalise_topology(body: bytes) -> str:
    doc = json.loads(body)
    text = json.dumps(doc, indent=1)
    # The file is the served bytes: nothing may change in the round trip but the values below.
    if text.encode() != body:
        raise AssertionError("GET /topology is not json.dumps(..., indent=1): the golden file would not be its bytes")
    for path, key in VOLATILE_TOPOLOGY:
        for holder in _walk(doc, path):
            if holder.get(key) is not None:
                holder[key] = NORMALISED
    return json.dumps(doc, indent=1) + "\n"


def _walk(doc: Any, path: tuple[str, ...]) -> list[dict[str, Any]]:
    found = [doc]
    for step in path:
        found = [v for d in found if isinstance(d, dict) for k, v in d.items() if step in ("*", k)]
    return [d for d in found if isinstance(d, dict)]


def place_document(rows: list[dict[str, Any]]) -> str:
    return json.dumps(rows, indent=1) + "\n"


# --- the served agent ---------------------------------------------------------------------

class Served:
    """`topoagent serve --root NODE` on a free loopback port, until stop()."""

    def __init__(self, node: str, work: Path) -> None:
        config = work / "topoagent.toml"
        config.write_text(AGENT_CONFIG)
        self.log_path = work / "agent.log"
        env = {k: v for k, v in os.environ.items() if k not in ("JOURNAL_STREAM", "CREDENTIALS_DIRECTORY")}
        # This checkout's code, wherever the interpreter's topoagent is installed from.
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        args = [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(SNAPSHOTS / node),
                "--listen", "127.0.0.1:0", "--state-dir", str(work / "state"), "--config", str(config)]
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        match = re.search(r"on http://127\.0\.0\.1:(\d+)", line)
        if not match:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"topoagent serve --root {node} did not start: {line!r}\n{self.log()}")
        self.port = int(match.group(1))

    def log(self) -> str:
        return self.log_path.read_text()[-3000:]

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        try:
            payload = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=payload, headers={"Content-Type": "application/json"} if payload else {})
            reply = conn.getresponse()
            return reply.status, reply.read()
        finally:
            conn.close()

    def wait_for(self, what: str, check: Callable[[], bool], timeout: float = 120.0) -> None:
        # Generous: eight agents start at once, on CI's two cores beside other tests.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if check():
                return
            if self.proc.poll() is not None:
                raise AssertionError(f"the agent exited {self.proc.returncode} before {what}:\n{self.log()}")
            time.sleep(0.1)
        raise AssertionError(f"never saw {what} within {timeout:g} s:\n{self.log()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"topoagent serve ignored SIGTERM:\n{self.log()}") from None
        if code != 0:
            raise AssertionError(f"topoagent serve exited {code}:\n{self.log()}")


def loaded(status: int, body: bytes) -> bool:
    """GET /readyz says a topology is loaded: 200, or 503 for a node loaded but not ready
    for placement (a recording whose GPUs no witness sees; it names its snapshot)."""
    return status == 200 or (status == 503 and "snapshot_version" in json.loads(body))


def _counters_replayed(agent: Served, discovery: set[str]) -> bool:
    """Whether the counter sources have reported: /metrics names collectors that
    discovery (GET /topology's `collectors`) does not."""
    _, metrics = agent.request("GET", "/metrics")
    reported = set(re.findall(r'^topoagent_collector_success\{collector="([^"]+)"\}', metrics.decode(), re.M))
    return bool(reported - discovery)


def served_outputs(node: str) -> dict[str, str]:
    """The node's golden files, from a real agent serving its recording."""
    with tempfile.TemporaryDirectory(prefix=f"golden-{node}-") as work:
        agent = Served(node, Path(work))
        try:
            agent.wait_for("a topology loaded (GET /readyz)", lambda: loaded(*agent.request("GET", "/readyz")))
            discovery = set(json.loads(agent.request("GET", "/topology")[1])["collectors"])
            agent.wait_for("the recorded counters served", lambda: _counters_replayed(agent, discovery))
            # 200 with figures, or a node not ready for placement's 503 (it has none to give).
            agent.wait_for("GET /capacity 200 (or 503 not_ready_for_placement)", lambda: (lambda status, body: status == 200 or (
                status == 503 and b'"not_ready_for_placement"' in body))(*agent.request("GET", "/capacity")))
            status, topology = agent.request("GET", "/topology")
            assert status == 200, topology
            gpus = len(json.loads(topology)["gpus"])
            rows = []
            for name, body in place_requests(gpus):
                status, answer = agent.request("POST", "/place", body)
                rows.append({"name": name, "request": body, "status": status, "answer": json.loads(answer)})
            status, metrics = agent.request("GET", "/metrics")
            assert status == 200, metrics
        finally:
            agent.stop()
    return {
        "topology.json": normalise_topology(topology),
        "place.json": place_document(rows),
        "metrics.txt": normalise_metrics(metrics.decode()),
    }


def all_outputs(nodes: list[str] | None = None) -> dict[str, dict[str, str]]:
    """Every node's files, the agents run at once (each mostly waits on its discovery)."""
    nodes = nodes or NODES
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return dict(zip(nodes, pool.map(served_outputs, nodes), strict=True))


def expected_dir(node: str) -> Path:
    return SNAPSHOTS / node / "expected"


def differences(node: str, files: dict[str, str]) -> list[str]:
    """A unified diff per file that differs from the committed one (committed first)."""
    out = []
    for name, fresh in files.items():
        path = expected_dir(node) / name
        committed = path.read_text() if path.is_file() else ""
        if committed != fresh:
            rel = path.relative_to(REPO)
            out.append("".join(difflib.unified_diff(
                committed.splitlines(keepends=True), fresh.splitlines(keepends=True), f"{rel} (committed)", f"{rel} (served now)")))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Regenerate the golden outputs of the recorded nodes (fixtures/snapshots/*/expected/).")
    parser.add_argument("--update", action="store_true", help="rewrite the committed files; without it, show what differs")
    parser.add_argument("nodes", nargs="*", metavar="NODE", help=f"only these ({', '.join(NODES)}); default: all")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.nodes) - set(NODES))
    if unknown:
        parser.error(f"no recorded node {', '.join(unknown)} (known: {', '.join(NODES)})")
    changed = 0
    for node, files in all_outputs(args.nodes or None).items():
        diffs = differences(node, files)
        changed += bool(diffs)
        if args.update:
            expected_dir(node).mkdir(exist_ok=True)
            for name, text in files.items():
                (expected_dir(node) / name).write_text(text)
            print(f"{'rewrote' if diffs else 'unchanged'} {expected_dir(node).relative_to(REPO)}")
        else:
            sys.stdout.write("".join(diffs))
    if changed and not args.update:
        print(f"{changed} node(s) differ; rewrite with: {UPDATE_COMMAND}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
