"""GET /capacity on a big node: computed off the event loop under its budget, so the
agent keeps answering /healthz and stops on SIGTERM while it runs.

A real `topoagent serve` over loopback on a generated 64-GPU recording with random
levels (only `nvidia-smi topo -m`, as a user's `snapshot` of a bare node may be): the
exact search over every k took tens of seconds there, on the event loop.  No assert
here is about speed: the bounds are liveness bounds, many times what the work needs.
"""

from __future__ import annotations

import random
import signal
import threading
import time
from pathlib import Path

from schema_check import validate
from service_helpers import Agent, metric_value, start_agent, wait_counters_read, wait_for, wait_ready

# A /healthz answer's bound, as a liveness probe's timeout: far above what the work needs
# (an answer is a millisecond; the budget below is seconds), so only an agent whose loop is
# held by a search misses it, and a miss fails the test.
HEALTHZ_BOUND_S = 10.0
LEVELS = ("NV1", "NV2", "NV4", "PIX", "PXB", "PHB", "NODE", "SYS")


def random_recording(base: Path, gpus: int, seed: int) -> Path:
    """A recorded node of ``gpus`` GPUs with random (symmetric) levels: the file
    `nvidia-smi topo -m` writes, under the name a recording gives it, and an empty sys/."""
    rng = random.Random(seed)
    level = {(a, b): rng.choice(LEVELS) for a in range(gpus) for b in range(a + 1, gpus)}
    header = "\t" + "\t".join(f"GPU{i}" for i in range(gpus)) + "\tCPU Affinity\tNUMA Affinity"
    rows = []
    for a in range(gpus):
        cells = ["X" if a == b else level[min(a, b), max(a, b)] for b in range(gpus)]
        numa = a * 4 // gpus
        rows.append(f"GPU{a}\t" + "\t".join(cells) + f"\t{numa * 8}-{numa * 8 + 7}\t{numa}")
    root = base / f"random{gpus}"
    (root / "commands").mkdir(parents=True)
    (root / "sys").mkdir()
    (root / "commands" / "nvidia-smi_topo_-m.out").write_text("\n".join([header, *rows]) + "\n")
    return root


def budget_config(ms: int) -> str:
    return f"[placement]\ncapacity_budget_ms = {ms}\n"


def in_thread(fn):
    """Run ``fn`` beside the test; ``.result`` once ``.join()`` returns."""
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = fn()
        except BaseException as exc:  # the test thread re-raises it
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def healthz_answers_while(agent: Agent, running: threading.Thread) -> int:
    """Ask /healthz over and over while ``running`` is alive; every answer must come
    within HEALTHZ_BOUND_S.  Returns how many answered."""
    answered = 0
    while running.is_alive() or answered == 0:
        reply = agent.get("/healthz", timeout=HEALTHZ_BOUND_S)
        assert reply.status == 200, (reply.status, agent.log())
        answered += 1
        time.sleep(0.05)  # the pace of the asking, not a wait for the agent
    return answered


def assert_fits_valid(doc: dict) -> None:
    free = set(doc["free"])
    assert [f["gpus"] for f in doc["fits"]] == list(range(1, doc["gpus"] + 1))
    for fit in doc["fits"]:
        k = fit["gpus"]
        if k <= len(free):  # a plain k-GPU request fits whenever k GPUs are free, proven or not
            assert fit["fits"], fit
            assert len(fit["indices"]) == k and len(set(fit["indices"])) == k and set(fit["indices"]) <= free, fit
            assert fit["score"] is not None
        else:
            assert not fit["fits"] and fit["indices"] == [] and fit["proven_optimal"], fit


def test_big_node_capacity_is_off_the_loop_and_within_its_budget(tmp_path):
    root = random_recording(tmp_path, 64, seed=21440)
    budget_ms = 3000  # long enough that /healthz is asked many times while it runs
    agent = start_agent(tmp_path, root=root, config=budget_config(budget_ms) + '[metrics]\ndetail = ["capacity"]\n')
    try:
        asking, box = in_thread(lambda: agent.get("/capacity"))
        healthz_answers_while(agent, asking)
        asking.join()
        assert "error" not in box, box  # the request's wait is bounded (2 x budget + 0.25 s): it answered
        reply = box["result"]
        # Within its wait (2 x budget + 0.25 s) the figures came; a far slower machine may
        # see 503 capacity_pending instead, then the figures on asking again.
        deadline = time.monotonic() + 120
        while reply.status == 503 and time.monotonic() < deadline:
            assert reply.json()["error"] == "capacity_pending"
            reply = agent.get("/capacity")
        assert reply.status == 200, (reply.status, reply.body)
        doc = reply.json()
        validate(doc, "Capacity")
        assert doc["gpus"] == 64 and doc["free_gpus"] == 64
        assert_fits_valid(doc)
        # Concurrent scrapes and reads share the computed figures: /metrics says the same
        # (per job size with [metrics] detail "capacity").
        page = agent.get("/metrics").body.decode()
        assert metric_value(page, "topoagent_capacity_free_gpus") == 64
        assert metric_value(page, "topoagent_capacity_fits", {"k": "64"}) == 1
        # Current figures carry an ETag an unchanged node answers 304 on; stale ones carry
        # none (no-store), so no cached copy is confirmed for a node that may have changed.
        deadline = time.monotonic() + 60
        reply = agent.get("/capacity")
        while "etag" not in reply.headers and time.monotonic() < deadline:
            assert reply.json()["stale"] is True and reply.headers["cache-control"] == "no-store"
            reply = agent.get("/capacity")
        assert agent.get("/capacity", headers={"If-None-Match": reply.headers["etag"]}).status in (304, 200)
    finally:
        assert agent.stop() == 0


def test_sigterm_stops_the_agent_while_capacity_is_computed(tmp_path):
    root = random_recording(tmp_path, 64, seed=7)
    agent = start_agent(tmp_path, root=root, config=budget_config(20_000), extra=["--log-level", "debug"])
    asking, _ = in_thread(lambda: agent.get("/capacity"))
    wait_for("the computation under way (it takes the whole budget)", lambda: "event=capacity_computing" in agent.log(), agent)
    assert agent.get("/healthz").status == 200
    # stop() waits at most 20 s: the request in flight is drained (its wait is bounded),
    # the search's daemon thread abandoned.
    assert agent.stop(signal.SIGTERM) == 0, agent.log()
    asking.join(timeout=30)


def test_concurrent_requests_share_one_computation(tmp_path):
    root = random_recording(tmp_path, 32, seed=3)
    # A budget whose wait (2 x budget + 0.25 s) outlasts the computation on a loaded machine:
    # every reply then carries computed figures, not capacity_pending.
    agent = start_agent(tmp_path, root=root, config=budget_config(5000), extra=["--log-level", "debug"])
    try:
        wait_counters_read(agent)  # the counters' first read swaps in a snapshot: one computation after it
        threads = [in_thread(lambda path=path: agent.get(path)) for path in ("/capacity", "/metrics", "/capacity", "/metrics")]
        for thread, _ in threads:
            thread.join(timeout=120)
        replies = [box["result"] for _, box in threads]
        assert all(r.status == 200 for r in replies), [(r.status, r.body[:200]) for r in replies]
        assert len({r.body for r in replies[::2]}) == 1
        # Nothing changed on the node: one computation served all four.
        assert agent.log().count("event=capacity_computed") == 1, agent.log()
    finally:
        assert agent.stop() == 0


def test_a_long_dry_run_is_off_the_loop_and_a_caller_without_the_token_gets_a_short_one(tmp_path):
    """A dry-run /place needs no token, so anyone may ask for the longest search: it runs
    off the event loop (/healthz answers throughout, as it did not for 15 s at 64 GPUs), and
    a caller without the token has its deadline cut to a second."""
    root = random_recording(tmp_path, 128, seed=21440)
    agent = start_agent(tmp_path, root=root)
    try:
        wait_ready(agent, timeout=120)
        # On this node: unproven at 3 s (at 64 GPUs the per-NUMA-set bound now proves such
        # requests within it).  `explain` echoes the request as the agent ran it.
        long = {"gpus": 16, "pattern": "allreduce", "deadline_ms": 3000, "detail": ["explain"]}
        asking, box = in_thread(lambda: agent.post("/place", long, token=agent.token))
        answered = healthz_answers_while(agent, asking)
        asking.join()
        assert "error" not in box, box
        assert box["result"].status == 200 and box["result"].json()["request"]["deadline_ms"] == 3000
        # The search ran its whole budget (not proven): a loop it held would have answered
        # the first /healthz only after it, once; off the loop, /healthz answers throughout.
        assert box["result"].json()["proven_optimal"] is False
        assert answered >= 2
        anyone = agent.post("/place", {**long, "deadline_ms": 60_000})
        assert anyone.status == 200 and anyone.json()["request"]["deadline_ms"] == 1000, anyone.body[:300]
    finally:
        assert agent.stop() == 0
