"""`topoagent serve` as schedulers and Prometheus meet it: a real process on loopback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
from service_helpers import (
    DGX_A100,
    TOPO_RECORDING,
    Agent,
    make_root,
    metric_value,
    start_agent,
    wait_counters_read,
    wait_for,
    wedge,
    wedge_env,
    without_leases,
)

GPUS = list(range(8))  # the recorded DGX A100


@pytest.fixture(scope="module")
def agent(tmp_path_factory) -> Agent:
    a = start_agent(tmp_path_factory.mktemp("agent"), root=DGX_A100)
    yield a
    a.stop()


@pytest.fixture
def fresh(tmp_path) -> Agent:
    """An agent of its own: for tests that count requests in /metrics or read the log."""
    a = start_agent(tmp_path)
    yield a
    a.stop()


@pytest.fixture
def clean(agent) -> Iterator[Agent]:
    """The module's agent holding no lease, as a fresh one starts (a start costs seconds);
    its leases released after too, so the read-only tests find nothing busy."""
    yield without_leases(agent)
    without_leases(agent)


def reserve(agent: Agent, gpus: int, owner: str = "job-42", ttl_s: float = 600, **extra):
    return agent.post("/place", {"gpus": gpus, "reserve": {"owner": owner, "ttl_s": ttl_s}, **extra}, token=agent.token)


# -- reads -------------------------------------------------------------------------------

def test_topology_json_etag_and_304(agent):
    wait_counters_read(agent)  # their first read swaps in a new snapshot: the ETag is then steady
    first = agent.get("/topology")
    assert first.status == 200
    doc = first.json()
    assert [g["index"] for g in doc["gpus"]] == GPUS
    assert doc["gpus"][0]["model"] == "NVIDIA A100-SXM4-40GB"
    pair01 = next(p for p in doc["pairs"] if (p["a"], p["b"]) == ("GPU0", "GPU1"))
    assert pair01["level"] == "NV12"
    assert doc["agent"]["stale"] is False
    # nvidia_driver, gpudirect and the fabric's neighbours find nothing in the recording:
    # absent (no_data), so still a success.
    assert {name for name, c in doc["collectors"].items() if c["status"] != "error"} == {
        "numa", "cpu", "pci", "infiniband", "interfaces", "gpudirect", "nvml", "nvidia_driver", "nvidia_smi",
        "ib_neighbours", "lldp"}
    assert all(c["last_success_at"] >= doc["agent"]["built_at"] for c in doc["collectors"].values())
    # Every fact once: no second copy of findings or collector status under agent.
    assert set(doc["agent"]) == {"snapshot_version", "built_at", "stale", "error", "failed_at", "probe_figures"}
    assert doc["schema_version"] == 3
    etag = first.headers["etag"]
    again = agent.get("/topology", headers={"If-None-Match": etag})
    assert again.status == 304 and again.body == b""
    assert agent.get("/topology", headers={"If-None-Match": '"other"'}).status == 200


def test_topology_matrix_text(agent):
    reply = agent.get("/topology?format=matrix")
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/plain")
    lines = reply.body.decode().splitlines()
    assert lines[0].split()[:2] == ["GPU0", "GPU1"]
    assert lines[1].split()[:3] == ["GPU0", "X", "NV12"]
    bad = agent.get("/topology?format=xml")
    assert bad.status == 400 and "format" in bad.json()["detail"]


def test_health_ready_openapi_and_index(agent):
    assert agent.get("/healthz").json() == {"status": "alive"}
    ready = agent.get("/readyz").json()
    assert ready["status"] == "ready" and ready["stale"] is False
    doc = agent.get("/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/", "/topology", "/place", "/probe", "/leases", "/leases/{lease_id}", "/metrics", "/healthz", "/readyz"} <= set(doc["paths"])
    page = agent.get("/")
    assert page.status == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert b"<svg" in page.body and b'href="/metrics"' in page.body
    assert agent.get("/", headers={"If-None-Match": page.headers["etag"]}).status == 304


def test_unknown_path_and_method_are_json_errors(agent):
    missing = agent.get("/nope")
    assert missing.status == 404 and missing.json()["error"] == "not_found"
    wrong = agent.request("PUT", "/topology")
    assert wrong.status == 405 and set(wrong.json()) == {"error", "detail"}


def test_metrics_cover_the_node(agent):
    reply = agent.get("/metrics")
    assert reply.status == 200
    text = reply.body.decode()
    assert metric_value(text, "topoagent_gpus") == 8
    # The pairwise levels are /topology's, not /metrics' unless [metrics] pairwise = true.
    assert metric_value(text, "topoagent_gpu_pair_link_level", {"gpu_a": "0", "gpu_b": "1"}) is None
    assert metric_value(text, "topoagent_gpu_nic_link_level", {"gpu": "0", "nic": "NIC0"}) is None
    assert metric_value(text, "topoagent_gpu_nvlinks_active", {"gpu": "0"}) == 12
    assert metric_value(text, "topoagent_collector_success", {"collector": "nvidia_smi"}) == 1
    assert metric_value(text, "topoagent_snapshot_stale") == 0
    assert metric_value(text, "topoagent_snapshot_age_seconds") >= 0
    assert metric_value(text, "topoagent_gpu_info", {"gpu": "3"}) == 1


# -- placement and leases ------------------------------------------------------------------

def test_dry_run_places_without_holding(clean):
    reply = clean.post("/place", {"gpus": 4})
    assert reply.status == 200, reply.body
    gpus = [g["index"] for g in reply.json()["gpus"]]
    assert len(gpus) == 4 and set(gpus) <= set(GPUS)
    assert clean.get("/leases").json() == {"leases": [], "orphaned": []}
    nofit = clean.post("/place", {"gpus": 9})
    assert nofit.status == 422  # more than the node has: never fits (409 is for busy now)
    assert nofit.json()["error"] == "never_fits" and nofit.json()["nofit"]["constraint"] == "gpus"
    assert nofit.json()["detail"] == "never fits this node: gpus: 9 GPUs requested, 8 free of 8"


def test_reserve_list_release(fresh):
    granted = reserve(fresh, 4)
    assert granted.status == 200, granted.body
    lease = granted.json()["lease"]
    assert lease["owner"] == "job-42" and len(lease["gpus"]) == 4
    assert lease["expires_at"] - lease["created_at"] == pytest.approx(600)
    assert fresh.get("/leases").json()["leases"] == [lease]
    # the held GPUs are busy for the next request
    second = reserve(fresh, 4, owner="job-43").json()["lease"]
    assert set(second["gpus"]).isdisjoint(lease["gpus"])
    assert reserve(fresh, 1).status == 409
    text = fresh.get("/metrics").body.decode()
    assert metric_value(text, "topoagent_leases") == 2
    assert metric_value(text, "topoagent_leased_gpus") == 8
    assert metric_value(text, "topoagent_placement_requests_total", {"outcome": "reserved"}) == 2
    assert metric_value(text, "topoagent_placement_requests_total", {"outcome": "nofit"}) == 1
    gone = fresh.request("DELETE", f"/leases/{lease['id']}", token=fresh.token)
    assert gone.status == 200 and gone.json()["id"] == lease["id"]
    assert [l["id"] for l in fresh.get("/leases").json()["leases"]] == [second["id"]]
    assert fresh.request("DELETE", f"/leases/{lease['id']}", token=fresh.token).status == 404


def test_place_is_lean_unless_the_request_names_details(clean):
    """A scheduler gets the choice; the bindings, launch forms and explanation come when the
    request's `detail` names them, with a lease too; another name is refused, naming them all."""
    lean = clean.post("/place", {"gpus": 4}).json()
    assert not {"env", "numactl", "cpus", "nics", "launch", "explain", "links", "request"} & set(lean)
    assert all(set(g) == {"rank", "index", "uuid", "pci_address", "numa_node"} for g in lean["gpus"])
    assert lean["reasons"] and lean["proven_optimal"] is True and "objective" in lean
    granted = reserve(clean, 2, detail=["bindings"]).json()
    assert granted["lease"]["gpus"] == [g["index"] for g in granted["gpus"]]
    assert granted["env"]["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, granted["lease"]["gpus"]))
    assert all("numactl" in g for g in granted["gpus"]) and "launch" not in granted and "explain" not in granted
    full = clean.post("/place", {"gpus": 2, "detail": ["all"]}).json()
    assert full["request"]["detail"] == ["bindings", "launch", "explain"] and full["launch"]["srun"] and full["explain"]
    bad = clean.post("/place", {"gpus": 2, "detail": ["bindings", "numa"]})
    assert bad.status == 400
    assert bad.json()["detail"] == 'detail[1]: expected one of bindings, launch, explain, all, got "numa"'


def test_short_lease_expires(tmp_path):
    a = start_agent(tmp_path, config="[leases]\nsweep_s = 0.2\n")
    try:
        assert reserve(a, 8, ttl_s=1).status == 200  # the shortest TTL a lease may have
        assert reserve(a, 1).status == 409
        # The sweeper's line, not /leases (which hides an ended lease at once): a grant
        # before the sweep would drop the lease unlogged.
        wait_for("the lease expired", lambda: "event=lease_expired" in a.log(), a, timeout=10)
        assert a.get("/leases").json() == {"leases": [], "orphaned": []}
        assert reserve(a, 8).status == 200
    finally:
        a.stop()


BAD_BODIES = [
    (b"{not json", "body"),
    (b"", "body"),
    (b"[1, 2]", "body"),
    (b'{"gpus": NaN}', "body"),
    (json.dumps({"gpus": 0}).encode(), "gpus"),
    (json.dumps({"gpus": 10**9}).encode(), "gpus"),
    (json.dumps({"gpus": "four"}).encode(), "gpus"),
    (json.dumps({"gpus": 2.5}).encode(), "gpus"),
    (json.dumps({"gpus": True}).encode(), "gpus"),
    (json.dumps({}).encode(), "gpus"),
    (json.dumps({"gpus": 2, "colour": "red"}).encode(), "colour"),
    (json.dumps({"gpus": 2, "pattern": "star"}).encode(), "pattern"),
    (json.dumps({"gpus": 2, "min_level": "NV0"}).encode(), "min_level"),
    (json.dumps({"gpus": 2, "min_level": "X"}).encode(), "min_level"),
    (json.dumps({"gpus": 2, "min_level": " PIX"}).encode(), "min_level"),
    (b'{"gpus": 2, "gpus": 3}', '"gpus"'),
    (json.dumps({"gpus": 2, "include": [1, 1]}).encode(), "include[1]"),
    (json.dumps({"gpus": 2, "exclude": [4, 5, 4]}).encode(), "exclude[2]"),
    (json.dumps({"gpus": 2, "include": [3, 12]}).encode(), "include[1]"),
    (json.dumps({"gpus": 1, "exclude": [99]}).encode(), "exclude[0]"),
    (json.dumps({"gpus": 2, "include": [1], "exclude": [1]}).encode(), "include"),
    (json.dumps({"gpus": 1, "include": [1, 2]}).encode(), "include"),
    (json.dumps({"gpus": 2, "reserve": None}).encode(), "reserve"),
    (json.dumps({"gpus": 2, "single_numa": "yes"}).encode(), "single_numa"),
    (json.dumps({"gpus": 2, "exclude": "3"}).encode(), "exclude"),
    (json.dumps({"gpus": 2, "reserve": {"owner": "a\nevent=forged", "ttl_s": 60}}).encode(), "reserve.owner"),
    (json.dumps({"gpus": 2, "nics": -1}).encode(), "nics"),
    (json.dumps({"gpus": 2, "reserve": {"owner": "j", "ttl_s": -5}}).encode(), "reserve.ttl_s"),
    (json.dumps({"gpus": 2, "reserve": {"owner": "j", "ttl_s": "600"}}).encode(), "reserve.ttl_s"),
    (json.dumps({"gpus": 2, "reserve": {"owner": "", "ttl_s": 60}}).encode(), "reserve.owner"),
    (json.dumps({"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60, "x": 1}}).encode(), "x"),
    (json.dumps({"gpus": 2, "reserve": ["j", 60]}).encode(), "reserve"),
    (json.dumps({"gpus": 2, "detail": ["bindings", "numa"]}).encode(), "detail[1]"),
    (json.dumps({"gpus": 2, "detail": "bindings"}).encode(), "detail"),
]


def test_bad_input_is_400_naming_the_field_and_changes_nothing(fresh):
    before_file = fresh.state_dir.joinpath("leases.json").exists()
    for raw, field in BAD_BODIES:
        reply = fresh.request("POST", "/place", raw=raw, token=fresh.token)
        assert reply.status == 400, (raw, reply.body)
        doc = reply.json()
        assert set(doc) == {"error", "detail"} and doc["error"] == "bad_request"
        assert field in doc["detail"], (raw, doc)
    assert fresh.get("/leases").json() == {"leases": [], "orphaned": []}
    assert fresh.state_dir.joinpath("leases.json").exists() == before_file
    text = fresh.get("/metrics").body.decode()
    assert metric_value(text, "topoagent_placement_requests_total", {"outcome": "reserved"}) == 0
    assert "Traceback" not in fresh.log()


def test_min_level_reads_like_the_cli(agent):
    """NV12, NV18 and lowercase nv mean what `topoagent place --min-level` makes of them."""
    for level, fits in (("NV12", True), ("nv12", True), ("nv", True), ("Pix", True), ("NV18", False), ("SOC", True)):
        reply = agent.post("/place", {"gpus": 2, "min_level": level})
        assert reply.status == (200 if fits else 422), (level, reply.body)  # nothing busy: never fits
    # The DGX A100's GPUs are joined by NV12: asking for 18 links cannot fit here.
    assert agent.post("/place", {"gpus": 2, "min_level": "NV18"}).json()["nofit"]["constraint"] == "min_level"


def test_busy_gpu_409_says_leased(clean):
    granted = reserve(clean, 1, include=[3]).json()["lease"]
    reply = clean.post("/place", {"gpus": 1, "include": [3]})
    assert reply.status == 409
    detail = reply.json()["detail"]
    assert "GPU 3 is leased" in detail and granted["id"] in detail and "running processes" not in detail


def test_refresh_takes_no_fields(clean):
    reply = clean.post("/refresh", {"force": True, "colour": 1}, token=clean.token)
    assert reply.status == 400 and "colour, force" in reply.json()["detail"]
    assert clean.post("/refresh", {}, token=clean.token).status == 200
    assert clean.post("/refresh", token=clean.token).status == 200


def test_long_values_are_cut_with_an_ellipsis(agent):
    reply = agent.post("/place", {"gpus": "x" * 500})
    assert reply.status == 400
    detail = reply.json()["detail"]
    assert detail.endswith("…") and len(detail) < 100


def test_oversized_body_is_413(clean):
    big = json.dumps({"gpus": 1, "include": [0] * 10000}).encode()
    assert len(big) > 16 * 1024
    reply = clean.request("POST", "/place", raw=big, token=clean.token)
    assert reply.status == 413
    assert reply.json()["error"] == "payload_too_large"
    assert clean.get("/leases").json() == {"leases": [], "orphaned": []}


def test_token_is_required_to_mutate(clean):
    body = {"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60}}
    for token in (None, "wrong-token-wrong-token", ""):
        reply = clean.post("/place", body, token=token)
        assert reply.status == 401, token
        assert reply.headers["www-authenticate"] == "Bearer"
    granted = reserve(clean, 2).json()["lease"]
    assert clean.request("DELETE", f"/leases/{granted['id']}").status == 401
    assert clean.request("DELETE", f"/leases/{granted['id']}", token="nope").status == 401
    assert clean.post("/refresh").status == 401
    assert [l["id"] for l in clean.get("/leases").json()["leases"]] == [granted["id"]]
    assert clean.token not in clean.log()


def test_without_token_file_mutating_endpoints_are_off(tmp_path):
    a = start_agent(tmp_path, token=False)
    try:
        assert "event=mutating_endpoints_off" in a.log()
        reply = a.post("/place", {"gpus": 2, "reserve": {"owner": "j", "ttl_s": 60}}, token="anything")
        assert reply.status == 403 and "token-file" in reply.json()["detail"]
        assert a.post("/place", {"gpus": 2}).status == 200  # dry runs still answer
        assert a.get("/leases").json() == {"leases": [], "orphaned": []}
    finally:
        a.stop()


def test_config_can_require_token_for_reads(tmp_path):
    a = start_agent(tmp_path, config="[http]\nrequire_token_for_reads = true\n")
    try:
        assert a.get("/topology").status == 401
        assert a.get("/metrics").status == 401
        assert a.get("/topology", token=a.token).status == 200
        assert a.get("/healthz").status == 200  # liveness probes carry no secrets
    finally:
        a.stop()


def test_refresh_on_demand(clean):
    before = clean.get("/readyz").json()["snapshot_version"]
    reply = clean.post("/refresh", token=clean.token)
    assert reply.status == 200
    assert reply.json()["snapshot_version"] > before and reply.json()["stale"] is False


# -- resilience ------------------------------------------------------------------------------

def test_failing_collector_serves_last_good_snapshot_as_stale(tmp_path):
    fresh = start_agent(tmp_path, root=make_root(tmp_path))
    try:
        failing_collector_scenario(fresh)
    finally:
        assert fresh.stop() == 0


def failing_collector_scenario(fresh: Agent) -> None:
    good = fresh.get("/topology").json()
    recording = fresh.root / TOPO_RECORDING
    recording.write_text("this is not a topology\n")
    assert fresh.post("/refresh", token=fresh.token).json()["stale"] is True
    reply = fresh.get("/topology")
    assert reply.status == 200
    doc = reply.json()
    assert doc["agent"]["stale"] is True
    assert "collector nvidia_smi" in doc["agent"]["error"]
    assert doc["pairs"] == good["pairs"]  # the declared levels were not dropped
    text = fresh.get("/metrics").body.decode()
    assert metric_value(text, "topoagent_snapshot_stale") == 1
    assert metric_value(text, "topoagent_collector_success", {"collector": "nvidia_smi"}) == 0
    assert metric_value(text, "topoagent_collector_success", {"collector": "pci"}) == 1
    assert metric_value(text, "topoagent_discovery_runs_total", {"outcome": "failure"}) >= 1
    assert fresh.post("/place", {"gpus": 2}).status == 200
    # and it recovers when the source does
    recording.write_text((DGX_A100 / TOPO_RECORDING).read_text())
    assert fresh.post("/refresh", token=fresh.token).json()["stale"] is False


def test_hanging_collector_is_cut_off_by_its_timeout(tmp_path):
    a = start_agent(tmp_path, root=make_root(tmp_path), config="[discovery]\ntimeout_s = 4\n")
    try:
        wedge(a.root)  # a read that never returns
        reply = a.post("/refresh", token=a.token)
        assert reply.status == 200 and reply.json()["stale"] is True
        assert "timed out" in reply.json()["error"]
        assert a.get("/topology").status == 200
        assert a.get("/topology").json()["agent"]["stale"] is True
        text = a.get("/metrics").body.decode()
        assert metric_value(text, "topoagent_snapshot_stale") == 1
        assert a.stop() == 0  # the stuck read does not keep the process alive
    finally:
        if a.proc.poll() is None:
            a.proc.kill()


def test_readyz_is_503_until_a_topology_loads(tmp_path):
    root = make_root(tmp_path)
    wedge(root)  # discovery never finishes
    config = tmp_path / "t.toml"
    config.write_text("[discovery]\ntimeout_s = 30\n")
    args = [sys.executable, "-P", "-m", "topoagent", "serve", "--root", str(root), "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path / "s"), "--config", str(config)]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env={**os.environ, **wedge_env()})
    try:
        line = proc.stdout.readline()
        port = int(line.rsplit(":", 1)[1])
        a = Agent(proc, "127.0.0.1", port, None, root, tmp_path / "s", tmp_path / "none")
        ready = a.get("/readyz")
        assert ready.status == 503 and ready.json()["error"] == "not_ready"
        assert a.get("/topology").status == 503
        assert a.post("/place", {"gpus": 1}).status == 503
        assert a.get("/healthz").status == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0


def _raw_exchange(agent: Agent, head: bytes, wait: float = 5.0) -> bytes:
    """Send only a request head (no body); read until the server closes or `wait` passes."""
    import socket

    with socket.create_connection((agent.host, agent.port), timeout=wait) as sock:
        sock.sendall(head)
        out = b""
        try:
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                out += chunk
        except TimeoutError:
            pass
    return out


def test_huge_content_length_is_413_before_the_body(agent):
    head = b"POST /place HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n"
    reply = _raw_exchange(agent, head)
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b'"payload_too_large"' in reply
    # With Expect: 100-continue the client is told 413 instead of being invited to send.
    reply = _raw_exchange(agent, head.replace(b"Host: 127.0.0.1\r\n", b"Host: 127.0.0.1\r\nExpect: 100-continue\r\n"))
    assert b"100 Continue" not in reply, reply[:200]
    assert reply.startswith(b"HTTP/1.1 413 "), reply[:200]
    assert b'"payload_too_large"' in reply
    assert agent.post("/place", {"gpus": 2}).status == 200  # still serving


def test_bad_content_length_is_400_and_one_log_line(fresh):
    for value in (b"-5", b"abc"):
        reply = _raw_exchange(fresh, b"POST /place HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: " + value + b"\r\n\r\n")
        assert reply.split(b"\r\n")[0].endswith(b"400 Bad Request"), reply[:200]
    # aiohttp's parser answers these itself, before any handler; the log keeps one line each.
    log = fresh.log()
    assert "Traceback" not in log
    lines = [l for l in log.splitlines() if "event=http_protocol_error" in l]
    assert len(lines) == 2 and all("Content-Length" in l for l in lines), log
    assert all(re.match(r"\d{4}-\d\d-\d\d [\d:,]+ [A-Z]+ event=", l) for l in log.splitlines()), log
