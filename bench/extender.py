"""The extender's defences, measured on loopback (issue #28 item 4's figures):

    python -m bench.extender            # 1,000,000 NodeNames; 1,100 half-sent sockets
    python -m bench.extender --quick    # 100,000; 300

1. One filter call naming 1,000,000 nodes (past --max-nodes 5000): the time to its 400,
   with /healthz asked all along (answers and the slowest, in seconds).
2. 1,100 connections held open, half with a request head cut short, half with a head and
   a body that never comes, past the extender's --max-connections 512: /healthz asked 5
   times (answered, and the slowest), then how many of the held sockets the extender has
   closed within 10 s.

The extender is the real child (`python -P -m topoagent extender`), its Node objects the
tests' loopback API server (tests/fake_apiserver.py); nothing leaves 127.0.0.1.  Every
count is fixed and every wait bounded: the run stops by itself (within about a minute).
Prints figures; asserts nothing.
"""

from __future__ import annotations

import argparse
import http.client
import json
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.cluster import _child_env, _wait_line, unanswering_node

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fake_apiserver import FakeApiServer  # the tests' API server double

RESOURCE = "nvidia.com/gpu"
HEALTHZ_ASKS = 5


def _call(port: int, method: str, path: str, body: bytes | None = None, timeout: float = 10.0) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        resp.read()
        return resp.status
    finally:
        conn.close()


def _healthz(port: int) -> tuple[bool, float]:
    started = time.monotonic()
    try:
        ok = _call(port, "GET", "/healthz", timeout=5.0) == 200
    except OSError:
        ok = False
    return ok, time.monotonic() - started


def many_names(port: int, count: int) -> dict[str, object]:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "bench", "namespace": "default", "uid": "0" * 8},
           "spec": {"containers": [{"name": "main", "resources": {"limits": {RESOURCE: "1"}}}]}}
    body = json.dumps({"Pod": pod, "NodeNames": [f"node-{n}" for n in range(count)]}).encode()
    answer: list[int] = []
    sender = threading.Thread(target=lambda: answer.append(_call(port, "POST", "/scheduler/filter", body, timeout=30.0)), daemon=True)
    started = time.monotonic()
    sender.start()
    probes: list[tuple[bool, float]] = []
    while sender.is_alive() and time.monotonic() - started < 30:
        probes.append(_healthz(port))
        time.sleep(0.02)
    sender.join(timeout=1)
    took = time.monotonic() - started
    return {"names": count, "body_mb": round(len(body) / 1e6, 1), "status": answer[0] if answer else None, "seconds": round(took, 2),
            "healthz_answered": f"{sum(ok for ok, _ in probes)} of {len(probes)}",
            "healthz_slowest_s": round(max((t for _, t in probes), default=0.0), 3)}


def half_sent(port: int, count: int) -> dict[str, object]:
    held: list[socket.socket] = []
    try:
        for n in range(count):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if n % 2:  # a head, then a body that never comes
                s.sendall(b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"Pod\":")
            else:  # a head cut short
                s.sendall(b"GET /healthz HTTP/1.1\r\nHo")
            held.append(s)
        probes = [_healthz(port) for _ in range(HEALTHZ_ASKS)]
        # How many the extender closed (cut at its cap, or timed out): each read answers b"" or a 408, or resets.
        closed = 0
        deadline = time.monotonic() + 10
        for s in held:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                got = s.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                got = b""
            closed += got == b"" or got.startswith(b"HTTP/1.1 408")
        return {"sockets": count, "healthz_answered": f"{sum(ok for ok, _ in probes)} of {HEALTHZ_ASKS}",
                "healthz_slowest_s": round(max(t for _, t in probes), 3), "closed_by_extender_within_10s": closed}
    finally:
        for s in held:
            s.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100,000 names and 300 sockets")
    args = parser.parse_args()
    names, sockets = (100_000, 300) if args.quick else (1_000_000, 1_100)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < sockets + 256:  # ours: the held sockets; the extender raises its own
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, sockets + 256), hard))
    api = FakeApiServer(nodes=[unanswering_node("node-real", "127.0.0.1")])
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "extender.log"
        with open(log, "w") as err:
            proc = subprocess.Popen(
                [sys.executable, "-P", "-m", "topoagent", "extender", "--listen", "127.0.0.1:0", "--kube-api", api.url,
                 "--agent-url", "http://{address}:9", "--header-timeout", "2", "--requeue-interval", "0"],
                stdout=subprocess.PIPE, stderr=err, text=True, env=_child_env())
        try:
            port = int(_wait_line(proc, "extender", log).split("http://127.0.0.1:", 1)[1].split("/", 1)[0])
            print(json.dumps({"many_names": many_names(port, names)}))
            print(json.dumps({"half_sent": half_sent(port, sockets)}))
            print(json.dumps({"extender_log_lines": log.read_text().count("\n")}))
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            api.close()


if __name__ == "__main__":
    main()
